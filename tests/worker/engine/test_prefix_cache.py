"""The prefix cache with real MLX on the demo model (in process), then through the worker."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest
from support import (
    KEYS,
    ON_BOTH,
    SLOW_TOKEN,
    check_stream,
    output_stream,
    wait_for,
    wait_for_deltas,
    worker_fixture,
    xadd_json,
)

from client import Done
from worker.engine.backends import Coverage
from worker.engine.backends.mlx_lm import MlxBatchBackend
from worker.engine.kv_blocks import BLOCK_TOKENS, token_bytes
from worker.engine.prefix_cache import PrefixCache
from worker.engine.sampling import build_logits_processors, build_sampler
from worker.engine.scheduler import StepPlan

from worker.messages import SamplingParams  # isort: skip

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def model(demo_model):
    from mlx_lm import load

    model, tokenizer = load(str(demo_model))
    return model, tokenizer


def generate(model, prompt: list[int], max_tokens: int = 12, cache: PrefixCache | None = None,
             ) -> tuple[list[int], Coverage, int]:
    """Greedy tokens, the finished sequence's cache, and how many prompt tokens came from `cache`."""
    net, tokenizer = model
    backend = MlxBatchBackend(net, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=2048)
    cached = cache.fetch(prompt) if cache else None
    reused = 0 if cached is None else len(cached.tokens)
    uid = backend.insert(prompt[reused:], max_tokens, build_sampler(GREEDY),
                         build_logits_processors(GREEDY), cached)
    tokens: list[int] = []
    while True:
        for out in backend.step(StepPlan(prefill_chunk=2048, prefill_prompts=8)):
            assert out.uid == uid
            tokens.append(out.token)
            if out.finish_reason is not None:
                backend.close()
                assert out.coverage is not None
                return tokens, out.coverage, reused


def snapshot(cache: PrefixCache) -> list[np.ndarray]:
    """Every stored array: the shared blocks' and each entry's own."""
    entries = sorted(cache._entries.values(), key=lambda e: e.id)  # (a hit moves its entry in the LRU order)
    blocks = [layer for block in cache._blocks._blocks.values() for layer in block.layers]
    own = [layer for entry in entries for layer in entry.tail or []] + \
        [layer.state[:2] for entry in entries for layer in entry.cache]
    return [np.array(a) for pair in blocks + own for a in pair]


PROMPT = list(range(100, 140))


def test_identical_prompt_reuses_all_but_one_token_and_matches_cold(model):
    cache = PrefixCache(max_bytes=10**9, max_entries=10)
    assert cache.fetch(PROMPT) is None, "miss first"
    cold, coverage, _ = generate(model, PROMPT)
    assert coverage.tokens == PROMPT + cold, "a finished sequence's cache covers its prompt and every token made"
    assert cache.store(coverage)
    assert cache.nbytes == len(coverage.tokens) * token_bytes(coverage.cache), "the key is exactly what it covers"
    warm, _, reused = generate(model, PROMPT, cache=cache)
    assert reused == len(PROMPT) - 1
    assert warm == cold


def test_a_cache_salt_hits_only_what_requests_of_that_salt_stored(model):
    """vLLM's cache_salt: another tenant's (or no) salt misses, whatever the prompt shares;
    the byte budget still holds every salt's entries together."""
    _, coverage, _ = generate(model, PROMPT)
    cache = PrefixCache(max_bytes=10**9, max_entries=2)
    assert cache.store(coverage, "team-a")
    assert cache.fetch(PROMPT, "team-b") is None and cache.fetch(PROMPT) is None
    hit = cache.fetch(PROMPT, "team-a")
    assert hit is not None and len(hit.tokens) == len(PROMPT) - 1
    cache.store(coverage, "team-b")
    cache.store(coverage)  # a third entry: the oldest (team-a's) goes
    assert len(cache) == 2 and cache.fetch(PROMPT, "team-a") is None
    assert cache.fetch(PROMPT, "team-b") is not None and cache.fetch(PROMPT) is not None


