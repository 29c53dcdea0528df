"""`max_kv_size`: each sequence keeps a rotating window of its last tokens, served in the
shared batch exactly as mlx-lm's own batch computes it; refused where it cannot be."""

from __future__ import annotations

import random

import pytest
from support import tokens_of, worker_fixture, xadd_json

WINDOW = 48
NEW_TOKENS = 60  # each prompt plus its output outgrows the window while it decodes

# Shorter than the window: the window rotates while decoding, where the chunking of a
# prefill (the step budget's, in the worker) cannot change what a token attends to.
PROMPTS = [random.Random(n).choices(range(10, 1000), k=n) for n in (20, 31, 44)]  # the demo vocabulary: 1,024

worker = worker_fixture(max_kv_size=WINDOW, max_num_seqs=8)


@pytest.fixture(scope="module")
def reference(demo_model):
    """mlx-lm's own batch, greedy, the prompts inserted together, with a window or without.
    (Its batch keeps the last `max_kv_size` tokens; its single-sequence `generate_step`
    keeps the first four besides, so the two part where the window first rotates.)"""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model = load(str(demo_model))[0]

    def generate(window: int | None) -> list[list[int]]:
        batch = BatchGenerator(model, stop_tokens=[], max_kv_size=window)
        uids = batch.insert(PROMPTS, max_tokens=[NEW_TOKENS] * len(PROMPTS))
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        while any(len(made) < NEW_TOKENS for made in tokens.values()):
            for response in batch.next_generated():
                tokens[response.uid].append(response.token)
        batch.close()
        return [tokens[uid] for uid in uids]

    return generate


def submit_together(r, queue: str, new_id) -> list[str]:
    ids = [new_id("kv") for _ in PROMPTS]
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        xadd_json(r, queue, rid, {"prompt_tokens": prompt, "max_tokens": NEW_TOKENS, "ignore_eos": True})
    return ids


def test_batched_sequences_decode_as_mlx_lm_does_with_the_same_window(worker, r, outputs, new_id, reference):
    windowed = reference(WINDOW)
    assert reference(None) != windowed, "the window must change the output, or this test could not tell it was applied"
    ids = submit_together(r, worker.queue, new_id)
    assert [tokens_of(outputs.of(rid)) for rid in ids] == windowed


def test_the_same_prompts_again_decode_the_same(worker, r, outputs, new_id):
    """The prefix cache keeps finished sequences' caches; a rotated one cannot be cut back
    to a prompt it covered, so the prompt is prefilled again and decodes the same."""
    runs = [[tokens_of(outputs.of(rid)) for rid in submit_together(r, worker.queue, new_id)] for _ in range(2)]
    assert runs[0] == runs[1]


def test_a_window_too_small_is_refused():
    from pydantic import ValidationError

    from worker.settings import load_settings

    with pytest.raises(ValidationError, match="max_kv_size"):
        load_settings(max_kv_size=8)


def test_a_vision_model_with_a_window_is_refused_before_loading(vision_model):
    from worker.engine.backends.mlx_vlm import load_vision_model
    from worker.settings import load_settings

    with pytest.raises(ValueError, match="max_kv_size is served through mlx-lm.s batch only"):
        load_vision_model(load_settings(model=str(vision_model), max_kv_size=WINDOW))


def test_a_prompt_longer_than_the_window_runs_beside_other_streams(worker, r, outputs, new_id):
    """Prefilled in the step budget's chunks into a window it outgrows, beside a running stream."""
    running, long = new_id("kv"), new_id("kv")
    xadd_json(r, worker.queue, running, {"prompt_tokens": PROMPTS[0], "max_tokens": 80, "ignore_eos": True})
    xadd_json(r, worker.queue, long, {"prompt_tokens": random.Random(7).choices(range(10, 1000), k=6 * WINDOW),
                                      "max_tokens": NEW_TOKENS, "ignore_eos": True})
    assert [len(tokens_of(outputs.of(rid))) for rid in (running, long)] == [80, NEW_TOKENS]
