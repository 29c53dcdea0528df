"""What the fleet looks like, read from Redis alone (`mlxq status`, the submit warning).

Workers write a heartbeat (`mlxq:workers:<name>`, gone 3 heartbeats after they stop)
and a stats hash (`mlxq:stats:<name>`: totals and their last heartbeat, kept for days; read
here with HGET alone, which the gateway's ACL allows, the totals from that heartbeat),
and list themselves in `mlxq:fleet` (scored by when last seen). A worker with a live
heartbeat is `ready` or `draining`; one whose heartbeat is gone is `stopped` if it said
so on its way out, else `gone` (it died). Queues are those the workers serve, plus any
asked for.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis as redis_py
import redis.asyncio as aioredis

from .batches import Batch
from .heartbeat import Heartbeat, StatsRecord
from .hosts import HostedModel, HostRecord
from .keys import BATCH_LANE, GROUP, Keys
from .replies import as_text

RECENT_S = 3600  # workers last seen longer ago than this are left out


@dataclass
class WorkerView:
    """One worker as the fleet sees it."""

    name: str
    state: str  # ready, draining, stopped, gone
    last_seen_s: float  # seconds ago
    heartbeat: Heartbeat  # what it last said about itself
    totals: dict[str, int]

    @property
    def queue(self) -> str | None:
        model = self.heartbeat.model
        return None if model is None else model.queue

    @property
    def alive(self) -> bool:
        return self.state in ("ready", "draining")


@dataclass
class StreamView:
    """One request stream of a queue (the queue itself, or one of its lanes)."""

    queue: str
    lane: str | None
    stream: str
    length: int  # entries in the stream: waiting plus in flight
    waiting: int  # not yet read by any worker
    pending: int  # read, not yet finished (in flight)
    oldest_waiting_s: float | None  # age of the oldest request nobody has read yet
    dead: int  # entries in the queue's dead-letter stream
    max_len: int | None  # the bound workers published (None: none published)


@dataclass
class Fleet:
    """Every recent worker and every stream they serve."""

    workers: list[WorkerView] = field(default_factory=list)
    streams: list[StreamView] = field(default_factory=list)
    models: list[HostedModel] = field(default_factory=list)  # of the workers of several models
    batches: list[Batch] = field(default_factory=list)  # those not ended

    def serving(self, queue: str) -> list[WorkerView]:
        """Live workers of `queue`."""
        return [w for w in self.workers if w.alive and w.heartbeat.serves(queue)]

    def only(self, queues: list[str]) -> Fleet:
        """The part of the fleet that serves `queues`: their streams, their workers, models and batches."""
        wanted = set(queues)
        return Fleet([w for w in self.workers if any(m.queue in wanted for m in w.heartbeat.models)],
                     [s for s in self.streams if s.queue in wanted], [m for m in self.models if m.name in wanted],
                     [b for b in self.batches if b.queue in wanted])

    def as_json(self) -> dict[str, Any]:
        workers = [{**asdict(w), "heartbeat": w.heartbeat.as_json()} for w in self.workers]
        return {"workers": workers, "streams": [asdict(s) for s in self.streams],
                "models": [asdict(m) for m in self.models], "batches": [asdict(b) for b in self.batches]}


def read_fleet(redis: redis_py.Redis, keys: Keys, queues: list[str] | None = None) -> Fleet:
    """The fleet now: workers seen in the last hour, and the streams of their queues and `queues`."""
    fleet = Fleet(workers=read_workers(redis, keys), models=read_hosted_models(redis, keys),
                  batches=read_active_batches(redis, keys))
    named = {(m.queue, lane) for w in fleet.workers for m in w.heartbeat.models for lane in
             [None, BATCH_LANE, *m.lanes]}
    named |= {(queue, None) for queue in queues or []} | {(m.name, None) for m in fleet.models}
    fleet.streams = [read_stream(redis, keys, queue, lane) for queue, lane in sorted(named, key=_by_name)]
    return fleet


def read_active_batches(redis: redis_py.Redis, keys: Keys) -> list[Batch]:
    """The batches not ended, oldest first; one whose state cannot be read is left out."""
    ids = sorted(as_text(b) for b in redis.smembers(keys.active_batches))  # type: ignore[union-attr]
    found = []
    for batch_id in ids:
        with redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.batch(batch_id))
            pipe.hlen(keys.batch_part(batch_id, "results"))
            pipe.hlen(keys.batch_part(batch_id, "errors"))
            raw, completed, failed = pipe.execute()
        try:
            found.append(Batch.from_hash(raw, completed, failed))
        except (KeyError, ValueError):
            continue
    return sorted(found, key=lambda b: b.created_at)


def read_hosted_models(redis: redis_py.Redis, keys: Keys) -> list[HostedModel]:
    """Each model of each live worker of several models, by worker then model."""
    seen: list[bytes] = redis.zrangebyscore(keys.hosts, time.time() - RECENT_S, "+inf")  # type: ignore[assignment]
    names = [as_text(n) for n in seen]
    with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.get(keys.host(name))  # GET, not MGET: the gateway's ACL allows GET
        return _hosted_models(pipe.execute())


async def read_hosted_models_async(redis: aioredis.Redis, keys: Keys) -> list[HostedModel]:
    """`read_hosted_models` for asyncio."""
    seen: list[bytes] = await redis.zrangebyscore(keys.hosts, time.time() - RECENT_S, "+inf")  # type: ignore[assignment]
    names = [as_text(n) for n in seen]
    async with redis.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.get(keys.host(name))
        return _hosted_models(await pipe.execute())


def _hosted_models(raws: list[bytes | None]) -> list[HostedModel]:
    """The models of the hosts whose key is still there (it expires soon after a host dies)."""
    records = [HostRecord.from_wire(raw) for raw in raws]
    return [model for record in records if record is not None for model in record.models]


def _by_name(item: tuple[str, str | None]) -> tuple[str, str]:
    return item[0], item[1] or ""


def read_workers(redis: redis_py.Redis, keys: Keys) -> list[WorkerView]:
    """Every worker seen in the last hour, alive or not, by name."""
    now = time.time()
    members: list[bytes] = redis.zrangebyscore(keys.fleet, now - RECENT_S, "+inf")  # type: ignore[assignment]
    names = [as_text(n) for n in members]
    with redis.pipeline(transaction=False) as pipe:
        _ask_for_workers(pipe, keys, names)
        return _workers(names, pipe.execute(), now)


async def read_workers_async(redis: aioredis.Redis, keys: Keys) -> list[WorkerView]:
    """`read_workers` for asyncio."""
    now = time.time()
    members: list[bytes] = await redis.zrangebyscore(keys.fleet, now - RECENT_S, "+inf")  # type: ignore[assignment]
    names = [as_text(n) for n in members]
    async with redis.pipeline(transaction=False) as pipe:
        _ask_for_workers(pipe, keys, names)
        return _workers(names, await pipe.execute(), now)


STATS_READ = ("heartbeat", "state", "last_seen")  # of each worker's stats hash; HGET only, as the gateway's ACL allows


def _ask_for_workers(pipe: Any, keys: Keys, names: list[str]) -> None:
    for name in names:
        pipe.get(keys.worker(name))  # gone 3 heartbeats after the worker stopped
        for field_name in STATS_READ:
            pipe.hget(keys.stats(name), field_name)  # its last heartbeat (with its totals), kept for days


def _workers(names: list[str], replies: list[Any], now: float) -> list[WorkerView]:
    per = 1 + len(STATS_READ)
    workers = []
    for i, name in enumerate(names):
        live, *stored = replies[i * per:(i + 1) * per]
        record = StatsRecord.from_wire({field.encode(): value for field, value in zip(STATS_READ, stored, strict=True)})
        workers.append(_worker(name, live, record, now))
    return sorted(workers, key=lambda w: w.name)


def _worker(name: str, live: bytes | None, stored: StatsRecord, now: float) -> WorkerView:
    heartbeat = Heartbeat.from_json(live) or stored.heartbeat or Heartbeat(name)
    state: str = heartbeat.state if live is not None else "stopped" if stored.state == "stopped" else "gone"
    return WorkerView(name, state, round(max(0.0, now - (stored.last_seen or 0.0)), 1), heartbeat,
                      dict(heartbeat.totals))


def read_stream(redis: redis_py.Redis, keys: Keys, queue: str, lane: str | None = None) -> StreamView:
    """Length, waiting, in flight and oldest waiting age of one stream; the queue's dead letters and bound."""
    stream = keys.queue(queue) if lane is None else keys.lane(queue, lane)
    with redis.pipeline(transaction=False) as pipe:
        pipe.xlen(stream)
        pipe.xlen(keys.dead(queue))
        pipe.hget(keys.limits(queue), "max_len")
        length, dead, max_len = pipe.execute()
    group = _group(redis, stream)
    pending = int(group.get("pending", 0)) if group else 0
    waiting = length - pending
    oldest = None
    if waiting > 0:
        after = as_text(group["last-delivered-id"]) if group else "0-0"
        first: list[Any] = redis.xrange(stream, f"({after}", "+", count=1)  # type: ignore[assignment]
        if first:
            seconds, micros = redis.time()  # type: ignore[misc]  # the entry id's clock, not ours
            added_ms = int(as_text(first[0][0]).split("-")[0])
            oldest = round(max(0.0, seconds + micros / 1e6 - added_ms / 1000), 1)
    return StreamView(queue, lane, stream, length, waiting, pending, oldest, dead,
                      None if max_len is None else int(max_len))


def _group(redis: redis_py.Redis, stream: str) -> dict[str, Any] | None:
    try:
        groups = redis.xinfo_groups(stream)
    except redis_py.ResponseError:  # no such stream yet
        return None
    for group in groups:
        if as_text(group["name"]) == GROUP:
            return {as_text(k): v for k, v in group.items()}
    return None
