"""Writes what the engine produced to Redis and acts on what each write found.

All events waiting when the publisher wakes go out together, fenced (see
`scripts.PUBLISH`): one call on one server, one round trip per node on a cluster. Each
request's status then says whether it finished (its entry is then settled, in one more
round trip for all that finished), whether another worker owns it now (drop it here),
whether another entry serves its id (settle ours), whether Redis lost output written
earlier (fail it without a gap), whether its fence expired (take it again and fail it),
or whether Redis refused its output stream (answer it on its own stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import structlog
from redis.exceptions import RedisError

from client.protocol import Done, Error, ErrorCode, Event
from worker.messages import Outgoing, Route, Step, failed
from worker.queue.fencing import Fencing, OutputWrite, Published, PublishStatus, encode_write, take_fence
from worker.queue.requests import RequestStatus, RequestTable
from worker.queue.retrying import describe, is_permission_error, retrying
from worker.queue.streams import RequestStreams

log = structlog.get_logger("mlxq.worker")


class Publisher:
    """Owns the queue of step outputs; writes them for the requests the table holds."""

    def __init__(self, streams: RequestStreams, fencing: Fencing, requests: RequestTable,
                 on_published: Callable[[Event], None] = lambda _: None) -> None:
        self.streams = streams
        self.fencing = fencing
        self.requests = requests
        self.on_published = on_published  # each event once it is written (totals, metrics)
        self.outputs: asyncio.Queue[Step] = asyncio.Queue()

    def take(self, step: Step) -> None:
        """Queue one engine step's output (it arrived from the engine process)."""
        self.outputs.put_nowait(step)

    def emit(self, outgoing: Outgoing) -> None:
        """Publish one event made outside the engine (an error, a cancel before start)."""
        self.outputs.put_nowait(Step([outgoing]))

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
            await self._take_fences(outgoing)
            writes = self._writes(outgoing)
            statuses = await self._write(writes)
            self._count(writes, statuses)
            ended = [write.route for write, status in zip(writes, statuses, strict=True)
                     if write.terminal and status.status is PublishStatus.APPLIED]
            if ended:
                await self._finish(ended)
            outgoing = []
            for write, status in zip(writes, statuses, strict=True):
                outgoing += await self._published(write, status)

    def _count(self, writes: list[OutputWrite], statuses: list[Published]) -> None:
        """Count what was written as soon as Redis says so, before anything else is awaited:
        a reader may see those events already, and metrics must not lag them by a settle."""
        for write, published in zip(writes, statuses, strict=True):
            if published.status is PublishStatus.APPLIED:
                for event in write.events:
                    self.on_published(event)

    async def _finish(self, ended: list[Route]) -> None:
        """Settle the entries whose terminal event is written. If Redis refuses (the queue's
        stream replaced by another type, say), their readers are answered already: the
        entries stay pending, and whoever takes them next finds their fences finished."""
        try:
            await retrying(partial(self.streams.finish, ended), "settling finished requests")
        except RedisError as e:
            if is_permission_error(e):
                raise  # the worker's own keys: the worker's failure (see `retrying`)
            log.error("redis refused settling finished requests; they stay pending", reason=describe(e),
                      request_ids=[route.id for route in ended])

    async def _take_fences(self, outgoing: list[Outgoing]) -> None:
        """Take the fence of requests answered before their intake took it (a poisoned
        entry, an error found before its body was read)."""
        for item in outgoing:
            held = self.requests.holding(item.ref)
            if held is None or held.route.fence:
                continue
            try:
                await take_fence(self.fencing, self.streams, self.requests, held)
            except RedisError as e:
                if is_permission_error(e):
                    raise  # the worker's own keys: the worker's failure (see `retrying`)
                log.error("redis refused this request's fence; settling it unanswered", request_id=held.route.id,
                          reason=describe(e))
                await retrying(partial(self.streams.settle_unanswered, held.route), "settling a request")
                self.requests.end(held.route.id, RequestStatus.SETTLED)

    async def _write(self, writes: list[OutputWrite]) -> list[Published]:
        """One call for all; if Redis refuses it (an ACL, say), one call per request, so
        that the refusal stays with the requests it belongs to."""
        if not writes:
            return []
        try:
            return await retrying(partial(self.fencing.publish, writes), "publishing")
        except RedisError as e:
            if len(writes) == 1:
                return [Published(PublishStatus.REFUSED, describe(e))]
            log.warning("redis refused a step's output; writing request by request", reason=describe(e))
        return [(await self._write([write]))[0] for write in writes]

    def _writes(self, outgoing: list[Outgoing]) -> list[OutputWrite]:
        """Each held request's events, in order and encoded; events of requests no longer
        held are dropped. An event that cannot be encoded ends its request there."""
        events: dict[str, list[Event]] = {}
        for item in outgoing:
            if self.requests.holding(item.ref) is not None:
                events.setdefault(item.ref.id, []).append(item.event)
        writes = []
        for request_id, its_events in events.items():
            held = self.requests.get(request_id)
            assert held is not None
            write = encode_write(held.route, held.written, [held.timed(e) for e in its_events])
            if write.terminal:
                self.requests.advance(request_id, RequestStatus.FINISHING)
            writes.append(write)
        return writes

    async def _published(self, write: OutputWrite, published: Published) -> list[Outgoing]:
        """Act on one request's status; returns the events to publish in its place, if any."""
        route, status = write.route, published.status
        if status is PublishStatus.APPLIED:
            self.requests.wrote(route.ref, write.first + len(write.entries), write.terminal)
            if write.terminal:
                _log_finished(write.events[-1])
            return []
        if status is PublishStatus.GAP:
            written = int(published.detail)
            log.error("output written earlier is missing (Redis lost data?); failing the request",
                      request_id=route.id, written=written, expected=write.first)
            return self._instead(route, written, ErrorCode.INTERNAL, (
                f"{write.first - written} events of this request's output were lost by Redis; "
                "it cannot continue without a gap"))
        if status is PublishStatus.REFUSED:
            return await self._refused(write, published.detail)
        if status is PublishStatus.EXPIRED:
            log.error("the request's fence expired before its output was written; failing it", request_id=route.id)
            return self._fail_afresh(route, (
                f"this request's output fence expired: nothing was written for longer than result_ttl_s "
                f"({self.fencing.result_ttl_s} s)"), ErrorCode.INTERNAL)
        if status is PublishStatus.LOST:
            return await self._lost(route)
        self.requests.end(route.id, RequestStatus.SETTLED)
        log.warning("another entry with this id is served; dropping this one", request_id=route.id,
                    entry_id=route.entry_id)
        await retrying(partial(self.streams.settle, route.stream, [route.entry_id]), "settling a duplicate")
        return []

    async def _lost(self, route: Route) -> list[Outgoing]:
        """Another taking holds the fence. Normally another worker took the request over
        (the pending list says so): drop it here. If the pending list still says it is
        ours, our taking was lost (a failover dropped the write), and nobody else would
        ever serve it: fail it under a fence taken anew."""
        if not await self._owns(route):
            log.warning("another worker took this request over; dropping it here", request_id=route.id)
            self.requests.end(route.id, RequestStatus.LOST)
            return []
        log.error("this worker holds the request but not its fence (lost in a failover?); failing it",
                  request_id=route.id)
        return self._fail_afresh(route, "this request's output fence was lost by Redis (a failover?); it cannot "
                                 "continue without risking a gap or a repeat", ErrorCode.INTERNAL)

    async def _owns(self, route: Route) -> bool:
        """Whether the pending list says we hold the entry; a refusal (no such group any
        more, say) means we do not."""
        try:
            return await retrying(partial(self.streams.owns, route), "checking who holds a request")
        except RedisError as e:
            if is_permission_error(e):
                raise
            log.warning("could not read who holds a request", request_id=route.id, reason=describe(e))
            return False

    async def _refused(self, write: OutputWrite, reason: str) -> list[Outgoing]:
        """Redis refused this request's output: say so on its own output stream, or, if
        even that is refused, settle it unanswered."""
        route = write.route
        own = self.streams.keys.output(self.streams.queue, route.id)
        if route.reply_to != own:
            log.error("redis refused the reply stream; the error goes to the request's own output stream",
                      request_id=route.id, reply_to=route.reply_to, reason=reason)
            return self._fail_afresh(replace(route, reply_to=own),
                                     f"reply_to: Redis refused writing to {route.reply_to} ({reason})",
                                     ErrorCode.INVALID_REQUEST)
        log.error("redis refused the request's output stream; settling it unanswered", request_id=route.id,
                  reason=reason)
        await retrying(partial(self.streams.settle_unanswered, route), "settling an unanswerable request")
        self.requests.end(route.id, RequestStatus.SETTLED)
        return []

    def _fail_afresh(self, route: Route, message: str, code: ErrorCode) -> list[Outgoing]:
        """Fail a request under a fence taken anew (one that expired, or the fence of its
        own output stream when its reply stream was refused): held without a fence, it
        is taken before the error is written."""
        route = replace(route, fence="")
        self.requests.hold_again(route, 0)
        return [failed(route.ref, code, message)]

    def _instead(self, route: Route, written: int, code: ErrorCode, message: str) -> list[Outgoing]:
        """Hold the request again, at `written`, to publish an error as its terminal event;
        the engine drops what it still makes for it."""
        self.requests.hold_again(route, written)
        return [failed(route.ref, code, message)]


def _log_finished(event: Event) -> None:
    if isinstance(event, Error):
        log.info("request failed", request_id=event.id, code=event.code, message=event.message)
        return
    assert isinstance(event, Done)
    log.info("request finished", request_id=event.id, finish_reason=event.finish_reason,
             prompt_tokens=event.usage.prompt_tokens, completion_tokens=event.usage.completion_tokens,
             ttft_ms=event.timing.ttft_ms, total_ms=event.timing.total_ms, tok_s=event.decode_tok_s)

