"""Speculative decoding by batch size: tok/s without it, with the worker's gate, and
always speculating, with acceptance and tokens per sequence step, on the worker's own
text backend in process (no queue); the gate both fresh ("cold": the first burst a worker sees
at that batch size) and after one burst ("warm").

    python -m mlxq.blas .venv/bin/python docs/spec_bench.py MODEL [--rows 1,2,4,8,16] [--rounds 2]
        [--method ngram|draft|itself]

MODEL is the trained demo model (`mlxq demo-model --trained`): random weights accept
almost nothing. `--method`: prompt lookup (`ngram`, the default), the draft trained
beside it (`draft`: MODEL/draft), or the model itself as its draft (`itself`: every
draft accepted, the upper bound of what a draft model can give). Prompts are 200-token windows of the standard library's sources, greedy,
256 new tokens each, inserted together; each (rows, way) runs in a fresh process-local
backend, the ways alternating, `--rounds` times.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

WAYS = ("plain", "gate", "always")


def run(model: str, prompts: list[list[int]], new_tokens: int, way: str,
        speculation: dict[str, Any]) -> list[dict[str, Any]]:
    """The way's burst on a fresh backend; for the gate, a second burst on the same
    backend too (its gate has measured this batch size: a worker that has run a while)."""
    from worker.engine.backends import load_model
    from worker.settings import WorkerSettings

    loaded = load_model(WorkerSettings(model=model, cache_memory_mb=0, **({} if way == "plain" else speculation)))
    backend = loaded.make_backend()
    if way == "always":
        backend._generator._generation_batch.gate.adaptive = False
    burst(backend, [prompts[0][:16]], 4)  # warm-up
    rows = []
    for label in (["gate cold", "gate warm"] if way == "gate" else [way]):
        before = loaded.speculation() if loaded.speculation else {}
        tok_s, steps = burst(backend, prompts, new_tokens)
        after = loaded.speculation() if loaded.speculation else {}
        drafted = after.get("draft_tokens", 0) - before.get("draft_tokens", 0)
        accepted = after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0)
        rows.append({"rows": len(prompts), "way": label, "tok_s": tok_s, "steps": steps,
                     "tokens_per_sequence_step": round(new_tokens / steps, 2),
                     "speculative_steps": after.get("steps", 0) - before.get("steps", 0),
                     "acceptance": round(accepted / drafted, 3) if drafted else None})
    return rows


def burst(backend: Any, prompts: list[list[int]], new_tokens: int) -> tuple[int, int]:
    """The prompts inserted together and decoded to the end: tok/s and steps."""
    from mlx_lm.sample_utils import greedy_sampler

    from worker.engine.scheduler import StepPlan

    uids = [backend.insert(p, new_tokens, greedy_sampler, []) for p in prompts]
    left, steps = set(uids), 0
    start = time.perf_counter()
    while left:
        left -= {t.uid for t in backend.step(StepPlan(4096, 64)) if t.finish_reason}
        steps += 1
    return round(len(prompts) * new_tokens / (time.perf_counter() - start)), steps


def main() -> None:
    from mlxq.demo_trained import corpus_tokens

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-lookup-max", type=int, default=3)
    parser.add_argument("--method", choices=("ngram", "draft", "itself"), default="ngram")
    args = parser.parse_args()
    speculation = {"ngram": {"prompt_lookup_max": args.prompt_lookup_max},
                   "draft": {"draft_model": str(Path(args.model) / "draft")},
                   "itself": {"draft_model": args.model}}[args.method]
    corpus = corpus_tokens(Path(args.model))
    for rows in (int(n) for n in args.rows.split(",")):
        rng = random.Random(rows)
        prompts = [corpus[s:s + 200].tolist() for s in (rng.randrange(len(corpus) - 300) for _ in range(rows))]
        for _ in range(args.rounds):
            for way in WAYS:
                for row in run(args.model, prompts, args.new_tokens, way, speculation):
                    print(json.dumps({"method": args.method, **row}), flush=True)


if __name__ == "__main__":
    main()
