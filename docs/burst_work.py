"""A 16-prompt burst through the worker and then in process, with the work each did.

For each side: tokens/s, the CPU seconds of its busiest threads (MLX's compute thread
first), how busy that thread was, its CPU per generated token, and what mlx-lm's
BatchGenerator was asked to compute: decode steps and rows, the attention length they
covered, prefill calls, rows and (padded) tokens, and how often the running batch was
extended or filtered (each a copy of its KV cache). The worker must be started through
this script, so that its BatchGenerator counts too:

    .venv/bin/python -m mlxq.blas .venv/bin/python docs/burst_work.py worker --redis-url URL \\
        --model MODEL_DIR --queue Q --max-num-seqs 16 --prefetch 0 [--max-step-tokens N]
    .venv/bin/python -m mlxq.blas .venv/bin/python docs/burst_work.py burst URL Q WORKER_PID MODEL_DIR SEED
"""

from __future__ import annotations

import collections
import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil

generate = importlib.import_module("mlx_lm.generate")  # the package's `generate` is a function
WORK: collections.Counter[str] = collections.Counter()
DUMP = Path("/tmp/mlxq-burst-work-{pid}.json")


def count_work() -> None:
    """Wrap BatchGenerator's batches so that they count what they compute."""
    step, prompt = generate.GenerationBatch._step, generate.PromptProcessingBatch.prompt

    def counted_step(self: Any) -> Any:
        WORK["decode steps"] += 1
        WORK["decode rows"] += len(self.uids)
        WORK["decode attention"] += getattr(self.prompt_cache[0], "_idx", 0) * len(self.uids) if self.prompt_cache else 0
        return step(self)

    def counted_prompt(self: Any, tokens: list[list[int]]) -> Any:
        if tokens:
            WORK["prefill calls"] += 1
            WORK["prefill rows"] += len(tokens)
            WORK["prefill tokens"] += sum(len(t) for t in tokens)
            WORK["prefill padded"] += max(len(t) for t in tokens) * len(tokens)
        return prompt(self, tokens)

    generate.GenerationBatch._step, generate.PromptProcessingBatch.prompt = counted_step, counted_prompt
    for name in ("extend", "filter"):
        def counted(self: Any, *args: Any, _method: Any = getattr(generate.GenerationBatch, name),
                    _name: str = name) -> Any:
            WORK[f"batch {_name}s"] += 1
            return _method(self, *args)
        setattr(generate.GenerationBatch, name, counted)


def worker_work(pid: int) -> dict[str, int]:
    """The counting worker's totals so far (it writes them on SIGUSR2)."""
    os.kill(pid, signal.SIGUSR2)
    time.sleep(0.3)
    return json.loads(Path(str(DUMP).format(pid=pid)).read_text())


def thread_seconds(process: psutil.Process) -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in process.threads()}


def report(name: str, process: psutil.Process, before: dict[int, float], wall: float, tokens: int,
           work: dict[str, int]) -> None:
    spent = sorted((seconds - before.get(tid, 0.0) for tid, seconds in thread_seconds(process).items()), reverse=True)
    print(f"{name}: {tokens / wall:.1f} tok/s; busiest threads {', '.join(f'{s:.2f}' for s in spent[:3])} s of "
          f"{wall:.2f} s ({100 * spent[0] / wall:.1f} % busy, {1000 * spent[0] / tokens:.2f} ms a token)", flush=True)
    print(f"  work: {work}", flush=True)


def burst(url: str, queue: str, worker_pid: int, model: str, seed: int) -> None:
    from client import Client
    from client.keys import Keys
    from mlxq.bench import Workload, in_process

    planned = Workload(requests=48, input_len=100, output_len=96, seed=seed).plan()
    worker = psutil.Process(worker_pid)
    with Client(url, queue=queue) as client:
        client.generate("warm up", max_tokens=2, timeout=60)
        work_before, before, started = worker_work(worker_pid), thread_seconds(worker), time.monotonic()
        jobs = [client.submit(prompt_tokens=p.prompt_tokens, max_tokens=p.max_tokens) for p in planned]
        tokens = sum(job.result(timeout=120).usage.completion_tokens for job in jobs)
        wall = time.monotonic() - started
    work = worker_work(worker_pid)
    report("worker    ", worker, before, wall, tokens, {k: v - work_before.get(k, 0) for k, v in work.items()})
    count_work()
    in_process(model, planned[:4], 4, lambda _: None)  # warm-up, untimed
    WORK.clear()
    me = psutil.Process()
    before = thread_seconds(me)
    timings = in_process(model, planned, 16, lambda _: None)
    wall = max(t.done or 0.0 for t in timings) - min(t.submitted for t in timings)
    report("in process", me, before, wall, sum(t.tokens for t in timings), dict(WORK))


def serve(argv: list[str]) -> None:
    count_work()
    signal.signal(signal.SIGUSR2, lambda *_: Path(str(DUMP).format(pid=os.getpid())).write_text(json.dumps(WORK)))
    from mlxq.cli import main

    sys.argv = ["mlxq", "worker", *argv]
    sys.exit(main())


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        serve(sys.argv[2:])
    else:
        burst(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6]))
