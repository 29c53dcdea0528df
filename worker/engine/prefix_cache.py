"""KV caches of finished requests, kept to skip the prefill of prompts that start the same.

mlx-lm's `PromptTrie` finds the stored token sequences nearest to a prompt; the policy
is ours, because mlx-lm's `LRUPromptCache` does not keep it: a fetch refreshes the
entry's place in the LRU order, an exact hit reuses all but the last token (at least
one token must be prefilled to get logits), an entry larger than the whole budget is
refused without evicting the others, and hits are counted only once a cache was used.

Entries are detached copies: stored arrays are copied out of the batch, and each fetch
hands out a deep copy, so nothing stored ever aliases live batch state. Used on the
engine thread only.

A request's `cache_salt` (vLLM's) is a namespace: it hits only what requests of the same
salt stored, so a tenant cannot learn from the time to its first token what another
tenant's prompts held.

Each entry keeps the fleet's name of its request's prompt prefix (`common.prefix_chain`):
the cache's digest, every hash of the chains it holds, is what the worker tells the
fleet it can serve cheaply (`worker.queue.affinity`).

In a worker group, rank 0's cache decides for every rank: each entry has an id, and a
`Mirror` hears which finished batch row each new entry was kept from and which entries
left, so the other ranks keep and drop their own shards of the same entries.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import mlx.core as mx
from mlx_lm.models.cache import PromptTrie, can_trim_prompt_cache, trim_prompt_cache

from client.engine_stats import CacheStats
from worker.engine.coverage import Coverage
from worker.engine.kv_blocks import (
    BLOCK_TOKENS,
    BlockPool,
    Layers,
    block_keys,
    cut,
    layers_bytes,
    splittable,
    token_bytes,
)

MODEL = "model"  # the trie's namespace (with the salt): one model per worker


class _Key(NamedTuple):
    salt: str
    tokens: tuple[int, ...]


class Mirror(Protocol):
    """Copies of the entries kept elsewhere (a worker group's other ranks)."""

    def keep(self, row: int, entry: int) -> None:
        """Keep the cache of the batch row `row`, which just finished, as entry `entry`."""
        ...

    def forget(self, entry: int) -> None: ...


@dataclass
class _Entry:
    cache: list[Any]  # the whole cache; [] where it is kept as blocks
    nbytes: int  # what it holds alone (its tail, where kept as blocks)
    id: int
    chain: tuple[int, ...] = ()
    blocks: list[bytes] = field(default_factory=list)  # its shared blocks, in order (`kv_blocks`)
    tail: Layers | None = None  # the tokens after its last whole block


class PrefixCache:
    """Stored KV caches keyed by the tokens they cover, under a byte and an entry budget."""

    def __init__(self, max_bytes: int, max_entries: int, min_common_prefix: int = 8,
                 mirror: Mirror | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.min_common_prefix = min_common_prefix  # below this, a partial match is not worth a copy
        self._trie = PromptTrie()
        self._entries: OrderedDict[_Key, _Entry] = OrderedDict()  # LRU order: oldest first
        self._mirror = mirror
        self._last_id = 0
        self.changes = 0  # entries kept or dropped so far: the digest is made anew only after one
        self._blocks = BlockPool()
        self._own_bytes = 0  # the entries' own bytes (whole caches, tails); the blocks' are the pool's
        self.hits = 0
        self.misses = 0
        self.refused = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._own_bytes + self._blocks.nbytes

    def stats(self) -> CacheStats:
        return CacheStats(entries=len(self), hits=self.hits, misses=self.misses, bytes=self.nbytes,
                          capacity=self.max_entries, refused=self.refused)

    @property
    def takes_running(self) -> bool:
        """Whether it keeps caches of sequences still running (not in a worker group: its
        other ranks keep their shards of an entry only from a row that just finished)."""
        return self._mirror is None and self.max_bytes > 0 and self.max_entries > 0

    def fetch(self, tokens: list[int], salt: str = "") -> Coverage | None:
        """A copy of the longest reusable cached prefix of `tokens` (at most all but the
        last token) that requests of the same `salt` stored."""
        found = self._trie.search((MODEL, salt), tokens)
        candidates = []  # (stored key, tokens reused)
        if found.exact is not None:
            candidates.append((found.exact, len(tokens) - 1))
        if found.shorter is not None:
            candidates.append((found.shorter, len(found.shorter)))
        whole_prompt = found.common_prefix == len(tokens)  # the prompt is a prefix of a stored sequence
        if found.longer is not None and (whole_prompt or found.common_prefix >= self.min_common_prefix):
            candidates.append((found.longer, min(found.common_prefix, len(tokens) - 1)))
        for key, reused in sorted(candidates, key=lambda c: -c[1]):
            hit = self._copy(_Key(salt, tuple(key)), reused)
            if hit is not None:
                return hit
        return None

    def count(self, hit: Coverage | None) -> None:
        """Record a lookup's outcome, once its cache was actually used (or not)."""
        if hit is None:
            self.misses += 1
        else:
            self.hits += 1

    def digest(self, limit: int) -> tuple[int, ...]:
        """The hashes of the prefix chains held, the most recently used entries' first, at
        most `limit` of them."""
        held: dict[int, None] = {}
        for entry in reversed(self._entries.values()):
            held.update(dict.fromkeys(entry.chain))
            if len(held) >= limit:
                break
        return tuple(held)[:limit]

    def store(self, finished: Coverage, salt: str = "", chain: tuple[int, ...] = ()) -> int | None:
        """Keep a copy of a finished sequence's cache for requests of `salt`, named for the
        fleet by its request's prefix `chain`: as shared blocks and a tail where it can be
        (`kv_blocks`), else whole; the new entry's id (from 1), None if refused."""
        tokens = finished.tokens
        if not tokens or self.max_bytes <= 0 or self.max_entries <= 0 or \
                (self._mirror is not None and finished.row is None):
            return None
        key = _Key(salt, tuple(tokens))
        self._drop(key)
        entry = self._blocked(finished, salt) if splittable(finished.cache) else self._whole(finished)
        if entry is None:
            self.refused += 1
            return None
        self._trie.add((MODEL, salt), tokens, key.tokens)
        self._entries[key] = entry
        entry.chain = chain
        self.changes += 1
        if self._mirror is not None:
            assert finished.row is not None
            self._mirror.keep(finished.row, entry.id)
        if not entry.blocks and not can_trim_prompt_cache(entry.cache):
            return entry.id
        for prefix_len, _ in self._trie.pop_prefixes((MODEL, salt), tokens):  # now redundant
            self._forget(_Key(salt, key.tokens[:prefix_len]))
        return entry.id

    def _whole(self, finished: Coverage) -> _Entry | None:
        detached = detached_cache(finished.cache)
        nbytes = sum(c.nbytes for c in detached)
        if nbytes > self.max_bytes or not self._make_room(nbytes):
            return None
        self._own_bytes += nbytes
        self._last_id += 1
        return _Entry(detached, nbytes, self._last_id)

    def _blocked(self, finished: Coverage, salt: str) -> _Entry | None:
        """The entry as blocks (those already stored are shared) and a tail."""
        covered = len(finished.tokens)
        if covered * token_bytes(finished.cache) > self.max_bytes:
            return None  # larger than the whole budget: the others stay
        keys = block_keys(finished.tokens, salt)
        missing = self._blocks.hold(keys)  # held first: making room must not free them
        tail_start = len(keys) * BLOCK_TOKENS
        needed = (len(missing) * BLOCK_TOKENS + covered - tail_start) * token_bytes(finished.cache)
        if needed > self.max_bytes or not self._make_room(needed):
            self._blocks.release([keys[i] for i in range(len(keys)) if i not in missing])
            return None
        for i in missing:
            self._blocks.add(keys[i], cut(finished.cache, i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS))
        tail = cut(finished.cache, tail_start, covered) if covered > tail_start else None
        nbytes = 0 if tail is None else layers_bytes(tail)
        self._own_bytes += nbytes
        self._last_id += 1
        return _Entry([], nbytes, self._last_id, blocks=keys, tail=tail)

    def _make_room(self, nbytes: int) -> bool:
        """Evict the least recently used entries until one more entry of `nbytes` fits."""
        while self._entries and (len(self._entries) >= self.max_entries or self.nbytes + nbytes > self.max_bytes):
            self._drop(next(iter(self._entries)))
        return self.nbytes + nbytes <= self.max_bytes

    def _copy(self, key: _Key, reused: int) -> Coverage | None:
        entry = self._entries.get(key)
        if entry is None or reused < 1:
            return None
        if entry.blocks or entry.tail is not None:
            cache: list[Any] | None = self._assembled(entry, reused)
        else:
            cache = prefix_copy(entry.cache, len(key.tokens), reused)
        if cache is None:
            return None
        self._entries.move_to_end(key)
        return Coverage(cache, list(key.tokens[:reused]), entry=entry.id)

    def _assembled(self, entry: _Entry, reused: int) -> list[Any]:
        """New caches of an entry kept as blocks, holding its first `reused` tokens."""
        needed = -(-reused // BLOCK_TOKENS)  # the blocks that hold them
        blocks = entry.blocks[:needed]
        tail = entry.tail if needed > len(entry.blocks) else None
        cache = self._blocks.assemble(blocks, tail)
        covered = cache[0].offset
        if covered > reused:
            trim_prompt_cache(cache, covered - reused)
        return cache

    def _drop(self, key: _Key) -> None:
        if key in self._entries:
            self._trie.pop((MODEL, key.salt), list(key.tokens))
            self._forget(key)

    def _forget(self, key: _Key) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._own_bytes -= entry.nbytes
            self._blocks.release(entry.blocks)
            self.changes += 1
            if self._mirror is not None:
                self._mirror.forget(entry.id)


def prefix_copy(cache: list[Any], covered: int, reused: int) -> list[Any] | None:
    """A copy of `cache` (which covers `covered` tokens) cut to its first `reused`; None
    if it cannot be cut (e.g. a rotating cache: a full prefill instead)."""
    copied = copy.deepcopy(cache)
    if reused < covered:
        if not can_trim_prompt_cache(copied):
            return None
        trim_prompt_cache(copied, covered - reused)
    return copied


def detached_cache(cache: list[Any]) -> list[Any]:
    """A copy whose arrays hold just the covered tokens and share no buffer with the batch."""
    detached = []
    for layer in cache:
        copied = copy.copy(layer)
        if getattr(layer, "keys", None) is not None and hasattr(layer, "offset") and layer.is_trimmable():
            copied.keys = mx.array(layer.keys[..., : layer.offset, :])
            copied.values = mx.array(layer.values[..., : layer.offset, :])
        else:
            copied = copy.deepcopy(layer)
        detached.append(copied)
    mx.eval([c.state for c in detached])
    return detached
