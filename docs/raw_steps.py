"""Raw BatchGenerator's steps on a backlog, timed one by one: how many steps carry a
prefill and what they cost, beside the decode steps of a full batch (docs/benchmarks.md,
"Where the backlog's gap is"). The same prompts as `mlxq bench --backlog --seed S`.

    MKL_NUM_THREADS=1 taskset -c 0 .venv/bin/python -m mlxq.blas .venv/bin/python \
        docs/raw_steps.py ~/.cache/mlxq/pinned-small 901
"""

from __future__ import annotations

import statistics
import sys
import time

from mlx_lm.generate import BatchGenerator

from mlxq.bench import Workload, _loaded
from worker.engine.cpu_scheduling import use_batch_scheduling


def main(model_path: str, seed: int, width: int = 16) -> None:
    use_batch_scheduling()
    model, tokenizer = _loaded(model_path)
    planned = Workload(seed=seed).plan()
    generator = BatchGenerator(model, stop_tokens=[[i] for i in tokenizer.eos_token_ids],
                               completion_batch_size=width, prefill_batch_size=min(width, 8))
    for request in planned:
        generator.insert([request.prompt_tokens], max_tokens=[request.max_tokens])
    steps: list[tuple[float, int, int]] = []  # seconds, rows decoding, prompts answered
    step = generator._next

    def timed() -> tuple[list, list]:
        started = time.perf_counter()
        prompts, generated = step()
        steps.append((time.perf_counter() - started, len(generator._generation_batch), len(prompts)))
        return prompts, generated

    generator._next = timed
    started, tokens, done = time.perf_counter(), 0, 0
    while done < len(planned):
        for response in generator.next_generated():
            tokens += 1
            done += response.finish_reason is not None
    elapsed = time.perf_counter() - started
    full = [s for s, rows, prompts in steps if rows == width and not prompts]
    prefill = [s for s, _, prompts in steps if prompts]
    print(f"{tokens / elapsed:.0f} tok/s; {len(steps)} steps in {elapsed:.3f} s; "
          f"{len(full)} decode steps of {width} rows, {sum(full):.3f} s "
          f"(median {statistics.median(full) * 1000:.2f} ms); "
          f"{len(prefill)} steps with prompts, {sum(prefill):.3f} s; {len(steps) - len(full) - len(prefill)} others")
    generator.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
