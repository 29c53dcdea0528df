"""What each page of the dashboard shows, read from Redis alone: the workers' heartbeats
and stats, the hosts' keys, the queues' streams, the dead letters, the batches and the
fleet's timeline. Nothing here acts; every value is handed to templates that escape it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis as redis_py
from markupsafe import Markup

from client.batches import Batch
from client.dead_letters import DeadLetter, DeadLetters
from client.fleet import Fleet, WorkerView, read_fleet
from client.heartbeat import RunningRequest
from client.hosts import HostRecord
from client.keys import Keys
from client.replies import as_text
from client.timeline import TIMELINE_KEEP_S, Sample, points, rates

from .charts import Series, chart, sparkline

MAX_SAMPLES = 50_000  # the most timeline entries one page reads (an hour of ~140 workers at 10 s)
DEAD_SHOWN = 25  # dead letters listed a queue
RUNNING_SHOWN = 25
BODY_SHOWN = 8192  # bytes of a dead letter's field shown when it is opened
STATES = {"ready": "serving", "draining": "draining", "stopped": "stopped", "gone": "dead"}


@dataclass
class Snapshot:
    """The fleet as one read of Redis saw it."""

    at: float
    fleet: Fleet
    hosts: list[HostRecord]
    samples: list[Sample]


def read_snapshot(redis: redis_py.Redis, keys: Keys) -> Snapshot:
    """Everything but dead letters and batches (a blocking read: run it in a thread)."""
    now = time.time()
    fleet = read_fleet(redis, keys)
    seen: list[bytes] = redis.zrangebyscore(keys.hosts, now - 3 * 60, "+inf")  # type: ignore[assignment]
    names = [as_text(n) for n in seen]
    hosts = [h for h in (HostRecord.from_wire(redis.get(keys.host(n))) for n in names) if h is not None]  # type: ignore[arg-type]
    entries: list[Any] = redis.xrange(keys.timeline, int((now - TIMELINE_KEEP_S) * 1000), "+",  # type: ignore[assignment]
                                      count=MAX_SAMPLES)
    samples = [s for s in (Sample.from_wire(entry_id, body) for entry_id, body in entries) if s is not None]
    return Snapshot(now, fleet, hosts, samples)


# ---- fleet ----------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerRow:
    name: str
    instance: str
    host: str
    state: str
    model: str
    adapters: str
    memory: str
    slots: str
    tok_s: str
    spark: Markup
    last_beat: str
    group: str
    may_drain: bool


@dataclass(frozen=True)
class ModelRow:
    host: str
    model: str
    state: str
    memory: str
    consumer: str
    instance: str  # of its worker process, when it runs: what unloading drains


def worker_rows(snapshot: Snapshot) -> list[WorkerRow]:
    return [_worker_row(w, snapshot) for w in snapshot.fleet.workers]


def _worker_row(worker: WorkerView, snapshot: Snapshot) -> WorkerRow:
    beat = worker.heartbeat
    model = beat.model
    stats = beat.stats
    adapters = ", ".join(str(a.get("name", "?")) for a in (stats.adapters or [])) if stats else ""
    group = beat.group or {}
    return WorkerRow(
        worker.name, beat.instance, beat.host, STATES.get(worker.state, worker.state),
        "" if model is None else f"{model.name} ({model.path})", adapters,
        _bytes(stats.memory_held) if stats else "", f"{beat.in_flight} / {beat.max_num_seqs or '?'}",
        f"{beat.tok_s or 0:.1f}", sparkline(rates(snapshot.samples, worker.name, snapshot.at)),
        f"{worker.last_seen_s:.1f} s ago",
        f"{group.get('mode', '?')}, {len(group.get('hosts', []))} ranks" if group else "",
        worker.alive and worker.state == "ready")


def model_rows(snapshot: Snapshot) -> list[ModelRow]:
    instances = {w.name: w.heartbeat.instance for w in snapshot.fleet.workers if w.alive}
    return [ModelRow(host.name, m.name, m.state, f"{_bytes(m.memory_bytes or 0)} of {_bytes(host.budget_bytes)}",
                     m.consumer, instances.get(m.consumer, "") if m.state == "loaded" else "")
            for host in snapshot.hosts for m in host.models]


# ---- queues ---------------------------------------------------------------------


@dataclass(frozen=True)
class QueueRow:
    queue: str
    lane: str
    length: int
    waiting: int
    pending: int
    oldest: str
    dead: int
    arrivals: str  # a minute
    completions: str


def queue_rows(snapshot: Snapshot) -> list[QueueRow]:
    minute_ago = snapshot.at - 60
    rows = []
    for stream in snapshot.fleet.streams:
        recent = [s for s in snapshot.samples if s.queue == stream.queue and s.at >= minute_ago]
        main = stream.lane is None
        rows.append(QueueRow(stream.queue, stream.lane or "(queue)", stream.length, stream.waiting, stream.pending,
                             "" if stream.oldest_waiting_s is None else f"{stream.oldest_waiting_s:.1f} s",
                             stream.dead, _arrivals(snapshot.samples, stream.queue, snapshot.at) if main else "",
                             str(sum(s.finished for s in recent)) if main else ""))
    return rows


def _arrivals(samples: list[Sample], queue: str, now: float) -> str:
    """Requests added to the queue's streams over the last minute (by their running total)."""
    mine = [s for s in samples if s.queue == queue and s.added]
    latest = max(mine, key=lambda s: s.at, default=None)
    before = [s for s in mine if s.at <= now - 60]
    if latest is None:
        return ""
    base = max(before, key=lambda s: s.at).added if before else min(s.added for s in mine)
    return str(max(0, latest.added - base))


