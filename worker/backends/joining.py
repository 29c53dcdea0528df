"""Prefilled prompts join mlx-lm's running batch before their first step.

mlx-lm 0.32's BatchGenerator makes each prefilled group of prompts a `GenerationBatch` of
its own, steps it once (the prompts' last tokens, drawing their first new tokens) and
only then merges it into the running batch: a forward pass of the group alone. A queue
brings requests one at a time (a slot frees, the next request arrives a step or two
later), so nearly every request pays that pass apart from the batch, about a whole
decode step on a small model. Here the group joins the running batch unstepped and its
last prompt tokens go through the batch's next step with every other row. That step's
output for a joined row is its prompt's last token, not a new one: `MlxBatchBackend`
drops it (`first_outputs_dropped`) and the row's token count starts one lower, so
`max_tokens` still counts new tokens only. Nothing else changes for the row: its cache,
tokens, samplers and logits processors see what mlx-lm's own first step shows them (its
stop-sequence matcher sees the prompt token too; the worker's rows carry none: the
engine stops them itself). The newcomer's first token then costs a step of the whole
batch rather than a pass of its own, which the running streams no longer wait for.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch, PromptProcessingBatch


class JoiningPromptBatch(PromptProcessingBatch):
    """mlx-lm's prompt batch, whose prefilled rows leave it unstepped."""

    def generate(self, tokens: list[list[int]]) -> GenerationBatch:
        if any(len(t) > 1 for t in tokens):
            self.prompt([t[:-1] for t in tokens])
        batch = _Unstepped(self.model, self.uids, mx.array([t[-1] for t in tokens], dtype=mx.uint32),
                           self.prompt_cache, self.tokens, self.samplers, self.fallback_sampler,
                           self.logits_processors, self.stop_sequences, self.max_tokens)
        self.uids, self.prompt_cache, self.tokens = [], [], []
        self.samplers, self.logits_processors, self.max_tokens = [], [], []
        return batch


class _Unstepped(GenerationBatch):
    """A group of prefilled rows whose next inputs are their prompts' last tokens. Its
    constructor's one call of `_step` runs nothing: the batch it joins computes the step."""

    def _step(self) -> Any:
        self._next_logprobs = [mx.zeros((1,))] * len(self.uids)  # that step's logprobs are of no token
        self._num_tokens = [-1] * len(self.uids)  # that step's output is not a new token
        return [], []
