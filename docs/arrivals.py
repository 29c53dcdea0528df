"""What arrivals through a queue cost mlx-lm's batch itself, with no worker around it.

`mlxq bench`'s in-process baselines refill every freed slot at once: requests of one
length then start, run and end together, eight prompts share a prefill and the batch's
rows keep one length. Through a queue a request arrives when its producer sends it (in
`mlxq bench`, when the one before it ended, a round trip later), and round trips vary:
on a small model, whose steps are shorter than a round trip, the requests that one step
freed arrive over the next few steps, start apart and stay apart. Two runs of mlx-lm's
BatchGenerator on the same prompts, alternating, `--pairs` times, on one thread
(batch-scheduled, as the worker's engine thread and the baselines run):

- together: every freed slot refilled before the next step (the baselines);
- through a queue: each freed slot refilled 1 to `--round-trip-steps` steps later, drawn
  uniformly per request (seeded): a round trip that takes a few steps.

Printed: tokens per second, the ratio of the two per pair, and how many requests each
insertion brought on average (to compare with a worker's: `_admit` in its engine core).

    MKL_NUM_THREADS=1 taskset -c 0 .venv/bin/python -m mlxq.blas .venv/bin/python docs/arrivals.py MODEL_DIR
        [--requests 64] [--concurrency 16] [--input-len 100] [--output-len 128] [--pairs 15]
        [--round-trip-steps 4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter
from typing import Any

from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from worker.engine.cpu_scheduling import use_batch_scheduling


def mlx_lm_run(model: Any, prompts: list[list[int]], width: int, output_len: int,
               round_trip_steps: int) -> tuple[float, float]:
    """Tokens per second with `width` requests at a time, each freed slot refilled 1 to
    `round_trip_steps` steps later (0: before the next step); and requests per insertion."""
    generator = BatchGenerator(model, stop_tokens=[], completion_batch_size=width, prefill_batch_size=min(width, 8))
    waiting, running, tokens, step, delays = list(prompts), 0, 0, 0, random.Random(1)
    due: Counter[int] = Counter({0: min(width, len(waiting))})  # step -> requests arriving then
    inserted, insertions = 0, 0
    started = time.perf_counter()
    try:
        while running or waiting:
            arriving = min(due.pop(step, 0), len(waiting))
            for _ in range(arriving):
                generator.insert([waiting.pop()], max_tokens=[output_len])
            running, inserted, insertions = running + arriving, inserted + arriving, insertions + (arriving > 0)
            for response in generator.next()[1]:
                tokens += 1
                if response.finish_reason is not None:
                    running -= 1
                    due[step + 1 + (delays.randint(1, round_trip_steps) if round_trip_steps else 0)] += 1
            step += 1
        return tokens / (time.perf_counter() - started), inserted / max(1, insertions)
    finally:
        generator.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--round-trip-steps", type=int, default=4)
    args = parser.parse_args()
    use_batch_scheduling()
    model = load(args.model)[0]
    rng = random.Random(700)
    prompts = [[rng.randrange(10, 1000) for _ in range(args.input_len)] for _ in range(args.requests)]
    runs = {"together": 0, "through a queue": args.round_trip_steps}
    mlx_lm_run(model, prompts, args.concurrency, args.output_len, 0)  # warm-up
    results: dict[str, list[float]] = {name: [] for name in runs}
    per_insertion: dict[str, float] = {}
    for pair in range(args.pairs):
        for name, round_trip in runs.items():
            tok_s, per_insertion[name] = mlx_lm_run(model, prompts, args.concurrency, args.output_len, round_trip)
            results[name].append(tok_s)
        print(f"pair {pair + 1}: " + ", ".join(f"{name} {values[-1]:,.0f}" for name, values in results.items())
              + " tok/s", flush=True)
    ratios = [ours / base for ours, base in zip(results["through a queue"], results["together"], strict=True)]
    print(f"through a queue / together: median {statistics.median(ratios):.3f} "
          f"({', '.join(f'{r:.3f}' for r in ratios)})")
    print("requests per insertion: " + ", ".join(f"{name} {n:.2f}" for name, n in per_insertion.items()))


if __name__ == "__main__":
    main()
