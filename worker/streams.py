"""Every Redis command the worker sends, and the normalising of their replies."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import itertools
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
import structlog
from redis.exceptions import BusyLoadingError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from client._keys import GROUP, Keys
from client._protocol import Delta, Error, Event, decode_event, encode_event
from client._replies import StreamEntry, as_text, keyed_stream_entries

from . import scripts
from .messages import Route

log = structlog.get_logger("mlxq.redis")

T = TypeVar("T")
TRANSIENT = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError)


async def retrying(operation: Callable[[], Awaitable[T]], what: str) -> T:
    """Run a Redis operation until it succeeds, backing off (with jitter) while Redis is unreachable."""
    for attempt in itertools.count(1):
        try:
            return await operation()
        except TRANSIENT as e:
            stop_if_cancelled(e)
            pause = min(5.0, 0.05 * 2**attempt) * random.uniform(0.5, 1.0)
            log.warning("redis unreachable; retrying", operation=what, error=repr(e), attempt=attempt,
                        retry_in_s=round(pause, 2))
            await asyncio.sleep(pause)
    raise AssertionError("unreachable")


def stop_if_cancelled(error: BaseException) -> None:
    """Re-raise a cancellation that a Redis client turned into a timeout or connection
    error on its way out: a loop that retries it would never stop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():  # type: ignore[attr-defined]  # 3.11+, as is the worker
        raise asyncio.CancelledError from error


