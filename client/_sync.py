"""The blocking client: the same API as `AsyncClient`, without an event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import redis as redis_py
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ._async import CANCEL_TTL_S, DEFAULT_URL, AsyncClient
from ._batch_jobs import BatchHandle
from ._jobs import BLOCK_MS, ENQUEUE, Bounds, Cursor, Deadline, Outage, build_submission, enqueue_args, queue_full
from .connect import connect
from .keys import DEFAULT_PREFIX, DEFAULT_QUEUE, Keys
from .pooling import embeddings_of, ranked_of
from .protocol import Delta, Done, Encoding, Event, Ranked, decode_event
from .replies import stream_entries


class Client:
    """Submits requests to an mlxq queue and follows their output.

    >>> with Client("redis://127.0.0.1:6390") as client:
    ...     for delta in client.submit("Hello", max_tokens=32).stream():
    ...         print(delta.text, end="")
    """

    def __init__(self, url: str = DEFAULT_URL, *, queue: str = DEFAULT_QUEUE, prefix: str = DEFAULT_PREFIX,
                 redis: redis_py.Redis | None = None) -> None:
        self.redis = redis or connect(url, socket_timeout=10)
        self.url = url
        self.queue = queue
        self.keys = Keys(prefix)
        self._bounds = Bounds()
        self._enqueue = self.redis.register_script(ENQUEUE)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the Redis connections."""
        self.redis.close()

    def submit(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
               prompt_tokens: list[int] | None = None, id: str | None = None, queue: str | None = None,
               lane: str | None = None, encoding: Encoding = "json", **params: Any) -> Job:
        """Queue a request (`params` are the body fields of docs/protocol.md) and return its job.
        `lane` puts it on a priority lane of the queue (workers read the lanes they are
        configured with before the queue itself).

        Raises `RequestRejected` before sending anything if the request is invalid, and
        `QueueFull` if the queue already holds as many waiting requests as its workers accept.
        """
        body = {"prompt": prompt, "messages": messages, "prompt_tokens": prompt_tokens, **params}
        queue = queue or self.queue
        submission = build_submission(self.keys, queue, id, encoding, body, lane)
        bound = self._bounds.cached(queue)
        if bound is None:
            bound = self._bounds.remember(queue, self.redis.hget(self.keys.limits(queue), "max_len"))
        if not bound:
            self.redis.xadd(submission.stream, submission.fields)  # type: ignore[arg-type]
        else:
            try:
                self._enqueue(keys=[submission.stream], args=enqueue_args(submission, bound))
            except ResponseError as e:
                raise queue_full(e, submission, bound) from e
        return Job(self, submission.id, submission.output, submission.queue)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> Done:
        """Submit and wait for the final output in one call."""
        return self.submit(prompt, **kwargs).result(timeout=timeout)

    def embed(self, input: str | list[str] | list[list[int]], *, dimensions: int | None = None,
              truncate: bool = False, queue: str | None = None, timeout: float | None = None,
              **params: Any) -> list[list[float]]:
        """One vector per input, in order, from the embedding model serving `queue` (sent as
        base64 float32, compact and exact). `params` are the body's other fields (priority,
        deadline_ms, metadata, ...); `submit(input=...)` gives the whole `done` (usage, timing)."""
        job = self.submit(input=input, dimensions=dimensions, truncate=truncate or None, encoding_format="base64",
                          queue=queue, **params)
        return embeddings_of(job.result(timeout=timeout))

    def rerank(self, query: str, documents: list[str], *, top_n: int | None = None,
               queue: str | None = None, timeout: float | None = None, **params: Any) -> list[Ranked]:
        """The documents' relevance to the query (`index` into `documents`, `relevance_score`),
        best first, `top_n` of them, from the reranker serving `queue`."""
        job = self.submit(query=query, documents=documents, top_n=top_n, queue=queue, **params)
        return ranked_of(job.result(timeout=timeout))

    def submit_batch(self, lines: Iterable[Mapping[str, Any]], *, queue: str | None = None,
                     completion_window: str = "24h", metadata: dict[str, str] | None = None) -> BatchHandle:
        """Queue many requests as one batch (see `AsyncClient.submit_batch`); batch calls use
        connections of their own to this client's URL."""
        async def create() -> str:
            async with AsyncClient(self.url, queue=self.queue, prefix=self.keys.prefix) as client:
                return (await client.submit_batch(lines, queue=queue, completion_window=completion_window,
                                                  metadata=metadata)).id

        return self.batch(asyncio.run(create()))

    def batch(self, batch_id: str) -> BatchHandle:
        """A batch made earlier, by id."""
        return BatchHandle(lambda: AsyncClient(self.url, prefix=self.keys.prefix), batch_id)

    def cancel(self, request_id: str, *, queue: str | None = None) -> None:
        """Cancel a request of `queue` (default: this client's), running or queued; does
        nothing if it already finished."""
        queue = queue or self.queue
        # Two calls, not a pipeline: a Redis Cluster pipeline refuses PUBLISH.
        self.redis.set(self.keys.cancel_flag(queue, request_id), 1, ex=CANCEL_TTL_S)
        self.redis.publish(self.keys.cancel_channel(queue), request_id)

    def events(self, stream: str, *, last_id: str = "0-0") -> Iterator[tuple[str, Event]]:
        """Every event on an output stream (a `reply_to` shared by many requests), forever."""
        while True:
            reply = self.redis.xread({stream: last_id}, count=100, block=BLOCK_MS)
            for entry_id, fields in stream_entries(reply):
                last_id = entry_id
                if fields is not None:
                    yield entry_id, decode_event(fields)


class Job:
    """One submitted request: stream its deltas, wait for its result, or cancel it."""

    def __init__(self, client: Client, request_id: str, output: str, queue: str) -> None:
        self.client = client
        self.id = request_id
        self.output = output
        self.queue = queue
        self._cursor = Cursor(request_id, output)
        self._outage = Outage()

    def _read(self, deadline: Deadline) -> list[Event]:
        try:
            reply = self.client.redis.xread({self.output: self._cursor.last_id}, count=100,
                                            block=deadline.block_ms())
        except (RedisConnectionError, RedisTimeoutError) as e:
            time.sleep(min(self._outage.failed(e), deadline.left()))
            return []
        self._outage.ended()
        return self._cursor.feed(stream_entries(reply))

    def stream(self, timeout: float | None = None) -> Iterator[Delta]:
        """Yield deltas as they arrive; at the end raise if the request failed or was cancelled."""
        deadline = Deadline(self.id, timeout)
        while self._cursor.terminal is None:
            for event in self._read(deadline):
                if isinstance(event, Delta):
                    yield event
        self._cursor.outcome()

    def result(self, timeout: float | None = None) -> Done:
        """Wait for the terminal event; raises `JobFailed`, `JobCancelled` or `JobTimeout`."""
        deadline = Deadline(self.id, timeout)
        while self._cursor.terminal is None:
            self._read(deadline)
        return self._cursor.outcome()

    def cancel(self) -> None:
        """Cancel this request."""
        self.client.cancel(self.id, queue=self.queue)
