"""Every Redis command the worker sends, and the normalising of their replies."""

from __future__ import annotations

import enum
import functools
import hashlib
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.crc import key_slot
from redis.exceptions import NoScriptError, ResponseError

from client.connect import is_cluster
from client.keys import GROUP, Keys
from client.protocol import Delta, Encoding, Error, ErrorCode, Event, decode_event, encode_event
from client.replies import StreamEntry, as_text, keyed_stream_entries

from . import scripts
from .messages import Resume, Route

log = structlog.get_logger("mlxq.redis")

DEAD_FIELDS = 16  # a dead letter keeps at most this many of the original's fields,
DEAD_FIELD_BYTES = 1024  # each cut to this size (its full size noted beside it),
DEAD_BODY_BYTES = 65536  # but the body (json or msgpack) to this: most can be requeued whole
LANE_POLL_MS = 100  # on a cluster with lanes in other slots, the longest a read blocks on one stream


class RedisQueue:
    """One queue's request streams (its priority lanes first), its dead letters, and the
    output streams it writes."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, queue: str, consumer: str, *,
                 result_ttl_s: int, dedupe_ttl_s: int, lanes: list[str] | None = None,
                 dead_letter_maxlen: int = 10_000) -> None:
        self.redis = redis
        self.keys = keys
        self.queue_stream = keys.queue(queue)
        # its priority lanes first: read in this order
        self.request_streams = [keys.lane(queue, lane) for lane in lanes or []] + [self.queue_stream]
        self.dead = keys.dead(queue)
        self.consumer = consumer
        self.result_ttl_s = result_ttl_s
        self.dedupe_ttl_s = dedupe_ttl_s
        self.dead_letter_maxlen = dead_letter_maxlen
        self._scripts = _Scripts(redis)
        # On a cluster no command may span two slots: lanes are then read one per call.
        self.one_slot = not is_cluster(redis) or len({key_slot(s.encode()) for s in self.request_streams}) == 1

    async def ensure_group(self) -> None:
        """Create the streams and their `workers` group unless they exist."""
        for stream in self.request_streams:
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
        one entry from each that gets one (so up to one per lane beyond `count`); on a
        cluster whose lanes lie in other slots, it blocks on the queue's own stream alone,
        for at most `LANE_POLL_MS`, so that the lanes are looked at again soon."""
        try:
            entries: list[tuple[str, str, dict[Any, Any] | None]] = []
            for stream in self.request_streams if len(self.request_streams) > 1 else []:
                reply = await self.redis.xreadgroup(GROUP, self.consumer, {stream: ">"}, count=count - len(entries))
                entries += keyed_stream_entries(reply)
                if len(entries) >= count:
                    return entries
            if entries:
                return entries
            if self.one_slot:
                wanted = count if len(self.request_streams) == 1 else 1
                every: dict[Any, Any] = {stream: ">" for stream in self.request_streams}
                reply = await self.redis.xreadgroup(GROUP, self.consumer, every, count=wanted, block=block_ms)
            else:
                reply = await self.redis.xreadgroup(GROUP, self.consumer, {self.queue_stream: ">"}, count=count,
                                                    block=min(block_ms, LANE_POLL_MS))
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            await self.ensure_group()
            return []
        return sorted(keyed_stream_entries(reply), key=lambda e: self.request_streams.index(e[0]))

    async def arrive(self, request_id: str, cancel_ttl_s: int) -> Arrival:
        """Open an attempt at an arriving request (see `Arrival`) and read whether it
        already finished or was cancelled, in one round trip. A cancel flag set without
        a TTL gets `cancel_ttl_s`, so flags never pile up."""
        attempt = uuid.uuid4().hex  # a set member, not a counter: a retried call adds it only once
        attempts, cancel = self.keys.crashes(request_id), self.keys.cancel_flag(request_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.sadd(attempts, attempt)
            pipe.scard(attempts)
            pipe.expire(attempts, self.dedupe_ttl_s)
            pipe.exists(self.keys.done(request_id))
            pipe.exists(cancel)
            pipe.expire(cancel, cancel_ttl_s, nx=True)
            _, open_attempts, _, done, cancelled, _ = await pipe.execute()
        return Arrival(attempt, crashes=int(open_attempts) - 1, done=bool(done), cancelled=bool(cancelled))

    async def close_attempt(self, request_id: str, attempt: str) -> None:
        """The preparation of a request ended, one way or another, and we are alive."""
        await self.redis.srem(self.keys.crashes(request_id), attempt)

    async def limit_cancel_flag(self, request_id: str, ttl_s: int) -> None:
        """Give a cancel flag a TTL if whoever set it gave none."""
        await self.redis.expire(self.keys.cancel_flag(request_id), ttl_s, nx=True)

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
            pipe.set(self.keys.done(route.id), route.entry_id, ex=self.dedupe_ttl_s)
            pipe.xack(route.stream, GROUP, route.entry_id)
            pipe.xdel(route.stream, route.entry_id)
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

    async def take(self, route: Route) -> Taken:
        """Take the fence of a request this worker starts serving (see `scripts.TAKE`):
        from now on only writes under the new token land, and another worker's, still
        running or cut off, are refused."""
        token = uuid.uuid4().hex
        status, written, finished = await self._scripts.run(
            scripts.TAKE, [self.keys.progress(route.id, route.reply_to)],
            [route.entry_id, token, self.consumer, self.result_ttl_s])
        return Taken(as_text(status) == "taken", token, int(written), bool(finished))

    async def publish(self, writes: list[OutputWrite]) -> list[Published]:
        """Write one step's events, fenced (see `scripts.PUBLISH`): one script call for all
        on one server; on a cluster one per slot, in one pipeline (a round trip per node).
        Returns one status per write; `finish` then settles the requests that ended."""
        groups = self._by_slot(writes)
        calls = []
        for group in groups:
            keys: list[str] = []
            args: list[Any] = [self.result_ttl_s]
            for write in group:
                route = write.route
                keys += [route.reply_to, self.keys.progress(route.id, route.reply_to)]
                args += [route.entry_id, route.fence, write.first, int(write.terminal), len(write.entries)]
                for kind, body in write.entries:
                    args += [kind, route.encoding, body]
            calls.append((keys, args))
        statuses = {}
        for group, reply in zip(groups, await self._scripts.run_many(scripts.PUBLISH, calls), strict=True):
            for write, status in zip(group, reply, strict=True):
                statuses[id(write)] = Published.parse(as_text(status))
        return [statuses[id(write)] for write in writes]

    def _by_slot(self, writes: list[OutputWrite]) -> list[list[OutputWrite]]:
        if not is_cluster(self.redis):
            return [writes]
        groups: dict[int, list[OutputWrite]] = {}
        for write in writes:
            groups.setdefault(key_slot(write.route.reply_to.encode()), []).append(write)
        return list(groups.values())

    async def owns(self, route: Route) -> bool:
        """Whether the group's pending list says this worker holds the request's entry."""
        rows: Any = await self.redis.xpending_range(route.stream, GROUP, route.entry_id, route.entry_id, 1)
        return bool(rows) and as_text(rows[0]["consumer"]) == self.consumer

    async def finish(self, routes: list[Route]) -> None:
        """Settle requests whose terminal event is written: remember the id as done, and
        acknowledge and delete its entry. Idempotent: a worker that takes over an entry
        whose fence says finished does the same."""
        if not routes:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for route in routes:
                pipe.set(self.keys.done(route.id), route.entry_id, ex=self.dedupe_ttl_s)
                pipe.xack(route.stream, GROUP, route.entry_id)
                pipe.xdel(route.stream, route.entry_id)
            await pipe.execute()

    async def earlier_output(self, route: Route, written: int) -> EarlierOutput:
        """The deltas earlier deliveries of this entry published, `written` events in all."""
        deltas = []
        entries: Any = await self.redis.xrange(route.reply_to)
        for _, fields in entries:
            event = decode_event(fields)
            if isinstance(event, Delta) and event.id == route.id:
                deltas.append(event)
        return EarlierOutput(written, deltas)

    async def claim_name(self, name: str, heartbeat: str, ttl_s: float, replacing: bytes | None = None) -> bytes | None:
        """Take the consumer name `name` by writing its heartbeat, unless a worker holds it
        (or, with `replacing`, unless it holds anything else). Returns None when taken,
        else the holder's heartbeat."""
        held = await self._scripts.run(scripts.CLAIM_NAME, [self.keys.worker(name)],
                                       [heartbeat, max(1, int(ttl_s * 1000)), replacing or ""])
        return None if held == 1 else held  # type: ignore[no-any-return]

    async def heartbeat_ttl_s(self, name: str) -> float:
        """Seconds until the heartbeat of consumer `name` expires (0 if it has none or no TTL)."""
        return max(0, await self.redis.pttl(self.keys.worker(name))) / 1000

    async def keep_mine(self, entries: dict[str, list[str]], heartbeat: str, ttl_s: float, instance: str,
                        idle_ms: int = 0) -> list[str]:
        """Refresh (or, with `heartbeat` empty, delete) this worker's heartbeat and set the
        idle time of its entries (ids by stream); returns the ids another worker took over.
        Raises `ResponseError` (NAMETAKEN) if another worker holds our consumer name now."""
        await self._scripts.run(scripts.HEARTBEAT, [self.keys.worker(self.consumer)],
                                [heartbeat, max(1, int(ttl_s * 1000)), instance])
        lost = []
        for stream in self.request_streams:
            args = [GROUP, self.consumer, idle_ms, *entries.get(stream, [])]
            lost += [as_text(i) for i in await self._scripts.run(scripts.KEEP_MINE, [stream], args)]
        return lost

    async def read_stats(self) -> dict[bytes, bytes]:
        """The stats hash an earlier run under our consumer name left (empty if none)."""
        stored: dict[bytes, bytes] = await self.redis.hgetall(self.keys.stats(self.consumer))  # type: ignore[assignment]
        return stored

    async def record_stats(self, fields: dict[str, Any], keep_s: int) -> None:
        """Write this worker's totals and last heartbeat where `mlxq status` finds them, for
        `keep_s` after its last write; workers not seen for that long leave the fleet set."""
        now = time.time()
        stats = self.keys.stats(self.consumer)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(stats, mapping={**fields, "last_seen": round(now, 3)})  # type: ignore[dict-item]
            pipe.expire(stats, keep_s)
            pipe.zadd(self.keys.fleet, {self.consumer: now})
            pipe.zremrangebyscore(self.keys.fleet, "-inf", now - keep_s)
            await pipe.execute()

    async def publish_limits(self, queue: str, max_len: int) -> None:
        """Tell producers how many waiting requests each stream of the queue accepts (0: no bound)."""
        await self.redis.hset(self.keys.limits(queue), "max_len", max_len)

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


@dataclass(frozen=True)
class OutputWrite:
    """One request's encoded events from one publish, and the position of the first."""

    route: Route
    first: int
    events: list[Event]
    entries: list[tuple[str, bytes]]  # each event's type and body, in the route's encoding

    @property
    def terminal(self) -> bool:
        """Whether the last event ends the request."""
        return not isinstance(self.events[-1], Delta)


class PublishStatus(enum.Enum):
    """What the publish script found for one request (see `scripts.PUBLISH`)."""

    APPLIED = "applied"
    LOST = "lost"
    DUPLICATE = "duplicate"
    EXPIRED = "expired"
    GAP = "gap"
    REFUSED = "refused"


@dataclass(frozen=True)
class Published:
    """One request's status from the publish script; `detail` is the count of events
    found (a gap) or Redis's reason (refused)."""

    status: PublishStatus
    detail: str = ""

    @classmethod
    def parse(cls, reply: str) -> Published:
        status, _, detail = reply.partition(":")
        return cls(PublishStatus(status), detail)


@dataclass(frozen=True)
class Taken:
    """A request's fence as this worker took it: its token (`taken`; else another entry
    serves the id), how many events were written before, and whether the last was terminal."""

    taken: bool
    token: str
    written: int
    finished: bool


@dataclass(frozen=True)
class Arrival:
    """What Redis knows of a request as a worker takes it in. `crashes` counts the
    workers that died while preparing it: each attempt is added to a set before the work
    and removed after, so only the attempts that killed their worker are left in it."""

    attempt: str  # ours, open until `close_attempt`
    crashes: int
    done: bool
    cancelled: bool


@dataclass(frozen=True)
class EarlierOutput:
    """An entry's output so far: how many events were written, and its deltas."""

    written: int
    deltas: list[Delta]

    @property
    def whole(self) -> bool:
        """Whether every event written is still there (else continuing would leave a gap)."""
        return len(self.deltas) == self.written

    def resume(self) -> Resume | None:
        """Where a new delivery continues: after these deltas; None if nothing was written."""
        if not self.written:
            return None
        return Resume(tokens=[t for d in self.deltas for t in d.tokens], text="".join(d.text for d in self.deltas),
                      deltas=self.written, reasoning="".join(d.reasoning or "" for d in self.deltas))


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

    async def run_many(self, script: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """One call of `script` per (keys, args), pipelined (on a cluster, grouped by node);
        the script is loaded once if a node lacks it, and every call sent again: each is a
        no-op where it already ran (see `scripts.PUBLISH`)."""
        if len(calls) == 1:
            return [await self.run(script, *calls[0])]
        try:
            return await self._pipelined(_sha1(script), calls)
        except NoScriptError:
            await self.redis.script_load(script)
            return await self._pipelined(_sha1(script), calls)

    async def _pipelined(self, sha: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                # execute_command: a cluster pipeline refuses its evalsha() method
                pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
            return await pipe.execute()  # type: ignore[no-any-return]


def encode_write(route: Route, first: int, events: list[Event]) -> OutputWrite:
    """A request's events, encoded. An event that cannot be encoded ends the request
    there with an `internal` error whose message is plain ASCII, so that it always can be."""
    entries: list[tuple[str, bytes]] = []
    for i, event in enumerate(events):
        try:
            entries.append(_entry(event, route.encoding))
        except (TypeError, ValueError, RecursionError) as e:
            reason = ascii(str(e)[:300])
            log.error("event could not be encoded", request_id=route.id, error=reason)
            error = Error(id=route.id, code=ErrorCode.INTERNAL, message=f"the output could not be encoded: {reason}")
            entries.append(_entry(error, route.encoding))
            return OutputWrite(route, first, [*events[:i], error], entries)
    return OutputWrite(route, first, events, entries)


def _entry(event: Event, encoding: Encoding) -> tuple[str, bytes]:
    fields = encode_event(event, encoding)
    return as_text(fields["type"]), fields[encoding]  # type: ignore[return-value]
