"""What arrivals through a queue cost mlx-lm's batch itself, with no worker around it.

`mlxq bench`'s in-process baselines refill every freed slot at once: requests of one
length then start, run and end together, eight prompts share a prefill and the batch's
rows keep one length. Through a queue a request arrives when its producer sends it (in
`mlxq bench`, when the one before it ended, a round trip later), so requests start a
step or more apart and stay apart. Two runs of mlx-lm's BatchGenerator on the same
prompts, alternating, `--pairs` times, on one thread (batch-scheduled, as the worker's
engine thread and the baselines run):

- together: every freed slot refilled at once (the baselines);
- one a step: at most one request inserted per step (a queue's arrivals).

    MKL_NUM_THREADS=1 taskset -c 0 .venv/bin/python -m mlxq.blas .venv/bin/python docs/arrivals.py MODEL_DIR
        [--requests 256] [--concurrency 16] [--input-len 100] [--output-len 128] [--pairs 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from worker.cpu_scheduling import use_batch_scheduling


def mlx_lm_run(model: Any, prompts: list[list[int]], width: int, output_len: int, one_a_step: bool) -> float:
    """Tokens per second with `width` requests at a time."""
    generator = BatchGenerator(model, stop_tokens=[], completion_batch_size=width, prefill_batch_size=min(width, 8))
    waiting, running, tokens = list(prompts), 0, 0
    started = time.perf_counter()
    try:
        while waiting or running:
            room = min(width - running, len(waiting))
            for _ in range(min(room, 1) if one_a_step else room):
                generator.insert([waiting.pop()], max_tokens=[output_len])
                running += 1
            for response in generator.next()[1]:
                tokens += 1
                running -= response.finish_reason is not None
        return tokens / (time.perf_counter() - started)
    finally:
        generator.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    use_batch_scheduling()  # as the worker's engine thread and the baselines run
    model = load(args.model)[0]
    rng = random.Random(700)
    prompts = [[rng.randrange(10, 1000) for _ in range(args.input_len)] for _ in range(args.requests)]
    runs = {
        "together": lambda: mlx_lm_run(model, prompts, args.concurrency, args.output_len, one_a_step=False),
        "one a step": lambda: mlx_lm_run(model, prompts, args.concurrency, args.output_len, one_a_step=True),
    }
    runs["together"]()  # warm-up
    results: dict[str, list[float]] = {name: [] for name in runs}
    for pair in range(args.pairs):
        for name, run in runs.items():
            results[name].append(run())
        print(f"pair {pair + 1}: " + ", ".join(f"{name} {values[-1]:,.0f}" for name, values in results.items())
              + " tok/s", flush=True)
    ratios = [ours / base for ours, base in zip(results["one a step"], results["together"], strict=True)]
    print(f"one a step / together: median {statistics.median(ratios):.3f} ({', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
