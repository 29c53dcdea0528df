"""What one worker has served, counted across its restarts.

The counts live here, on the event loop; every heartbeat writes them to the worker's
stats hash in Redis (`mlxq:stats:<consumer>`), and a worker that starts under the same
name continues from there, so `mlxq status` shows totals that outlive a restart (up to
one heartbeat of counts is lost to a `kill -9`). The set of fields is fixed: finish
reasons and error codes are the protocol's, so the hash stays small whatever requests
carry.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

from client.heartbeat import EVENT_COUNTS, PLACEMENTS, StatsRecord, counter_names
from client.protocol import Delta, Done, Error, ErrorCode, Event

RATE_WINDOW_S = 60.0  # tok/s is over this last stretch


class Totals:
    """Counters of one worker, and its generation rate over the last minute."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.last_error: dict[str, Any] | None = None
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic, generation tokens so far)

    def restore(self, stored: StatsRecord) -> None:
        """Continue from the counts an earlier run under this name left in Redis."""
        self._samples.clear()  # a rate sampled before would count the restored tokens as made now
        self.counts.update(stored.totals)
        self.last_error = stored.last_error

    def observe(self, event: Event) -> None:
        """Count one event that was published."""
        if isinstance(event, Delta):
            self.counts["generation_tokens"] += len(event.tokens)
        elif isinstance(event, Done):
            self.counts[f"finished:{event.finish_reason}"] += 1
            self.counts["prompt_tokens"] += event.usage.prompt_tokens
            self.counts["cached_tokens"] += event.usage.cached_tokens
        elif isinstance(event, Error):
            code = event.code if event.code in ErrorCode._value2member_map_ else ErrorCode.INTERNAL.value
            self.counts[f"errors:{code}"] += 1
            self.last_error = {"code": code, "message": event.message[:300], "request_id": event.id,
                               "at": round(time.time(), 3)}

    def count(self, name: str, n: int = 1) -> None:
        """Count `n` takeovers, dead letters or engine restarts."""
        assert name in EVENT_COUNTS or name.removeprefix("placed:") in PLACEMENTS, name
        self.counts[name] += n

    def tok_s(self, now: float | None = None) -> float:
        """Tokens generated per second over the last minute (samples taken at heartbeats)."""
        now = time.monotonic() if now is None else now
        self._samples.append((now, self.counts["generation_tokens"]))
        while len(self._samples) >= 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        first_at, first_tokens = self._samples[0]
        elapsed = now - first_at
        return 0.0 if elapsed <= 0 else round((self.counts["generation_tokens"] - first_tokens) / elapsed, 1)

    def as_fields(self) -> dict[str, int]:
        """Every counter, zeros included, as the stats hash holds them."""
        return {name: self.counts[name] for name in counter_names()}
