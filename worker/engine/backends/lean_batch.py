"""mlx-lm's generation batch, without the log-softmax that no row asked for.

mlx-lm's `GenerationBatch._step` turns every step's logits into logprobs (a logsumexp
over the vocabulary for every row) and splits them into one array per row, so that each
response can carry its row's. The engine reads them only for requests that asked for
logprobs, and sampling does not need them: the argmax of the logits is the argmax of
the logprobs, and the engine's random sampler normalizes where its filter needs
probabilities (`sampling._RandomSampler`). On the small demo model that work is about
15 % of a 16-row decode step (docs/benchmarks.md, "Logprobs only when asked").

A step takes mlx-lm's own path whenever a row asked for logprobs or has logits
processors (penalties, a constraint's mask, min_tokens): those see exactly what they
see in mlx-lm. (On a half-precision model a greedy row's argmax is over the logits as
they are, not over logprobs rounded to that precision: where two tokens tie only after
that rounding, it may choose another token than mlx-lm's step would.)
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch


class LeanGenerationBatch(GenerationBatch):
    """A `GenerationBatch` whose steps compute logprobs only when a row wants them."""

    wants_logprobs: set[int]  # uids of the rows that asked for logprobs (kept by the backend)
    # mlx-lm's attributes, which its annotations leave Optional
    _current_tokens: Any
    _next_tokens: Any
    samplers: Any
    logits_processors: Any

    @classmethod
    def lean(cls, model: Any, fallback_sampler: Any) -> LeanGenerationBatch:
        batch = cls.empty(model, fallback_sampler)
        assert isinstance(batch, LeanGenerationBatch)
        batch.wants_logprobs = set()
        return batch

    def _step(self) -> tuple[list[int], list[Any]]:
        if any(self.logits_processors) or not self.wants_logprobs.isdisjoint(self.uids):
            return super()._step()  # type: ignore[no-any-return]
        self._current_tokens, self._current_logprobs = self._next_tokens, self._next_logprobs
        inputs = self._current_tokens
        logits = self.model(inputs[:, None], cache=self.prompt_cache)[:, -1, :]
        self._next_tokens = self._sample(logits)
        self._next_logprobs = [None] * len(self.uids)
        # Computed while this step's tokens go out; the logits too, as mlx-lm's step has its
        # logprobs computed: a worker group's follower samples nothing from them (its
        # tokens come from rank 0), and its forward pass, collectives and all, must run.
        mx.async_eval(self._next_tokens, logits)
        mx.eval(inputs, [lp for lp in self._current_logprobs if lp is not None])
        tokens: list[int] = inputs.tolist()
        for row, token in zip(self.tokens, tokens, strict=True):
            row.append(token)
        return tokens, self._current_logprobs

    def _sample(self, logits: mx.array) -> mx.array:
        """As mlx-lm samples: one call when the rows share a sampler, else one per row (a
        worker group's ranks make the same calls, whatever each one's inputs)."""
        samplers = [self.fallback_sampler if s is None else s for s in (self.samplers or [None] * len(self.uids))]
        if all(s is samplers[0] for s in samplers):
            return samplers[0](logits)
        return mx.concatenate([s(logits[row:row + 1]) for row, s in enumerate(samplers)], axis=0)
