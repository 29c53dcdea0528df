"""The per-step token budget (`max_step_tokens`): how a step is shared between running
streams and prompt chunks, and, with real MLX on the demo models (mlx-lm's batch and
mlx-vlm's), that no step processes more than its budget while new prompts are
prefilled, with the same greedy output."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from worker.engine.backends import TokenOut
from worker.engine.backends.mlx_lm import MlxBatchBackend
from worker.engine.sampling import build_logits_processors, build_sampler
from worker.engine.scheduler import MIN_PREFILL_CHUNK, StepBudget, StepPlan
from worker.messages import SamplingParams

GREEDY = SamplingParams()


@pytest.mark.parametrize(("budget", "decoding", "prefilling", "split"), [
    (512, 0, 8, (512, 8)),  # nothing decoding, no stream to keep steady: BatchGenerator's own sizes
    (40, 0, 1, (512, 8)),
    (512, 1, 8, (63, 8)),  # one stream decodes: eight prompts share the rest
    (512, 1, 1, (511, 8)),  # one prompt takes all the rest, up to prefill_step_size
    (40, 8, 1, (32, 2)),  # eight streams decode; one prompt gets the rest
    (40, 8, 8, (16, 2)),  # eight waiting prompts: two at a time, at the smallest chunk
    (16, 30, 3, (MIN_PREFILL_CHUNK, 1)),  # over budget already: one prompt still advances
])
def test_a_step_is_shared_between_streams_and_prompt_chunks(budget, decoding, prefilling, split):
    budget_of = StepBudget(budget, prefill_batch_size=8, prefill_step_size=512)
    assert budget_of.plan(decoding, prefilling) == StepPlan(*split)


def drive(backend: Any, budget: int, prompts: list[list[int]], late: list[int],
          step: Callable[[StepPlan], tuple[list[TokenOut], int]]) -> tuple[dict[int, list[int]], list[int]]:
    """Greedy tokens of `prompts` (24 new tokens each), with `late` inserted once the
    first prompts are decoding; and, for each step that decoded anything, the tokens it
    processed beyond its budget. `step` runs one step of `backend` and says how many
    prompt tokens it processed."""
    budget_of = StepBudget(budget, prefill_batch_size=8, prefill_step_size=512)
    tokens: dict[int, list[int]] = {}

    def insert(prompt: list[int]) -> int:
        uid = backend.insert(prompt, 24, build_sampler(GREEDY), build_logits_processors(GREEDY))
        tokens[uid] = []
        return uid

    order = [insert(p) for p in prompts]
    over, steps = [], 0
    while any(len(t) < 24 for t in tokens.values()):
        decoding = sum(0 < len(t) < 24 for t in tokens.values())
        prefilling = sum(not t for t in tokens.values())
        out, prompt_tokens = step(budget_of.plan(decoding, prefilling))
        if decoding:
            over.append(prompt_tokens + decoding - budget)
        for token in out:
            tokens[token.uid].append(token.token)
        steps += 1
        if steps == 3:
            order.append(insert(late))
    backend.close()
    return {i: tokens[uid] for i, uid in enumerate(order)}, over


def run(model, budget: int, prompts: list[list[int]], late: list[int]) -> tuple[dict[int, list[int]], list[int]]:
    """`drive` on mlx-lm's batch, which counts the prompt tokens it processed itself."""
    net, _ = model
    backend = MlxBatchBackend(net, completion_batch_size=16, prefill_batch_size=8, prefill_step_size=512)

    def step(plan: StepPlan) -> tuple[list[TokenOut], int]:
        with backend._generator.stats() as stats:
            out = backend.step(plan)
        return out, stats.prompt_tokens

    return drive(backend, budget, prompts, late, step)


def test_no_step_exceeds_its_budget_and_the_output_is_the_same(loaded_demo_model):
    """Three 120-token prompts, then a 200-token one arriving while they decode: with a
    budget of 48 tokens no step that decodes processes more than 48 (running streams'
    tokens plus prompt chunks), and every greedy output equals the unbounded run's."""
    prompts = [[100 + (7 * i + j) % 900 for j in range(120)] for i in range(3)]
    late = [300 + j % 500 for j in range(200)]
    bounded, over = run(loaded_demo_model, 48, prompts, late)
    unbounded, _ = run(loaded_demo_model, 100_000, prompts, late)
    assert max(over) <= 0, over
    assert bounded == unbounded


def run_vision(vision_model, budget: int, prompts: list[list[int]], late: list[int],
               monkeypatch: pytest.MonkeyPatch) -> tuple[dict[int, list[int]], list[int]]:
    """`drive` on mlx-vlm's batch (the vision demo model, text-only prompts), counting the
    prompt tokens each step processes, padding included, as mlx-vlm's prompt batch
    reports its chunks."""
    from mlx_vlm.generate import ar

    from worker.engine.backends.mlx_vlm import load_vision_model
    from worker.settings import WorkerSettings

    counted: list[int] = []
    chunk, finish = ar.PromptProcessingBatch.prompt_step, ar.PromptProcessingBatch.generate

    def counting_chunk(self, *args, **kwargs):
        done = chunk(self, *args, **kwargs)
        counted.append(done * len(self.uids))
        return done

    def counting_finish(self, *args, **kwargs):
        counted.append(self._inputs_embeds.shape[1] * len(self.uids))  # the columns left, in one pass
        return finish(self, *args, **kwargs)

    monkeypatch.setattr(ar.PromptProcessingBatch, "prompt_step", counting_chunk)
    monkeypatch.setattr(ar.PromptProcessingBatch, "generate", counting_finish)
    loaded = load_vision_model(WorkerSettings(model=str(vision_model), max_num_seqs=8, cache_memory_mb=0))
    backend = loaded.make_backend()

    def step(plan: StepPlan) -> tuple[list[TokenOut], int]:
        counted.clear()
        out = backend.step(plan)
        return out, sum(counted)

    return drive(backend, budget, prompts, late, step)


def test_no_vision_step_exceeds_its_budget_and_the_output_is_the_same(vision_model, monkeypatch):
    """The same on mlx-vlm's batch: a 200-token prompt arriving while three decode is
    prefilled in chunks that keep every decoding step within 48 tokens, and every greedy
    output equals the unbounded run's."""
    prompts = [[100 + (7 * i + j) % 900 for j in range(120)] for i in range(3)]
    late = [300 + j % 500 for j in range(200)]
    bounded, over = run_vision(vision_model, 48, prompts, late, monkeypatch)
    unbounded, unbounded_over = run_vision(vision_model, 100_000, prompts, late, monkeypatch)
    assert max(over) <= 0, over
    assert max(unbounded_over) + 100_000 - 48 > 0, "unbounded, the late prompt goes in one step over 48"
    assert bounded == unbounded
