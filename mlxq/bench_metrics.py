"""The numbers `mlxq bench` reports, from what each request saw. Pure arithmetic."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)
# The worker's stages of a request, each in ms from its arrival (docs/protocol.md, `timing`).
STAGES = ("read_ms", "prepared_ms", "queued_ms", "ttft_ms", "published_ms", "total_ms")


@dataclass
class RequestTiming:
    """What one request saw, in seconds on one monotonic clock."""

    submitted: float
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in that delta)
    done: float | None = None
    tokens: int = 0
    queued_ms: float | None = None  # the worker's view: entry id stamp to admission
    cached_tokens: int = 0
    stages_ms: dict[str, float] = field(default_factory=dict)  # the worker's stage timings (done.timing)

    @property
    def ttft_ms(self) -> float | None:
        return None if not self.token_times else (self.token_times[0][0] - self.submitted) * 1000

    @property
    def e2e_ms(self) -> float | None:
        return None if self.done is None else (self.done - self.submitted) * 1000

    def itl_ms(self) -> list[float]:
        """Inter-token latencies after the first delta: each delta's gap spread over its tokens."""
        gaps = []
        for (before, _), (at, count) in itertools.pairwise(self.token_times):
            gaps += [(at - before) * 1000 / count] * count
        return gaps


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 / p90 / p95 / p99 (linear interpolation) and the max; None for an empty list."""
    if not values:
        return {**{f"p{p}": None for p in PERCENTILES}, "max": None}
    points = np.percentile(np.asarray(values, dtype=float), PERCENTILES)
    return {**{f"p{p}": round(float(v), 2) for p, v in zip(PERCENTILES, points, strict=True)},
            "max": round(float(max(values)), 2)}


def summarize(timings: list[RequestTiming]) -> dict[str, Any]:
    """Latency percentiles and aggregate rates of one run."""
    finished = [t for t in timings if t.done is not None]
    tokens = sum(t.tokens for t in finished)
    start = min((t.submitted for t in timings), default=0.0)
    end = max((t.done for t in finished if t.done is not None), default=start)
    elapsed = end - start
    return {
        "requests": len(timings),
        "finished": len(finished),
        "tokens": tokens,
        "elapsed_s": round(elapsed, 3),
        "throughput_tok_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
        "requests_s": round(len(finished) / elapsed, 2) if elapsed > 0 else None,
        "ttft_ms": percentiles([t.ttft_ms for t in finished if t.ttft_ms is not None]),
        "itl_ms": percentiles([gap for t in finished for gap in t.itl_ms()]),
        "e2e_ms": percentiles([t.e2e_ms for t in finished if t.e2e_ms is not None]),
        "queue_ms": percentiles([t.queued_ms for t in finished if t.queued_ms is not None]),
        "cached_tokens": sum(t.cached_tokens for t in finished),
        "stages_ms": {stage: percentiles([t.stages_ms[stage] for t in finished if stage in t.stages_ms])["p50"]
                      for stage in STAGES},
    }


def command_stats(before: dict[str, Any], after: dict[str, Any], tokens: int) -> dict[str, Any]:
    """Redis commands run between two `INFO commandstats`, in all and per generated token."""
    calls = {name.removeprefix("cmdstat_"): after[name]["calls"] - before.get(name, {}).get("calls", 0)
             for name in after}
    calls = {name: n for name, n in sorted(calls.items(), key=lambda kv: -kv[1]) if n > 0}
    total = sum(calls.values())
    return {"commands": total, "per_token": round(total / tokens, 3) if tokens else None, "by_command": calls}
