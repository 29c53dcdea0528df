"""Speculative decoding in the running batch, by prompt lookup (`prompt_lookup_max`:
drafts from a request's own tokens) and by a draft model (`draft_model`): verified
drafts leave every greedy output exactly as without them; rows that cannot speculate
run beside them unchanged; the gate keeps whichever way is faster at each batch size."""

from __future__ import annotations

import random
import signal
import time
import uuid

import pytest
from support import (
    KEYS,
    check_stream,
    free_port,
    heartbeat_stats,
    scrape_metrics,
    start_worker,
    wait_for,
    wait_for_deltas,
    worker_url,
    xadd_json,
)

from client import Delta, Done
from worker.engine.backends.prompt_lookup import History, propose
from worker.engine.backends.speculative import EPOCH, FIRST_PATIENCE, MARGIN, Gate

# The demo model's vocabulary is 1,024. Each prompt repeats a span, which prompt lookup
# proposes; random weights loop in their own output too, which it proposes as well.
SPANS = [random.Random(n).choices(range(10, 1000), k=12) for n in range(4)]
PROMPTS = [span * 3 + random.Random(9 + n).choices(range(10, 1000), k=n) for n, span in enumerate(SPANS)]
NEW_TOKENS = 48


def test_a_draft_is_what_followed_the_latest_longest_match():
    context = [1, 2, 3, 9, 1, 2, 3, 7, 8, 4, 2, 3]
    assert propose(context, max_ngram=3, max_tokens=2) == [7, 8]  # "2 3" last matched before "7 8"
    assert propose([5, 6, 1, 2, 7, 1, 2], max_ngram=3, max_tokens=4) == [7, 1, 2]
    assert propose([1, 2, 3, 4], max_ngram=3, max_tokens=4) == []  # no earlier match
    assert propose([4, 4, 4], max_ngram=2, max_tokens=0) == []


def naive_proposal(context: list[int], max_ngram: int, max_tokens: int) -> list[int]:
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == context[-n:]:
                return context[start + n:start + n + max_tokens]
    return []


def test_a_growing_history_proposes_what_a_plain_search_finds():
    rng = random.Random(3)
    tokens, history = rng.choices(range(20), k=300), History()
    for _ in range(400):  # past its first capacity
        pending = rng.randrange(20)
        assert propose(history.view(tokens, pending), 3, 4) == naive_proposal([*tokens, pending], 3, 4)
        tokens.append(pending)


def run(gate: Gate, rows: int, way_rate: dict[bool, float], start: float) -> float:
    """Drive `gate` through one epoch at `rows` rows where each way makes `way_rate` tokens/s
    (a step of 1 s, giving that many tokens); the time after it."""
    now = start
    for _ in range(EPOCH):
        way = gate.choose(rows, now)
        gate.took(int(way_rate[way]), speculative=way)
        now += 1.0
    return now


def ways(gate: Gate, rows: int, way_rate: dict[bool, float], epochs: int) -> list[bool]:
    now, taken = 0.0, []
    for _ in range(epochs):
        taken.append(gate.choose(rows, now))
        gate.took(int(way_rate[taken[-1]]), speculative=taken[-1])
        now = run(gate, rows, way_rate, now + 1.0)
    return taken


