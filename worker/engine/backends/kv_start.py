"""`quantized_kv_start`: a running batch keeps its keys and values in the model's dtype
until it holds that many positions, then they are quantized (`kv_bits`), every row at once.

mlx-vlm 0.7.10's batch quantizes from the first token (its `quantized_kv_start` reaches
only its single-sequence path, and TurboQuant's prefill), so the batch here runs dense and
`QuantizeFrom` switches its caches after a step. The switch is the batch's, not a row's: a
layer's cache is one tensor for all rows, so once the batch's longest sequence (its
left-padded length) reaches `quantized_kv_start`, every row is quantized, and a row that
joins later is quantized as it joins. As mlx-lm's single-sequence switch, it quantizes the
positions already held too; each position is quantized on its own (groups along the head),
so what a position becomes does not depend on when the switch came. The layers quantized
are mlx-vlm's batch's (`should_quantize_kv_layer`: the last stays dense in a deeper stack).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_vlm.models.cache import BatchKVCache, BatchQuantizedKVCache, KVCache, should_quantize_kv_layer


class QuantizeFrom:
    """Quantizes a running mlx-vlm batch's dense caches once it is `start` positions long."""

    def __init__(self, start: int, bits: int, group_size: int) -> None:
        self.start = start
        self.bits = bits
        self.group_size = group_size

    def after_step(self, batch: Any) -> None:
        """Switch `batch`'s (mlx-vlm's `GenerationBatch`) layers once it is long enough.
        Called between steps, before the next step's forward pass is queued, so that pass
        reads what is switched here, as mlx-lm's switch before each step does."""
        caches = batch.prompt_cache
        layers = len(caches)
        for index, layer in enumerate(caches):
            if type(layer) in (BatchKVCache, KVCache) and should_quantize_kv_layer(index, layers) \
                    and _length(layer) >= self.start:
                caches[index] = self.quantized(layer)

    def quantized(self, dense: Any) -> JoiningQuantizedKVCache:
        """`dense`'s rows (a `BatchKVCache`, or a lone row's `KVCache`) as a quantized batch cache."""
        cache: Any = JoiningQuantizedKVCache(self, [0], group_size=self.group_size, bits=self.bits)
        length = _length(dense)
        if isinstance(dense, KVCache):
            cache.offset = mx.array([dense.offset])
        else:
            cache.left_padding, cache.offset = dense.left_padding, dense.offset
        if dense.keys is not None and length:
            cache.keys = tuple(mx.quantize(dense.keys[..., :length, :], group_size=self.group_size, bits=self.bits))
            cache.values = tuple(mx.quantize(dense.values[..., :length, :], group_size=self.group_size,
                                             bits=self.bits))
            cache._idx = length
        return cache


class JoiningQuantizedKVCache(BatchQuantizedKVCache):
    """mlx-vlm's quantized batch cache that quantizes a dense row joining it: the rows
    mlx-vlm prefills join the running batch dense, before a step ends."""

    def __init__(self, switch: QuantizeFrom, left_padding: list[int], *, group_size: int, bits: int) -> None:
        super().__init__(left_padding, group_size=group_size, bits=bits)
        self._switch = switch

    def extend(self, other: Any) -> None:
        if type(other) is BatchKVCache:
            other = self._switch.quantized(other)
        super().extend(other)


def _length(cache: Any) -> int:
    """Positions held: a batch's left-padded length, a lone row's offset."""
    return int(cache.offset) if isinstance(cache, KVCache) else cache._idx
