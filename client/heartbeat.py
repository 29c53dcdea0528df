"""A worker's heartbeat: what it tells the fleet about itself, as one type.

The worker writes it (`mlxq:workers:<consumer>`, and its last one into `mlxq:stats:<consumer>`);
`mlxq status`, the submit warning, the gateway's model directory and the name claim read
it back through `Heartbeat.from_json`, never as a loose dict. A worker lists each model it
can serve in `models` (one today); the flat `queue`, `lanes`, `model` and `tool_call`
keys repeat its first model's, for readers written against the earlier shape
(docs/protocol.md). Reading is lenient: a field missing or of the wrong type takes its
default, so a heartbeat of an older or newer worker still reads.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, cast, get_args

from .engine_stats import EngineStats
from .protocol import ErrorCode, FinishReason, Task

LONGEST = 5  # running requests a heartbeat lists
WorkerState = Literal["ready", "draining", "stopped"]
ModelLoad = Literal["loaded", "loading", "draining", "available"]


@dataclass(frozen=True)
class ModelState:
    """One model a worker can serve, and where it stands there."""

    name: str  # the model's name: requests for it go to `mlxq:q:<queue>`
    queue: str
    path: str  # what it was loaded from: a directory or a Hugging Face id
    state: ModelLoad = "loaded"
    lanes: tuple[str, ...] = ()  # the queue's lanes this worker reads too
    tool_call: tuple[str, str] | None = None  # the model's tool-call markers (start, end), when it has a format
    memory_bytes: int | None = None  # what it holds in memory, where counted
    task: Task = "generate"  # what its queue serves

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelState | None:
        name, queue, path = (raw.get(k) for k in ("name", "queue", "path"))
        if not isinstance(queue, str) or not isinstance(path, str):
            return None
        state, task = raw.get("state"), raw.get("task")
        return cls(name if isinstance(name, str) else queue, queue, path,
                   cast(ModelLoad, state if state in get_args(ModelLoad) else "available"), _strings(raw.get("lanes")),
                   _markers(raw.get("tool_call")), _int(raw.get("memory_bytes")),
                   cast(Task, task if task in get_args(Task) else "generate"))


@dataclass(frozen=True)
class RunningRequest:
    """One of the requests a worker has held longest: for the dashboard's "in flight"."""

    id: str
    stream: str  # the request stream it was read from (its queue's, or a lane's)
    read_at: float  # unix seconds
    tokens: int = 0  # generated so far

    @classmethod
    def from_dict(cls, raw: Any) -> RunningRequest | None:
        if not isinstance(raw, dict) or not isinstance(raw.get("id"), str):
            return None
        return cls(raw["id"][:256], _str(raw.get("stream"), "?")[:256], _float(raw.get("read_at")) or 0.0,
                   _int(raw.get("tokens")) or 0)


@dataclass(frozen=True)
class Heartbeat:
    """What one worker process says about itself every `heartbeat_s`."""

    consumer: str
    instance: str = ""  # a token per process: tells it from a later holder of its name
    state: WorkerState = "ready"
    host: str = "?"
    pid: int | None = None
    engine_pid: int | None = None  # its engine process's (pin it to a core of its own: docs/bench_pinned.sh)
    started_at: float = 0.0  # unix seconds
    version: str = "?"
    blas: str = "?"
    models: tuple[ModelState, ...] = ()
    in_flight: int = 0
    max_num_seqs: int | None = None
    tok_s: float | None = None  # generated over the last minute
    totals: dict[str, int] = field(default_factory=dict)
    last_error: dict[str, Any] | None = None  # {code, message, request_id, at}
    stats: EngineStats | None = None  # the engine's figures (None until its model is loaded)
    group: dict[str, Any] | None = None  # a worker group's: its mode, its ranks' hosts (rank 0 first)
    placement: dict[str, Any] | None = None  # placement by prefix: enabled, its digest's size and version
    longest: tuple[RunningRequest, ...] = ()  # the requests it has held longest, longest first (a few)

    @property
    def model(self) -> ModelState | None:
        """Its first model (a worker serves one today)."""
        return self.models[0] if self.models else None

    def serves(self, queue: str) -> bool:
        return any(m.queue == queue for m in self.models)

    def as_json(self) -> dict[str, Any]:
        """The written shape: the engine's figures at the top level, as they always were,
        and the first model's flat keys beside `models`."""
        first = self.model
        body = {k: v for k, v in asdict(self).items() if k != "stats"}
        flat = {"queue": first.queue, "lanes": list(first.lanes), "model": first.path,
                "tool_call": first.tool_call} if first else {}
        return {**(self.stats.to_wire() if self.stats else {}), **body, **flat}

    def to_json(self) -> str:
        return json.dumps(self.as_json())

    @classmethod
    def from_json(cls, raw: bytes | str | None) -> Heartbeat | None:
        """The heartbeat in `raw`; None for nothing, or for what is not a JSON object."""
        if not raw:
            return None
        try:
            value = json.loads(raw)
        except ValueError:
            return None
        return cls.from_dict(value) if isinstance(value, dict) else None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Heartbeat:
        state = raw.get("state")
        totals = raw.get("totals")
        last_error = raw.get("last_error")
        return cls(
            consumer=_str(raw.get("consumer"), ""), instance=_str(raw.get("instance"), ""),
            state=cast(WorkerState, state if state in get_args(WorkerState) else "ready"),
            host=_str(raw.get("host"), "?"),
            pid=_int(raw.get("pid")), engine_pid=_int(raw.get("engine_pid")),
            started_at=_float(raw.get("started_at")) or 0.0,
            version=_str(raw.get("version"), "?"), blas=_str(raw.get("blas"), "?"), models=_models(raw),
            in_flight=_int(raw.get("in_flight")) or 0, max_num_seqs=_int(raw.get("max_num_seqs")),
            tok_s=_float(raw.get("tok_s")),
            totals={k: v for k, v in totals.items() if isinstance(v, int)} if isinstance(totals, dict) else {},
            last_error=last_error if isinstance(last_error, dict) else None,
            stats=EngineStats.from_wire(raw), group=group if isinstance(group := raw.get("group"), dict) else None,
            placement=placement if isinstance(placement := raw.get("placement"), dict) else None,
            longest=_running(raw.get("longest")))


