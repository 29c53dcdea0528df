"""Per-request samplers: filters, temperature and seeds (MLX on the CPU, no model)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from worker.engine.sampling import build_sampler
from worker.messages import SamplingParams

LOGITS = mx.random.normal((1, 256), key=mx.random.key(1)) * 3
LOGPROBS = LOGITS - mx.logsumexp(LOGITS, axis=-1, keepdims=True)
ARGMAX = LOGPROBS.argmax(axis=-1).item()


def draws(params: SamplingParams, n: int = 50) -> list[int]:
    sampler = build_sampler(params)
    return [sampler(LOGPROBS).item() for _ in range(n)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, min_p=1.0),
    SamplingParams(temperature=1.0, top_p=1e-6),
    SamplingParams(temperature=1e-4),
], ids=["top_k 1", "min_p 1", "tiny top_p", "cold"])
def test_filters_that_leave_one_token_give_the_argmax(params):
    """Each filter, pushed to its limit, leaves only the most likely token."""
    assert set(draws(params)) == {ARGMAX}


def test_top_k_keeps_only_the_k_best():
    """With top_k 3, every draw is among the three most likely tokens."""
    best = set(mx.argsort(-LOGPROBS, axis=-1)[0, :3].tolist())
    samples = draws(SamplingParams(temperature=5.0, top_k=3), n=200)
    assert set(samples) <= best and len(set(samples)) > 1


def test_seed_repeats_and_differs():
    """The same seed draws the same sequence; another seed draws a different one."""
    hot = SamplingParams(temperature=2.0, seed=11)
    assert draws(hot) == draws(hot)
    assert draws(hot) != draws(SamplingParams(temperature=2.0, seed=12))


def test_greedy_requests_share_one_sampler():
    """Greedy samplers are one object, so BatchGenerator samples them in one batched call."""
    assert build_sampler(SamplingParams()) is build_sampler(SamplingParams(seed=3))
    assert build_sampler(SamplingParams(temperature=0.5)) is not build_sampler(SamplingParams(temperature=0.5))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_p=0.5, seed=5),
    SamplingParams(temperature=0.7, min_p=0.05, top_k=20, seed=5),
    SamplingParams(temperature=1.3, top_p=0.9, min_p=0.02, top_k=50, seed=5),
], ids=["top_p", "min_p top_k", "all"])
def test_logits_draw_as_their_logprobs_do(params):
    """The batch hands samplers logits where no row asked for logprobs: every draw from
    them is the draw from the logprobs, even from logits far above zero (top_p
    normalizes what it is given, so its exp cannot overflow)."""
    assert _draws_from(params, LOGITS) == draws(params)
    assert _draws_from(params, LOGITS + 100) == draws(params)


def _draws_from(params: SamplingParams, scores: mx.array, n: int = 50) -> list[int]:
    sampler = build_sampler(params)
    return [sampler(scores).item() for _ in range(n)]
