"""Quantized prefix-cache entries: with `kv_bits` from the first token, mlx-vlm's prefix
cache keeps each block as the running batch's own codes, not as dense keys and values.

mlx-vlm 0.7.10's block cache stores what `dequantize_for_apc` gives (the model's dtype)
and quantizes it again on a hit. So a block took as much memory as an unquantized one,
and a hit changed the output: `mx.quantize` of dequantized values does not give back the
codes (values move by up to a step), so a repeated prompt decoded differently from its
cold run. Here a quantized layer's row is stored as one uint32 array per block (its codes,
then its scales and biases bit for bit), which the block pool, its LRU and its SSD tier
slice, copy and write as they do any array without looking inside, and a hit rebuilds the
quantized batch cache from those codes as they were. A dense layer (mlx-vlm leaves the
last one of a deeper stack unquantized) is stored and rebuilt by mlx-vlm as before.

`PackedPrefixCoordinator` is mlx-vlm's `APCCoordinator` (the one object its batch asks to
store a prefilled row and to build a hit's cache) with those two steps changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import structlog
from mlx_vlm.apc import _fill_batch_layer_cache, layer_kv_for_apc
from mlx_vlm.apc_coordinator import APCCoordinator
from mlx_vlm.models.cache import BatchQuantizedKVCache, QuantizedKVCache, should_quantize_kv_layer

log = structlog.get_logger()

PACKED = mx.uint32  # no model keeps dense keys in it


def pack(parts: Sequence[mx.array]) -> mx.array:
    """A quantized tensor's (codes, scales, biases), each [..., tokens, width], as one
    uint32 array [..., tokens, all three widths]: slicing its tokens slices all three."""
    codes, scales, biases = parts
    rest = mx.contiguous(mx.concatenate([scales, biases], axis=-1)).view(PACKED)
    return mx.concatenate([codes, rest], axis=-1)


def unpack(packed: mx.array, bits: int, group_size: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
    """`pack`'s inverse, for `bits` codes in groups of `group_size` with scales of `dtype`."""
    # A head of d values packs into d * bits / 32 words of codes and d / group_size scales and
    # as many biases of `dtype`: the width tells d.
    words_per_value = bits / 32 + 2 * dtype.size / (4 * group_size)
    width = round(packed.shape[-1] / words_per_value) * bits // 32
    rest = mx.contiguous(packed[..., width:]).view(dtype)
    groups = rest.shape[-1] // 2
    return packed[..., :width], rest[..., :groups], rest[..., groups:]


def packed_bytes_per_token(head_dim: int, bits: int, group_size: int, itemsize: int) -> int:
    """Bytes of one head's keys (or values) for one token, packed."""
    return head_dim * bits // 8 + 2 * (head_dim // group_size) * itemsize


