"""A queue's request streams as one consumer of their group sees them: reading
entries (priority lanes first), settling them, dead letters, the pending lists that
recovery claims from, and the marks kept per request id (its attempts, done, cancel flag)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import ResponseError

from client.connect import is_cluster
from client.keys import GROUP, Keys
from client.replies import StreamEntry, as_text, keyed_stream_entries
from worker.messages import Route
from worker.queue import scripts

DEAD_FIELDS = 16  # a dead letter keeps at most this many of the original's fields,
DEAD_FIELD_BYTES = 1024  # each cut to this size (its full size noted beside it),
DEAD_BODY_BYTES = 65536  # but the body (json or msgpack) to this: most can be requeued whole
LANE_POLL_MS = 100  # on a cluster with lanes in other slots, the longest a read blocks on one stream
BATCH_LANE_LOOK_S = 1.0  # an empty batch lane is read at most this often (a read costs the loop ~80 us)


def request_streams(keys: Keys, queue: str, lanes: list[str] | None = None) -> list[str]:
    """The streams a queue's workers read, in the order they read them: lanes first, the
    batch lane last."""
    return [keys.lane(queue, lane) for lane in lanes or []] + [keys.queue(queue), keys.batch_lane(queue)]


async def ensure_groups(redis: aioredis.Redis, streams: list[str]) -> None:
    """Create the streams and their `workers` group unless they exist."""
    for stream in streams:
        try:
            await redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise


async def publish_limits(redis: aioredis.Redis, keys: Keys, queue: str, max_len: int) -> None:
    """Tell producers how many waiting requests each stream of the queue accepts (0: no bound)."""
    await redis.hset(keys.limits(queue), "max_len", max_len)


async def server_clock_offset_s(redis: aioredis.Redis) -> float:
    """Redis server time minus this host's clock, in seconds (entry ids are server time)."""
    before = time.time()
    seconds, micros = await redis.time()
    after = time.time()
    return seconds + micros / 1e6 - (before + after) / 2


