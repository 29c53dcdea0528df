"""Prefilled prompts join mlx-lm's running batch before their first step
(`worker.backends.joining`): the same tokens and logprobs as mlx-lm's own batch, with no
forward pass of their own. Real MLX, the demo model."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from worker.backends.mlx_lm import MlxBatchBackend
from worker.messages import SamplingParams
from worker.sampling import build_logits_processors, build_sampler
from worker.scheduler import StepPlan

PLAN = StepPlan(512, 8)
# Greedy; greedy with penalties (logits processors see the prompt and the tokens so far);
# seeded sampling (a private key per request, the same draws in any batch).
PARAMS = [SamplingParams(), SamplingParams(repetition_penalty=1.3, presence_penalty=0.5),
          SamplingParams(temperature=0.9, top_p=0.9, seed=11)]


class CountingModel:
    """The model, counting its forward passes."""

    def __init__(self, model: Any) -> None:
        self.model, self.calls = model, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def prompts() -> list[list[int]]:
    return [[50 + (13 * i + 7 * j) % 900 for j in range(20 + 9 * i)] for i in range(5)]


def through_backend(model: Any, arrivals: dict[int, int], max_tokens: int = 12) -> dict[int, tuple[list, list]]:
    """Each prompt's tokens and logprobs through the worker's backend; prompt i arrives
    before step `arrivals[i]`."""
    backend = MlxBatchBackend(model, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=512)
    uids: dict[int, int] = {}
    out: dict[int, tuple[list, list]] = {}
    step = 0
    while len(uids) < len(arrivals) or any(len(out[i][0]) < max_tokens for i in uids):
        for i, at in arrivals.items():
            if at == step:
                params = PARAMS[i % len(PARAMS)]
                uids[i] = backend.insert(prompts()[i], max_tokens, build_sampler(params),
                                         build_logits_processors(params), logprobs=True)
                out[i] = ([], [])
        by_uid = {uid: i for i, uid in uids.items()}
        for token in backend.step(PLAN):
            tokens, logprobs = out[by_uid[token.uid]]
            tokens.append(token.token)
            logprobs.append(token.logprobs[token.token].item())
        step += 1
    backend.close()
    return out


def through_mlx_lm(model: Any, arrivals: dict[int, int], max_tokens: int = 12) -> dict[int, tuple[list, list]]:
    """The same through mlx-lm's BatchGenerator as it comes."""
    generator = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    uids: dict[int, int] = {}
    out: dict[int, tuple[list, list]] = {}
    step = 0
    while len(uids) < len(arrivals) or any(len(out[i][0]) < max_tokens for i in uids):
        for i, at in arrivals.items():
            if at == step:
                params = PARAMS[i % len(PARAMS)]
                (uids[i],) = generator.insert([prompts()[i]], max_tokens=[max_tokens],
                                              samplers=[build_sampler(params)],
                                              logits_processors=[build_logits_processors(params)],
                                              stop_sequences=[StopSequences([])])
                out[i] = ([], [])
        by_uid = {uid: i for i, uid in uids.items()}
        for response in generator.next()[1]:
            tokens, logprobs = out[by_uid[response.uid]]
            tokens.append(response.token)
            logprobs.append(response.logprobs[response.token].item())
        step += 1
    generator.close()
    return out


def test_a_joining_prompt_makes_what_mlx_lms_batch_makes(loaded_demo_model):
    """Prompts arriving one by one into a decoding batch (and two together): every
    request's tokens and their logprobs equal mlx-lm's own batch's, greedy, penalized and
    seeded alike, none short of or beyond its max_tokens."""
    model, _ = loaded_demo_model
    arrivals = {0: 0, 1: 3, 2: 4, 3: 9, 4: 9}
    ours, theirs = through_backend(model, arrivals), through_mlx_lm(model, arrivals)
    assert {i: t for i, (t, _) in ours.items()} == {i: t for i, (t, _) in theirs.items()}
    assert all(len(t) == 12 for t, _ in ours.values())
    for i in arrivals:
        assert mx.allclose(mx.array(ours[i][1]), mx.array(theirs[i][1]), atol=1e-4), i


def test_a_joining_prompt_runs_no_forward_pass_of_its_own(loaded_demo_model):
    """A one-token prompt (nothing to prefill) arriving while two rows decode: every step
    is one forward pass of the whole batch, the one that draws the newcomer's first token
    included (mlx-lm's batch as it comes runs a second pass for the newcomer alone:
    [2, 1])."""
    model, _ = loaded_demo_model
    counting = CountingModel(model)
    backend = MlxBatchBackend(counting, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=512)
    greedy = build_sampler(SamplingParams())
    for prompt in ([5, 6, 7], [8, 9, 10]):
        backend.insert(prompt, 20, greedy, [])
    while len(backend.step(PLAN)) < 2:  # both decoding
        pass
    newcomer = backend.insert([11], 20, greedy, [])
    passes: list[int] = []
    out: list = []
    while not any(t.uid == newcomer for t in out):
        before = counting.calls
        out = backend.step(PLAN)
        passes.append(counting.calls - before)
        assert len(passes) <= 3, passes
    backend.close()
    # The step that joined it, the one that ran its prompt's token, the one that output its first.
    assert passes == [1, 1, 1]