class QueueStreams:
    """One queue's request streams (its priority lanes first), its dead letters, and the
    output streams it writes."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, queue: str, consumer: str, *,
                 result_ttl_s: int, dedupe_ttl_s: int, lanes: list[str] | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.stream = keys.queue(queue)
        self.streams = [keys.lane(queue, lane) for lane in lanes or []] + [self.stream]  # read in this order
        self.dead = keys.dead(queue)
        self.consumer = consumer
        self.result_ttl_s = result_ttl_s
        self.dedupe_ttl_s = dedupe_ttl_s
        self._scripts = _Scripts(redis)

    async def ensure_group(self) -> None:
        """Create the streams and their `workers` group unless they exist."""
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    async def clock_offset_s(self) -> float:
        """Redis server time minus this host's clock, in seconds."""
        before = time.time()
        seconds, micros = await self.redis.time()
        after = time.time()
        return seconds + micros / 1e6 - (before + after) / 2

    async def read(self, count: int, block_ms: int) -> list[tuple[str, str, dict[Any, Any] | None]]:
        """Up to `count` new entries (stream, id, fields), higher lanes first; recreates the
        group after a data loss. When every stream is empty it blocks on all of them, taking
        one entry from each that gets one (so up to one per lane beyond `count`)."""
        try:
            entries: list[tuple[str, str, dict[Any, Any] | None]] = []
            for stream in self.streams if len(self.streams) > 1 else []:
                reply = await self.redis.xreadgroup(GROUP, self.consumer, {stream: ">"}, count=count - len(entries))
                entries += keyed_stream_entries(reply)
                if len(entries) >= count:
                    return entries
            if entries:
                return entries
            wanted = count if len(self.streams) == 1 else 1
            reply = await self.redis.xreadgroup(GROUP, self.consumer, {s: ">" for s in self.streams}, count=wanted,
                                                block=block_ms)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            await self.ensure_group()
            return []
        return sorted(keyed_stream_entries(reply), key=lambda e: self.streams.index(e[0]))

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

    async def settle(self, stream: str, entry_ids: Iterable[str]) -> None:
        """Acknowledge and delete entries that need no output (repeats, deleted entries)."""
        entry_ids = list(entry_ids)
        if entry_ids:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xack(stream, GROUP, *entry_ids)
                pipe.xdel(stream, *entry_ids)
                await pipe.execute()

    async def dead_letter(self, stream: str, entry_id: str, fields: dict[Any, Any], reason: str,
                          **history: Any) -> None:
        """Move an entry nobody can answer to the dead-letter stream, with the reason."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self.dead, self._dead_record(stream, entry_id, fields, reason, history))
            pipe.xack(stream, GROUP, entry_id)
            pipe.xdel(stream, entry_id)
            await pipe.execute()

    async def record_dead(self, stream: str, entry_id: str, fields: dict[Any, Any], reason: str,
                          **history: Any) -> None:
        """Copy an entry to the dead-letter stream; it is settled when its error is published."""
        await self.redis.xadd(self.dead, self._dead_record(stream, entry_id, fields, reason, history))

    def _dead_record(self, stream: str, entry_id: str, fields: dict[Any, Any], reason: str,
                     history: dict[str, Any]) -> dict[Any, Any]:
        record: dict[Any, Any] = {b"stream": stream, b"entry_id": entry_id, b"reason": reason,
                                  b"consumer": self.consumer}
        record.update({k.encode(): str(v) for k, v in history.items()})
        record.update({b"field:" + (k if isinstance(k, bytes) else k.encode()): v for k, v in fields.items()})
        return record

    async def publish(self, batches: list[Batch]) -> list[str]:
        """Write one step's events in one call, fenced (see `scripts.PUBLISH`); a terminal
        event also marks the id done, acknowledges its entry and deletes it from the queue.
        Returns one status per batch."""
        keys: list[str] = []
        args: list[Any] = [GROUP, self.consumer, self.result_ttl_s, self.dedupe_ttl_s]
        for batch in batches:
            route = batch.route
            keys += [route.stream, route.reply_to, self.keys.progress(route.id), self.keys.done(route.id)]
            args += [route.entry_id, batch.first, int(not isinstance(batch.events[-1], Delta)), len(batch.events)]
            for event in batch.events:
                fields = _encoded(route, event)
                args += [fields["type"], route.encoding, fields[route.encoding]]
        statuses = await self._scripts.run(scripts.PUBLISH, keys, args)
        return [as_text(s) for s in statuses]

    async def progress(self, route: Route) -> Progress:
        """What earlier deliveries of this entry already published: the count and the deltas."""
        entry, written = await self.redis.hmget(self.keys.progress(route.id), ["entry", "next"])
        if entry is None or written is None or as_text(entry) != route.entry_id:
            return Progress(0, [])
        deltas = []
        entries: Any = await self.redis.xrange(route.reply_to)
        for _, fields in entries:
            event = decode_event(fields)
            if isinstance(event, Delta) and event.id == route.id:
                deltas.append(event)
        return Progress(int(written), deltas)

    async def keep_mine(self, entries: dict[str, list[str]], heartbeat: str, ttl_s: float,
                        idle_ms: int = 0) -> list[str]:
        """Refresh (or, with `heartbeat` empty, delete) this worker's heartbeat and set the
        idle time of its entries (ids by stream); returns the ids another worker took over."""
        lost = []
        for stream in self.streams:
            keys = [stream, self.keys.worker(self.consumer)]
            args = [GROUP, self.consumer, heartbeat, max(1, int(ttl_s * 1000)), idle_ms, *entries.get(stream, [])]
            lost += [as_text(i) for i in await self._scripts.run(scripts.KEEP_MINE, keys, args)]
        return lost

    async def dead_consumers(self, stream: str) -> list[str]:
        """Other consumers of the group on `stream` whose heartbeat is gone."""
        try:
            consumers = await self.redis.xinfo_consumers(stream, GROUP)
        except ResponseError:  # no stream or group (Redis restarted empty): read() recreates them
            return []
        others = [name for name in (as_text(c["name"]) for c in consumers) if name != self.consumer]
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in others:
                pipe.exists(self.keys.worker(name))
            alive = await pipe.execute()
        return [name for name, is_alive in zip(others, alive, strict=True) if not is_alive]

    async def pending(self, stream: str, consumer: str, count: int, min_idle_ms: int,
                      after: str = "-") -> list[tuple[str, int]]:
        """Up to `count` entries `consumer` holds on `stream`, idle at least `min_idle_ms`,
        with ids above `after`: (id, deliveries)."""
        start = after if after == "-" else f"({after}"
        rows = await self.redis.xpending_range(stream, GROUP, start, "+", count, consumername=consumer,
                                               idle=min_idle_ms or None)
        return [(as_text(row["message_id"]), int(row["times_delivered"])) for row in rows]  # type: ignore[arg-type]

    async def claim(self, stream: str, entry_ids: list[str], min_idle_ms: int) -> list[StreamEntry]:
        """Take entries over (their delivery count goes up); deleted ones drop out of the
        pending list and are not returned."""
        if not entry_ids:
            return []
        reply: Any = await self.redis.xclaim(
            stream, GROUP, self.consumer, min_idle_ms, list[Any](entry_ids))
        return [(as_text(entry_id), fields) for entry_id, fields in reply if fields is not None]

    async def forget_consumer(self, stream: str, consumer: str) -> bool:
        """Delete a consumer that left, if it is silent and owns nothing; True if deleted."""
        keys = [stream, self.keys.worker(consumer)]
        return bool(await self._scripts.run(scripts.FORGET_CONSUMER, keys, [GROUP, consumer]))


@dataclass(frozen=True)
class Batch:
    """One request's events from one publish, and the position of the first."""

    route: Route
    first: int
    events: list[Event]


@dataclass(frozen=True)
class Progress:
    """An entry's output so far: how many events were written, and its deltas."""

    written: int
    deltas: list[Delta]


@functools.cache
def _sha1(script: str) -> str:
    """The hash Redis knows a script by (computed once: the publish script runs every step)."""
    return hashlib.sha1(script.encode()).hexdigest()


class _Scripts:
    """Runs Lua scripts by hash, loading one when Redis does not have it (after a restart)."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis

    async def run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        sha = _sha1(script)
        try:
            return await self.redis.evalsha(sha, len(keys), *keys, *args)  # type: ignore[misc]
        except NoScriptError:
            await self.redis.script_load(script)
            return await self.redis.evalsha(sha, len(keys), *keys, *args)  # type: ignore[misc]


def _encoded(route: Route, event: Event) -> dict[str, bytes | str]:
    """The entry fields of an event; an event that cannot be encoded becomes an `internal` error."""
    try:
        return encode_event(event, route.encoding)
    except (TypeError, ValueError) as e:
        log.error("event could not be encoded", request_id=route.id, error=repr(e))
        error = Error(id=route.id, code="internal", message=f"the output could not be encoded: {e}")
        return encode_event(error, route.encoding)
