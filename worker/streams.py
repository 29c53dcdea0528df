"""Every Redis command the worker sends, and the normalising of their replies."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from client._keys import GROUP, Keys
from client._protocol import Delta, encode_event
from client._replies import StreamEntry, stream_entries

from .messages import Outgoing


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
        terminal event mark the id done and acknowledge its entry (after the event)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            streams = set()
            for item in outgoing:
                pipe.xadd(item.route.reply_to, encode_event(item.event, item.route.encoding))  # type: ignore[arg-type]
                streams.add(item.route.reply_to)
            for stream in streams:
                pipe.expire(stream, self.result_ttl_s)
            for item in outgoing:
                if not isinstance(item.event, Delta):
                    pipe.set(self.keys.done(item.route.id), item.route.entry_id, ex=self.dedupe_ttl_s)
                    pipe.xack(self.stream, GROUP, item.route.entry_id)
            await pipe.execute()

    async def heartbeat(self, consumer: str, info: dict[str, Any], ttl_s: float) -> None:
        """Say this worker is alive, what it serves and how loaded it is."""
        await self.redis.set(self.keys.worker(consumer), json.dumps(info), px=int(ttl_s * 1000))
