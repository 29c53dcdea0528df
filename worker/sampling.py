"""Per-request samplers and logits processors, built with mlx-lm's own helpers.

Runs on the engine thread: samplers hold MLX state.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.sample_utils import (
    LogitsProcessor,
    Sampler,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

from .messages import SamplingParams


def build_sampler(params: SamplingParams) -> Sampler:
    """The request's own sampler. Greedy requests share mlx-lm's greedy sampler, which
    lets BatchGenerator sample them in one batched call."""
    if params.seed is None or params.temperature == 0:
        return make_sampler(temp=params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k)
    return _seeded_sampler(params, params.seed)


def build_logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """Repetition penalty, when asked for."""
    return make_logits_processors(repetition_penalty=params.repetition_penalty)


def _seeded_sampler(params: SamplingParams, seed: int) -> Sampler:
    """mlx-lm's sampling chain drawn from a private random key, so a seeded request
    samples the same tokens whatever else is in the batch (mlx-lm's own sampler draws
    from the global random state, which every request shares)."""
    filters = []
    if 0 < params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, params.min_p))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    key = mx.random.key(seed)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, draw = mx.random.split(key)
        for keep in filters:
            logprobs = keep(logprobs)
        return mx.random.categorical(logprobs * (1.0 / params.temperature), key=draw)

    return sample