def _running(value: Any) -> tuple[RunningRequest, ...]:
    found = (RunningRequest.from_dict(x) for x in value[:LONGEST]) if isinstance(value, list) else ()
    return tuple(r for r in found if r is not None)


def _models(raw: dict[str, Any]) -> tuple[ModelState, ...]:
    listed = raw.get("models")
    if isinstance(listed, list):
        return tuple(m for m in (ModelState.from_dict(x) for x in listed if isinstance(x, dict)) if m is not None)
    flat = ModelState.from_dict({"queue": raw.get("queue"), "path": raw.get("model"), "state": "loaded",
                                 "lanes": raw.get("lanes"), "tool_call": raw.get("tool_call")})
    return () if flat is None else (flat,)  # a worker from before `models`


def _str(value: Any, default: str) -> str:
    return value if isinstance(value, str) else default


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    """A finite number (JSON as Python reads it has NaN and Infinity too), else None."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        return None
    return float(value)


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()


def _markers(value: Any) -> tuple[str, str] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return value[0], value[1]
    return None


TOKEN_COUNTS = ("prompt_tokens", "generation_tokens", "cached_tokens")
EVENT_COUNTS = ("takeovers", "dead_letters", "engine_restarts")
# Placement by prefix: served where its prefix is cached, moved to the worker that caches
# it, kept here because that worker was full, taken from a worker's lane past the bound.
PLACEMENTS = ("affine", "forwarded", "balanced", "stolen")


def counter_names() -> list[str]:
    """Every counter a worker's stats record holds: a fixed set (finish reasons and error
    codes are the protocol's), so the hash stays small whatever requests carry."""
    return ([f"finished:{reason}" for reason in get_args(FinishReason)] + [f"errors:{code}" for code in ErrorCode]
            + list(TOKEN_COUNTS) + list(EVENT_COUNTS) + [f"placed:{reason}" for reason in PLACEMENTS])


@dataclass(frozen=True)
class StatsRecord:
    """A worker's stats hash (`mlxq:stats:<consumer>`), kept for days past its heartbeat:
    its counters, its last heartbeat, `stopped` once it said so on its way out, its last
    error, and when it last wrote (unix s, added by the writer)."""

    totals: dict[str, int] = field(default_factory=dict)
    heartbeat: Heartbeat | None = None
    state: str = ""
    last_error: dict[str, Any] | None = None
    last_seen: float | None = None

    def to_wire(self) -> dict[str, str | int]:
        return {**{name: self.totals.get(name, 0) for name in counter_names()},
                "heartbeat": self.heartbeat.to_json() if self.heartbeat else "", "state": self.state,
                "last_error": json.dumps(self.last_error)}

    @classmethod
    def from_wire(cls, stored: dict[bytes, bytes]) -> StatsRecord:
        """The record in what HGETALL (or HGETs of some fields) gave; what is not one of its
        fields, or not of its shape, is left out."""
        fields = {name.decode(errors="replace"): value for name, value in stored.items() if value is not None}
        known = set(counter_names())
        try:
            last_error = json.loads(fields.get("last_error", b"null"))
        except ValueError:
            last_error = None
        return cls({k: int(v) for k, v in fields.items() if k in known and v.isdigit()},
                   Heartbeat.from_json(fields.get("heartbeat")), fields.get("state", b"").decode(errors="replace"),
                   last_error if isinstance(last_error, dict) else None, _float(_number_text(fields.get("last_seen"))))


def _number_text(raw: bytes | None) -> float | None:
    try:
        return float(raw) if raw else None
    except ValueError:
        return None
