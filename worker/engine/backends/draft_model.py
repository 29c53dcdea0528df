"""A draft model's proposals (vLLM's `draft_model` method) for the running batch.

A small model with the target's tokenizer runs beside it, with a KV cache of its own for
each eligible row, in the batch's order. Each speculative step it drafts
`num_draft_tokens` tokens greedily for all those rows together, one pass a token; after
verification each row's draft cache drops what the target rejected, as the target's
does. Rows join with their whole context prefilled into the draft, one row at a time
(they arrive in small groups and the draft is small). Plain steps, which the gate takes
where speculation does not pay, leave the draft behind; the next speculative step's
first pass feeds each row what it missed, in one right-padded pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from worker.engine.backends.speculative import drop_last

if TYPE_CHECKING:
    from worker.engine.backends.speculative import SpeculativeGenerationBatch

PREFILL_CHUNK = 2048  # tokens of one row's context per draft prefill pass


class DraftModel:
    """The `Proposer` of a draft model."""

    method = "draft_model"

    def __init__(self, model: Any, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size  # the target's: a draft with a wider head never proposes past it
        self._cache: list[Any] = []  # one BatchKVCache a layer, a row per entry of _uids
        self._uids: list[int] = []
        self._covered: list[int] = []  # tokens of each row's sequence in its draft cache
        self._fed = -1  # draft tokens fed in the drafting not yet verified, after each row's pending one
        self._before: list[int] = []  # each row's tokens in the target's cache when it was drafted

    def drafts(self, batch: SpeculativeGenerationBatch, pending: list[int], room: list[int]) -> list[list[int]]:
        row_of = {uid: row for row, uid in enumerate(batch.uids)}
        rows = [row_of[uid] for uid in self._uids]
        width = max((room[row] for row in rows), default=0)
        if width == 0:
            return [[] for _ in batch.uids]
        self._before = [len(batch.tokens[row]) for row in rows]
        missed = [[*batch.tokens[row][covered:], pending[row]]
                  for row, covered in zip(rows, self._covered, strict=True)]
        tokens = [self._catch_up(missed)]
        for _ in range(width - 1):
            tokens.append(self._greedy(self.model(tokens[-1][:, None], cache=self._cache)[:, -1, :]))
        drafted = cast(list[list[int]], mx.stack(tokens, axis=1).tolist())
        self._fed = width - 1
        drafts: list[list[int]] = [[] for _ in batch.uids]
        for row, draft in zip(rows, drafted, strict=True):
            drafts[row] = draft[:room[row]]
        return drafts

    def verified(self, batch: SpeculativeGenerationBatch, accepted: list[int]) -> None:
        if self._fed < 0:
            return
        row_of = {uid: row for row, uid in enumerate(batch.uids)}
        # Of the fed drafts a row keeps those the target accepted; its pending token stays.
        kept = [min(accepted[row_of[uid]], self._fed) for uid in self._uids]
        drop_last(self._cache, [self._fed - k for k in kept])
        self._covered = [before + 1 + k for before, k in zip(self._before, kept, strict=True)]
        self._fed = -1

    def extended(self, batch: SpeculativeGenerationBatch, first_new: int) -> None:
        for row in range(first_new, len(batch.uids)):
            if batch.uids[row] in batch.eligible:
                self._join(batch.uids[row], batch.tokens[row])

    def filtered(self, batch: SpeculativeGenerationBatch) -> None:
        staying = set(batch.uids)
        keep = [j for j, uid in enumerate(self._uids) if uid in staying]
        if len(keep) == len(self._uids):
            return
        self._uids = [self._uids[j] for j in keep]
        self._covered = [self._covered[j] for j in keep]
        if not keep:
            self._cache = []
        else:
            for cache in self._cache:
                cache.filter(keep)

    def _join(self, uid: int, context: list[int]) -> None:
        """Prefill a new row's context into a cache of its own, then add it to the batch's."""
        cache = make_prompt_cache(self.model)
        for start in range(0, len(context), PREFILL_CHUNK):
            self.model(mx.array(context[start:start + PREFILL_CHUNK])[None], cache=cache)
            mx.eval([c.state for c in cache])
        row = [BatchKVCache.merge([c]) for c in cache]
        if self._cache:
            for mine, new in zip(self._cache, row, strict=True):
                mine.extend(new)
        else:
            self._cache = row
        self._uids.append(uid)
        self._covered.append(len(context))

    def _catch_up(self, missed: list[list[int]]) -> mx.array:
        """Feed each row what its draft cache lacks (its pending token at least); the
        draft's first token for each."""
        lengths = [len(m) for m in missed]
        width = max(lengths)
        if width == 1:
            return self._greedy(self.model(mx.array(missed), cache=self._cache)[:, -1, :])
        padding = [width - n for n in lengths]
        for cache in self._cache:
            cache.prepare(right_padding=padding)
        logits = self.model(mx.array([m + [0] * (width - len(m)) for m in missed]), cache=self._cache)
        for cache in self._cache:
            cache.finalize()
        return self._greedy(logits[mx.arange(len(missed)), mx.array(lengths) - 1])

    def _greedy(self, logits: mx.array) -> mx.array:
        return mx.argmax(logits[..., :self.vocab_size], axis=-1)


def refusal(draft: Any) -> str | None:
    """Why a model cannot draft in the batch (its caches cannot drop rejected tokens); None if it can."""
    kinds = {type(c).__name__ for c in make_prompt_cache(draft)}
    if kinds != {KVCache.__name__}:
        return f"its caches are {', '.join(sorted(kinds))}, not plain KV caches that can drop rejected tokens"
    return None