def test_the_gate_keeps_the_faster_way_and_tries_the_other_less_and_less():
    gate = Gate()
    taken = ways(gate, 16, {True: 50.0, False: 100.0}, epochs=60)
    assert taken[0] is False and taken[1] is True  # each way measured once, plain first
    tries = [i for i, way in enumerate(taken) if way][1:]
    assert tries, "the losing way is tried again"
    gaps = [b - a for a, b in zip(tries, tries[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > FIRST_PATIENCE  # less and less often
    assert sum(taken) < len(taken) // 4


def test_the_gate_speculates_where_it_pays_and_not_beyond():
    gate = Gate()
    assert sum(ways(gate, 1, {True: 200.0, False: 100.0}, epochs=20)) > 15  # pays alone
    assert sum(ways(gate, 2, {True: 80.0, False: 100.0}, epochs=20)) < 8  # loses at 2
    big = ways(gate, 16, {True: 400.0, False: 500.0}, epochs=6)
    assert big[0] is False, "it lost at a smaller batch: not tried first at a larger one"


def test_a_near_tie_goes_to_plain():
    """Speculation measured a little faster (within MARGIN: a drifting machine's noise) is
    not chosen; where it pays (200 against 100 above) it is."""
    gate = Gate()
    assert sum(ways(gate, 4, {True: 100.0 * (1 + MARGIN * 0.9), False: 100.0}, epochs=40)) < 40 // 4


@pytest.fixture(scope="module")
def backends(demo_model):
    """The worker's text backend on the demo model with `settings` (speculating ones with
    their gate always speculating), and what loaded it (for its counters)."""
    from worker.engine.backends import load_model
    from worker.engine.backends.speculative import SpeculativeGenerationBatch
    from worker.settings import WorkerSettings

    def make(**settings):
        loaded = load_model(WorkerSettings(model=str(demo_model), cache_memory_mb=0, **settings))
        backend = loaded.make_backend()
        batch = backend._generator._generation_batch
        if isinstance(batch, SpeculativeGenerationBatch):
            batch.gate.adaptive = False
        return backend, loaded

    return make


@pytest.fixture(scope="module")
def near_draft(demo_model, tmp_path_factory):
    """A draft that agrees with the demo model often, not always: its weights with a
    little noise (random weights are chaotic: noise of 2% of each matrix's spread keeps
    about 60% of greedy tokens; an unrelated random model keeps none)."""
    import shutil

    import mlx.core as mx

    out = tmp_path_factory.mktemp("draft") / "near"
    shutil.copytree(demo_model, out)
    weights = mx.load(str(demo_model / "model.safetensors"))
    mx.random.seed(5)
    noisy = {name: (w + 0.02 * w.std() * mx.random.normal(w.shape)).astype(w.dtype) if w.ndim == 2 else w
             for name, w in weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), noisy, metadata={"format": "mlx"})
    return out


def decode(backend, requests) -> list[list[int]]:
    """Each (prompt, sampler, processors, speculative) inserted together, stepped to the end."""
    from worker.engine.scheduler import StepPlan

    uids = [backend.insert(p, NEW_TOKENS, s, lp, speculative=sp) for p, s, lp, sp in requests]
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    done: set[int] = set()
    while len(done) < len(uids):
        for token in backend.step(StepPlan(prefill_chunk=512, prefill_prompts=8)):
            out[token.uid].append(token.token)
            if token.finish_reason:
                done.add(token.uid)
    return [out[uid] for uid in uids]


def mixed_requests(speculative: bool = True):
    """Greedy prompts beside a seeded sampled one and one with a repetition penalty."""
    import mlx.core as mx
    from mlx_lm.sample_utils import greedy_sampler, make_logits_processors, make_sampler

    mx.random.seed(7)
    greedy = [(p, greedy_sampler, [], speculative) for p in PROMPTS]
    sampled = (PROMPTS[0], make_sampler(temp=0.8), [], True)
    penalized = (PROMPTS[1], greedy_sampler, make_logits_processors(repetition_penalty=1.3), True)
    return [*greedy, sampled, penalized]


def test_greedy_output_is_unchanged_and_its_neighbours_too(backends):
    import mlx.core as mx

    plain, _ = backends()
    lookup, loaded = backends(prompt_lookup_max=3)
    mx.random.seed(7)
    expected = decode(plain, mixed_requests())
    mx.random.seed(7)
    assert decode(lookup, mixed_requests()) == expected
    stats = loaded.speculation()
    assert stats["accepted_tokens"] > 0, stats  # drafts were taken, or this test could not tell
    assert all(len(tokens) == NEW_TOKENS for tokens in expected)


def test_a_request_that_opts_out_is_never_drafted(backends):
    lookup, loaded = backends(prompt_lookup_max=3)
    before = loaded.speculation()["draft_tokens"]
    decode(lookup, mixed_requests(speculative=False)[:len(PROMPTS)])
    assert loaded.speculation()["draft_tokens"] == before


def decode_arriving(backend, requests, seed: int) -> list[list[int]]:
    """Like `decode`, with a request joining every third step and the gate's choice
    random (plain steps leave a draft model behind, to catch up on the next draft)."""
    from worker.engine.backends.speculative import SpeculativeGenerationBatch
    from worker.engine.scheduler import StepPlan

    batch, rng = backend._generator._generation_batch, random.Random(seed)
    if isinstance(batch, SpeculativeGenerationBatch):
        batch.gate.choose = lambda rows, now: rng.random() < 0.6
    waiting, uids, out, done, steps = list(requests), [], {}, set(), 0
    while waiting or len(done) < len(uids):
        if waiting and steps % 3 == 0:
            prompt, sampler, processors, speculative = waiting.pop(0)
            uids.append(backend.insert(prompt, NEW_TOKENS, sampler, processors, speculative=speculative))
            out[uids[-1]] = []
        for token in backend.step(StepPlan(prefill_chunk=16, prefill_prompts=2)):  # prompts prefill over steps
            out[token.uid].append(token.token)
            if token.finish_reason:
                done.add(token.uid)
        steps += 1
    return [out[uid] for uid in uids]


@pytest.mark.parametrize("draft", ["itself", "near"])
def test_a_draft_model_leaves_greedy_output_unchanged(backends, demo_model, near_draft, draft):
    """With the model itself as its draft every draft of a row without processors is
    accepted (the upper bound), which holds only while each row's draft cache covers
    exactly its tokens; with a draft that agrees often, rows accept part of their drafts
    and drop the rest, the penalized row through its penalty."""
    import mlx.core as mx

    plain, _ = backends()
    drafting, loaded = backends(draft_model=str(demo_model if draft == "itself" else near_draft))
    requests = mixed_requests() if draft == "near" else mixed_requests()[:-1]  # the penalty rejects drafts
    mx.random.seed(7)
    expected = decode_arriving(plain, requests, seed=1)
    mx.random.seed(7)
    got = decode_arriving(drafting, requests, seed=1)
    greedy = [*range(len(PROMPTS)), *([len(requests) - 1] if draft == "near" else [])]
    assert [got[i] for i in greedy] == [expected[i] for i in greedy]
    stats = loaded.speculation()
    assert stats["method"] == "draft_model"
    if draft == "itself":
        assert stats["acceptance_rate"] >= 0.95, stats
    else:
        assert 0.1 < stats["acceptance_rate"] < 0.95, stats


def test_a_draft_proposes_what_it_would_from_each_rows_whole_context(backends, near_draft):
    """Each row's draft, from the draft's batched cache after rejections, catch-ups and
    rows coming and going, is the draft model's own greedy continuation of the row's
    tokens computed afresh."""
    import mlx.core as mx

    drafting, _ = backends(draft_model=str(near_draft))
    batch = drafting._generator._generation_batch
    proposer, checked = batch.proposer, []
    propose_drafts = proposer.drafts

    def checking(batch, pending, room):
        drafts = propose_drafts(batch, pending, room)
        for row, draft in enumerate(drafts):
            context = [*batch.tokens[row], pending[row]]
            for token in draft:
                checked.append(token == mx.argmax(proposer.model(mx.array([context]))[0, -1]).item())
                context.append(token)
        return drafts

    proposer.drafts = checking
    decode_arriving(drafting, mixed_requests(), seed=2)
    assert len(checked) > 100 and sum(checked) >= 0.95 * len(checked), (sum(checked), len(checked))


def test_hostile_settings_are_refused(demo_model):
    from pydantic import ValidationError

    from worker.engine.backends import load_model
    from worker.settings import load_settings

    for setting, value in (("prompt_lookup_max", -1), ("prompt_lookup_max", 1000), ("num_draft_tokens", 0)):
        with pytest.raises(ValidationError, match=setting):
            load_settings(**{setting: value})
    with pytest.raises(ValueError, match="rotating cache"):
        load_model(load_settings(model=str(demo_model), prompt_lookup_max=3, max_kv_size=64))
    with pytest.raises(ValueError, match="prompt_lookup_max is served through mlx-lm's batch only"):
        load_model(load_settings(model=str(demo_model), prompt_lookup_max=3, ssd_cache_dir="/tmp/x"))
    draft = str(demo_model)
    with pytest.raises(ValidationError, match="choose one way to draft"):
        load_settings(prompt_lookup_max=3, draft_model=draft)
    with pytest.raises(ValidationError, match="draft_model"):
        load_settings(draft_model="/nowhere/draft")
    with pytest.raises(ValueError, match="rotating cache"):
        load_model(load_settings(model=str(demo_model), draft_model=draft, max_kv_size=64))
    with pytest.raises(ValueError, match="draft_model is served through mlx-lm's batch only"):
        load_model(load_settings(model=str(demo_model), draft_model=draft, kv_bits=8))


def test_a_draft_of_another_vocabulary_is_refused(demo_model, tmp_path):
    from mlxq.demo_model import build
    from worker.engine.backends import load_model
    from worker.settings import load_settings

    other = build(tmp_path / "thinking", size="thinking")  # its tokenizer has more tokens
    with pytest.raises(ValueError, match="its tokenizer is not the model's"):
        load_model(load_settings(model=str(demo_model), draft_model=str(other)))


@pytest.fixture(scope="module")
def workers(redis_url, demo_model, near_draft, logs_dir):
    """A plain worker, and a speculating one by each method (with its metrics port), whose
    gate always speculates: what speculation does must not hang on this machine's timing."""
    url = worker_url(redis_url)
    plain = start_worker(url, demo_model, "specplain", logs_dir, max_num_seqs=8)
    speculating = {}
    for method, setting in (("ngram", {"prompt_lookup_max": 3}), ("draft_model", {"draft_model": near_draft})):
        port = free_port()
        speculating[method] = (start_worker(url, demo_model, f"spec{method}", logs_dir, max_num_seqs=8,
                                            metrics_port=port, env={"MLXQ_TEST_ALWAYS_SPECULATE": "1"}, **setting),
                               port)
    yield plain, speculating
    for worker in (plain, *(w for w, _ in speculating.values())):
        worker.stop()
        assert worker.process.returncode == 0, worker.log()


def outputs_of(r, outputs, worker, bodies: list[dict]) -> list[tuple[list[int], str]]:
    ids = [f"spec-{worker.queue}-{random.getrandbits(32):x}" for _ in bodies]
    for rid, body in zip(ids, bodies, strict=True):
        xadd_json(r, worker.queue, rid, body)
    result = []
    for rid in ids:
        events = outputs.of(rid)
        done = check_stream(events)
        assert isinstance(done, Done), events
        result.append(([t for e in events if isinstance(e, Delta) for t in e.tokens], done.finish_reason))
    return result


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_speculating_worker_streams_what_a_plain_one_does(workers, r, outputs, method):
    plain, speculating = workers
    lookup, port = speculating[method]
    bodies = [{"prompt_tokens": p, "max_tokens": NEW_TOKENS, "ignore_eos": True} for p in PROMPTS]
    expected = outputs_of(r, outputs, plain, bodies)
    # A stop token in the middle of a speculative step's tokens ends the request there.
    stop = expected[0][0][NEW_TOKENS // 2]
    bodies.append({"prompt_tokens": PROMPTS[0], "max_tokens": NEW_TOKENS, "ignore_eos": True,
                   "stop_token_ids": [stop]})
    bodies.append({"prompt_tokens": PROMPTS[1], "max_tokens": NEW_TOKENS, "ignore_eos": True,
                   "speculative": False})
    got = outputs_of(r, outputs, lookup, bodies)
    assert got[:len(PROMPTS)] == expected
    cut = expected[0][0].index(stop)
    assert got[len(PROMPTS)] == (expected[0][0][:cut], "stop")  # the stop token itself is not streamed
    assert got[-1] == expected[1]
    wait_for(lambda: (heartbeat_stats(r, lookup.consumer).get("speculation") or {}).get("steps", 0) > 0,
             what="speculative steps in the heartbeat")
    assert heartbeat_stats(r, lookup.consumer)["speculation"]["method"] == method
    wait_for(lambda: scrape_metrics(port).get("mlxq_spec_decode_num_draft_tokens_total", {}).get((), 0) > 0,
             what="drafts in the metrics")


# A format that lets a model go on long enough to draft: words and digits, then a dot.
LONG_REGEX = {"type": "regex", "pattern": "[a-z0-9 ]{20,120}\\."}
LIST_SCHEMA = {"type": "json_schema", "json_schema": {"name": "items", "strict": True, "schema": {
    "type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"}}},
    "required": ["items"], "additionalProperties": False}}}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_requests_verify_drafts_through_their_masks(workers, r, outputs, method):
    """Greedy constrained requests speculate: a draft token counts only where the masked
    choice agrees, and the output is the plain worker's, token for token."""
    plain, speculating = workers
    worker, _ = speculating[method]
    bodies = [{"prompt_tokens": p, "max_tokens": 96, "temperature": 0, "response_format": f}
              for p in PROMPTS for f in (LONG_REGEX, LIST_SCHEMA)]
    before = (heartbeat_stats(r, worker.consumer).get("speculation") or {}).get("accepted_tokens", 0)
    expected = outputs_of(r, outputs, plain, bodies)
    assert outputs_of(r, outputs, worker, bodies) == expected
    wait_for(lambda: (heartbeat_stats(r, worker.consumer).get("speculation") or {}).get("accepted_tokens", 0)
             > before, what="drafts accepted for constrained requests")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_kill_9_mid_generation_resumes_to_the_same_text(redis_url, demo_model, near_draft, logs_dir, r, outputs,
                                                        method):
    """A speculating worker killed with SIGKILL: another takes its requests over and ends
    each with the text a plain uninterrupted run gives."""
    queue, url = f"specrec{uuid.uuid4().hex[:8]}", worker_url(redis_url)
    setting = {"prompt_lookup_max": 3} if method == "ngram" else {"draft_model": near_draft}
    bodies = [{"prompt_tokens": p, "max_tokens": 400, "ignore_eos": True} for p in PROMPTS]
    victim = start_worker(url, demo_model, queue, logs_dir, consumer="spec-victim", **setting)
    ids = [f"specrec{i}-{uuid.uuid4().hex[:8]}" for i in range(len(bodies))]
    for rid, body in zip(ids, bodies, strict=True):
        xadd_json(r, queue, rid, body)
    for rid in ids:
        wait_for_deltas(r, KEYS.output(queue, rid), [rid], 10)
    victim.signal(signal.SIGSTOP)
    time.sleep(0.2)  # a write already sent lands
    survivor = start_worker(url, demo_model, queue, logs_dir, consumer="spec-survivor", reclaim_interval_s=0.2,
                            **setting)
    try:
        victim.process.kill()
        victim.wait()
        resumed = []
        for rid in ids:
            done = check_stream(outputs.of(rid, timeout=120))
            assert isinstance(done, Done) and done.usage.completion_tokens == 400, done
            resumed.append(done.text)
        assert "took over the requests of a silent worker" in survivor.log()  # some were mid-generation
    finally:
        survivor.stop()
    plain = start_worker(url, demo_model, queue, logs_dir, consumer="spec-plain")
    try:
        expected = [check_stream(outputs.of(rid, timeout=120)).text
                    for rid in [xadd_and_id(r, queue, body) for body in bodies]]
    finally:
        plain.stop()
    assert resumed == expected


def xadd_and_id(r, queue: str, body: dict) -> str:
    rid = f"specref-{random.getrandbits(32):x}"
    xadd_json(r, queue, rid, body)
    return rid


def test_a_losing_try_is_cut_short():
    from worker.engine.backends.speculative import CUT_SHORT_AFTER

    gate, now, way_rate = Gate(), 0.0, {True: 10.0, False: 100.0}
    for _ in range(EPOCH * (FIRST_PATIENCE + 2)):  # speculation's first epoch, then plain's until a retry
        way = gate.choose(16, now)
        gate.took(int(way_rate[way]), speculative=way)
        now += 1.0
    steps = []
    for _ in range(EPOCH * 2 * FIRST_PATIENCE):
        steps.append(gate.choose(16, now))
        gate.took(int(way_rate[steps[-1]]), speculative=steps[-1])
        now += 1.0
    assert any(steps), "speculation is tried again"
    tries = "".join("s" if way else "." for way in steps).split(".")
    assert max(len(t) for t in tries) <= CUT_SHORT_AFTER, steps
