"""Batches: many requests tracked as one job, with their state in Redis.

A batch is stored whole when it is created: its lines (`mlxq:batch:{<id>}:lines`, each a
custom id and an mlxq request body, or the reason it was refused), and its state (the
hash `mlxq:batch:{<id>}`: status, times, queue, how many lines were fed). Whoever drives
it (`client.batch_driver`: a gateway, `mlxq batch`, a client waiting on it) holds its
lease, feeds its lines to the queue's batch lane and files each line's terminal event
under the line's number (`...:results`, `...:errors`). Every key of a batch shares its
hash tag, so its scripts run on a Redis Cluster too. docs/protocol.md, "Batches", is
the contract for producers in other languages.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import re
import secrets
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import msgpack
import redis.asyncio as aioredis

from .keys import Keys
from .protocol import Delta, Done, Error, decode_event, encode_event
from .replies import as_text

Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                 "cancelled"]
ENDED: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
MAX_LINES = 50_000  # OpenAI's limit on one batch
RETENTION_S = 7 * 24 * 3600  # a batch's keys are kept this long after it ends
LINES_PER_CALL = 1000
WINDOW = re.compile(r"([1-9][0-9]{0,6})([smhd])")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_WINDOW_S = 7 * 86400

# KEYS: a batch's hash. ARGV: the new status, the time (unix s), then the statuses it may
# come from. Returns {1 if it moved, the status before} (false if there is no batch).
MOVE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
for i = 3, #ARGV do
  if ARGV[i] == status then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[2])
    return {1, status}
  end
end
return {0, status}
"""


# KEYS: a batch's results (or errors) hash, its state. ARGV: the line, its result, its tokens.
FILE = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then redis.call('HINCRBY', KEYS[2], 'tokens', ARGV[3]) end
"""


def completion_window_s(window: str) -> int:
    """Seconds in a completion window: OpenAI's "24h", or any `<n>s|m|h|d` up to 7 days."""
    match = WINDOW.fullmatch(window)
    seconds = int(match[1]) * UNIT_S[match[2]] if match else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise ValueError(f"completion_window {window!r}: use '24h' (or a duration such as '30m', '2h', "
                         "'45s', at most 7d)")
    return seconds


@dataclass(frozen=True)
class BatchLine:
    """One line as stored: its custom id and either the mlxq request body it submits or
    why it was refused; `meta` is what its creator needs to render its result (the
    gateway keeps the OpenAI route and model there)."""

    custom_id: str | None  # None: a line so malformed that it has none
    body: dict[str, Any] | None = None
    error: dict[str, str] | None = None  # {"code", "message"}
    meta: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        """As stored: msgpack, so that a body's raw bytes (images, audio) keep their form."""
        packed: bytes = msgpack.packb({"custom_id": self.custom_id, "body": self.body, "error": self.error,
                                       "meta": self.meta}, use_bin_type=True)
        return packed

    @classmethod
    def decode(cls, raw: bytes | str) -> BatchLine:
        """A stored line: msgpack, or JSON as lines were stored before (a JSON object starts
        with '{', which in msgpack would be an integer, never a map)."""
        if isinstance(raw, str) or raw[:1] == b"{":
            line = json.loads(raw)
        else:
            line = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        return cls(line["custom_id"], line.get("body"), line.get("error"), line.get("meta") or {})


@dataclass(frozen=True)
class LineResult:
    """A line's end: its `done` or `error` event (an error made by the batch itself, such
    as `batch_expired`, is an `Error` too), with the logprobs its deltas carried."""

    index: int
    custom_id: str | None
    event: Done | Error
    request_id: str
    deltas: list[Delta] = field(default_factory=list)
    entry: str | None = None  # the reply entry that ended it (Redis server time, ms first)

    def to_json(self) -> str:
        return json.dumps({"custom_id": self.custom_id, "request_id": self.request_id, "entry": self.entry,
                           "event": _fields_text(encode_event(self.event, "json")),
                           "deltas": [_fields_text(encode_event(d, "json")) for d in self.deltas]},
                          separators=(",", ":"))

    @classmethod
    def from_json(cls, index: int, raw: bytes | str) -> LineResult:
        stored = json.loads(raw)
        event = decode_event(stored["event"])
        assert isinstance(event, (Done, Error))
        return cls(index, stored["custom_id"], event, stored["request_id"],
                   [cast(Delta, decode_event(d)) for d in stored.get("deltas") or []], stored.get("entry"))


def _fields_text(fields: dict[str, bytes | str]) -> dict[str, str]:
    return {k: as_text(v) for k, v in fields.items()}


