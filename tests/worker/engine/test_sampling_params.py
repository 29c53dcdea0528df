"""vLLM's sampling parameters, per request in the shared batch: logit_bias, presence and
frequency penalties (over the generated tokens), min_tokens, ignore_eos, stop_token_ids,
include_stop_str_in_output. Real MLX through the worker, each test on a text model
(mlx-lm's batch) and on a vision model (mlx-vlm's), the same requests on both."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import pytest
from support import check_stream, new_sequence, on_text_and_vision

from client import Client, Done, JobFailed

PROMPT = [11, 23, 35, 47, 59, 71, 83, 95, 107, 119]
# A bias of +20 makes greedy pick 500 on both demo models (their logits are wide), so
# the penalties change the output; 500 in the prompt too, so that counting the prompt's
# tokens (which vLLM does not) would change it differently.
BIASED = {"500": 20}
PENALISED_PROMPT = [*PROMPT, 500, 500]


served, worker, reference = on_text_and_vision(max_num_seqs=8)


def run(client: Client, **body) -> Done:
    done = client.generate(prompt_tokens=PROMPT, timeout=60, **{"max_tokens": 12, **body})
    return done


def generate_tokens(client: Client, **body) -> tuple[list[int], Done]:
    job = client.submit(**{"prompt_tokens": PROMPT, "max_tokens": 12, **body})
    deltas = list(job.stream(timeout=60))
    return [t for d in deltas for t in d.tokens], job.result(timeout=60)


def greedy_with_penalties(reference: tuple, presence: float, frequency: float, steps: int,
                          prompt: list[int] = PENALISED_PROMPT) -> list[int]:
    """Greedy decoding in process, biased as BIASED says, penalising what was generated
    (not the prompt), as vLLM does."""
    net, make_cache, *_ = reference
    net = new_sequence(net)
    cache, generated, feed = make_cache(net), [], prompt
    for _ in range(steps):
        out = net(mx.array([feed]), cache=cache)
        logits = (out.logits if hasattr(out, "logits") else out)[0, -1].astype(mx.float32)
        for token, bias in BIASED.items():
            logits[int(token)] += bias
        for token, n in Counter(generated).items():
            logits[token] -= presence + frequency * n
        generated.append(int(mx.argmax(logits).item()))
        feed = generated[-1:]
    return generated


def test_a_large_logit_bias_decides_the_token(client):
    """+100 on one token makes greedy pick it every time; -100 on greedy's first choice moves it."""
    plain, _ = generate_tokens(client)
    forced, _ = generate_tokens(client, logit_bias={"321": 100})
    assert forced == [321] * 12
    banned, _ = generate_tokens(client, logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, 2.0), (2.0, 0.0), (0.0, 1.0)])
def test_penalties_count_the_generated_tokens_as_vllm_does(client, reference, presence, frequency):
    """Greedy with presence/frequency penalties equals greedy decoding in process with the
    penalties applied to the generated tokens only (the prompt's are not penalised)."""
    plain, _ = generate_tokens(client, prompt_tokens=PENALISED_PROMPT, logit_bias=BIASED, max_tokens=16)
    generated, _ = generate_tokens(client, prompt_tokens=PENALISED_PROMPT, logit_bias=BIASED, presence_penalty=presence,
                             frequency_penalty=frequency, max_tokens=16)
    assert generated != plain, "the penalty must change something here, or this test shows nothing"
    assert generated == greedy_with_penalties(reference, presence, frequency, 16)


def test_a_prefix_cache_hit_changes_neither_penalties_nor_min_tokens(client, reference):
    """A prompt seen before starts from the prefix cache (on mlx-vlm's batch the logits
    processors then see only the prompt's uncached part): the penalties still count the
    generated tokens alone, and min_tokens still holds eos back for exactly its tokens."""
    prompt = [*PROMPT * 4, *PENALISED_PROMPT]  # 60 tokens: whole blocks of mlx-vlm's cache
    body = {"prompt_tokens": prompt, "logit_bias": BIASED, "frequency_penalty": 1.0, "max_tokens": 16}
    first, _ = generate_tokens(client, **body)
    second, done = generate_tokens(client, **body)
    assert done.usage.cached_tokens > 0, "the second request must hit the prefix cache"
    assert first == second == greedy_with_penalties(reference, 0.0, 1.0, 16, prompt)
    eos = reference[2][0]
    held, done = generate_tokens(client, prompt_tokens=prompt, logit_bias={str(eos): 100}, min_tokens=4)
    assert done.usage.cached_tokens > 0
    assert len(held) == 4 and eos not in held and done.finish_reason == "stop"


def test_stop_token_ids_min_tokens_and_ignore_eos(client, reference):
    """A stop token ends the output before it (finish stop); min_tokens holds stop tokens
    back until then; ignore_eos runs past eos to max_tokens, eos output like any token."""
    plain, _ = generate_tokens(client)
    stop_at = next(i for i, t in enumerate(plain) if i >= 2 and t not in plain[:i])
    cut, done = generate_tokens(client, stop_token_ids=[plain[stop_at]])
    assert cut == plain[:stop_at] and done.finish_reason == "stop"
    held, done = generate_tokens(client, stop_token_ids=[plain[stop_at]], min_tokens=stop_at + 3)
    assert len(held) >= stop_at + 3 and plain[stop_at] not in held[:stop_at + 3]
    eos = reference[2][0]
    stopped, done = generate_tokens(client, logit_bias={str(eos): 100})
    assert stopped == [] and done.finish_reason == "stop"
    ignored, done = generate_tokens(client, logit_bias={str(eos): 100}, ignore_eos=True)
    assert ignored == [eos] * 12 and done.finish_reason == "length"
    at_least, done = generate_tokens(client, logit_bias={str(eos): 100}, min_tokens=4)
    assert len(at_least) == 4 and eos not in at_least and done.finish_reason == "stop"


def test_include_stop_str_in_output(client):
    """The stop string ends the text, cut before it, or after it when asked."""
    text = run(client, max_tokens=24).text
    stop = text[6:9]
    assert stop and text.find(stop) >= 1
    at = text.find(stop)
    assert run(client, max_tokens=24, stop=[stop]).text == text[:at]
    kept = run(client, max_tokens=24, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == text[:at + len(stop)] and kept.finish_reason == "stop"


def test_bad_sampling_params_are_refused_precisely(client, worker, r, outputs, new_id):
    """Each is refused with its reason (the client before sending; the worker for what
    only it knows: the vocabulary, its max_tokens); a valid request completes after."""
    outside = "token ids [999999] are outside the vocabulary"
    for body, message in [({"min_tokens": 20, "max_tokens": 5}, "min_tokens: 20 is above max_tokens (5)"),
                          ({"logit_bias": {"999999": 1}}, f"logit_bias: {outside}"),
                          ({"stop_token_ids": [999999]}, f"stop_token_ids: {outside}")]:
        with pytest.raises(JobFailed) as failed:
            client.generate(prompt_tokens=PROMPT, timeout=60, **body)
        assert failed.value.code == "invalid_request" and message in failed.value.message
    assert check_stream(outputs.of(client.submit(prompt_tokens=PROMPT, max_tokens=3).id)).finish_reason == "length"
