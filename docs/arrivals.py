"""What arrivals through a queue cost mlx-lm's batch itself, with no worker around it.

`mlxq bench`'s in-process baselines refill every freed slot at once: requests of one
length then start, run and end together, eight prompts share a prefill and the batch's
rows keep one length. Through a queue a request arrives when its producer sends it (in
`mlxq bench`, when the one before it ended, a round trip later), so requests start a
step or more apart and stay apart. Three runs of the same prompts, alternating, each
`--pairs` times, on one thread:

- together: mlx-lm's BatchGenerator, every freed slot refilled at once (the baselines);
- one a step: the same, at most one request inserted per step (a queue's arrivals);
- joining: the worker's backend (`MlxBatchBackend`, whose prefilled prompts join the
  batch before their first step, `worker.backends.joining`), the same arrivals.

    MKL_NUM_THREADS=1 taskset -c 0 .venv/bin/python -m mlxq.blas .venv/bin/python docs/arrivals.py MODEL_DIR
        [--requests 256] [--concurrency 16] [--input-len 100] [--output-len 128] [--pairs 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from worker.backends.mlx_lm import MlxBatchBackend
from worker.cpu_scheduling import use_batch_scheduling
from worker.messages import SamplingParams
from worker.sampling import build_sampler
from worker.scheduler import StepPlan

Step = Callable[[], list[tuple[int, bool]]]  # one step: (uid, finished) per token made
Insert = Callable[[list[int], int], int]


def drive(insert: Insert, step: Step, prompts: list[list[int]], width: int, output_len: int,
          one_a_step: bool) -> float:
    """Tokens per second with `width` requests at a time."""
    waiting, running, tokens = list(prompts), 0, 0
    started = time.perf_counter()
    while waiting or running:
        room = min(width - running, len(waiting))
        for _ in range(min(room, 1) if one_a_step else room):
            insert(waiting.pop(), output_len)
            running += 1
        for _, finished in step():
            tokens += 1
            running -= finished
    return tokens / (time.perf_counter() - started)


def mlx_lm_run(model, prompts: list[list[int]], width: int, output_len: int, one_a_step: bool) -> float:
    generator = BatchGenerator(model, stop_tokens=[], completion_batch_size=width, prefill_batch_size=min(width, 8))

    def insert(prompt: list[int], max_tokens: int) -> int:
        return generator.insert([prompt], max_tokens=[max_tokens])[0]

    def step() -> list[tuple[int, bool]]:
        return [(r.uid, r.finish_reason is not None) for r in generator.next()[1]]

    try:
        return drive(insert, step, prompts, width, output_len, one_a_step)
    finally:
        generator.close()


def joining_run(model, prompts: list[list[int]], width: int, output_len: int) -> float:
    backend = MlxBatchBackend(model, completion_batch_size=width, prefill_batch_size=min(width, 8),
                              prefill_step_size=2048)
    greedy, plan = build_sampler(SamplingParams()), StepPlan(2048, min(width, 8))

    def insert(prompt: list[int], max_tokens: int) -> int:
        return backend.insert(prompt, max_tokens, greedy, [])

    def step() -> list[tuple[int, bool]]:
        return [(t.uid, t.finish_reason is not None) for t in backend.step(plan)]

    try:
        return drive(insert, step, prompts, width, output_len, one_a_step=True)
    finally:
        backend.close()


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
        "joining": lambda: joining_run(model, prompts, args.concurrency, args.output_len),
    }
    runs["together"]()  # warm-up
    results: dict[str, list[float]] = {name: [] for name in runs}
    for pair in range(args.pairs):
        for name, run in runs.items():
            results[name].append(run())
        print(f"pair {pair + 1}: " + ", ".join(f"{name} {values[-1]:,.0f}" for name, values in results.items())
              + " tok/s", flush=True)
    together = results["together"]
    for name in ("one a step", "joining"):
        ratios = [ours / base for ours, base in zip(results[name], together, strict=True)]
        print(f"{name} / together: median {statistics.median(ratios):.3f} ({', '.join(f'{r:.3f}' for r in ratios)})")
    ratios = [ours / base for ours, base in zip(results["joining"], results["one a step"], strict=True)]
    print(f"joining / one a step: median {statistics.median(ratios):.3f} ({', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
