"""The vision-embedding cache: a repeated image skips the vision tower.

An LRU of the tower's output per image, keyed by the model and a hash of the image
bytes, held to a byte budget. Used on the engine thread only (it holds MLX arrays).
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx

from .messages import CacheStats


class VisionCache:
    """Image features by key, least recently used evicted first."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, mx.array] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> mx.array | None:
        """The features of an image seen before (refreshed as most recent), or None; counted."""
        features = self._entries.get(key)
        if features is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return features

    def put(self, key: str, features: mx.array) -> None:
        """Keep `features` (evaluated), evicting the least recently used to stay in budget;
        features larger than the whole budget are not kept."""
        if features.nbytes > self.budget_bytes or key in self._entries:
            return
        mx.eval(features)
        self._entries[key] = features
        self.nbytes += features.nbytes
        while self.nbytes > self.budget_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes

    def stats(self) -> CacheStats:
        return CacheStats(entries=len(self), hits=self.hits, misses=self.misses, bytes=self.nbytes)