# ---- in flight ------------------------------------------------------------------


@dataclass(frozen=True)
class RunningRow:
    id: str
    queue: str
    worker: str
    running: str
    tokens: int


def running_rows(snapshot: Snapshot) -> list[RunningRow]:
    found: list[tuple[RunningRequest, WorkerView]] = [
        (r, w) for w in snapshot.fleet.workers if w.alive for r in w.heartbeat.longest]
    found.sort(key=lambda pair: pair[0].read_at)
    return [RunningRow(r.id, w.queue or "?", w.name, f"{max(0.0, snapshot.at - r.read_at):.1f} s", r.tokens)
            for r, w in found[:RUNNING_SHOWN]]


# ---- dead letters ---------------------------------------------------------------


@dataclass(frozen=True)
class DeadRow:
    queue: str
    entry_id: str
    died: str
    request_id: str
    reason: str
    deliveries: str


def dead_rows(redis: redis_py.Redis, keys: Keys, queues: list[str]) -> list[DeadRow]:
    """The newest dead letters of each queue (a blocking read)."""
    return [DeadRow(queue, letter.entry_id, _when(letter.died_at), letter.request_id or "(no id)",
                    letter.text("reason")[:300], letter.text("deliveries"))
            for queue in queues for letter in DeadLetters(redis, keys, queue).newest(DEAD_SHOWN)]


def dead_letter(redis: redis_py.Redis, keys: Keys, queue: str, entry_id: str) -> DeadLetter | None:
    return DeadLetters(redis, keys, queue).get(entry_id)


def shown_fields(letter: DeadLetter) -> list[tuple[str, str]]:
    """Each field of a dead letter as text, cut at `BODY_SHOWN` bytes; msgpack by its size."""
    shown = []
    for name, value in letter.fields.items():
        if name == "field:msgpack":
            text = f"<{len(value)} bytes of msgpack>"
        else:
            text = value[:BODY_SHOWN].decode(errors="replace")
            if len(value) > BODY_SHOWN:
                text += f"\n... ({len(value) - BODY_SHOWN} more bytes)"
        shown.append((name, text))
    return shown


# ---- batches --------------------------------------------------------------------


@dataclass(frozen=True)
class BatchRow:
    id: str
    tenant: str
    status: str
    done: int
    failed: int
    total: int
    eta: str
    cancellable: bool


def batch_rows(batches: list[Batch], now: float) -> list[BatchRow]:
    return [BatchRow(b.id, b.tenant or "(client)", b.status, b.completed, b.failed, b.total, _eta(b, now),
                     b.status in ("validating", "in_progress")) for b in batches]


def _eta(batch: Batch, now: float) -> str:
    started = batch.times.get("in_progress_at") or batch.created_at
    finished = batch.completed + batch.failed
    if batch.ended or not finished or finished >= batch.total:
        return ""
    return f"{(now - started) / finished * (batch.total - finished):.0f} s"


# ---- charts ---------------------------------------------------------------------


@dataclass(frozen=True)
class Charts:
    throughput: Markup
    ttft: Markup
    depth: Markup
    errors: Markup


def charts(snapshot: Snapshot) -> Charts:
    found = points(snapshot.samples, snapshot.at)
    busy = [p if p.finished or p.tok_s else None for p in found]
    return Charts(
        chart("throughput", "tok/s", [Series("tok/s", [p.tok_s for p in found])]),
        chart("time to first token", "ms", [Series("p50", [p.ttft_p50_ms if p else None for p in busy]),
                                            Series("p99", [p.ttft_p99_ms if p else None for p in busy])]),
        chart("queue depth", "requests", [Series("depth", [float(p.depth) for p in found])]),
        chart("errors", "a minute", [Series("errors", [float(p.errors) for p in found])]))


def _bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))
