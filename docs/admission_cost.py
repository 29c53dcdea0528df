"""What starting prompts costs mlx-lm's batch beyond its decode steps, one prompt at a
time against eight together (docs/benchmarks.md, "Prefill groups"): 16 rows decode,
then `group` of them are replaced by new 100-token prompts, 40 times; printed, the extra
time of the steps that start them, per group and per prompt.

    MKL_NUM_THREADS=1 taskset -c 0 .venv/bin/python -m mlxq.blas .venv/bin/python \
        docs/admission_cost.py ~/.cache/mlxq/pinned-small 1     # then 8
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from mlx_lm.generate import BatchGenerator

from mlxq.bench import _loaded
from worker.engine.cpu_scheduling import use_batch_scheduling


def main(model_path: str, group: int) -> None:
    use_batch_scheduling()
    model, tokenizer = _loaded(model_path)
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(100, 1000) for _ in range(100)]

    generator = BatchGenerator(model, completion_batch_size=16, prefill_batch_size=8)
    generator.insert([prompt() for _ in range(16)], max_tokens=[100_000] * 16)
    for _ in range(30):
        generator.next()
    decode, starting = [], []
    for _ in range(40):
        generator.remove(list(generator._generation_batch.uids)[:group])
        generator.insert([prompt() for _ in range(group)], max_tokens=[100_000] * group)
        started, steps = time.perf_counter(), 0
        while len(generator._generation_batch) < 16:
            generator.next()
            steps += 1
        starting.append((time.perf_counter() - started, steps))
        started = time.perf_counter()
        for _ in range(8):
            generator.next()
        decode.append((time.perf_counter() - started) / 8)
    step = statistics.median(decode)
    extra = statistics.median(spent - steps * step for spent, steps in starting)
    print(f"group of {group}: decode step {step * 1000:.2f} ms; starting it costs {extra * 1000:.2f} ms beyond its "
          f"steps' decoding, {extra * 1000 / group:.2f} ms a prompt")
    generator.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
