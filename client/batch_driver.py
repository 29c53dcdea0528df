"""Driving batches: feeding their lines to the queue's batch lane and filing each end.

One driver at a time per batch: it holds the batch's lease (`...:lease`, a token with a
TTL that it renews on every pass). A driver that stops renewing (killed) loses it within
`lease_s`, and any process that runs a `BatchRunner` (every gateway) or waits on the
batch (`mlxq batch submit --wait`, a client's `BatchHandle.wait()`) takes over from
what Redis holds. A takeover repeats nothing and loses nothing: each line's request id
is fixed (`<batch>-<n>-<token>`, the token made from the batch's secret), so a line fed
twice is computed once (the worker's fence and done mark); each line's end is filed once
under its number; the replies are read on from the last entry whose line was filed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from ._errors import QueueFull, RequestRejected
from .batch_share import BatchShares
from .batches import Batch, BatchLine, BatchStore, LineResult, batch_error, line_index, line_request_id
from .keys import BATCH_LANE, Keys
from .pooling import pooling_kind
from .protocol import Delta, Done, Error, Event, decode_event
from .replies import as_text, stream_entries


class BatchClient(Protocol):
    """What driving a batch needs of a client (`AsyncClient` is one)."""

    @property
    def redis(self) -> aioredis.Redis: ...

    @property
    def keys(self) -> Keys: ...

    @property
    def submit(self) -> Callable[..., Awaitable[Any]]: ...  # AsyncClient.submit: a line's body as keywords

    async def cancel(self, request_id: str, *, queue: str | None = None) -> None: ...

log = logging.getLogger("mlxq.batches")

LEASE_S = 10.0  # a driver that stops renewing its lease is replaced this long after
WINDOW = 512  # lines fed and not yet ended, at most: the fleet's slots, with room to spare
READ_BLOCK_MS = 500  # one pass waits this long for replies
READ_COUNT = 500
CANCEL_GRACE_S = 30.0  # a cancelled batch waits this long for its running lines to stop
RETRY_FAILED_S = 30.0  # a batch whose driver failed is taken up again after this
ONE_DELTA = 2**31 - 1  # stream_interval: a line's text comes in one delta, beside its `done`

# KEYS: the lease. ARGV: our token, the TTL in ms. 1 if we still hold it (renewed), else 0.
RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class BatchDriver:
    """Drives one batch while it holds the batch's lease."""

    def __init__(self, client: BatchClient, batch_id: str, *, lease_s: float = LEASE_S, window: int = WINDOW,
                 shares: BatchShares | None = None) -> None:
        self.client = client
        self.shares = shares or BatchShares(client.redis, client.keys)
        self.batch_id = batch_id
        self.store = BatchStore(client.redis, client.keys)
        self.lease_key = client.keys.batch_part(batch_id, "lease")
        self.replies = ""  # the batch's reply stream, once its queue is read
        self.lease_ms = int(lease_s * 1000)
        self.window = window
        self.token = uuid.uuid4().hex
        self._renew = client.redis.register_script(RENEW)
        self._release = client.redis.register_script(RELEASE)
        self._cursor: str | None = None  # the last reply entry read
        self._deltas: dict[int, list[Delta]] = {}  # logprobs of lines whose `done` has not been read yet
        self._custom_ids: dict[int, str | None] = {}
        self._stopping: set[int] | None = None  # lines told to stop (cancel), until their ends are read
        self._stop_sent_at = 0.0
        self._trim_refused = False
        self.failed = False  # it stopped on an error of its own (see `_logged`)

    async def take(self) -> bool:
        """Take the lease if nobody holds it."""
        return bool(await self.client.redis.set(self.lease_key, self.token, nx=True, px=self.lease_ms))

    async def run(self) -> Batch | None:
        """Drive until the batch ends or the lease is lost; the last state seen."""
        batch = None
        try:
            while await self._renew(keys=[self.lease_key], args=[self.token, self.lease_ms]):
                batch = await self.store.get(self.batch_id)
                if batch is None or batch.ended:
                    return batch
                self.replies = self.client.keys.batch_replies(batch.queue, batch.id)
                try:
                    await self._pass(batch)
                except Exception as e:  # noqa: BLE001 - Redis away a moment, or a bug: log, try again
                    log.warning("batch %s: a pass failed: %r", self.batch_id, e, exc_info=not isinstance(e, RedisError))
                    await asyncio.sleep(1.0)
            log.warning("batch %s: lease lost; another driver has it", self.batch_id)
            return batch
        finally:
            try:
                await self._release(keys=[self.lease_key], args=[self.token])
            except RedisError:
                pass  # it expires

    async def _pass(self, batch: Batch) -> None:
        if batch.status == "validating":
            await self.store.move(batch.id, "in_progress", came_from=("validating",))
        elif batch.status == "in_progress":
            if time.time() >= batch.expires_at:
                await self._expire(batch)
                return
            await self._feed(batch)
            await self._gather(batch)
            batch = await self.store.get(batch.id) or batch
            if batch.completed + batch.failed >= batch.total:
                await self.store.move(batch.id, "finalizing", came_from=("in_progress",))
        elif batch.status == "finalizing":
            await self.store.move(batch.id, "completed", came_from=("finalizing",))
        elif batch.status == "cancelling":
            await self._cancel(batch)

    async def _feed(self, batch: Batch) -> None:
        """Submit lines until `window` (or the batch's share of its queue's slots, if less)
        are in flight; a full queue waits for the next pass."""
        fed = batch.fed
        share = await self.shares.share(batch.queue, batch.id)
        window = self.window if share is None else min(self.window, share)
        room = window - (fed - batch.completed - batch.failed)
        if room <= 0 or fed >= batch.total:
            return
        for line in await self.store.lines(batch.id, fed, min(batch.total, fed + room)):
            if not await self._submit(batch, fed, line):
                break
            fed += 1
        await self.store.note(batch.id, fed=fed)

    async def _submit(self, batch: Batch, index: int, line: BatchLine) -> bool:
        """Feed one line (or file why it cannot run); False if the queue is full."""
        request_id = line_request_id(batch, index)
        self._custom_ids[index] = line.custom_id
        if line.error is not None:
            await self.store.file(batch.id, batch_error(index, line.custom_id, request_id, **line.error))
            return True
        body = {k: v for k, v in (line.body or {}).items() if k != "encoding"}
        body["reply_to"] = self.replies
        if pooling_kind(body) is None:  # a generation: its text in one delta (a pooling request has no deltas)
            body["stream_interval"] = ONE_DELTA
        try:
            await self.client.submit(id=request_id, queue=batch.queue, lane=BATCH_LANE, encoding="msgpack", **body)
        except QueueFull:
            return False
        except RequestRejected as e:
            await self.store.file(batch.id, batch_error(index, line.custom_id, request_id, str(e.code), str(e)))
        return True

    async def _gather(self, batch: Batch) -> None:
        """File the ends that came since the last pass (waiting up to `READ_BLOCK_MS`)."""
        if self._cursor is None:
            self._cursor = batch.cursor
        reply = await self.client.redis.xread({self.replies: self._cursor}, count=READ_COUNT, block=READ_BLOCK_MS)
        safe = None
        for entry_id, fields in stream_entries(reply):
            self._cursor = entry_id
            if fields is not None:
                await self._take(batch, entry_id, fields)
            if not self._deltas:
                safe = entry_id  # a driver taking over re-reads from here and misses nothing
        if safe is not None:
            await self.store.note(batch.id, cursor=safe)
            await self._trim(safe)

    async def _trim(self, upto: str) -> None:
        """Drop the replies filed (only drivers read them); a Redis that refuses it (an ACL
        without XTRIM) leaves them to expire with the batch."""
        if self._trim_refused:
            return
        ms, _, seq = upto.partition("-")
        try:
            await self.client.redis.xtrim(self.replies, minid=f"{ms}-{int(seq) + 1}")
        except ResponseError as e:
            self._trim_refused = True
            log.warning("batch %s: cannot trim its reply stream (%s); it is kept until the batch expires",
                        self.batch_id, e)

    async def _take(self, batch: Batch, entry_id: str, fields: dict[bytes, bytes]) -> None:
        try:
            event: Event = decode_event(fields)
        except Exception:  # noqa: BLE001 - an entry nobody of ours wrote: not a line's
            return
        index = line_index(batch, event.id)
        if index is None or index >= batch.total:
            return
        if isinstance(event, Delta):
            if event.logprobs:
                self._deltas.setdefault(index, []).append(event)
            return
        deltas = self._deltas.pop(index, [])
        if self._stopping is not None and isinstance(event, Done) and event.finish_reason == "cancelled":
            self._stopping.discard(index)  # the batch's own cancel: the line is dropped, as OpenAI does
            return
        if self._stopping is not None:
            self._stopping.discard(index)
        if isinstance(event, Done) and event.finish_reason == "cancelled":  # someone cancelled this line alone
            event = Error(id=event.id, code="cancelled", message="the request was cancelled")
        await self.store.file(batch.id, LineResult(index, await self._custom_id(batch, index), event, event.id,
                                                   deltas, entry_id))

    async def _custom_id(self, batch: Batch, index: int) -> str | None:
        if index not in self._custom_ids:
            (line,) = await self.store.lines(batch.id, index, index + 1)
            self._custom_ids[index] = line.custom_id
        return self._custom_ids[index]

    async def _stop_running(self, batch: Batch) -> set[int]:
        """Cancel every line fed and not yet ended; their numbers."""
        finished = await self.store.finished_lines(batch.id)
        running = {i for i in range(batch.fed) if i not in finished}
        for index in running:
            await self.client.cancel(line_request_id(batch, index), queue=batch.queue)
        return running

    async def _cancel(self, batch: Batch) -> None:
        """Stop the lines running, file those that end anyway, then end `cancelled`."""
        if self._stopping is None:
            self._stopping = await self._stop_running(batch)
            self._stop_sent_at = time.monotonic()
        await self._gather(batch)
        if not self._stopping or time.monotonic() - self._stop_sent_at > CANCEL_GRACE_S:
            await self.store.move(batch.id, "cancelled", came_from=("cancelling",))

    async def _expire(self, batch: Batch) -> None:
        """Past its window: file the ends already written, stop what runs, file every line
        not ended as `batch_expired`."""
        await self._gather(batch)
        await self._stop_running(batch)
        finished = await self.store.finished_lines(batch.id)
        left = [i for i in range(batch.total) if i not in finished]
        for start in range(0, len(left), 1000):
            chunk = left[start:start + 1000]
            lines = await self.store.lines(batch.id, chunk[0], chunk[-1] + 1)
            for index in chunk:
                line = lines[index - chunk[0]]
                await self.store.file(batch.id, batch_error(
                    index, line.custom_id, line_request_id(batch, index), "batch_expired",
                    f"the batch's completion_window ({batch.completion_window}) ended before this line did"))
        await self.store.move(batch.id, "expired", came_from=("in_progress",))


