"""A 16-row decode step of mlx-lm's batch as it ships against the engine's
(`backends.lean_batch`: no logprobs unless a row asks), alternated, three runs of 128
steps each way (docs/benchmarks.md, "Logprobs only when asked").

    MKL_NUM_THREADS=1 taskset -c 0 .venv/bin/python -m mlxq.blas .venv/bin/python \
        docs/lean_step.py ~/.cache/mlxq/pinned-small
"""

from __future__ import annotations

import random
import sys
import time

from mlx_lm.generate import BatchGenerator

from mlxq.bench import _loaded
from worker.engine.backends.lean_batch import LeanGenerationBatch
from worker.engine.cpu_scheduling import use_batch_scheduling


def step_ms(model: object, lean: bool, rng: random.Random) -> float:
    generator = BatchGenerator(model, completion_batch_size=16, prefill_batch_size=16)
    if lean:
        generator._generation_batch = LeanGenerationBatch.lean(model, generator.sampler)
    generator.insert([[rng.randrange(100, 1000) for _ in range(100)] for _ in range(16)], max_tokens=[100_000] * 16)
    for _ in range(5):
        generator.next()
    started = time.perf_counter()
    for _ in range(128):
        generator.next()
    elapsed = (time.perf_counter() - started) / 128 * 1000
    generator.close()
    return elapsed


def main(model_path: str) -> None:
    use_batch_scheduling()
    model, _ = _loaded(model_path)
    rng = random.Random(0)
    for _ in range(2):
        for lean in (False, True):
            runs = [step_ms(model, lean, rng) for _ in range(3)]
            print(f"{'lean' if lean else 'mlx-lm'}: {' '.join(f'{ms:.2f}' for ms in runs)} ms a step")


if __name__ == "__main__":
    main(sys.argv[1])