@dataclass(frozen=True)
class Batch:
    """A batch's state as stored; `completed` and `failed` count its lines' results."""

    id: str
    status: Status
    queue: str
    endpoint: str
    completion_window: str
    created_at: int
    expires_at: int
    total: int
    fed: int
    completed: int = 0
    failed: int = 0
    times: dict[str, int] = field(default_factory=dict)  # in_progress_at, completed_at, ...
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None  # why it failed validation
    input_file_id: str | None = None
    model: str | None = None
    cursor: str = "0-0"  # the last reply entry its driver has filed
    tokens: int = 0  # generated by the lines completed
    tenant: str | None = None  # who made it, through a gateway's key (None: made with the client)
    secret: str = ""  # in its lines' request ids, so that no producer can pass off a result as a line's

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @property
    def request_counts(self) -> dict[str, int]:
        return {"total": self.total, "completed": self.completed, "failed": self.failed}

    @classmethod
    def from_hash(cls, raw: dict[Any, Any], completed: int, failed: int) -> Batch:
        h = {as_text(k): as_text(v) for k, v in raw.items()}
        times = {k: int(float(v)) for k, v in h.items() if k.endswith("_at") and k not in ("created_at", "expires_at")}
        return cls(h["id"], cast(Status, h["status"]), h["queue"], h["endpoint"], h["completion_window"],
                   int(h["created_at"]), int(h["expires_at"]), int(h["total"]), int(h.get("fed", 0)), completed,
                   failed, times, json.loads(h.get("metadata") or "null"), json.loads(h.get("errors") or "null"),
                   h.get("input_file_id") or None, h.get("model") or None, h.get("cursor", "0-0"),
                   int(h.get("tokens", 0)), h.get("tenant") or None, h.get("secret", ""))


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def line_request_id(batch: Batch, index: int) -> str:
    """The request id of a batch's line: the same for every driver that feeds it, so a line
    fed twice (a driver died between feeding and noting it) is computed once; and, with the
    batch's secret in it, one that no producer can guess before the line is fed, so nobody
    else's request can be filed as the line's result."""
    if not batch.secret:  # a batch stored before lines had secrets
        return f"{batch.id}-{index}"
    token = hmac.new(batch.secret.encode(), str(index).encode(), hashlib.sha256).hexdigest()[:16]
    return f"{batch.id}-{index}-{token}"


def line_index(batch: Batch, request_id: str) -> int | None:
    """The line a request id stands for, or None if it is not one of this batch's."""
    head, _, tail = request_id.removeprefix(f"{batch.id}-").partition("-")
    if not head.isdigit() or not head.isascii():
        return None
    index = int(head)
    return index if hmac.compare_digest(request_id, line_request_id(batch, index)) else None