def test_extended_and_divergent_prompts_reuse_the_common_prefix(model):
    cache = PrefixCache(max_bytes=10**9, max_entries=10)
    _, coverage, _ = generate(model, PROMPT)
    cache.store(coverage)
    extended = coverage.tokens + [7, 8, 9]
    cold, _, _ = generate(model, extended)
    warm, _, reused = generate(model, extended, cache=cache)
    assert reused == len(coverage.tokens), "everything stored is reused; only the 3 new tokens are prefilled"
    assert warm == cold
    divergent = PROMPT[:30] + [5, 6, 7, 8]
    cold, _, _ = generate(model, divergent)
    warm, _, reused = generate(model, divergent, cache=cache)
    assert reused == 30, "only the common prefix"
    assert warm == cold


def test_a_short_prompt_is_cached_too(model):
    cache = PrefixCache(max_bytes=10**9, max_entries=10)
    short = [300, 301, 302]
    cold, coverage, _ = generate(model, short, max_tokens=1)
    cache.store(coverage)
    warm, _, reused = generate(model, short, max_tokens=1, cache=cache)
    assert reused == 2 and warm == cold


def test_a_stored_entry_is_unchanged_by_the_request_that_reuses_it(model):
    cache = PrefixCache(max_bytes=10**9, max_entries=10)
    _, coverage, _ = generate(model, PROMPT)
    cache.store(coverage)
    before = snapshot(cache)
    generate(model, coverage.tokens + [1, 2, 3], max_tokens=40, cache=cache)  # decodes 40 tokens on top of it
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(cache), strict=True))


def test_budget_evicts_the_least_recently_used_and_refuses_what_cannot_fit(model):
    entries = []
    for start in (400, 500, 600):
        _, coverage, _ = generate(model, list(range(start, start + 20)), max_tokens=2)
        entries.append(coverage)
    size = PrefixCache(10**9, 10)
    size.store(entries[0])
    one = size.nbytes
    cache = PrefixCache(max_bytes=2 * one, max_entries=10)
    cache.store(entries[0])
    cache.store(entries[1])
    assert cache.fetch(entries[0].tokens) is not None  # entry 0 is now the most recently used
    cache.store(entries[2])
    assert cache.fetch(entries[1].tokens) is None, "the least recently used went"
    assert cache.fetch(entries[0].tokens) is not None and cache.fetch(entries[2].tokens) is not None
    tiny = PrefixCache(max_bytes=one - 1, max_entries=10)
    assert not tiny.store(entries[0])
    assert tiny.refused == 1 and len(tiny) == 0
    few = PrefixCache(max_bytes=10 * one, max_entries=1)
    few.store(entries[0])
    few.store(entries[1])
    assert len(few) == 1 and few.fetch(entries[1].tokens) is not None


