"""Writes what the engine produced to Redis and acts on what each write found.

All events waiting when the publisher wakes go out in one fenced call (see
`scripts.PUBLISH`); each request's status then says whether it finished, whether
another worker owns it now (drop it here), whether another entry serves its id
(settle ours), or whether Redis lost output written earlier (fail it without a gap).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import structlog

from client._protocol import Delta, Done, Error, Event

from .engine import Engine
from .messages import Outgoing, Route, StepOutput
from .streams import Batch, QueueStreams, retrying

log = structlog.get_logger("mlxq.worker")


@dataclass
class InFlight:
    """A request this worker holds: where its output goes, and how much of it is written."""

    route: Route
    written: int = 0  # events (deltas and terminal) in its output stream: the next one's position


class Publisher:
    """Owns the queue of step outputs; reads and updates the worker's in-flight requests."""

    def __init__(self, streams: QueueStreams, in_flight: dict[str, InFlight], engine: Engine,
                 forget: Callable[[str], None]) -> None:
        self.streams = streams
        self.in_flight = in_flight
        self.engine = engine
        self.forget = forget  # the worker lets go of a request id
        self.outputs: asyncio.Queue[StepOutput] = asyncio.Queue()

    async def run(self) -> None:
        """Publish until cancelled: everything waiting goes out together, one call for all."""
        while True:
            outputs = [await self.outputs.get()]
            while not self.outputs.empty():
                outputs.append(self.outputs.get_nowait())
            outgoing = [item for out in outputs for item in out.outgoing]
            if outgoing:
                await asyncio.shield(self._publish(outgoing))
            left = sum(len(out.abandoned) for out in outputs)
            if left:
                log.info("requests left unfinished at the drain deadline; they are handed back", requests=left)
            for _ in outputs:
                self.outputs.task_done()

    async def _publish(self, outgoing: list[Outgoing]) -> None:
        """Write events (one call for all requests) and act on what each request's write found."""
        batches = self._batches(outgoing)
        if not batches:
            return
        statuses = await retrying(partial(self.streams.publish, batches), "publishing")
        for batch, status in zip(batches, statuses, strict=True):
            await self._published(batch, status)

    def _batches(self, outgoing: list[Outgoing]) -> list[Batch]:
        """Each held request's events, in order; events of requests no longer held are dropped."""
        events: dict[str, list[Event]] = {}
        for item in outgoing:
            flight = self.in_flight.get(item.route.id)
            if flight is not None and flight.route.entry_id == item.route.entry_id:
                events.setdefault(item.route.id, []).append(item.event)
        return [Batch(self.in_flight[i].route, self.in_flight[i].written, e) for i, e in events.items()]

    async def _published(self, batch: Batch, status: str) -> None:
        route, terminal = batch.route, batch.events[-1]
        if status == "applied":
            flight = self.in_flight.get(route.id)
            if flight is not None and flight.route == route:  # not dropped while the write was under way
                flight.written = batch.first + len(batch.events)
            if not isinstance(terminal, Delta):
                self.forget(route.id)
                _log_finished(terminal)
            return
        self.engine.abandon(route.id)
        self.forget(route.id)
        if status == "lost":
            log.warning("another worker took this request over; dropping it here", request_id=route.id)
        elif status == "duplicate":
            log.warning("another entry with this id is served; dropping this one", request_id=route.id,
                        entry_id=route.entry_id)
            await retrying(partial(self.streams.settle, route.stream, [route.entry_id]), "settling a duplicate")
        elif status.startswith("gap:"):
            written = int(status.removeprefix("gap:"))
            log.error("output written earlier is missing (Redis lost data?); failing the request",
                      request_id=route.id, written=written, expected=batch.first)
            self.in_flight[route.id] = InFlight(route, written)
            await self._publish([Outgoing(route, Error(id=route.id, code="internal", message=(
                f"{batch.first - written} events of this request's output were lost by Redis; "
                "it cannot continue without a gap")))])
        else:
            log.error("redis refused the output; the request is settled without it", request_id=route.id,
                      problem=status.removeprefix("refused:"))


def _log_finished(event: Event) -> None:
    if isinstance(event, Error):
        log.info("request failed", request_id=event.id, code=event.code, message=event.message)
        return
    assert isinstance(event, Done)
    log.info("request finished", request_id=event.id, finish_reason=event.finish_reason,
             prompt_tokens=event.usage["prompt_tokens"], completion_tokens=event.usage["completion_tokens"],
             ttft_ms=event.timing["ttft_ms"], total_ms=event.timing["total_ms"], tok_s=event.decode_tok_s)