class BatchStore:
    """A batch's keys, read and written (asyncio)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._move = redis.register_script(MOVE)
        self._file = redis.register_script(FILE)

    async def create(self, lines: Sequence[BatchLine], *, queue: str, endpoint: str, completion_window: str,
                     model: str | None = None, metadata: dict[str, str] | None = None,
                     input_file_id: str | None = None, errors: list[dict[str, Any]] | None = None,
                     tenant: str | None = None, batch_id: str | None = None) -> Batch:
        """Store a new batch, `validating` (a driver starts it), or `failed` with `errors`.
        A creation that fails leaves nothing of the batch behind."""
        window_s = completion_window_s(completion_window)
        batch_id = batch_id or new_batch_id()
        encoded = [] if errors else [line.encode() for line in lines]  # all of them, before anything is written
        now = int(time.time())
        state: dict[str, Any] = {"id": batch_id, "status": "failed" if errors else "validating", "queue": queue,
                                 "endpoint": endpoint, "completion_window": completion_window, "created_at": now,
                                 "expires_at": now + window_s, "total": len(lines), "fed": 0,
                                 "metadata": json.dumps(metadata), "input_file_id": input_file_id or "",
                                 "model": model or "", "tenant": tenant or "", "secret": secrets.token_hex(16)}
        if errors:
            state.update(errors=json.dumps(errors), failed_at=now)
        try:
            await self._write(batch_id, encoded, state, window_s)
        except BaseException:
            await self._forget(batch_id, tenant)
            raise
        batch = await self.get(batch_id)
        assert batch is not None
        return batch

    async def _write(self, batch_id: str, encoded: list[bytes], state: dict[str, Any], window_s: int) -> None:
        lines_key = self.keys.batch_part(batch_id, "lines")
        for start in range(0, len(encoded), LINES_PER_CALL):
            await self.redis.rpush(lines_key, *encoded[start:start + LINES_PER_CALL])
            if not start:  # a creator that dies before the batch exists leaves nothing for good
                await self.redis.expire(lines_key, window_s + RETENTION_S)
        await self.redis.hset(self.keys.batch(batch_id), mapping=state)  # type: ignore[arg-type]
        await self.redis.zadd(self.keys.batches, {batch_id: state["created_at"]})
        if state["tenant"]:
            await self.redis.zadd(self.keys.tenant(state["tenant"], "batches"), {batch_id: state["created_at"]})
        if state["status"] == "failed":
            await self._retire(batch_id)
        else:
            await self.redis.sadd(self.keys.active_batches, batch_id)

    async def _forget(self, batch_id: str, tenant: str | None) -> None:
        """Delete what a failed creation wrote (shielded: a cancelled request still cleans up)."""
        async def forget() -> None:
            await self.redis.srem(self.keys.active_batches, batch_id)
            await self.redis.zrem(self.keys.batches, batch_id)
            if tenant:
                await self.redis.zrem(self.keys.tenant(tenant, "batches"), batch_id)
            await self.redis.delete(self.keys.batch(batch_id), self.keys.batch_part(batch_id, "lines"))
        await asyncio.shield(forget())

    async def get(self, batch_id: str) -> Batch | None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.batch(batch_id))
            pipe.hlen(self.keys.batch_part(batch_id, "results"))
            pipe.hlen(self.keys.batch_part(batch_id, "errors"))
            raw, completed, failed = await pipe.execute()
        return Batch.from_hash(raw, completed, failed) if raw else None

    async def listing(self, after: str | None = None, limit: int = 20,
                      tenant: str | None = None) -> tuple[list[Batch], bool]:
        """The newest batches first (of `tenant` alone, if given), starting after the batch
        `after`; and whether more follow."""
        index = self.keys.batches if tenant is None else self.keys.tenant(tenant, "batches")
        start = 0
        if after is not None:
            rank: int | None = await self.redis.zrevrank(index, after)  # type: ignore[assignment]
            start = 0 if rank is None else rank + 1
        found: list[Batch] = []
        while len(found) < limit + 1:
            ids: list[bytes] = await self.redis.zrevrange(index, start, start + limit)  # type: ignore[assignment]
            if not ids:
                break
            start += len(ids)
            for batch_id in ids:
                batch = await self.get(as_text(batch_id))
                if batch is None:  # its keys expired: forget it
                    await self.redis.zrem(index, batch_id)
                else:
                    found.append(batch)
        return found[:limit], len(found) > limit

    async def move(self, batch_id: str, to: Status, *, came_from: Iterable[str]) -> bool:
        """Change the status (and note the time) if it is one of `came_from`; ending it
        takes it off the active set and starts its keys' retention."""
        moved = await self._move(keys=[self.keys.batch(batch_id)], args=[to, int(time.time()), *came_from])
        if not moved or not int(moved[0]):
            return False
        if to in ENDED:
            await self._retire(batch_id)
        return True

    async def cancel(self, batch_id: str) -> Batch | None:
        """Ask for the batch to be cancelled (its driver cancels the lines running); an ended
        or finalizing batch is left as it is."""
        await self.move(batch_id, "cancelling", came_from=("validating", "in_progress"))
        return await self.get(batch_id)

    async def lines(self, batch_id: str, start: int, stop: int) -> list[BatchLine]:
        """Lines `start` to `stop` - 1."""
        raw = await self.redis.lrange(self.keys.batch_part(batch_id, "lines"), start, stop - 1)
        return [BatchLine.decode(line) for line in raw]

    async def results(self, batch_id: str) -> list[LineResult]:
        """Every line's result so far, successes and failures, in line order."""
        done = await self.redis.hgetall(self.keys.batch_part(batch_id, "results"))
        failed = await self.redis.hgetall(self.keys.batch_part(batch_id, "errors"))
        found = [LineResult.from_json(int(as_text(i)), raw) for i, raw in {**done, **failed}.items()]
        return sorted(found, key=lambda r: r.index)

    async def file(self, batch_id: str, result: LineResult) -> None:
        """Note a line's end, once (the first word on a line stands), and count its tokens."""
        part = "results" if isinstance(result.event, Done) else "errors"
        tokens = result.event.usage.completion_tokens if isinstance(result.event, Done) else 0
        await self._file(keys=[self.keys.batch_part(batch_id, part), self.keys.batch(batch_id)],
                         args=[result.index, result.to_json(), tokens])

    async def finished_lines(self, batch_id: str) -> set[int]:
        done = await self.redis.hkeys(self.keys.batch_part(batch_id, "results"))
        failed = await self.redis.hkeys(self.keys.batch_part(batch_id, "errors"))
        return {int(as_text(i)) for i in [*done, *failed]}

    async def note(self, batch_id: str, **values: Any) -> None:
        await self.redis.hset(self.keys.batch(batch_id), mapping=values)  # type: ignore[arg-type]

    async def _retire(self, batch_id: str) -> None:
        await self.redis.srem(self.keys.active_batches, batch_id)
        tenant, queue = await self.redis.hmget(self.keys.batch(batch_id), ["tenant", "queue"])
        if tenant:
            await self.redis.zrem(self.keys.tenant(as_text(tenant), "active"), batch_id)
        replies = [self.keys.batch_replies(as_text(queue), batch_id)] if queue else []
        for key in (self.keys.batch(batch_id), *(self.keys.batch_part(batch_id, p) for p in
                                                 ("lines", "results", "errors")), *replies):
            await self.redis.expire(key, RETENTION_S)


def batch_error(index: int, custom_id: str | None, request_id: str, code: str, message: str) -> LineResult:
    """A line's end that the batch itself decides (refused at creation, expired, cancelled)."""
    return LineResult(index, custom_id, Error(id=request_id, code=code, message=message), request_id)