def test_a_shared_prefix_is_stored_once_and_every_hit_decodes_as_cold(model):
    """Entries that start alike share the KV of their common whole blocks: four requests
    on one 200-token system prompt hold it once; a hit assembled from the shared blocks
    (cut inside a block, or reaching into an entry's own tail) decodes as a cold run."""
    system = list(range(200, 400))
    entries = [generate(model, system + [900 + 10 * i + j for j in range(10)], max_tokens=4)[1] for i in range(4)]
    per_token = token_bytes(entries[0].cache)
    cache = PrefixCache(max_bytes=10**9, max_entries=10)
    for entry in entries:
        cache.store(entry)
    shared = (200 // BLOCK_TOKENS) * BLOCK_TOKENS
    assert cache.nbytes == (shared + sum(len(e.tokens) - shared for e in entries)) * per_token
    assert cache.nbytes < 1.6 * len(entries[0].tokens) * per_token, "not four copies of the system prompt"
    for prompt, reused in ((system + [5, 6, 7], 200), (system[:130] + [5, 6, 7], 130),
                           (entries[2].tokens + [5], len(entries[2].tokens))):
        cold, _, _ = generate(model, prompt)
        warm, _, got = generate(model, prompt, cache=cache)
        assert (got, warm) == (reused, cold)
    before = snapshot(cache)
    generate(model, system + [1, 2, 3], max_tokens=30, cache=cache)
    assert all(np.array_equal(a, b) for a, b in zip(before, snapshot(cache), strict=True)), "hits copy, never alias"
    small = PrefixCache(max_bytes=cache.nbytes - per_token, max_entries=10)  # one entry's tail short of all four
    for entry in entries:
        small.store(entry)
    assert [list(k.tokens) for k in small._entries] == [e.tokens for e in entries[1:]], "the oldest went"
    hit = small.fetch(entries[0].tokens)
    assert hit is not None and len(hit.tokens) == 200, "its system prompt's blocks stay, shared by the others"
    for key in list(small._entries):
        small._forget(key)
    assert (len(small), small.nbytes) == (0, 0), "the last user of a block frees it"


def test_a_running_sequences_cache_is_kept_apart_and_its_hits_decode_as_cold(model):
    """The cache of a sequence still decoding in a batch, kept past its prefill: a later
    prompt on the same prefix decodes as a cold run, and the batch's row goes on unchanged
    by what was kept or by the hit."""
    net, _ = model
    system = list(range(200, 400))
    alone, _, _ = generate(model, system + [7, 8], max_tokens=8)
    backend = MlxBatchBackend(net, completion_batch_size=8, prefill_batch_size=8, prefill_step_size=2048)
    uid = backend.insert(system + [7, 8], 8, build_sampler(GREEDY), build_logits_processors(GREEDY))
    made: list[int] = []
    while len(made) < 3:
        made += [out.token for out in backend.step(StepPlan(2048, 8)) if out.uid == uid]
    running = backend.running_cache(uid)
    assert running is not None and running.tokens[:len(system) + 2] == system + [7, 8]
    cache = PrefixCache(max_bytes=10**9, max_entries=10)
    cache.store(running)
    kept = snapshot(cache)
    cold, _, _ = generate(model, system + [5, 6])
    warm, _, reused = generate(model, system + [5, 6], cache=cache)
    assert (reused, warm) == (len(system), cold)
    while len(made) < 8:
        made += [out.token for out in backend.step(StepPlan(2048, 8)) if out.uid == uid]
    assert made == alone, "the running sequence decodes on as if nothing were kept"
    assert all(np.array_equal(a, b) for a, b in zip(kept, snapshot(cache), strict=True)), "kept apart from the batch"
    backend.close()


class Recorded:
    """A worker group's other ranks, as rank 0's cache tells them what to keep and drop."""

    def __init__(self) -> None:
        self.told: list[tuple] = []

    def keep(self, row: int, entry: int) -> None:
        self.told.append(("keep", row, entry))

    def forget(self, entry: int) -> None:
        self.told.append(("forget", entry))


def test_a_mirror_hears_each_entry_kept_and_dropped_and_hits_name_their_entry(model):
    """The other ranks of a group keep their shards of exactly rank 0's entries."""
    entries = [generate(model, list(range(start, start + 20)), max_tokens=2)[1] for start in (400, 500)]
    mirror = Recorded()
    cache = PrefixCache(max_bytes=10**9, max_entries=1, mirror=mirror)
    rowless = Coverage(entries[0].cache, entries[0].tokens)
    assert cache.store(rowless) is None, "a cache no row can be named for is not kept where others copy it"
    first, second = (Coverage(e.cache, e.tokens, row=row) for row, e in ((7, entries[0]), (9, entries[1])))
    assert cache.store(first) == 1
    hit = cache.fetch(first.tokens + [3])
    assert hit is not None and hit.entry == 1 and hit.tokens == first.tokens
    assert cache.store(second) == 2  # one entry at most: the first goes
    assert mirror.told == [("keep", 7, 1), ("forget", 1), ("keep", 9, 2)]


def test_hits_count_only_when_used(model):
    cache = PrefixCache(max_bytes=10**9, max_entries=10)
    _, coverage, _ = generate(model, PROMPT)
    cache.store(coverage)
    cache.fetch(PROMPT)
    assert (cache.hits, cache.misses) == (0, 0)
    generate(model, PROMPT, cache=cache)
    cache.count(cache.fetch(PROMPT))
    cache.count(cache.fetch([9, 9, 9]))
    assert (cache.hits, cache.misses, cache.stats().hit_rate) == (1, 1, 0.5)


worker = worker_fixture()


@ON_BOTH
def test_miss_hit_miss_hit_through_the_worker(worker, r, outputs, new_id):
    """The seeds' table, from `usage.cached_tokens`: first MISS, same prompt HIT,
    different prompt MISS, back to the first HIT."""
    first = {"prompt_tokens": list(range(200, 260)), "max_tokens": 5}
    other = {"prompt_tokens": list(range(700, 760)), "max_tokens": 5}
    seen = []
    for body in (first, first, other, first):
        rid = new_id()
        xadd_json(r, worker.queue, rid, body)
        done = check_stream(outputs.of(rid))
        assert isinstance(done, Done)
        seen.append(done.usage.cached_tokens)
    assert seen == [0, 59, 0, 59]
    deadline = time.monotonic() + 10
    while (stats := json.loads(r.get(KEYS.worker(worker.consumer))))["prefix_cache"]["hits"] < 2:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert stats["prefix_cache"]["entries"] >= 2 and stats["prefix_cache"]["bytes"] > 0
    assert stats["memory"]["active"] > 0 and {"peak", "cache"} <= set(stats["memory"])
    assert stats["running"] == 0 and stats["waiting"] == 0


@ON_BOTH
def test_different_users_share_a_system_prompt(worker, r, outputs, new_id):
    """Chat requests with the same system prompt and different user messages reuse the system part."""
    system = {"role": "system", "content": "You are a careful assistant who answers in one short sentence. " * 4}
    cached = []
    for question in ("What is a queue?", "Why batch requests?"):
        rid = new_id()
        xadd_json(r, worker.queue, rid, {"messages": [system, {"role": "user", "content": question}],
                                         "max_tokens": 4})
        done = check_stream(outputs.of(rid))
        cached.append(done.usage.cached_tokens)
    assert cached[0] == 0 and cached[1] >= 40


def system_prompt(seed: int) -> list[int]:
    """A long shared prompt of its own (1,201 tokens) that slows the worker's steps while it
    runs (`SLOW_TOKEN`): its prefill takes several steps of a quarter second each."""
    rng = random.Random(seed)
    return [SLOW_TOKEN] + [rng.randrange(10, 1000) for _ in range(1200)]


def test_a_request_reuses_the_prompt_of_a_request_still_running(worker, r, outputs, new_id):
    """The second request on a system prompt hits the first's cache while the first still
    runs (it cannot end by itself), not only once it has ended."""
    shared = system_prompt(1)
    first, second = new_id(), new_id()
    xadd_json(r, worker.queue, first, {"prompt_tokens": shared + [40, 41], "max_tokens": 2000, "ignore_eos": True})
    wait_for_deltas(r, wait_for(lambda: output_stream(r, first)), [first])  # past its prefill
    xadd_json(r, worker.queue, second, {"prompt_tokens": shared + [50], "max_tokens": 2})
    done = check_stream(outputs.of(second))
    assert isinstance(done, Done) and done.usage.cached_tokens == len(shared)
    r.set(KEYS.cancel_flag(worker.queue, first), 1, ex=60)
    r.publish(KEYS.cancel_channel(worker.queue), first)
    end = check_stream(outputs.of(first))
    assert isinstance(end, Done) and end.finish_reason == "cancelled" and end.usage.cached_tokens == 0


def test_requests_sent_together_on_a_new_system_prompt_prefill_it_once(worker, r, outputs, new_id):
    """Two requests that arrive together on a prompt nothing holds yet: one waits for the
    other's prefill and reuses it, instead of computing the same prefix beside it."""
    shared = system_prompt(2)
    ids = [new_id(), new_id()]
    with r.pipeline(transaction=False) as pipe:
        for i, rid in enumerate(ids):
            pipe.xadd(KEYS.queue(worker.queue), {"id": rid, "json": json.dumps(
                {"prompt_tokens": shared + [60 + i], "max_tokens": 2})})
        pipe.execute()
    dones = [check_stream(outputs.of(rid)) for rid in ids]
    assert all(isinstance(d, Done) for d in dones), dones
    assert sorted(d.usage.cached_tokens for d in dones) == [0, len(shared)]