class PackedPrefixCoordinator(APCCoordinator):
    """mlx-vlm's prefix-cache coordinator, keeping quantized layers' codes in its blocks."""

    def __init__(self, manager: Any, model: Any, *, bits: int, group_size: int, dtype: mx.Dtype) -> None:
        super().__init__(manager, model)
        self.bits, self.group_size, self.dtype = bits, group_size, dtype

    def commit(self, prompt_cache: Sequence[Any], token_ids: Sequence[int], *, batch_idx: int | None = None,
               extra_hash: int = 0, skip_first_n_tokens: int = 0, blocks_in_use: Sequence[Any] = ()) -> bool:
        """Store a prefilled row's new full blocks (mlx-vlm's `commit_prefix_blocks`, with
        quantized layers packed) and release the blocks its hit held."""
        if not self.enabled or self.is_checkpoint:
            return super().commit(prompt_cache, token_ids, batch_idx=batch_idx, extra_hash=extra_hash,
                                  skip_first_n_tokens=skip_first_n_tokens, blocks_in_use=blocks_in_use)
        rows = [_row(layer, batch_idx, self.dtype) for layer in prompt_cache]
        # A layer's blocks are all packed or all dense (a hit joins them): a row whose layer
        # came out in the other form (a family running some row on other caches) is not stored.
        forms = [None if row is None else row[0].dtype == PACKED for row in rows]
        expected = [should_quantize_kv_layer(index, len(rows)) for index in range(len(rows))]
        stored = []
        if forms == expected:
            keys, values = zip(*rows, strict=True)
            stored = self.manager.store_kv_blocks(token_ids, list(keys), list(values), extra_hash=extra_hash,
                                                  skip_first_n_tokens=skip_first_n_tokens)
        self.manager.release([*blocks_in_use, *stored])
        return True

    def merge_rows(self, picks: Sequence[dict | None], prefix_lens: Sequence[int], *,
                   kv_quant_config: dict | None = None) -> tuple[list[Any] | None, int]:
        """The batch cache of rows whose prefixes were found (`picks`: blocks, or a warm
        cache read from the SSD tier) and cold rows (None), left-padded to the longest."""
        if not self.enabled or self.is_checkpoint:
            return super().merge_rows(picks, prefix_lens, kv_quant_config=kv_quant_config)
        memory = self.manager.memory_plan
        if len(prefix_lens) == len(memory.lengths):  # as mlx-vlm's: the reserve for this prefill
            self.prepare_prefill(memory.lengths, prefill_step_size=memory.chunk_size, prefix_lengths=prefix_lens)
        lengths = [pick["prefix_len"] if pick else 0 for pick in picks]
        if max(lengths, default=0) == 0:
            return [], 0
        layers = len(self.plan.components)
        caches = [self._layer(picks, lengths, index, layers, kv_quant_config) for index in range(layers)]
        with self.manager.lock:
            self.manager.stats.restored_tokens += sum(prefix_lens)
        return caches, max(lengths)

    def _layer(self, picks: Sequence[dict | None], lengths: list[int], index: int, layers: int,
               kv_quant_config: dict | None) -> Any:
        longest = max(lengths)
        found = [None if pick is None else _prefix(pick, index) for pick in picks]
        sample = next(kv for kv in found if kv is not None)
        keys, values = (mx.concatenate([_left_padded(None if kv is None else kv[part], sample[part], longest)
                                        for kv in found], axis=0) for part in (0, 1))
        padding = [longest - length for length in lengths]
        if keys.dtype != PACKED:  # a dense layer: as mlx-vlm builds it (quantized if its policy says)
            quantize = kv_quant_config is not None and should_quantize_kv_layer(index, layers)
            return _fill_batch_layer_cache(keys, values, left_padding=padding, offset=lengths, quantize=quantize,
                                           kv_quant_config=kv_quant_config)
        cache: Any = BatchQuantizedKVCache(padding, group_size=self.group_size, bits=self.bits)
        cache.keys = unpack(keys, self.bits, self.group_size, self.dtype)
        cache.values = unpack(values, self.bits, self.group_size, self.dtype)
        cache._idx = longest
        cache.offset = mx.array(lengths)
        return cache


def _row(layer: Any, batch_idx: int | None, dtype: mx.Dtype) -> tuple[mx.array, mx.array] | None:
    """One row's keys and values in a layer, as the block pool keeps them: a quantized
    layer's packed (as mlx-vlm's harvest reads them: from its left padding to its end),
    a dense layer's as mlx-vlm's own harvest takes them; None if it has none, or if its
    scales are not of `dtype`, which a hit would unpack them as (nothing is stored then)."""
    if isinstance(layer, (BatchQuantizedKVCache, QuantizedKVCache)) and layer.keys is not None:
        if layer.keys[1].dtype != dtype:
            log.warning("prefix cache entry not stored", scales=str(layer.keys[1].dtype), expected=str(dtype))
            return None
        if isinstance(layer, BatchQuantizedKVCache):
            row = batch_idx or 0
            start, end = int(layer.left_padding[row].item()), layer._idx
        else:
            row, start, end = 0, 0, int(layer.offset)
        keys, values = (pack([part[row:row + 1, :, start:end, :] for part in parts])
                        for parts in (layer.keys, layer.values))
        return keys, values
    keys, values = layer_kv_for_apc(layer, batch_idx=batch_idx)
    if keys is None or values is None:
        return None
    if batch_idx is not None and keys.shape[0] != 1:
        keys, values = keys[batch_idx:batch_idx + 1], values[batch_idx:batch_idx + 1]
    return keys, values


def _prefix(pick: dict, index: int) -> tuple[mx.array, mx.array]:
    """Layer `index` of a hit's prefix: its blocks joined, or the warm cache read for it."""
    warm = pick.get("warm_cache")
    if warm is not None:
        length = pick["prefix_len"]
        return warm[index].keys[..., :length, :], warm[index].values[..., :length, :]
    blocks = pick["matched_blocks"]
    return (mx.concatenate([block.keys[index] for block in blocks], axis=2),
            mx.concatenate([block.values[index] for block in blocks], axis=2))


def _left_padded(prefix: mx.array | None, sample: mx.array, longest: int) -> mx.array:
    """A row's prefix behind zeros up to `longest` positions (all zeros for a cold row):
    the batch's mask hides them."""
    held = 0 if prefix is None else prefix.shape[2]
    zeros = mx.zeros((1, sample.shape[1], longest - held, sample.shape[3]), dtype=sample.dtype)
    return zeros if prefix is None else mx.concatenate([zeros, prefix], axis=2)
