"""Prompt lookup (vLLM's `ngram` method): a row's draft is what followed the last earlier
occurrence of its last n tokens (n from `prompt_lookup_max` down to 1) in its own prompt
and output. No second model, and the win for extraction and rewriting jobs, which copy
their input."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from worker.engine.backends.speculative import SpeculativeGenerationBatch


def propose(context: list[int] | np.ndarray, max_ngram: int, max_tokens: int) -> list[int]:
    """The tokens that followed the latest earlier match of the context's last n tokens,
    the longest n (at most `max_ngram`) that matches; [] when none does."""
    tokens = np.asarray(context)
    if max_tokens <= 0 or len(tokens) < 2:
        return []
    last = len(tokens) - 1
    # Where the last token occurred before: every match of any n ends at one of them.
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    for k in range(1, min(max_ngram, last)):  # the match grows one token back at a time
        ends = ends[ends >= k]
        longer = ends[tokens[ends - k] == tokens[last - k]]
        if longer.size == 0:
            break
        ends = longer
    if ends.size == 0:
        return []
    follow = int(ends[-1]) + 1
    return tokens[follow:follow + max_tokens].tolist()


class History:
    """A sequence's tokens as an array, grown as they come: converting a long prompt's
    token list on every step would cost more than the search."""

    def __init__(self) -> None:
        self._array = np.empty(256, dtype=np.int64)
        self._length = 0

    def view(self, tokens: list[int], pending: int) -> np.ndarray:
        """The array of `tokens` and then `pending`."""
        if len(tokens) < self._length:  # not the list it grew from: start over
            self._length = 0
        new = tokens[self._length:]
        needed = self._length + len(new) + 1
        if needed > len(self._array):
            grown = np.empty(max(needed, 2 * len(self._array)), dtype=np.int64)
            grown[:self._length] = self._array[:self._length]
            self._array = grown
        self._array[self._length:self._length + len(new)] = new
        self._length += len(new)
        self._array[self._length] = pending
        return self._array[:self._length + 1]


class PromptLookup:
    """The `Proposer` of prompt lookup: each eligible row's draft from its own tokens."""

    method = "ngram"

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self._histories: dict[int, History] = {}

    def drafts(self, batch: SpeculativeGenerationBatch, pending: list[int], room: list[int]) -> list[list[int]]:
        if len(self._histories) > 2 * len(batch.uids):  # of sequences gone
            self._histories = {uid: h for uid, h in self._histories.items() if uid in batch.eligible}
        drafts: list[list[int]] = []
        for row, (uid, token) in enumerate(zip(batch.uids, pending, strict=True)):
            if uid not in batch.eligible or room[row] <= 0:
                drafts.append([])
                continue
            history = self._histories.setdefault(uid, History())
            drafts.append(propose(history.view(batch.tokens[row], token), self.max_ngram, room[row]))
        return drafts

    def verified(self, batch: SpeculativeGenerationBatch, accepted: list[int]) -> None:
        """Nothing to undo: the history grows from the batch's tokens."""

    def extended(self, batch: SpeculativeGenerationBatch, first_new: int) -> None:
        """New rows start their history at their first draft."""

    def filtered(self, batch: SpeculativeGenerationBatch) -> None:
        """Histories of gone rows are dropped as they pile up."""
