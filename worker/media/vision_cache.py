"""The vision-embedding cache: repeated media skip the vision tower.

An LRU of the tower's output per request's media, keyed by the model and the hashes of
the media (`PreparedMedia.key`), held to a byte budget. Used on the engine thread only
(it holds MLX arrays).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import mlx.core as mx

from client.engine_stats import CacheStats

Features = mx.array | Sequence[mx.array]


def _nbytes(features: Features) -> int:
    return features.nbytes if isinstance(features, mx.array) else sum(f.nbytes for f in features)


class VisionCache:
    """Vision features by key, least recently used evicted first. Features are one array,
    or a few (a family whose encoder gives several)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, Features] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Features | None:
        """The features of media seen before (refreshed as most recent), or None; counted."""
        features = self._entries.get(key)
        if features is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return features

    def put(self, key: str, features: Features) -> None:
        """Keep `features` (evaluated), evicting the least recently used to stay in budget;
        features larger than the whole budget are not kept."""
        size = _nbytes(features)
        if size > self.budget_bytes or key in self._entries:
            return
        mx.eval(features)
        self._entries[key] = features
        self.nbytes += size
        while self.nbytes > self.budget_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= _nbytes(evicted)

    def stats(self) -> CacheStats:
        return CacheStats(entries=len(self), hits=self.hits, misses=self.misses, bytes=self.nbytes)
