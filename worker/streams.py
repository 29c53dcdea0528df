"""Every Redis command the worker sends, and the normalising of their replies."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import redis.asyncio as aioredis
import structlog
from redis.exceptions import BusyLoadingError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from client._keys import GROUP, Keys
from client._protocol import Delta, Error, encode_event
from client._replies import StreamEntry, stream_entries

from .messages import Outgoing

log = structlog.get_logger("mlxq.redis")

T = TypeVar("T")
TRANSIENT = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError)


async def retrying(operation: Callable[[], Awaitable[T]], what: str) -> T:
    """Run a Redis operation until it succeeds, backing off (with jitter) while Redis is unreachable."""
    for attempt in itertools.count(1):
        try:
            return await operation()
        except TRANSIENT as e:
            pause = min(5.0, 0.05 * 2**attempt) * random.uniform(0.5, 1.0)
            log.warning("redis unreachable; retrying", operation=what, error=repr(e), attempt=attempt,
                        retry_in_s=round(pause, 2))
            await asyncio.sleep(pause)
    raise AssertionError("unreachable")


class QueueStreams:
    """One queue's request stream, its dead letters, and the output streams it writes."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, queue: str, consumer: str, *,
                 result_ttl_s: int, dedupe_ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.stream = keys.queue(queue)
        self.dead = keys.dead(queue)
        self.consumer = consumer
        self.result_ttl_s = result_ttl_s
        self.dedupe_ttl_s = dedupe_ttl_s

    async def ensure_group(self) -> None:
        """Create the stream and its `workers` group unless they exist."""
        try:
            await self.redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def clock_offset_s(self) -> float:
        """Redis server time minus this host's clock, in seconds."""
        before = time.time()
        seconds, micros = await self.redis.time()
        after = time.time()
        return seconds + micros / 1e6 - (before + after) / 2

    async def read(self, count: int, block_ms: int) -> list[StreamEntry]:
        """Up to `count` new entries for this consumer; recreates the group after a data loss."""
        try:
            reply = await self.redis.xreadgroup(GROUP, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            await self.ensure_group()
            return []
        return stream_entries(reply)

    async def flags(self, ids: list[str]) -> tuple[set[str], set[str]]:
        """Which ids already finished, and which were cancelled, in one round trip."""
        if not ids:
            return set(), set()
        async with self.redis.pipeline(transaction=False) as pipe:
            for request_id in ids:
                pipe.exists(self.keys.done(request_id))
                pipe.exists(self.keys.cancel_flag(request_id))
            replies = await pipe.execute()
        done = {i for i, flag in zip(ids, replies[0::2], strict=True) if flag}
        cancelled = {i for i, flag in zip(ids, replies[1::2], strict=True) if flag}
        return done, cancelled

    async def ack(self, entry_ids: Iterable[str]) -> None:
        """Acknowledge entries that need no output (repeats of finished ids, deleted entries)."""
        entry_ids = list(entry_ids)
        if entry_ids:
            await self.redis.xack(self.stream, GROUP, *entry_ids)

    async def dead_letter(self, entry_id: str, fields: dict[Any, Any], reason: str) -> None:
        """Move an entry nobody can answer to the dead-letter stream, with the reason."""
        record: dict[Any, Any] = {b"entry_id": entry_id, b"reason": reason, b"consumer": self.consumer}
        record.update({b"field:" + (k if isinstance(k, bytes) else k.encode()): v for k, v in fields.items()})
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self.dead, record)
            pipe.xack(self.stream, GROUP, entry_id)
            await pipe.execute()

    async def publish(self, outgoing: list[Outgoing]) -> None:
        """Write a step's events in one pipeline: XADD each, refresh TTLs, and for each
        terminal event mark the id done and acknowledge its entry (after the event).

        A command Redis refuses (say, a `reply_to` key of another type) is logged and
        does not hold up the rest; only an unreachable Redis raises."""
        commands: list[tuple[str, str]] = []  # what each queued command was, for the log
        async with self.redis.pipeline(transaction=False) as pipe:
            streams = set()
            for item in outgoing:
                pipe.xadd(item.route.reply_to, _encoded(item))  # type: ignore[arg-type]
                commands.append(("XADD", item.route.reply_to))
                streams.add(item.route.reply_to)
            for stream in streams:
                pipe.expire(stream, self.result_ttl_s)
                commands.append(("EXPIRE", stream))
            for item in outgoing:
                if not isinstance(item.event, Delta):
                    pipe.set(self.keys.done(item.route.id), item.route.entry_id, ex=self.dedupe_ttl_s)
                    pipe.xack(self.stream, GROUP, item.route.entry_id)
                    commands += [("SET", self.keys.done(item.route.id)), ("XACK", item.route.entry_id)]
            replies = await pipe.execute(raise_on_error=False)
        for command, reply in zip(commands, replies, strict=True):
            if isinstance(reply, Exception):
                log.error("redis refused a write", command=command, error=str(reply))

    async def heartbeat(self, consumer: str, info: dict[str, Any], ttl_s: float) -> None:
        """Say this worker is alive, what it serves and how loaded it is."""
        await self.redis.set(self.keys.worker(consumer), json.dumps(info), px=int(ttl_s * 1000))


def _encoded(item: Outgoing) -> dict[str, bytes | str]:
    """The entry fields of an event; an event that cannot be encoded becomes an `internal` error."""
    try:
        return encode_event(item.event, item.route.encoding)
    except (TypeError, ValueError) as e:
        log.error("event could not be encoded", request_id=item.route.id, error=repr(e))
        error = Error(id=item.route.id, code="internal", message=f"the output could not be encoded: {e}")
        return encode_event(error, item.route.encoding)
