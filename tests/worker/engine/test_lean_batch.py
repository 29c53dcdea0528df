"""Logprobs only where asked (`backends.lean_batch`): with real MLX on the demo model,
mlx-lm's batch drives the same greedy tokens with and without them, a row that asks
gets mlx-lm's own logprobs beside rows that do not, and a batch where nobody asks
computes none."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from worker.engine.backends.mlx_lm import MlxBatchBackend
from worker.engine.sampling import build_logits_processors, build_sampler
from worker.engine.scheduler import StepPlan
from worker.messages import SamplingParams

GREEDY = SamplingParams()
PROMPTS = [[100 + (7 * i + j) % 900 for j in range(40 + 9 * i)] for i in range(4)]
NEW_TOKENS = 12


def stock(net) -> dict[int, list[tuple[int, mx.array]]]:
    """Each prompt's tokens and logprobs from mlx-lm's BatchGenerator as it ships."""
    generator = BatchGenerator(net, completion_batch_size=8, prefill_batch_size=8)
    uids = generator.insert(PROMPTS, max_tokens=[NEW_TOKENS] * len(PROMPTS),
                            stop_sequences=[StopSequences([])] * len(PROMPTS))
    out: dict[int, list[tuple[int, mx.array]]] = {uid: [] for uid in uids}
    while any(len(tokens) < NEW_TOKENS for tokens in out.values()):
        for response in generator.next_generated():
            out[response.uid].append((response.token, response.logprobs))
    generator.close()
    return {i: out[uid] for i, uid in enumerate(uids)}


def lean(net, asking: set[int]) -> dict[int, list[tuple[int, mx.array | None]]]:
    """The same through the engine's backend, the prompts in `asking` asking for logprobs."""
    backend = MlxBatchBackend(net, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=512)
    uids = [backend.insert(p, NEW_TOKENS, build_sampler(GREEDY), build_logits_processors(GREEDY),
                           logprobs=i in asking) for i, p in enumerate(PROMPTS)]
    out: dict[int, list[tuple[int, mx.array | None]]] = {uid: [] for uid in uids}
    while any(len(tokens) < NEW_TOKENS for tokens in out.values()):
        for token in backend.step(StepPlan(512, 8)):
            out[token.uid].append((token.token, token.logprobs))
    backend.close()
    return {i: out[uid] for i, uid in enumerate(uids)}


def test_the_tokens_are_mlx_lms_and_logprobs_come_only_where_asked(loaded_demo_model):
    net, _ = loaded_demo_model
    expected = stock(net)
    nobody, one = lean(net, set()), lean(net, {2})
    tokens = {i: [t for t, _ in run] for i, run in expected.items()}
    assert {i: [t for t, _ in run] for i, run in nobody.items()} == tokens
    assert {i: [t for t, _ in run] for i, run in one.items()} == tokens
    # Nobody asked: after each row's first token (its prefill's, mlx-lm's own step), none.
    assert all(lp is None for run in nobody.values() for _, lp in run[1:])
    # Row 2 asked: every one of its tokens has mlx-lm's logprobs.
    for (_, got), (_, want) in zip(one[2], expected[2], strict=True):
        assert got is not None and mx.allclose(got, want, atol=1e-5)
