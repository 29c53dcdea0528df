"""How many requests that share a long system prompt the prefix cache holds within one
budget: entries kept whole (before 2026-12-05) against shared blocks (`kv_blocks`).

    .venv/bin/python -m mlxq.blas .venv/bin/python docs/prefix_blocks.py ~/.cache/mlxq/pinned-bench

16 requests, one 1,300-token system prompt and a 20-token question each, 8 new tokens;
the budget is four whole entries. Then the hit rate of 16 more questions on the same
prompt, each looked up once. Then one worker's cache under the placement benchmark's
workload: 32 requests, each of one of 8 tenants' 1,500-token system prompts (drawn at
random) and a question, looked up then stored in turn, in a budget of 8 whole entries.
"""

from __future__ import annotations

import random
import sys

from mlx_lm import load

import worker.engine.prefix_cache as prefix_cache
from worker.engine.backends.mlx_lm import MlxBatchBackend
from worker.engine.kv_blocks import token_bytes
from worker.engine.prefix_cache import PrefixCache
from worker.engine.sampling import build_logits_processors, build_sampler
from worker.engine.scheduler import StepPlan
from worker.messages import SamplingParams

SYSTEM, QUESTION, REQUESTS = 1300, 20, 16


def finished(model, prompts: list[list[int]]) -> list:
    """Each prompt's finished cache, greedy, 8 new tokens."""
    backend = MlxBatchBackend(model, completion_batch_size=16, prefill_batch_size=4, prefill_step_size=2048)
    for prompt in prompts:
        backend.insert(prompt, 8, build_sampler(SamplingParams()), build_logits_processors(SamplingParams()))
    done = {}
    while len(done) < len(prompts):
        for out in backend.step(StepPlan(prefill_chunk=2048, prefill_prompts=4)):
            if out.finish_reason is not None:
                done[out.uid] = out.coverage
    backend.close()
    return [done[uid] for uid in sorted(done)]


def main(path: str) -> None:
    model = load(path)[0]
    system = [10 + i % 900 for i in range(SYSTEM)]
    asked = [system + [100 + 7 * i + j for j in range(QUESTION)] for i in range(2 * REQUESTS)]
    entries = finished(model, asked[:REQUESTS])
    budget = 4 * len(entries[0].tokens) * token_bytes(entries[0].cache)
    splittable = prefix_cache.splittable
    for name, blocks in (("whole entries", False), ("shared blocks", True)):
        prefix_cache.splittable = splittable if blocks else (lambda cache: False)
        cache = PrefixCache(budget, 256)
        for entry in entries:
            cache.store(entry)
        hits = [cache.fetch(prompt) for prompt in asked[REQUESTS:]]
        reused = sum(len(h.tokens) for h in hits if h is not None)
        print(f"{name}: {len(cache)} of {REQUESTS} requests held in {cache.nbytes / 2**20:.1f} MiB "
              f"(budget {budget / 2**20:.1f} MiB); then {sum(h is not None for h in hits)} of {REQUESTS} "
              f"new questions hit, reusing {reused} prompt tokens")

    rng = random.Random(0)
    tenants = [[10 + (t * 131 + i) % 900 for i in range(1500)] for t in range(8)]
    drawn = [tenants[rng.randrange(8)] + [100 + 7 * i + j for j in range(QUESTION)] for i in range(32)]
    entries = finished(model, drawn)
    budget = 8 * len(entries[0].tokens) * token_bytes(entries[0].cache)
    for name, blocks in (("whole entries", False), ("shared blocks", True)):
        prefix_cache.splittable = splittable if blocks else (lambda cache: False)
        cache, hits = PrefixCache(budget, 256), 0
        for prompt, entry in zip(drawn, entries, strict=True):
            hit = cache.fetch(prompt)
            hits += hit is not None and len(hit.tokens) >= 1500
            cache.store(entry)
        print(f"8 tenants, {name}: {hits} of 32 requests found their tenant's prompt cached (at most 24); "
              f"{len(cache)} entries held at the end")


if __name__ == "__main__":
    main(sys.argv[1])
