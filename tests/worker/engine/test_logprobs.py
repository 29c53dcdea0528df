"""Logprobs: each delta carries, per token, the model's own log probability and the top
alternatives, computed from the batch's logits; asked per request. On a text model
(mlx-lm's batch) and a vision model (mlx-vlm's) alike."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from support import KEYS, check_stream, new_sequence, on_text_and_vision, xadd_json

from client import Client, Delta, Done, Job, JobFailed, RequestRejected

served, worker, reference = on_text_and_vision(max_num_seqs=4)

PROMPT = [5, 17, 42, 99, 7, 300, 12, 64]


def _entries(events):
    deltas = [e for e in events if isinstance(e, Delta)]
    return deltas, [entry for d in deltas for entry in d.logprobs]


def test_logprobs_are_the_models_own_and_the_alternatives_sorted(worker, reference, r, outputs, new_id):
    """A greedy request with top_logprobs 5, beside a sampled one and a plain one: each
    token's logprob equals the model's in process for that prefix, its alternatives are
    sorted, greedy picked the top one; the sampled token's logprob is the model's too; the
    plain request's deltas carry none."""
    greedy, hot, plain = new_id("greedy"), new_id("hot"), new_id("plain")
    xadd_json(r, worker.queue, greedy, {"prompt_tokens": PROMPT, "max_tokens": 12, "logprobs": True,
                                        "top_logprobs": 5})
    xadd_json(r, worker.queue, hot, {"prompt_tokens": PROMPT, "max_tokens": 12, "logprobs": True,
                                     "temperature": 1.5, "seed": 3})
    xadd_json(r, worker.queue, plain, {"prompt_tokens": PROMPT, "max_tokens": 12})
    model, _, _, tokenizer = reference
    for request_id, alternatives in ((greedy, 5), (hot, 0)):
        events = outputs.of(request_id)
        assert isinstance(check_stream(events), Done)
        deltas, entries = _entries(events)
        generated = [t for d in deltas for t in d.tokens]
        assert [e.token_id for e in entries] == generated
        assert all(e.text == tokenizer.decode([e.token_id]) for e in entries)
        expected = _model_logprobs(model, PROMPT, generated)
        for i, entry in enumerate(entries):
            assert entry.logprob == pytest.approx(expected[i, entry.token_id].item(), abs=1e-3)
            assert len(entry.top_logprobs) == alternatives
            values = [t.logprob for t in entry.top_logprobs]
            assert values == sorted(values, reverse=True)
            for top in entry.top_logprobs:
                assert top.logprob == pytest.approx(expected[i, top.token_id].item(), abs=1e-3)
            if request_id == greedy:
                assert entry.top_logprobs[0].token_id == entry.token_id
                assert entry.top_logprobs[0].logprob == entry.logprob
    assert all(d.logprobs is None for d in outputs.of(plain) if isinstance(d, Delta))


def test_logprobs_asked_badly_are_refused_and_the_worker_goes_on(worker):
    """top_logprobs above 20 or without logprobs: refused before sending; sent raw, the
    worker answers invalid_request; then a valid request completes."""
    with Client(worker.redis_url, queue=worker.queue) as client:
        with pytest.raises(RequestRejected, match="top_logprobs: Input should be less than or equal to 20"):
            client.submit(prompt="x", logprobs=True, top_logprobs=50)
        with pytest.raises(RequestRejected, match="top_logprobs needs logprobs: true"):
            client.submit(prompt="x", top_logprobs=3)
        client.redis.xadd(KEYS.queue(worker.queue), {"id": "raw-top-50", "json": json.dumps(
            {"prompt": "x", "logprobs": True, "top_logprobs": 50})})
        with pytest.raises(JobFailed) as failed:
            Job(client, "raw-top-50", KEYS.output(worker.queue, "raw-top-50"), worker.queue).result(timeout=60)
        assert failed.value.code == "invalid_request"
        assert "top_logprobs" in failed.value.message
        assert client.generate(prompt="x", max_tokens=2, logprobs=True, timeout=60).usage.completion_tokens == 2


def _model_logprobs(model, prompt: list[int], generated: list[int]) -> mx.array:
    """The model's log-softmax at each generated position, from one forward pass in process."""
    tokens = mx.array([prompt + generated[:-1]])
    out = new_sequence(model)(tokens)
    logits = (out.logits if hasattr(out, "logits") else out)[0, len(prompt) - 1:].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

