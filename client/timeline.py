"""The fleet's timeline (`mlxq:timeline`): what each worker served, a sample every
`timeline_s`, kept for the last hour; the dashboard draws its charts from it.

One stream for the fleet, trimmed by entry id (`MINID`) as it is written, so it holds an
hour whatever the number of workers. A sample counts what happened since the one before
(tokens, requests finished, errors, and the time to first token of each request as counts
per bucket, as a Prometheus histogram does, so that workers' samples add up), how many
entries its queue's streams held then and how many were ever added to them. Samples are
read back into one point a minute.
"""

from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from .replies import as_text

TIMELINE_KEEP_S = 3600
# Upper bounds of the time-to-first-token buckets (ms); one more bucket holds what is above.
TTFT_BOUNDS_MS = (25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)


def ttft_bucket(ms: float) -> int:
    """The bucket a time to first token falls in."""
    return bisect.bisect_left(TTFT_BOUNDS_MS, ms)


@dataclass
class Sample:
    """What one worker served over one stretch, and its queue's depth at its end."""

    consumer: str
    queue: str
    at: float = 0.0  # unix seconds: the entry id's, read back
    tokens: int = 0
    finished: int = 0
    errors: int = 0
    depth: int = 0  # entries in its queue's streams: waiting and in flight
    added: int = 0  # entries ever added to its queue's streams (a running total: arrivals are its growth)
    ttft: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BOUNDS_MS) + 1))

    def to_wire(self) -> dict[str, str | int]:
        return {"consumer": self.consumer, "queue": self.queue, "tokens": self.tokens, "finished": self.finished,
                "errors": self.errors, "depth": self.depth, "added": self.added, "ttft": json.dumps(self.ttft)}

    @classmethod
    def from_wire(cls, entry_id: Any, fields: dict[Any, Any]) -> Sample | None:
        """The sample in a stream entry; None for one that does not read as one."""
        text = {as_text(k): as_text(v) for k, v in fields.items()}
        try:
            ttft = json.loads(text.get("ttft", "[]"))
            numbers = {name: int(text.get(name, "0")) for name in ("tokens", "finished", "errors", "depth", "added")}
            at = int(as_text(entry_id).split("-")[0]) / 1000
        except ValueError:
            return None
        if not isinstance(ttft, list) or len(ttft) != len(TTFT_BOUNDS_MS) + 1 or \
                not all(isinstance(n, int) and n >= 0 for n in ttft) or min(numbers.values()) < 0:
            return None
        return cls(text.get("consumer", "?"), text.get("queue", "?"), at, ttft=ttft, **numbers)


@dataclass(frozen=True)
class Point:
    """The fleet over one minute."""

    at: float  # unix seconds: the minute's start
    tok_s: float
    finished: int
    errors: int
    depth: int  # the deepest each queue was seen in the minute, summed over queues
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None


def points(samples: list[Sample], now: float, step_s: int = 60, span_s: int = TIMELINE_KEEP_S) -> list[Point]:
    """One point a `step_s` over the last `span_s`, oldest first; a minute with no sample is zero."""
    first = int(now // step_s) * step_s - span_s + step_s
    minutes: dict[int, list[Sample]] = {first + i * step_s: [] for i in range(span_s // step_s)}
    for sample in samples:
        start = int(sample.at // step_s) * step_s
        if start in minutes:
            minutes[start].append(sample)
    return [_point(start, found, step_s) for start, found in minutes.items()]


def _point(start: int, samples: list[Sample], step_s: int) -> Point:
    ttft = [sum(column) for column in zip(*(s.ttft for s in samples), strict=True)] if samples else []
    depth: dict[str, int] = {}
    for sample in samples:
        depth[sample.queue] = max(depth.get(sample.queue, 0), sample.depth)
    return Point(start, round(sum(s.tokens for s in samples) / step_s, 1), sum(s.finished for s in samples),
                 sum(s.errors for s in samples), sum(depth.values()), percentile(ttft, 0.5), percentile(ttft, 0.99))


def percentile(counts: list[int], q: float) -> float | None:
    """The `q` quantile of bucket counts, as the upper bound of its bucket (None: no counts;
    past the last bound: twice the last bound, as "above it")."""
    total = sum(counts)
    if not total:
        return None
    cumulative = list(itertools.accumulate(counts))
    index = next(i for i, seen in enumerate(cumulative) if seen >= q * total)
    return float(TTFT_BOUNDS_MS[index]) if index < len(TTFT_BOUNDS_MS) else 2.0 * TTFT_BOUNDS_MS[-1]


def rates(samples: list[Sample], consumer: str, now: float, step_s: int = 60,
          span_s: int = TIMELINE_KEEP_S) -> list[float]:
    """One worker's tokens per second, a value a `step_s` over the last `span_s`: its sparkline."""
    return [p.tok_s for p in points([s for s in samples if s.consumer == consumer], now, step_s, span_s)]