class RequestStreams:
    """One consumer's view of a queue's request streams (its placement lane, then its
    priority lanes, first) and its dead letters. The consumer name is fixed: it is made
    once the name is claimed."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, queue: str, consumer: str, *, dedupe_ttl_s: int,
                 lanes: list[str] | None = None, dead_letter_maxlen: int = 10_000) -> None:
        self.redis = redis
        self.keys = keys
        self.queue = queue
        self.queue_stream = keys.queue(queue)
        self.batch_lane = keys.batch_lane(queue)
        self.batch_lines_waiting = False  # the last read of the batch lane got all it asked for
        self._next_batch_look = 0.0  # monotonic time from which an empty batch lane is read again
        self.own_lane = keys.affinity_lane(queue, consumer)  # what other workers placed here (`affinity`)
        self.request_streams = [self.own_lane, *request_streams(keys, queue, lanes)]
        self.interactive_streams = [stream for stream in self.request_streams if stream != self.batch_lane]
        self.dead = keys.dead(queue)
        self.consumer = consumer
        self.dedupe_ttl_s = dedupe_ttl_s
        self.dead_letter_maxlen = dead_letter_maxlen
        self._scripts = scripts.ScriptRunner(redis)
        # On a cluster no command may span two slots: lanes are then read one per call (by
        # whether the batch lane is read too).
        self.one_slot = {low: not is_cluster(redis) or len({key_slot(s.encode()) for s in streams}) == 1
                         for low, streams in ((False, self.interactive_streams), (True, self.request_streams))}

    async def ensure_group(self) -> None:
        """Create the streams and their group again (after Redis lost its data)."""
        await ensure_groups(self.redis, self.request_streams)

    async def read(self, count: int, block_ms: int, low_count: int) -> list[tuple[str, str, dict[Any, Any] | None]]:
        """Up to `count` new entries (stream, id, fields), higher lanes first, and at most
        `low_count` of them from the batch lane (looked at only every `BATCH_LANE_LOOK_S`
        while it is empty); recreates the group after a data loss. When every stream is
        empty it blocks (unless `block_ms` is 0) on all of them, taking one entry from each
        that gets one (so up to one per lane beyond `count`); on a cluster whose lanes lie
        in other slots, it blocks on the queue's own stream alone, for at most
        `LANE_POLL_MS`, so that the lanes are looked at again soon."""
        low = low_count > 0 and (self.batch_lines_waiting or time.monotonic() >= self._next_batch_look)
        streams = self.interactive_streams + ([self.batch_lane] if low else [])
        try:
            if len(streams) == 1:  # one round trip, as in a worker without lanes
                reply = await self.redis.xreadgroup(GROUP, self.consumer, {streams[0]: ">"}, count=count,
                                                    block=block_ms or None)
                return keyed_stream_entries(reply)
            entries = await self._read_each(streams, count, low_count)
            if entries or not block_ms:
                return entries
            if self.one_slot[low]:
                every: dict[Any, Any] = {stream: ">" for stream in streams}
                reply = await self.redis.xreadgroup(GROUP, self.consumer, every, count=1, block=block_ms)
            else:
                reply = await self.redis.xreadgroup(GROUP, self.consumer, {self.queue_stream: ">"}, count=count,
                                                    block=min(block_ms, LANE_POLL_MS))
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            await self.ensure_group()
            return []
        return sorted(keyed_stream_entries(reply), key=lambda e: self.request_streams.index(e[0]))

    async def undelivered(self) -> int:
        """How many entries of the queue's own stream no worker has read yet (its group's
        lag; 0 where the server cannot say: before Redis 7, or after entries were deleted)."""
        groups: Any = await self.redis.xinfo_groups(self.queue_stream)
        group = next((g for g in groups if as_text(g["name"]) == GROUP), None)
        lag = group.get("lag") if group is not None else None
        return lag if isinstance(lag, int) else 0

    async def _read_each(self, streams: list[str], count: int,
                         low_count: int) -> list[tuple[str, str, dict[Any, Any] | None]]:
        """What `streams` hold now, in order, without blocking."""
        entries: list[tuple[str, str, dict[Any, Any] | None]] = []
        for stream in streams:
            low = stream == self.batch_lane
            wanted = min(count - len(entries), low_count) if low else count - len(entries)
            if wanted <= 0:
                break
            got = keyed_stream_entries(await self.redis.xreadgroup(GROUP, self.consumer, {stream: ">"},
                                                                   count=wanted))
            entries += got
            if low:
                self.batch_lines_waiting = len(got) == wanted  # all it asked for: more may wait
                if not got:
                    self._next_batch_look = time.monotonic() + BATCH_LANE_LOOK_S
        return entries

    async def register_lane(self) -> None:
        """Create this worker's placement lane and list it, so that its entries are taken
        by others once it is gone."""
        await ensure_groups(self.redis, [self.own_lane])
        await self.redis.sadd(self.keys.affinity_lanes(self.queue), self.consumer)

    async def other_lanes(self) -> list[str]:
        """The workers, other than this one, whose placement lanes are listed."""
        members: Any = await self.redis.smembers(self.keys.affinity_lanes(self.queue))
        return sorted(name for name in map(as_text, members) if name != self.consumer)

    async def drop_lane(self, consumer: str) -> None:
        """Stop listing a gone worker's placement lane, unless it still holds entries
        (pending ones are taken over first, by `recovery`). Unlisted first, then looked
        at: an entry placed meanwhile lists it again (`add_to_lane`), so none is missed.
        The empty stream stays: deleting it could race with a placement."""
        await self.redis.srem(self.keys.affinity_lanes(self.queue), consumer)
        if await self.redis.xlen(self.keys.affinity_lane(self.queue, consumer)):
            await self.redis.sadd(self.keys.affinity_lanes(self.queue), consumer)

    async def add_to_lane(self, consumer: str, fields: dict[Any, Any]) -> None:
        """Place an entry in a worker's placement lane, and list the lane."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self.keys.affinity_lane(self.queue, consumer), fields)
            pipe.sadd(self.keys.affinity_lanes(self.queue), consumer)
            await pipe.execute()

    async def settle(self, stream: str, entry_ids: Iterable[str]) -> None:
        """Acknowledge and delete entries that need no output (repeats, deleted entries)."""
        entry_ids = list(entry_ids)
        if entry_ids:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xack(stream, GROUP, *entry_ids)
                pipe.xdel(stream, *entry_ids)
                await pipe.execute()

    async def settle_unanswered(self, route: Route) -> None:
        """Mark a request done and settle its entry although no terminal event could be
        written (Redis refused even its own output stream)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.done(self.queue, route.id), route.entry_id, ex=self.dedupe_ttl_s)
            pipe.xack(route.stream, GROUP, route.entry_id)
            pipe.xdel(route.stream, route.entry_id)
            await pipe.execute()

    async def finish(self, routes: list[Route]) -> None:
        """Settle requests whose terminal event is written: remember the id as done, and
        acknowledge and delete its entry. Idempotent: a worker that takes over an entry
        whose fence says finished does the same."""
        if not routes:
            return
        entries: dict[str, list[str]] = {}  # by stream: one XACK and one XDEL for all of its entries
        async with self.redis.pipeline(transaction=False) as pipe:
            for route in routes:
                pipe.set(self.keys.done(self.queue, route.id), route.entry_id, ex=self.dedupe_ttl_s)
                entries.setdefault(route.stream, []).append(route.entry_id)
            for stream, ids in entries.items():
                pipe.xack(stream, GROUP, *ids)
                pipe.xdel(stream, *ids)
            await pipe.execute()

    async def dead_letter(self, stream: str, entry_id: str, fields: dict[Any, Any], reason: str,
                          **history: Any) -> None:
        """Move an entry nobody can answer to the dead-letter stream, with the reason."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self.dead, self._dead_record(stream, entry_id, fields, reason, history),
                      maxlen=self.dead_letter_maxlen, approximate=True)
            pipe.xack(stream, GROUP, entry_id)
            pipe.xdel(stream, entry_id)
            await pipe.execute()

    async def record_dead(self, stream: str, entry_id: str, fields: dict[Any, Any], reason: str,
                          **history: Any) -> None:
        """Copy an entry to the dead-letter stream; it is settled when its error is published."""
        await self.redis.xadd(self.dead, self._dead_record(stream, entry_id, fields, reason, history),
                              maxlen=self.dead_letter_maxlen, approximate=True)

    def _dead_record(self, stream: str, entry_id: str, fields: dict[Any, Any], reason: str,
                     history: dict[str, Any]) -> dict[Any, Any]:
        """The reason and history, and a bounded copy of the original fields: at most
        `DEAD_FIELDS` of them, the body cut to `DEAD_BODY_BYTES` and others to
        `DEAD_FIELD_BYTES` (`field:<name>:bytes` says how long it was)."""
        record: dict[Any, Any] = {b"stream": stream, b"entry_id": entry_id, b"reason": reason,
                                  b"consumer": self.consumer}
        record.update({k.encode(): str(v) for k, v in history.items()})
        for i, (name, value) in enumerate(fields.items()):
            if i == DEAD_FIELDS:
                record[b"fields_dropped"] = len(fields) - DEAD_FIELDS
                break
            key = b"field:" + (name if isinstance(name, bytes) else str(name).encode())[:64]
            value = value if isinstance(value, bytes) else str(value).encode("utf-8", "backslashreplace")
            limit = DEAD_BODY_BYTES if key in (b"field:json", b"field:msgpack") else DEAD_FIELD_BYTES
            if len(value) > limit:
                record[key + b":bytes"] = len(value)
                value = value[:limit]
            record[key] = value
        return record

    async def owns(self, route: Route) -> bool:
        """Whether the group's pending list says this worker holds the request's entry."""
        rows: Any = await self.redis.xpending_range(route.stream, GROUP, route.entry_id, route.entry_id, 1)
        return bool(rows) and as_text(rows[0]["consumer"]) == self.consumer

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
        try:
            rows = await self.redis.xpending_range(stream, GROUP, start, "+", count, consumername=consumer,
                                                   idle=min_idle_ms or None)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            await self.ensure_group()  # Redis lost its data (restarted empty): nothing is pending any more
            return []
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
        """Delete a consumer that left (its heartbeat is gone), if it owns nothing; True if deleted."""
        return bool(await self._scripts.run(scripts.FORGET_CONSUMER, [stream], [GROUP, consumer]))


