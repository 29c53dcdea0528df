"""The asyncio client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from ._batch_jobs import AsyncBatchHandle, native_lines
from ._errors import RedisUnavailable, RequestRejected, redis_errors
from ._jobs import (
    BLOCK_MS,
    ENQUEUE,
    Bounds,
    Cursor,
    Deadline,
    Outage,
    Submission,
    build_submission,
    enqueue_args,
    queue_full,
)
from .batches import BatchStore, completion_window_s
from .connect import close_async, connect_async
from .keys import DEFAULT_PREFIX, DEFAULT_QUEUE, Keys
from .pooling import embeddings_of, ranked_of
from .protocol import Delta, Done, Encoding, Event, Ranked, decode_event
from .replies import stream_entries
from .which_redis import default_url

CANCEL_TTL_S = 86400


class AsyncClient:
    """Submits requests to an mlxq queue and follows their output.

    >>> async with AsyncClient("redis://127.0.0.1:6390") as client:
    ...     done = await client.generate("Hello", max_tokens=32)
    """

    def __init__(self, url: str | None = None, *, queue: str = DEFAULT_QUEUE, prefix: str = DEFAULT_PREFIX,
                 redis: aioredis.Redis | None = None) -> None:
        url = url or default_url()  # $MLXQ_REDIS_URL, else the embedded Valkey's
        self.redis = redis or connect_async(url, socket_timeout=10)
        self.url = url
        self.queue = queue
        self.keys = Keys(prefix)
        self._bounds = Bounds()
        self._enqueue = self.redis.register_script(ENQUEUE)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the Redis connections."""
        await close_async(self.redis)

    async def submit(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
                     prompt_tokens: list[int] | None = None, id: str | None = None, queue: str | None = None,
                     lane: str | None = None, encoding: Encoding = "json", **params: Any) -> AsyncJob:
        """Queue a request (`params` are the body fields of docs/protocol.md) and return its job.
        `lane` puts it on a priority lane of the queue (workers read the lanes they are
        configured with before the queue itself).

        Raises `RequestRejected` before sending anything if the request is invalid, and
        `QueueFull` if the queue already holds as many waiting requests as its workers accept.
        """
        body = {"prompt": prompt, "messages": messages, "prompt_tokens": prompt_tokens, **params}
        queue = queue or self.queue
        submission = build_submission(self.keys, queue, id, encoding, body, lane)
        with redis_errors():
            await self._send(submission)
        return AsyncJob(self, submission.id, submission.output, submission.queue)

    async def submit_many(self, requests: Iterable[Mapping[str, Any]], *, queue: str | None = None,
                          lane: str | None = None, encoding: Encoding = "json") -> list[AsyncJob]:
        """Queue many requests in one call, all or none, and return their jobs in order.
        Each mapping holds what `submit` takes: `prompt`, `messages` or `prompt_tokens`,
        optionally `id`, and the body fields. Workers waiting on the queue read them
        together (a backlog pushed at once, as Sidekiq's `push_bulk`).

        Raises `RequestRejected` (naming the request's index) before sending anything if
        one is invalid, and `QueueFull` if they would pass the queue's bound.
        """
        queue = queue or self.queue
        submissions = []
        for index, request in enumerate(requests):
            body = {key: value for key, value in request.items() if key != "id"}
            try:
                submissions.append(build_submission(self.keys, queue, request.get("id"), encoding, body, lane))
            except RequestRejected as e:
                raise RequestRejected(f"request {index}: {e}", e.code) from e
        if submissions:
            with redis_errors():
                await self._send(*submissions)
        return [AsyncJob(self, s.id, s.output, s.queue) for s in submissions]

    async def _send(self, *submissions: Submission) -> None:
        """XADD the requests (to one stream), through the bounded enqueue where the queue's
        workers published a bound, or where there are several (then added together)."""
        first = submissions[0]
        bound = self._bounds.cached(first.queue)
        if bound is None:
            bound = self._bounds.remember(first.queue, await self.redis.hget(self.keys.limits(first.queue), "max_len"))
        if not bound and len(submissions) == 1:
            await self.redis.xadd(first.stream, first.fields)  # type: ignore[arg-type]
            return
        try:
            await self._enqueue(keys=[first.stream], args=enqueue_args(list(submissions), bound))
        except ResponseError as e:
            raise queue_full(e, first, bound) from e

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> Done:
        """Submit and wait for the final output in one call."""
        job = await self.submit(prompt, **kwargs)
        return await job.result(timeout=timeout)

    async def embed(self, input: str | list[str] | list[list[int]], *, dimensions: int | None = None,
                    truncate: bool = False, queue: str | None = None, timeout: float | None = None,
                    **params: Any) -> list[list[float]]:
        """One vector per input, in order, from the embedding model serving `queue` (sent as
        base64 float32, compact and exact). `params` are the body's other fields (priority,
        deadline_ms, metadata, ...); `submit(input=...)` gives the whole `done` (usage, timing)."""
        job = await self.submit(input=input, dimensions=dimensions, truncate=truncate or None,
                                encoding_format="base64", queue=queue, **params)
        return embeddings_of(await job.result(timeout=timeout))

    async def rerank(self, query: str, documents: list[str], *, top_n: int | None = None,
                     queue: str | None = None, timeout: float | None = None, **params: Any) -> list[Ranked]:
        """The documents' relevance to the query (`index` into `documents`, `relevance_score`),
        best first, `top_n` of them, from the reranker serving `queue`."""
        job = await self.submit(query=query, documents=documents, top_n=top_n, queue=queue, **params)
        return ranked_of(await job.result(timeout=timeout))

    async def submit_batch(self, lines: Iterable[Mapping[str, Any]], *, queue: str | None = None,
                           completion_window: str = "24h", metadata: dict[str, str] | None = None) -> AsyncBatchHandle:
        """Queue many requests as one batch: `lines` are `{"custom_id", "body"}`, each body
        what `submit` takes. Its lines run behind the queue's interactive requests; a
        gateway (or `wait()`) drives it. A body the worker would refuse is that line's
        error; malformed lines refuse the batch (`RequestRejected`, nothing stored)."""
        queue = queue or self.queue
        checked = native_lines(lines, self.keys, queue)
        try:
            completion_window_s(completion_window)
        except ValueError as e:
            raise RequestRejected(str(e)) from e
        with redis_errors():
            batch = await BatchStore(self.redis, self.keys).create(checked, queue=queue, endpoint="mlxq",
                                                                   completion_window=completion_window,
                                                                   metadata=metadata)
        return AsyncBatchHandle(self, batch.id)

    def batch(self, batch_id: str) -> AsyncBatchHandle:
        """A batch made earlier, by id."""
        return AsyncBatchHandle(self, batch_id)

    async def cancel(self, request_id: str, *, queue: str | None = None) -> None:
        """Cancel a request of `queue` (default: this client's), running or queued; does
        nothing if it already finished."""
        queue = queue or self.queue
        # Two calls, not a pipeline: a Redis Cluster pipeline refuses PUBLISH.
        with redis_errors():
            await self.redis.set(self.keys.cancel_flag(queue, request_id), 1, ex=CANCEL_TTL_S)
            await self.redis.publish(self.keys.cancel_channel(queue), request_id)

    async def events(self, stream: str, *, last_id: str = "0-0") -> AsyncIterator[tuple[str, Event]]:
        """Every event on an output stream (a `reply_to` shared by many requests), forever."""
        while True:
            with redis_errors():
                reply = await self.redis.xread({stream: last_id}, count=100, block=BLOCK_MS)
            for entry_id, fields in stream_entries(reply):
                last_id = entry_id
                if fields is not None:
                    yield entry_id, decode_event(fields)


