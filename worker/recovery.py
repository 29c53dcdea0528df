"""Finding work that was left behind: this consumer's own pending entries after a
restart, and the entries of consumers whose heartbeat is gone.

A live worker keeps its heartbeat and its entries' idle times fresh, so only the entries
of silent consumers are taken over, never a live worker's long generation. XAUTOCLAIM
cannot tell owners apart, so the owner filter is XPENDING per silent consumer, and
XCLAIM with the same minimum idle time keeps a consumer that comes back at the last
moment from being robbed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog

from .streams import QueueStreams

log = structlog.get_logger("mlxq.recovery")


@dataclass(frozen=True)
class Delivery:
    """A request entry handed to this worker, and how many times it was delivered so far."""

    entry_id: str
    fields: dict[Any, Any] | None  # None: deleted from the stream
    deliveries: int = 1


class Reclaimer:
    """Takes over work left pending: first our own (once, at start), then, every
    `interval_s`, what silent consumers held for at least `min_idle_ms`."""

    def __init__(self, streams: QueueStreams, interval_s: float, min_idle_ms: int) -> None:
        self.streams = streams
        self.interval_s = interval_s
        self.min_idle_ms = min_idle_ms
        self._own_after: str | None = "-"  # XPENDING cursor over our own entries; None once done
        self._next_scan = 0.0

    async def take(self, room: int) -> list[Delivery]:
        """Up to `room` entries to serve now; usually none."""
        if self._own_after is not None:
            return await self._own(room)
        if time.monotonic() < self._next_scan:
            return []
        self._next_scan = time.monotonic() + self.interval_s
        for consumer in await self.streams.dead_consumers():
            taken = await self._claim(await self.streams.pending(consumer, room, self.min_idle_ms))
            if taken:
                log.warning("took over the requests of a silent worker", consumer=consumer, entries=len(taken))
                self._next_scan = 0.0  # there may be more
                return taken
            if await self.streams.forget_consumer(consumer):
                log.info("removed a consumer that left", consumer=consumer)
        return []

    async def _own(self, room: int) -> list[Delivery]:
        """Our own pending entries, left by an earlier run under this consumer name."""
        assert self._own_after is not None
        rows = await self.streams.pending(self.streams.consumer, room, 0, after=self._own_after)
        self._own_after = rows[-1][0] if len(rows) == room else None
        taken = await self._claim(rows, min_idle_ms=0)
        if taken:
            log.info("resuming this consumer's own pending requests", entries=len(taken))
        return taken

    async def _claim(self, rows: list[tuple[str, int]], min_idle_ms: int | None = None) -> list[Delivery]:
        idle = self.min_idle_ms if min_idle_ms is None else min_idle_ms
        counts = dict(rows)
        entries = await self.streams.claim([entry_id for entry_id, _ in rows], idle)
        return [Delivery(entry_id, fields, counts[entry_id] + 1) for entry_id, fields in entries]
