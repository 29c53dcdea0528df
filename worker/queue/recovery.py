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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from worker.queue.streams import RequestStreams
from worker.queue.totals import Totals

log = structlog.get_logger("mlxq.recovery")


@dataclass(frozen=True)
class Delivery:
    """A request entry handed to this worker, and how many times it was delivered so far."""

    stream: str
    entry_id: str
    fields: dict[Any, Any] | None  # None: deleted from the stream
    deliveries: int = 1


class Reclaimer:
    """Takes over work left pending: first our own (listed at start, before the first read,
    and again after a Redis outage: a read whose reply was lost leaves entries pending to
    us that we never saw), then, every `interval_s`, what silent consumers held for at least
    `min_idle_ms`."""

    def __init__(self, streams: RequestStreams, interval_s: float, min_idle_ms: int, totals: Totals) -> None:
        self.streams = streams
        self.totals = totals
        self.interval_s = interval_s
        self.min_idle_ms = min_idle_ms
        self._own: list[tuple[str, str, int]] = []  # (stream, entry id, deliveries) left by an earlier run
        self._next_scan = 0.0

    async def list_own(self, held: Callable[[str, str], bool] = lambda _stream, _entry: False) -> None:
        """List the entries pending to our consumer name that we do not hold (`held`: by
        stream and entry id): an earlier run's, or a lost read's."""
        self._own = []
        for stream in self.streams.request_streams:
            after = "-"
            while True:
                rows = await self.streams.pending(stream, self.streams.consumer, 100, 0, after=after)
                self._own += [(stream, entry_id, deliveries) for entry_id, deliveries in rows
                          if not held(stream, entry_id)]
                if len(rows) < 100:
                    break
                after = rows[-1][0]
        if self._own:
            log.info("resuming this consumer's own pending requests", entries=len(self._own))

    async def take(self, room: int) -> list[Delivery]:
        """Up to `room` entries to serve now; usually none."""
        if self._own:
            return await self._take_own(room)
        if time.monotonic() < self._next_scan:
            return []
        self._next_scan = time.monotonic() + self.interval_s
        lanes = [self.streams.keys.affinity_lane(self.streams.queue, name) for name in await self.streams.other_lanes()]
        for stream in [*self.streams.request_streams, *lanes]:  # other workers' placement lanes too
            for consumer in await self.streams.dead_consumers(stream):
                rows = await self.streams.pending(stream, consumer, room, self.min_idle_ms)
                taken = await self._claim(stream, rows, self.min_idle_ms)
                if taken:
                    self.totals.count("takeovers", len(taken))
                    log.warning("took over the requests of a silent worker", consumer=consumer, entries=len(taken))
                    self._next_scan = 0.0  # there may be more
                    return taken
                if await self.streams.forget_consumer(stream, consumer):
                    log.info("removed a consumer that left", consumer=consumer, stream=stream)
        return []

    async def _take_own(self, room: int) -> list[Delivery]:
        """The next of our own pending entries, from the first stream listed."""
        stream = self._own[0][0]
        rows = [(entry_id, n) for s, entry_id, n in self._own if s == stream][:room]
        taken = {entry_id for entry_id, _ in rows}
        self._own = [row for row in self._own if row[1] not in taken or row[0] != stream]
        return await self._claim(stream, rows, min_idle_ms=0)

    async def _claim(self, stream: str, rows: list[tuple[str, int]], min_idle_ms: int) -> list[Delivery]:
        counts = dict(rows)
        entries = await self.streams.claim(stream, [entry_id for entry_id, _ in rows], min_idle_ms)
        return [Delivery(stream, entry_id, fields, counts[entry_id] + 1) for entry_id, fields in entries]
