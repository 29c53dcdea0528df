"""Writes what the engine produced to Redis and acts on what each write found.

All events waiting when the publisher wakes go out in one fenced call (see
`scripts.PUBLISH`); each request's status then says whether it finished, whether
another worker owns it now (drop it here), whether another entry serves its id
(settle ours), or whether Redis lost output written earlier (fail it without a gap).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import structlog
from redis.exceptions import RedisError

from client.protocol import Done, Error, Event

from .engine import Engine
from .messages import Outgoing, Route, StepOutput
from .retrying import describe, retrying
from .streams import Batch, Published, PublishStatus, QueueStreams, encode_batch

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
        """Write events (one call for all requests) and act on what each request's write
        found; what that calls for (an error in place of lost output) goes out next."""
        while outgoing:
            batches = self._batches(outgoing)
            statuses = await self._write(batches)
            outgoing = []
            for batch, status in zip(batches, statuses, strict=True):
                outgoing += await self._published(batch, status)

    async def _write(self, batches: list[Batch]) -> list[Published]:
        """One call for all; if Redis refuses it (an ACL, say), one call per request, so
        that the refusal stays with the requests it belongs to."""
        if not batches:
            return []
        try:
            return await retrying(partial(self.streams.publish, batches), "publishing")
        except RedisError as e:
            if len(batches) == 1:
                return [Published(PublishStatus.REFUSED, describe(e))]
            log.warning("redis refused a step's output; writing request by request", reason=describe(e))
        return [(await self._write([batch]))[0] for batch in batches]

    def _batches(self, outgoing: list[Outgoing]) -> list[Batch]:
        """Each held request's events, in order and encoded; events of requests no longer
        held are dropped."""
        events: dict[str, list[Event]] = {}
        for item in outgoing:
            flight = self.in_flight.get(item.route.id)
            if flight is not None and flight.route.entry_id == item.route.entry_id:
                events.setdefault(item.route.id, []).append(item.event)
        batches = []
        for request_id, its_events in events.items():
            flight = self.in_flight[request_id]
            batch, cut = encode_batch(flight.route, flight.written, its_events)
            if cut:  # it ends with an error here: stop generating for it
                self.engine.abandon(request_id)
            batches.append(batch)
        return batches

    async def _published(self, batch: Batch, published: Published) -> list[Outgoing]:
        """Act on one request's status; returns the events to publish in its place, if any."""
        route, status = batch.route, published.status
        if status is PublishStatus.APPLIED:
            flight = self.in_flight.get(route.id)
            if flight is not None and flight.route == route:  # not dropped while the write was under way
                flight.written = batch.first + len(batch.entries)
            if batch.terminal:
                self.forget(route.id)
                _log_finished(batch.events[-1])
            return []
        self.engine.abandon(route.id)
        self.forget(route.id)
        if status is PublishStatus.LOST:
            log.warning("another worker took this request over; dropping it here", request_id=route.id)
        elif status is PublishStatus.DUPLICATE:
            log.warning("another entry with this id is served; dropping this one", request_id=route.id,
                        entry_id=route.entry_id)
            await retrying(partial(self.streams.settle, route.stream, [route.entry_id]), "settling a duplicate")
        elif status is PublishStatus.GAP:
            written = int(published.detail)
            log.error("output written earlier is missing (Redis lost data?); failing the request",
                      request_id=route.id, written=written, expected=batch.first)
            return self._instead(route, written, Error(id=route.id, code="internal", message=(
                f"{batch.first - written} events of this request's output were lost by Redis; "
                "it cannot continue without a gap")))
        else:
            return await self._refused(batch, published.detail)
        return []

    async def _refused(self, batch: Batch, reason: str) -> list[Outgoing]:
        """Redis refused this request's output: say so on its own output stream, or, if
        even that is refused, settle it unanswered."""
        route = batch.route
        own = self.streams.keys.output(route.id)
        if route.reply_to != own:
            log.error("redis refused the reply stream; the error goes to the request's own output stream",
                      request_id=route.id, reply_to=route.reply_to, reason=reason)
            return self._instead(replace(route, reply_to=own), batch.first, Error(
                id=route.id, code="invalid_request",
                message=f"reply_to: Redis refused writing to {route.reply_to} ({reason})"))
        log.error("redis refused the request's output stream; settling it unanswered", request_id=route.id,
                  reason=reason)
        await retrying(partial(self.streams.settle_unanswered, route), "settling an unanswerable request")
        return []

    def _instead(self, route: Route, written: int, error: Error) -> list[Outgoing]:
        """Hold the request again, at `written`, to publish `error` as its terminal event."""
        self.in_flight[route.id] = InFlight(route, written)
        return [Outgoing(route, error)]


def _log_finished(event: Event) -> None:
    if isinstance(event, Error):
        log.info("request failed", request_id=event.id, code=event.code, message=event.message)
        return
    assert isinstance(event, Done)
    log.info("request finished", request_id=event.id, finish_reason=event.finish_reason,
             prompt_tokens=event.usage.prompt_tokens, completion_tokens=event.usage.completion_tokens,
             ttft_ms=event.timing.ttft_ms, total_ms=event.timing.total_ms, tok_s=event.decode_tok_s)
