"""The blocking client: `AsyncClient` itself, run on an event loop of its own (`Portal`),
so that both have one implementation. The same calls, the same errors, without `await`."""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import redis as redis_py

from ._async import AsyncClient, AsyncJob
from ._batch_jobs import AsyncBatchHandle
from ._portal import Portal
from .batches import Batch, LineResult
from .connect import connect
from .keys import DEFAULT_PREFIX, DEFAULT_QUEUE
from .protocol import Delta, Done, Encoding, Event, Ranked
from .which_redis import default_url

T = TypeVar("T")


class Client:
    """Submits requests to an mlxq queue and follows their output.

    >>> with Client("redis://127.0.0.1:6390") as client:
    ...     for delta in client.submit("Hello", max_tokens=32).stream():
    ...         print(delta.text, end="")
    """

    def __init__(self, url: str | None = None, *, queue: str = DEFAULT_QUEUE, prefix: str = DEFAULT_PREFIX) -> None:
        url = url or default_url()  # $MLXQ_REDIS_URL, else the embedded Valkey's (client/which_redis.py)
        self._portal = Portal()
        self._client = AsyncClient(url, queue=queue, prefix=prefix)
        self.url, self.queue, self.keys = url, queue, self._client.keys
        # A blocking connection for the caller's own commands (it connects on first use).
        self.redis: redis_py.Redis = connect(url, socket_timeout=10)
        # Closed with `close()`, or once the client is collected: `Client(url).cancel(id)` leaks nothing.
        self._release = weakref.finalize(self, _release, self._portal, self._client, self.redis)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the Redis connections and the client's event loop."""
        self._release()

    def submit(self, prompt: str | None = None, *, messages: list[dict[str, str]] | None = None,
               prompt_tokens: list[int] | None = None, id: str | None = None, queue: str | None = None,
               lane: str | None = None, encoding: Encoding = "json", **params: Any) -> Job:
        """Queue a request and return its job (see `AsyncClient.submit`)."""
        job = self._portal.call(lambda: self._client.submit(prompt, messages=messages, prompt_tokens=prompt_tokens,
                                                            id=id, queue=queue, lane=lane, encoding=encoding,
                                                            **params))
        return Job(self, job.id, job.output, job.queue)

    def submit_many(self, requests: Iterable[Mapping[str, Any]], *, queue: str | None = None,
                    lane: str | None = None, encoding: Encoding = "json") -> list[Job]:
        """Queue many requests in one call, all or none (see `AsyncClient.submit_many`)."""
        jobs = self._portal.call(lambda: self._client.submit_many(requests, queue=queue, lane=lane,
                                                                  encoding=encoding))
        return [Job(self, job.id, job.output, job.queue) for job in jobs]

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> Done:
        """Submit and wait for the final output in one call."""
        return self._portal.call(lambda: self._client.generate(prompt, timeout=timeout, **kwargs))

    def embed(self, input: str | list[str] | list[list[int]], *, dimensions: int | None = None,
              truncate: bool = False, queue: str | None = None, timeout: float | None = None,
              **params: Any) -> list[list[float]]:
        """One vector per input, in order (see `AsyncClient.embed`)."""
        return self._portal.call(lambda: self._client.embed(input, dimensions=dimensions, truncate=truncate,
                                                            queue=queue, timeout=timeout, **params))

    def rerank(self, query: str, documents: list[str], *, top_n: int | None = None,
               queue: str | None = None, timeout: float | None = None, **params: Any) -> list[Ranked]:
        """The documents' relevance to the query, best first (see `AsyncClient.rerank`)."""
        return self._portal.call(lambda: self._client.rerank(query, documents, top_n=top_n, queue=queue,
                                                             timeout=timeout, **params))

    def submit_batch(self, lines: Iterable[Mapping[str, Any]], *, queue: str | None = None,
                     completion_window: str = "24h", metadata: dict[str, str] | None = None) -> BatchHandle:
        """Queue many requests as one batch (see `AsyncClient.submit_batch`)."""
        handle = self._portal.call(lambda: self._client.submit_batch(lines, queue=queue,
                                                                     completion_window=completion_window,
                                                                     metadata=metadata))
        return self.batch(handle.id)

    def batch(self, batch_id: str) -> BatchHandle:
        """A batch made earlier, by id."""
        return BatchHandle(self.url, self.keys.prefix, batch_id)

    def cancel(self, request_id: str, *, queue: str | None = None) -> None:
        """Cancel a request of `queue` (default: this client's), running or queued; does
        nothing if it already finished."""
        self._portal.call(lambda: self._client.cancel(request_id, queue=queue))

    def events(self, stream: str, *, last_id: str = "0-0") -> Iterator[tuple[str, Event]]:
        """Every event on an output stream (a `reply_to` shared by many requests), forever."""
        return self._portal.iterate(self._client.events(stream, last_id=last_id))


def _release(portal: Portal, client: AsyncClient, redis: redis_py.Redis) -> None:
    portal.close(client.aclose)
    redis.close()


class Job:
    """One submitted request: stream its deltas, wait for its result, or cancel it."""

    def __init__(self, client: Client, request_id: str, output: str, queue: str) -> None:
        self.client = client
        self.id = request_id
        self.output = output
        self.queue = queue
        self._job = AsyncJob(client._client, request_id, output, queue)

    def stream(self, timeout: float | None = None) -> Iterator[Delta]:
        """Yield deltas as they arrive; at the end raise if the request failed or was cancelled."""
        return self.client._portal.iterate(self._job.stream(timeout))

    def result(self, timeout: float | None = None) -> Done:
        """Wait for the terminal event; raises `JobFailed`, `JobCancelled` or `JobTimeout`."""
        return self.client._portal.call(lambda: self._job.result(timeout))

    def cancel(self) -> None:
        """Cancel this request."""
        self.client.cancel(self.id, queue=self.queue)


class BatchHandle:
    """The blocking `AsyncBatchHandle`. Each call runs on a client of its own, so a handle
    outlives the client that made it (a batch runs for hours)."""

    def __init__(self, url: str, prefix: str, batch_id: str) -> None:
        self.url, self.prefix, self.id = url, prefix, batch_id

    def progress(self) -> Batch:
        return self._run(lambda h: h.progress())

    def wait(self, timeout: float | None = None, on_progress: Callable[[Batch], None] = lambda _: None) -> Batch:
        return self._run(lambda h: h.wait(timeout, on_progress))

    def results(self) -> list[LineResult]:
        return self._run(lambda h: h.results())

    def cancel(self) -> Batch:
        return self._run(lambda h: h.cancel())

    def _run(self, call: Callable[[AsyncBatchHandle], Awaitable[T]]) -> T:
        with Client(self.url, prefix=self.prefix) as client:
            return client._portal.call(lambda: call(client._client.batch(self.id)))
