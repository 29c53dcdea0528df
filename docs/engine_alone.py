"""The worker's engine without Redis, against raw BatchGenerator, on the same prompts.

The engine (its thread, the step budget, samplers, detokenizing, stop checks, events) is
driven in process: requests go in through `Engine.submit`, events come out of its
`on_output`, and nothing else runs. Raw BatchGenerator runs the same requests on the
main thread. The two alternate, `--pairs` times. Printed per run: tok/s, TTFT and ITL
(concurrency 1), and how busy MLX's compute thread was (its CPU seconds over the run's
wall time): a share below 100 % is time the model waited for Python. With `--threads`
(Linux), each busy thread's CPU and context switches per token, from /proc: how often
MLX's compute thread went to sleep (voluntary) and the driving thread was preempted.

    .venv/bin/python -m mlxq.blas .venv/bin/python docs/engine_alone.py MODEL_DIR [--concurrency 16] [--pairs 3]
        [--flush-ms 10] [--threads] [--backlog: every request handed over at once]
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import time
from collections.abc import Callable

import psutil
from mlx_lm.generate import BatchGenerator

from client import Delta, Done
from mlxq.bench import Planned, Workload
from worker.engine.backends.mlx_lm import load_text_model
from worker.engine.scheduler import SchedulingPolicy
from worker.engine.thread import Engine
from worker.messages import EngineRequest, Queueing, RequestRef, SamplingParams, Stopping
from worker.settings import WorkerSettings

Run = Callable[[list[Planned], int], tuple[int, list[float], list[float]]]  # tokens, TTFTs, ITLs


def through_engine(engine: Engine, outputs: queue.Queue, backlog: bool = False) -> Run:
    """`backlog`: every request handed over at once, the batch as wide as --concurrency."""
    def run(planned: list[Planned], width: int) -> tuple[int, list[float], list[float]]:
        waiting, started, last, ttft, itl, tokens = list(planned), {}, {}, [], [], 0

        def submit() -> None:
            request, rid = waiting.pop(0), f"r{time.time_ns()}"
            started[rid] = time.perf_counter()
            engine.submit(EngineRequest(RequestRef(rid, "1-0"), request.prompt_tokens, SamplingParams(),
                                        Stopping(request.max_tokens), Queueing(0, time.time())))

        for _ in range(len(waiting) if backlog else min(width, len(waiting))):
            submit()
        while started:
            out = outputs.get()
            now = time.perf_counter()
            for item in out.outgoing:
                rid = item.ref.id
                if isinstance(item.event, Delta):
                    if rid in last:  # a delta may carry several steps' tokens (the flush)
                        count = len(item.event.tokens)
                        itl.extend([(now - last[rid]) / count] * count)
                    else:
                        ttft.append(now - started[rid])
                    last[rid] = now
                elif isinstance(item.event, Done):
                    tokens += item.event.usage.completion_tokens
                    del started[rid]
                    if waiting:
                        submit()
        return tokens, ttft, itl
    return run


def raw(model: object, backlog: bool = False) -> Run:
    def run(planned: list[Planned], width: int) -> tuple[int, list[float], list[float]]:
        generator = BatchGenerator(model, stop_tokens=[], completion_batch_size=width,
                                   prefill_batch_size=min(width, 8))
        waiting, started, last, ttft, itl, tokens = list(planned), {}, {}, [], [], 0
        while waiting or started:
            while waiting and (backlog or len(started) < width):
                request = waiting.pop(0)
                (uid,) = generator.insert([request.prompt_tokens], max_tokens=[request.max_tokens])
                started[uid] = time.perf_counter()
            responses = generator.next_generated()
            now = time.perf_counter()
            for response in responses:
                uid = response.uid
                gaps = itl if uid in last else ttft
                gaps.append(now - last.get(uid, started[uid]))
                last[uid] = now
                tokens += 1
                if response.finish_reason:
                    del started[uid]
        generator.close()
        return tokens, ttft, itl
    return run


def switches() -> dict[str, tuple[int, int]]:
    """Each thread's (voluntary, involuntary) context switches so far (Linux)."""
    counts = {}
    for tid in os.listdir("/proc/self/task"):
        fields = dict(line.split(":", 1) for line in open(f"/proc/self/task/{tid}/status"))
        counts[tid] = (int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"]))
    return counts


def measured(name: str, run: Run, planned: list[Planned], width: int, threads: bool = False) -> None:
    me = psutil.Process()
    before = {t.id: t.user_time + t.system_time for t in me.threads()}
    switched = switches() if threads else {}
    started = time.perf_counter()
    tokens, ttft, itl = run(planned, width)
    wall = time.perf_counter() - started
    busiest = max(t.user_time + t.system_time - before.get(t.id, 0.0) for t in me.threads())
    total = sum(t.user_time + t.system_time - before.get(t.id, 0.0) for t in me.threads())
    print(f"{name:6s} {tokens / wall:6.1f} tok/s  TTFT p50 {statistics.median(ttft) * 1000:6.1f} ms  "
          f"ITL p50 {statistics.median(itl) * 1000:5.2f} ms  compute thread {100 * busiest / wall:5.1f}% busy, "
          f"{1000 * busiest / tokens:.2f} ms a token; all threads {total:.1f} s",
          flush=True)
    if threads:
        now = switches()
        for t in me.threads():
            cpu = t.user_time + t.system_time - before.get(t.id, 0.0)
            if cpu > 0.05 * wall:
                voluntary, involuntary = (a - b for a, b in zip(now[str(t.id)], switched.get(str(t.id), (0, 0)), strict=True))
                print(f"       thread {t.id}: {1e6 * cpu / tokens:5.1f} us a token, switches a token: "
                      f"{voluntary / tokens:.2f} voluntary, {involuntary / tokens:.2f} involuntary")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=0, help="default: 6 at concurrency 1, else 3 x concurrency")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--flush-ms", type=float, default=10.0, help="the engine's flush interval (flush_interval_ms)")
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--threads", action="store_true", help="per-thread CPU and context switches (Linux)")
    parser.add_argument("--backlog", action="store_true", help="every request at once (a queue's backlog)")
    args = parser.parse_args()
    loaded = load_text_model(WorkerSettings(model=args.model))
    outputs: queue.Queue = queue.Queue()
    engine = Engine(lambda: loaded, SchedulingPolicy(args.concurrency, flush_interval_s=args.flush_ms / 1000),
                    on_output=outputs.put, on_fatal=print)
    engine.start()
    engine.wait_ready(60)
    spare = loaded.make_backend()  # the loaded model, for raw BatchGenerator beside the engine's
    model = spare._model  # the model itself, not the adapters' wrapper the batch calls
    spare.close()
    requests = args.requests or (6 if args.concurrency == 1 else 3 * args.concurrency)
    warm_up = Workload(requests=2, output_len=8, seed=1).plan()
    for run in (raw(model), through_engine(engine, outputs)):
        run(warm_up, 2)
    for pair in range(args.pairs):
        planned = Workload(requests=requests, input_len=100, output_len=args.output_len, seed=100 + pair).plan()
        measured("raw", raw(model, args.backlog), planned, args.concurrency, args.threads)
        measured("engine", through_engine(engine, outputs, args.backlog), planned, args.concurrency, args.threads)


if __name__ == "__main__":
    main()
