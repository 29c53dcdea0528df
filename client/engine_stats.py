"""The engine's figures as a worker's heartbeat carries them (at its top level): running
and waiting requests, memory, each cache, constrained decoding's mask fills, where the
engine thread's time went, speculation's counters. One typed record, written by the
worker's engine thread and read by `mlxq status`, the host of several models and the
metrics, with its encoding beside it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class CacheStats:
    """One shape for every cache: the prefix cache, mlx-vlm's block cache (entries are
    blocks), the vision-embedding cache."""

    entries: int
    hits: int
    misses: int
    bytes: int | None = None  # None where the cache does not count them
    capacity: int | None = None  # most entries it can hold, where that is fixed
    refused: int = 0  # entries too large to keep

    @property
    def hit_rate(self) -> float | None:
        looked_up = self.hits + self.misses
        return None if looked_up == 0 else round(self.hits / looked_up, 3)

    def to_wire(self) -> dict[str, Any]:
        return {**asdict(self), "hit_rate": self.hit_rate}

    @classmethod
    def from_wire(cls, raw: Any) -> CacheStats | None:
        if not isinstance(raw, dict) or not all(_count(raw.get(k)) for k in ("entries", "hits", "misses")):
            return None
        size, capacity, refused = (raw.get(k) for k in ("bytes", "capacity", "refused"))
        return cls(raw["entries"], raw["hits"], raw["misses"], size if _count(size) else None,
                   capacity if _count(capacity) else None, refused if isinstance(refused, int) else 0)


@dataclass
class EngineTime:
    """Seconds of the engine thread: inside the model's step (the forward pass and sampling,
    `model_s`), around it (admitting, masks, logprobs, detokenizing, stop strings, events:
    `other_s`), handing each step's events to the event loop (`handoff_s`: until its publisher has
    taken them, see `Publisher.hand_over`), and waiting for work (`idle_s`); and the steps taken."""

    steps: int = 0
    model_s: float = 0.0
    other_s: float = 0.0
    handoff_s: float = 0.0
    idle_s: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        return {"steps": self.steps, **{name: round(getattr(self, name), 3)
                                        for name in ("model_s", "other_s", "handoff_s", "idle_s")}}

    @classmethod
    def from_wire(cls, raw: Any) -> EngineTime | None:
        if not isinstance(raw, dict):
            return None
        return cls(**{f.name: raw[f.name] for f in fields(cls) if _number(raw.get(f.name))})


@dataclass(frozen=True)
class EngineStats:
    """What the engine thread tells the event loop about itself, now and then."""

    running: int
    waiting: int
    memory: dict[str, int]  # the framework's figures, in bytes
    prefix_cache: CacheStats | None = None
    vision_cache: CacheStats | None = None
    ssd_cache: CacheStats | None = None  # the prefix cache's SSD tier
    speculation: dict[str, Any] | None = None  # speculative decoding's counters, where it runs
    mask_fills: int = 0  # batch fills of constrained rows' masks, and the time they took
    mask_fill_ms: float = 0.0
    time: EngineTime | None = None  # where the engine thread's time went, since it started
    adapters: list[dict[str, Any]] | None = None  # its LoRA adapters (name, path, loaded, rank, running | error)
    # Its prefix cache's digest, for the fleet's placement (`worker.queue.affinity`); the
    # heartbeat gives its size alone.
    prefix_digest: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {"running": self.running, "waiting": self.waiting, "memory": self.memory,
                "constraints": {"mask_fills": self.mask_fills, "mask_fill_ms": round(self.mask_fill_ms, 1)},
                "engine": None if self.time is None else self.time.to_wire(),
                "prefix_cache": None if self.prefix_cache is None else self.prefix_cache.to_wire(),
                "vision_cache": None if self.vision_cache is None else self.vision_cache.to_wire(),
                "ssd_cache": None if self.ssd_cache is None else self.ssd_cache.to_wire(),
                "speculation": self.speculation, "adapters": self.adapters}

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> EngineStats | None:
        """The figures in a heartbeat's top level; None where it has none (a worker still loading)."""
        if not _count(raw.get("running")) or not _count(raw.get("waiting")):
            return None
        memory, constraints, speculation = raw.get("memory"), raw.get("constraints"), raw.get("speculation")
        constraints = constraints if isinstance(constraints, dict) else {}
        return cls(raw["running"], raw["waiting"],
                   {k: v for k, v in memory.items() if _count(v)} if isinstance(memory, dict) else {},
                   prefix_cache=CacheStats.from_wire(raw.get("prefix_cache")),
                   vision_cache=CacheStats.from_wire(raw.get("vision_cache")),
                   ssd_cache=CacheStats.from_wire(raw.get("ssd_cache")),
                   speculation=speculation if isinstance(speculation, dict) else None,
                   mask_fills=constraints["mask_fills"] if _count(constraints.get("mask_fills")) else 0,
                   mask_fill_ms=constraints["mask_fill_ms"] if _number(constraints.get("mask_fill_ms")) else 0.0,
                   time=EngineTime.from_wire(raw.get("engine")),
                   adapters=_dicts(raw.get("adapters")))

    @property
    def memory_held(self) -> int:
        """The bytes the framework holds: active and cached."""
        return sum(v for k, v in self.memory.items() if k in ("active", "cache"))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _dicts(value: Any) -> list[dict[str, Any]] | None:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else None
