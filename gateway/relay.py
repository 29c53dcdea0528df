"""One HTTP request through the queue: submit, follow the output stream, answer.

A streaming call waits up to `keepalive_s` for its request's first event before it
commits to a 200, so that an error the worker finds at intake (a bad schema, a prompt
too long) still gets its proper status; a request that waits longer in the queue gets
its stream started and an SSE comment every `keepalive_s`. A client that goes away, at
any point, cancels its request through the cancel key and channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import anyio
import structlog
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from client import AsyncClient, QueueFull, RequestRejected
from client.protocol import Delta, Done, Error, Event, TokenLogprob

from .errors import TIMEOUT, ApiError
from .metrics import GatewayMetrics
from .models import ModelDirectory
from .quotas import Quotas
from .replies import Followed, ReplyStream
from .requests import Call
from .responses import Shaper
from .tenants import Caller

log = structlog.get_logger("mlxq.gateway")
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection: logged, never seen by anyone
DONE_LINE = b"data: [DONE]\n\n"
KEEPALIVE_LINE = b": keep-alive\n\n"
TIMER_SLACK_S = 0.005


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class Disconnect:
    """Watches for the client going away while the request is relayed."""

    def __init__(self, request: Request) -> None:
        self._task = asyncio.ensure_future(self._wait(request))

    @staticmethod
    async def _wait(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def race(self, work: Awaitable[T]) -> T | None:
        """`work`'s result, or None (and `work` cancelled) if the client went away first."""
        task = asyncio.ensure_future(work)
        done, _ = await asyncio.wait({task, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None

    def stop(self) -> None:
        """Stop watching (the streaming response watches from here on)."""
        self._task.cancel()


class Shape(Protocol):
    """How one call's answer is written: a whole response, or a stream's lines."""

    route: str  # the metrics' label
    keepalive: bytes

    def opening(self) -> list[bytes]: ...
    def lines(self, event: Event) -> list[bytes]: ...
    def failure(self, error: ApiError) -> list[bytes]: ...
    def whole(self, done: Done, logprobs: list[TokenLogprob] | None) -> dict[str, Any]: ...
    async def settle(self) -> None: ...  # after the answer is made: what the shape keeps (a stored response)


ShapeFor = Callable[[Call, str, "tuple[str, str] | None"], Shape]


class OpenAIShape:
    """OpenAI's chunks and responses (`Shaper`), as SSE lines ending in `data: [DONE]`."""

    keepalive = KEEPALIVE_LINE

    def __init__(self, call: Call, request_id: str, tool_call: tuple[str, str] | None) -> None:
        self.shaper = Shaper(call, request_id, tool_call)
        self.route: str = call.kind

    def opening(self) -> list[bytes]:
        return [sse(chunk) for chunk in self.shaper.opening()]

    def lines(self, event: Event) -> list[bytes]:
        if isinstance(event, Delta):
            return [sse(chunk) for chunk in self.shaper.delta(event)]
        if isinstance(event, Done):
            return [*(sse(chunk) for chunk in self.shaper.ending(event)), DONE_LINE]
        return self.failure(ApiError.from_code(event.code, event.message))

    def failure(self, error: ApiError) -> list[bytes]:
        return [sse(error.body()), DONE_LINE]

    def whole(self, done: Done, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        return self.shaper.whole(done, logprobs)

    async def settle(self) -> None:
        pass


class Relay:
    """Serves calls: the one place that submits and follows requests."""

    def __init__(self, client: AsyncClient, directory: ModelDirectory, replies: ReplyStream,
                 metrics: GatewayMetrics, quotas: Quotas, *, timeout_s: float, keepalive_s: float) -> None:
        self.client = client
        self.directory = directory
        self.replies = replies
        self.metrics = metrics
        self.quotas = quotas
        self.timeout_s = timeout_s
        self.keepalive_s = keepalive_s

    async def serve(self, request: Request, call: Call, started: float, caller: Caller,
                    shape_for: ShapeFor | None = None, request_id: str | None = None) -> Response:
        """Submit `call` for `caller` (under its key's limits, under `request_id` or a new
        id) and answer it in the shape `shape_for` makes (OpenAI's by default); raises `ApiError`."""
        served = await self.directory.resolve(call.model, caller)
        if served.task is not None and served.task != call.task:
            raise ApiError.invalid(f"model {call.model!r} serves {served.task}; this endpoint needs a model that "
                                   f"serves {call.task}", param="model")
        deadline_ms = int((time.time() + self.timeout_s) * 1000)  # not started by then: not computed at all
        body = dict(call.body) | ({"adapter": served.adapter} if served.adapter else {})
        caller.shape(body)
        job, reply_to = self.replies.follow(request_id or uuid.uuid4().hex, served.queue)
        job.on_queue = served.queue
        streaming = False
        try:
            job.admission = await self.quotas.admit(caller, job.id)
            try:
                await self.client.submit(id=job.id, queue=served.queue, encoding="msgpack",
                                         reply_to=reply_to, deadline_ms=deadline_ms, **body)
            except (RequestRejected, QueueFull) as e:
                raise ApiError.from_mlxq(e) from e
            shape: Shape = (shape_for or OpenAIShape)(call, job.id, served.tool_call)
            if not call.stream:
                return await self._whole(request, job, shape, started, call.body.get("logprobs", False))
            response = await self._stream(request, job, shape, started)
            streaming = isinstance(response, StreamingResponse)  # it releases the request when it ends
            return response
        finally:
            if not streaming:
                self.replies.forget(job.id)
                await self._charge(job)

    async def _whole(self, request: Request, job: Followed, shape: Shape, started: float,
                     logprobs: bool) -> Response:
        watch = Disconnect(request)
        try:
            return await self._wait_whole(job, shape, watch, started, logprobs)
        finally:
            watch.stop()

    async def _wait_whole(self, job: Followed, shape: Shape, watch: Disconnect, started: float,
                          logprobs: bool) -> Response:
        entries: list[TokenLogprob] | None = [] if logprobs else None
        ends_at = time.monotonic() + self.timeout_s
        while True:
            events = await watch.race(job.read(ends_at - time.monotonic()))
            if events is None:
                return await self._gone(job)
            for event in events:
                if isinstance(event, Delta) and entries is not None and event.logprobs:
                    entries += event.logprobs
                elif isinstance(event, Done):
                    self.metrics.first_byte(shape.route, started)
                    answer = shape.whole(event, entries)
                    await shape.settle()
                    return JSONResponse(answer, headers={"x-request-id": job.id})
                elif isinstance(event, Error):
                    raise ApiError.from_code(event.code, event.message)
            if time.monotonic() >= ends_at:
                await self._cancel(job)
                raise self._timed_out(job)

    async def _stream(self, request: Request, job: Followed, shape: Shape, started: float) -> Response:
        watch = Disconnect(request)
        try:
            first = await self._first_events(job, watch)
        finally:
            watch.stop()
        if first is None:
            return await self._gone(job)
        if first and isinstance(first[0], Error):
            raise ApiError.from_code(first[0].code, first[0].message)
        headers = {"x-request-id": job.id, "cache-control": "no-cache", "x-accel-buffering": "no"}
        # The task runs after the stream, even one whose client left before it began.
        return StreamingResponse(self._events(job, shape, first, started), media_type="text/event-stream",
                                 headers=headers, background=BackgroundTask(self._release, job))

    async def _first_events(self, job: Followed, watch: Disconnect) -> list[Event] | None:
        """What came within `keepalive_s` (maybe nothing); None if the client left meanwhile."""
        commit_at = time.monotonic() + self.keepalive_s
        while time.monotonic() < commit_at:
            events = await watch.race(job.read(commit_at - time.monotonic()))
            if events is None or events:
                return events
        return []

    async def _events(self, job: Followed, shape: Shape, first: list[Event], started: float) -> AsyncIterator[bytes]:
        """The SSE body; Starlette cancels it when the client goes away, and that cancels the request."""
        self.metrics.open_streams.inc()
        self.metrics.first_byte(shape.route, started)
        ends_at = started + self.timeout_s
        try:
            for line in shape.opening():
                yield line
            events, beat_at = first, time.monotonic() + self.keepalive_s
            while True:
                for event in events:
                    for line in shape.lines(event):
                        yield line
                if job.finished:
                    await shape.settle()
                    return
                if time.monotonic() >= ends_at:
                    await self._cancel(job)
                    for line in shape.failure(self._timed_out(job)):
                        yield line
                    await shape.settle()
                    return
                events = await job.read(min(beat_at, ends_at) - time.monotonic())
                if events:
                    beat_at = time.monotonic() + self.keepalive_s
                elif time.monotonic() >= beat_at - TIMER_SLACK_S:  # a timer may fire a little early
                    yield shape.keepalive
                    beat_at = time.monotonic() + self.keepalive_s
        finally:
            self.metrics.open_streams.dec()
            with anyio.CancelScope(shield=True):  # the response's task is being cancelled: finish this first
                await self._release(job)

    async def _release(self, job: Followed) -> None:
        """Stop following the request, and cancel it unless it ended; once, however often called."""
        if job.released:
            return
        job.released = True
        self.replies.forget(job.id)
        if not job.finished:
            await self._cancel(job)
        await self._charge(job)

    async def _charge(self, job: Followed) -> None:
        """Count the request against its key (its tokens, its lease back)."""
        try:
            await job.admission.close(job.tokens)
        except Exception as e:  # noqa: BLE001 - Redis gone: the lease lapses by itself
            log.warning("could not count a request against its key", request_id=job.id, error=str(e))

    async def _gone(self, job: Followed) -> Response:
        """The client closed the connection before the answer: cancel, answer nobody."""
        await self._cancel(job)
        return Response(status_code=CLIENT_CLOSED)

    async def _cancel(self, job: Followed) -> None:
        try:
            await self.client.cancel(job.id, queue=job.on_queue)
            log.info("request cancelled: the client went away or it timed out", request_id=job.id)
        except Exception as e:  # noqa: BLE001 - Redis gone: the request runs on, unread; nothing else to do
            log.warning("could not cancel a request", request_id=job.id, error=str(e))

    def _timed_out(self, job: Followed) -> ApiError:
        return ApiError.from_code(TIMEOUT, f"request {job.id} did not finish within {self.timeout_s:g} s "
                                  "(the gateway's request_timeout_s); it was cancelled")

