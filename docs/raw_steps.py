"""Raw BatchGenerator's steps on a backlog, timed one by one: how many steps carry a
prefill and what they cost, beside the decode steps of a full batch (docs/benchmarks.md,
"Where the backlog's gap is"). The same prompts as `mlxq bench --backlog --seed S`.

Then the fastest any BatchGenerator-based engine could work through that backlog on this
core (docs/benchmarks.md, "How fast a backlog can go"): every generated token after a
request's first in a decode step of the full width, at raw's median time for one, and
every prompt token at the cheapest a token costs in one forward pass of 1, 2, 4, 8 or 16
whole prompts. Nothing can do better without computing less.

    MKL_NUM_THREADS=1 taskset -c 0 .venv/bin/python -m mlxq.blas .venv/bin/python \
        docs/raw_steps.py ~/.cache/mlxq/pinned-small 901
"""

from __future__ import annotations

import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

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
    prompt_tokens = sum(len(r.prompt_tokens) for r in planned)
    per_prompt_token = min(_prefill_s(model, planned, group) / (group * len(planned[0].prompt_tokens))
                           for group in (1, 2, 4, 8, 16))
    decode_s = (tokens - len(planned)) / width * statistics.median(full)
    bound_s = decode_s + prompt_tokens * per_prompt_token
    print(f"bound: {tokens / bound_s:.0f} tok/s ({decode_s:.3f} s decoding, {prompt_tokens} prompt tokens at "
          f"{per_prompt_token * 1e6:.0f} us each); raw BatchGenerator made {bound_s / elapsed:.3f} of it")


def _prefill_s(model, planned: list, group: int, repeats: int = 5) -> float:
    """The median time of one forward pass over `group` of the workload's prompts."""
    prompts = mx.array([r.prompt_tokens for r in planned[:group]])
    times = []
    for _ in range(repeats):
        cache = make_prompt_cache(model)
        started = time.perf_counter()
        mx.eval(model(prompts, cache=cache))
        times.append(time.perf_counter() - started)
    return statistics.median(times)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
