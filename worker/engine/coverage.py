"""What a batch hands back of a finished sequence, and the prefix cache hands out: its
KV cache and the tokens it covers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Coverage:
    """A sequence's KV cache and exactly the tokens it covers (prompt and generated).

    A worker group's other ranks hold their own shard of each cache, so rank 0 tells them
    which: `row` is the batch row a finished sequence's cache was taken from, `entry` the
    prefix cache entry a reused one was copied from (`worker.process.group`)."""

    cache: list[Any]
    tokens: list[int]
    row: int | None = None
    entry: int | None = None