class BatchRunner:
    """Drives every active batch that nobody drives (every gateway runs one): looks for
    them every `poll_s`, and takes each one whose lease is free."""

    def __init__(self, client: BatchClient, *, lease_s: float = LEASE_S, window: int = WINDOW,
                 poll_s: float = 1.0) -> None:
        self.client = client
        self.lease_s = lease_s
        self.window = window
        self.poll_s = poll_s
        self.shares = BatchShares(client.redis, client.keys)
        self._driving: dict[str, asyncio.Task[Batch | None]] = {}
        self._resting: dict[str, float] = {}  # batches whose driver failed: not taken again until then

    async def run(self) -> None:
        """Until cancelled."""
        failing = False  # a look that fails is logged once until one succeeds (an ACL without the batch keys)
        try:
            while True:
                try:
                    await self._look()
                    failing = False
                except RedisError as e:
                    if not failing:
                        log.warning("could not look for batches to drive (tried again every %g s): %s", self.poll_s, e)
                    failing = True
                await asyncio.sleep(self.poll_s)
        finally:
            for task in self._driving.values():
                task.cancel()
            await asyncio.gather(*self._driving.values(), return_exceptions=True)

    async def _look(self) -> None:
        for batch_id in [as_text(b) for b in await self.client.redis.smembers(self.client.keys.active_batches)]:
            if batch_id in self._driving or self._resting.get(batch_id, 0.0) > time.monotonic():
                continue
            driver = BatchDriver(self.client, batch_id, lease_s=self.lease_s, window=self.window, shares=self.shares)
            if await driver.take():
                log.info("driving batch %s", batch_id)
                task = asyncio.create_task(_logged(driver))
                self._driving[batch_id] = task
                task.add_done_callback(lambda _, d=driver: self._done(d))  # type: ignore[misc]

    def _done(self, driver: BatchDriver) -> None:
        self._driving.pop(driver.batch_id, None)
        if driver.failed:  # a batch whose state it could not read is not retried every second
            self._resting[driver.batch_id] = time.monotonic() + RETRY_FAILED_S