class RequestMarks:
    """What Redis keeps per request id of one queue beside the streams: the attempts at
    preparing it, whether it is done, its cancel flag."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, queue: str, dedupe_ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.queue = queue
        self.dedupe_ttl_s = dedupe_ttl_s
        self._scripts = scripts.ScriptRunner(redis)

    async def arrive(self, request_id: str, cancel_ttl_s: int) -> Arrival:
        """Open an attempt at an arriving request (see `Arrival`) and read whether it
        already finished or was cancelled, in one round trip. A cancel flag set without
        a TTL gets `cancel_ttl_s`, so flags never pile up."""
        attempt = uuid.uuid4().hex  # a set member, not a counter: a retried call adds it only once
        keys = [self.keys.crashes(self.queue, request_id), self.keys.done(self.queue, request_id),
                self.keys.cancel_flag(self.queue, request_id)]
        open_attempts, done, cancelled = await self._scripts.run(scripts.ARRIVE, keys,
                                                                  [attempt, self.dedupe_ttl_s, cancel_ttl_s])
        return Arrival(attempt, crashes=int(open_attempts) - 1, done=bool(done), cancelled=bool(cancelled))

    async def close_attempt(self, request_id: str, attempt: str) -> None:
        """The preparation of a request ended, one way or another, and we are alive."""
        await self.redis.srem(self.keys.crashes(self.queue, request_id), attempt)

    async def record_crash(self, request_id: str) -> None:
        """The engine process died while it held the request: an attempt left open, as a
        worker that died preparing it leaves one (counted by the next `arrive`)."""
        key = self.keys.crashes(self.queue, request_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.sadd(key, uuid.uuid4().hex)
            pipe.expire(key, self.dedupe_ttl_s)
            await pipe.execute()

    async def limit_cancel_flag(self, request_id: str, ttl_s: int) -> None:
        """Give a cancel flag a TTL if whoever set it gave none."""
        await self.redis.expire(self.keys.cancel_flag(self.queue, request_id), ttl_s, nx=True)


@dataclass(frozen=True)
class Arrival:
    """What Redis knows of a request as a worker takes it in. `crashes` counts the
    workers that died while preparing it, and the engine processes that died while they
    held it: each attempt is added to a set before the work and removed after, so only the
    attempts that killed their worker are left in it (`record_crash` adds an engine's)."""

    attempt: str  # ours, open until `close_attempt`
    crashes: int
    done: bool
    cancelled: bool
