"""Per-request samplers and logits processors. Runs on the engine thread: they hold MLX state.

mlx-lm's `make_sampler` passes temperature and top_p into `mx.compile`d functions as
Python floats, and compile caches on their values: every new temperature or top_p
recompiled there, stalling the whole batch for ~0.5 s on a CPU. Here they travel as
arrays, so one compiled function serves every value; mlx-lm's own filters still do
the work where they take arrays (top_p, top_k).
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
from mlx_lm.sample_utils import (
    LogitsProcessor,
    Sampler,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from worker.messages import SamplingParams

OUTPUT_CONTEXT = 1 << 30  # "every generated token" to mlx-lm's penalties, which count the last N
GREEDY_BELOW = 1e-5  # a temperature this small is greedy (as in vLLM): 1/T would overflow float32


def build_sampler(params: SamplingParams) -> Sampler:
    """The request's own sampler. Greedy requests share mlx-lm's greedy sampler, which
    lets BatchGenerator sample them in one batched call."""
    if params.temperature < GREEDY_BELOW:
        return greedy_sampler
    return _RandomSampler(params)


def build_logits_processors(params: SamplingParams, resumed: int = 0, stop_tokens: frozenset[int] = frozenset(),
                            min_tokens: int = 0) -> list[LogitsProcessor]:
    """mlx-lm's logit bias and repetition penalty (over the last 20 tokens, prompt
    included, as mlx-lm counts it); its presence and frequency penalties over the
    generated tokens only, as vLLM counts them; and, before `min_tokens`, the stop tokens
    masked. `resumed`: the tokens an earlier delivery generated, which the batch was
    given as part of the prompt (see `OutputTokens`)."""
    processors = make_logits_processors(logit_bias=params.logit_bias, repetition_penalty=params.repetition_penalty)
    for penalty in make_logits_processors(presence_penalty=params.presence_penalty,
                                          presence_context_size=OUTPUT_CONTEXT,
                                          frequency_penalty=params.frequency_penalty,
                                          frequency_context_size=OUTPUT_CONTEXT):
        processors.append(partial(_on_generated, penalty, OutputTokens(resumed)))
    if min_tokens and stop_tokens:
        processors.append(partial(_hold_stop_tokens, mx.array(sorted(stop_tokens)), OutputTokens(resumed), min_tokens))
    return processors


class OutputTokens:
    """The generated part of what a logits processor is shown. A batch shows it the
    sequence's tokens, but not always the whole prompt: mlx-vlm's shows only the part
    after a prefix-cache hit. So the output starts where the first call's tokens end
    (that call draws the first token), less the tokens an earlier delivery generated,
    which came in as part of the prompt (a prefix hit that covers some of them hides
    those from the penalties)."""

    def __init__(self, resumed: int) -> None:
        self.resumed = resumed
        self.start: int | None = None

    def of(self, tokens: mx.array) -> mx.array:
        if self.start is None:
            self.start = max(0, len(tokens) - self.resumed)
        return tokens[self.start:]


def _on_generated(penalty: LogitsProcessor, output: OutputTokens, tokens: mx.array, logits: mx.array) -> mx.array:
    return penalty(output.of(tokens), logits)


def _hold_stop_tokens(stop_tokens: mx.array, output: OutputTokens, min_tokens: int, tokens: mx.array,
                      logits: mx.array) -> mx.array:
    if len(output.of(tokens)) < min_tokens:
        logits[:, stop_tokens] = -mx.inf
    return logits


def warm_up(vocab_size: int) -> None:
    """Compile the sampling filters once at start, not in the middle of someone's stream."""
    logprobs = mx.zeros((1, vocab_size))
    mx.eval(_RandomSampler(SamplingParams(temperature=1.0, top_p=0.9, top_k=2, min_p=0.1, seed=0))(logprobs))


class _RandomSampler:
    """Temperature sampling after top_p / min_p / top_k; with a seed, from a private random
    key, so that the draws do not depend on what else is in the batch."""

    def __init__(self, params: SamplingParams) -> None:
        self.inverse_temperature = mx.array(1.0 / params.temperature)
        self.top_p = mx.array(params.top_p) if 0 < params.top_p < 1 else None
        self.log_min_p = mx.log(mx.array(params.min_p)) if params.min_p > 0 else None
        self.top_k = params.top_k
        self.key = None if params.seed is None else mx.random.key(params.seed)

    def __call__(self, logits: mx.array) -> mx.array:
        """A token from `logits`: logprobs, or logits as the model made them (every filter
        is unmoved by a shift; top_p's input is normalized, as exp of a logit can overflow)."""
        logprobs = logits
        if self.top_p is not None:
            logprobs = apply_top_p(logits - mx.logsumexp(logits, axis=-1, keepdims=True),
                                   self.top_p)  # type: ignore[arg-type]  # an array: see above
        if self.log_min_p is not None:  # mlx-lm's apply_min_p takes a float: inlined
            floor = logprobs.max(axis=-1, keepdims=True) + self.log_min_p
            logprobs = mx.where(logprobs < floor, -mx.inf, logprobs)
        if 0 < self.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        draw = None
        if self.key is not None:
            self.key, draw = mx.random.split(self.key)
        return mx.random.categorical(logprobs * self.inverse_temperature, key=draw)