async def _logged(driver: BatchDriver) -> Batch | None:
    """Drive; a failure (Redis gone, the lease's script refused) ends this driver only:
    its lease expires and the batch is taken up again."""
    try:
        return await driver.run()
    except Exception as e:  # noqa: BLE001 - logged; another pass or driver takes the batch up
        log.warning("batch %s: its driver stopped: %r", driver.batch_id, e)
        driver.failed = True
        return None


async def drive_until_ended(client: BatchClient, batch_id: str, *, lease_s: float = LEASE_S,
                            window: int = WINDOW, poll_s: float = 1.0,
                            on_progress: Callable[[Batch], None] = lambda _: None) -> Batch:
    """Wait for a batch to end, driving it whenever nobody else does; `on_progress` sees
    its state after every look. Raises KeyError for an unknown batch."""
    store = BatchStore(client.redis, client.keys)
    shares = BatchShares(client.redis, client.keys)
    while True:
        batch = await store.get(batch_id)
        if batch is None:
            raise KeyError(batch_id)
        on_progress(batch)
        if batch.ended:
            return batch
        driver = BatchDriver(client, batch_id, lease_s=lease_s, window=window, shares=shares)
        if await driver.take():
            task = asyncio.create_task(_logged(driver))
            while not task.done():
                await asyncio.wait([task], timeout=poll_s)
                batch = await store.get(batch_id)
                if batch is not None:
                    on_progress(batch)
        else:
            await asyncio.sleep(poll_s)
