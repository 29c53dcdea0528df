"""The prefix cache's shared blocks: the KV of each whole block of `BLOCK_TOKENS` tokens,
stored once however many entries start with it.

Sixteen requests that share a 1,300-token system prompt leave sixteen entries; stored
whole, the prompt's KV is kept sixteen times. Here an entry of a plain `KVCache` model is
its chain of blocks (keyed by the hash of every token up to the block's end, within its
cache salt: vLLM's hashed blocks, SGLang's radix tree in another shape) and a tail of
fewer than `BLOCK_TOKENS` tokens of its own; a block lives while an entry uses it.
Caches of other kinds (rotating, quantized, recurrent) are kept whole by the prefix cache.

A block's arrays are copies (never views of a batch's buffers), and a hit is assembled
into new arrays, so nothing stored aliases live batch state. Used on the engine thread.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

BLOCK_TOKENS = 64

Layers = list[tuple[mx.array, mx.array]]  # each layer's keys and values, (1, heads, tokens, dim)


@dataclass
class _Block:
    layers: Layers
    nbytes: int
    users: int = 1


def splittable(cache: list[Any]) -> bool:
    """Whether a cache can be kept as blocks: plain KV caches of one sequence."""
    return bool(cache) and all(type(layer) is KVCache and layer.keys is not None and layer.keys.shape[0] == 1
                               for layer in cache)


def block_keys(tokens: list[int], salt: str) -> list[bytes]:
    """The key of each whole block of `tokens`: a hash of every token up to its end."""
    keys, digest = [], hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        block = struct.pack(f"<{BLOCK_TOKENS}I", *tokens[start:start + BLOCK_TOKENS])
        digest = hashlib.blake2b(digest + block, digest_size=16).digest()
        keys.append(digest)
    return keys


def token_bytes(cache: list[Any]) -> int:
    """What one token's keys and values take over every layer."""
    return sum(2 * layer.keys.shape[1] * layer.keys.shape[3] * layer.keys.dtype.size for layer in cache)


def cut(cache: list[Any], start: int, end: int) -> Layers:
    """A copy of tokens start..end of every layer."""
    layers = [(mx.array(layer.keys[..., start:end, :]), mx.array(layer.values[..., start:end, :]))
              for layer in cache]
    mx.eval(layers)
    return layers


def layers_bytes(layers: Layers) -> int:
    return sum(k.nbytes + v.nbytes for k, v in layers)


class BlockPool:
    """The blocks every entry shares, counted by their users."""

    def __init__(self) -> None:
        self._blocks: dict[bytes, _Block] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def hold(self, keys: list[bytes]) -> list[int]:
        """Take a use of each block already stored; the places of those that are not."""
        missing = []
        for i, key in enumerate(keys):
            block = self._blocks.get(key)
            if block is None:
                missing.append(i)
            else:
                block.users += 1
        return missing

    def add(self, key: bytes, layers: Layers) -> None:
        nbytes = layers_bytes(layers)
        self._blocks[key] = _Block(layers, nbytes)
        self.nbytes += nbytes

    def release(self, keys: list[bytes]) -> None:
        """Give back a use of each block (taken with `hold` or `add`); unused ones go."""
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                continue
            block.users -= 1
            if block.users <= 0:
                del self._blocks[key]
                self.nbytes -= block.nbytes

    def assemble(self, keys: list[bytes], tail: Layers | None) -> list[KVCache]:
        """New caches holding the blocks' tokens in order, then `tail`'s."""
        parts = [self._blocks[key].layers for key in keys] + ([tail] if tail is not None else [])
        caches = []
        for layer in range(len(parts[0])):
            cache = KVCache()
            cache.keys = mx.concatenate([part[layer][0] for part in parts], axis=2)
            cache.values = mx.concatenate([part[layer][1] for part in parts], axis=2)
            cache.offset = cache.keys.shape[2]
            caches.append(cache)
        mx.eval([(c.keys, c.values) for c in caches])
        return caches