class AsyncJob:
    """One submitted request: stream its deltas, wait for its result, or cancel it."""

    def __init__(self, client: AsyncClient, request_id: str, output: str, queue: str) -> None:
        self.client = client
        self.id = request_id
        self.output = output
        self.queue = queue
        self._cursor = Cursor(request_id, output)
        self._outage = Outage()

    async def _read(self, deadline: Deadline) -> list[Event]:
        try:
            with redis_errors():
                reply = await self.client.redis.xread({self.output: self._cursor.last_id}, count=100,
                                                      block=deadline.block_ms())
        except RedisUnavailable as e:
            await asyncio.sleep(min(self._outage.failed(e), deadline.left()))
            return []
        self._outage.ended()
        return self._cursor.feed(stream_entries(reply))

    async def stream(self, timeout: float | None = None) -> AsyncIterator[Delta]:
        """Yield deltas as they arrive; at the end raise if the request failed or was cancelled."""
        deadline = Deadline(self.id, timeout)
        while self._cursor.terminal is None:
            for event in await self._read(deadline):
                if isinstance(event, Delta):
                    yield event
        self._cursor.outcome()

    async def result(self, timeout: float | None = None) -> Done:
        """Wait for the terminal event; raises `JobFailed`, `JobCancelled` or `JobTimeout`."""
        deadline = Deadline(self.id, timeout)
        while self._cursor.terminal is None:
            await self._read(deadline)
        return self._cursor.outcome()

    async def cancel(self) -> None:
        """Cancel this request."""
        await self.client.cancel(self.id, queue=self.queue)
