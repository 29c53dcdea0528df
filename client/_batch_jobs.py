"""A batch as the client sees it: made from lines of mlxq request bodies, followed,
waited on (driving it whenever nobody else does), cancelled, its results read."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from ._errors import RequestRejected, redis_errors
from ._jobs import build_submission
from .batch_driver import BatchClient, drive_until_ended
from .batches import MAX_LINES, Batch, BatchLine, BatchStore, LineResult
from .keys import Keys

T = TypeVar("T")
MAX_CUSTOM_ID = 512


def native_lines(lines: Iterable[Mapping[str, Any]], keys: Keys, queue: str) -> list[BatchLine]:
    """Lines `{"custom_id", "body"}` (a body as `AsyncClient.submit` takes it) checked: a
    body the worker would refuse becomes that line's error; a line without a custom id, a
    custom id twice or too many lines refuse the whole batch (`RequestRejected`)."""
    checked: list[BatchLine] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, 1):
        if not isinstance(line, Mapping) or set(line) - {"custom_id", "body"}:
            raise RequestRejected(f"line {number}: a batch line is {{'custom_id': str, 'body': dict}}")
        custom_id, body = line.get("custom_id"), line.get("body")
        if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
            raise RequestRejected(f"line {number}: custom_id must be a string of 1-{MAX_CUSTOM_ID} characters")
        if custom_id in seen:
            raise RequestRejected(f"line {number}: custom_id {custom_id!r} is used twice; each line needs its own")
        seen.add(custom_id)
        checked.append(_checked(custom_id, body, keys, queue))
        if len(checked) > MAX_LINES:
            raise RequestRejected(f"a batch holds at most {MAX_LINES} lines")
    if not checked:
        raise RequestRejected("a batch needs at least one line")
    return checked


def _checked(custom_id: str, body: Any, keys: Keys, queue: str) -> BatchLine:
    if not isinstance(body, dict):
        return BatchLine(custom_id, error={"code": "invalid_request", "message": "body: must be an object"})
    try:
        build_submission(keys, queue, None, "json", body)
    except RequestRejected as e:
        return BatchLine(custom_id, error={"code": str(e.code), "message": str(e)})
    return BatchLine(custom_id, body={k: v for k, v in body.items() if v is not None})


class AsyncBatchHandle:
    """One batch: its progress, its end, its results."""

    def __init__(self, client: BatchClient, batch_id: str) -> None:
        self.client = client
        self.id = batch_id
        self._store = BatchStore(client.redis, client.keys)

    async def progress(self) -> Batch:
        """The batch now: status and request counts (done, failed, total)."""
        with redis_errors():
            batch = await self._store.get(self.id)
        if batch is None:
            raise KeyError(f"no batch {self.id} (never made, or ended more than a week ago)")
        return batch

    async def wait(self, timeout: float | None = None, on_progress: Callable[[Batch], None] = lambda _: None) -> Batch:
        """Wait until it ends, driving it while nobody else does; raises TimeoutError."""
        return await asyncio.wait_for(drive_until_ended(self.client, self.id, on_progress=on_progress), timeout)

    async def results(self) -> list[LineResult]:
        """Every line's end so far, in line order: `event` is the line's `Done` or `Error`."""
        with redis_errors():
            return await self._store.results(self.id)

    async def cancel(self) -> Batch:
        """Stop it: running lines are cancelled, lines not started never run."""
        with redis_errors():
            batch = await self._store.cancel(self.id)
        if batch is None:
            raise KeyError(f"no batch {self.id}")
        return batch
