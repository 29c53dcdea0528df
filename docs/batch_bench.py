"""A batch against the same prompts sent directly, and interactive TTFT while a batch runs.

    python -m mlxq.blas .venv/bin/python docs/batch_bench.py MODEL [--lines 2000] [--tokens 64] [--pairs 2]

Starts one `mlxq worker` (16 slots) on an embedded Valkey of its own. Throughput: the
prompts as one batch (`Client.submit_batch`, driven by this process, as `mlxq batch
submit --wait` does) and as `--lines` direct requests, alternated `--pairs` times.
Interactive TTFT: `--interactive` requests at `--rate` a second (Poisson), alone and
again while a batch of `--lines` lines runs on the same queue. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time

PORT = 6432
QUEUE = "bench"


def body(i: int, tokens: int) -> dict[str, object]:
    return {"prompt": f"Story {i}: once upon a time in a land of queues,", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}


def direct(client: object, lines: int, tokens: int) -> float:
    started = time.perf_counter()
    jobs = [client.submit(**body(i, tokens)) for i in range(lines)]  # type: ignore[attr-defined]
    for job in jobs:
        job.result(timeout=3600)
    return lines * tokens / (time.perf_counter() - started)


def batch(client: object, lines: int, tokens: int) -> float:
    started = time.perf_counter()
    handle = client.submit_batch([{"custom_id": f"l{i}", "body": body(i, tokens)}  # type: ignore[attr-defined]
                                  for i in range(lines)])
    ended = handle.wait(timeout=3600)
    assert ended.status == "completed" and ended.completed == lines, ended
    return lines * tokens / (time.perf_counter() - started)


def ttfts(client: object, count: int, rate: float, seed: int) -> list[float]:
    """Time to first token of `count` interactive requests arriving at `rate` a second."""
    rng = random.Random(seed)
    found: list[float] = []

    def one(i: int) -> None:
        started = time.perf_counter()
        job = client.submit(f"Question {i}: what is a queue?", max_tokens=16, temperature=0)  # type: ignore[attr-defined]
        next(iter(job.stream(timeout=600)))
        found.append((time.perf_counter() - started) * 1000)
        job.result(timeout=600)

    threads = []
    for i in range(count):
        thread = threading.Thread(target=one, args=(i,))
        thread.start()
        threads.append(thread)
        time.sleep(rng.expovariate(rate))
    for thread in threads:
        thread.join()
    return found


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 1), "p99": round(ordered[min(len(ordered) - 1,
                                                                                  int(0.99 * len(ordered)))], 1)}


def main() -> None:
    from client import Client

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--interactive", type=int, default=40)
    parser.add_argument("--rate", type=float, default=2.0)
    args = parser.parse_args()
    worker = subprocess.Popen([sys.executable, "-m", "mlxq", "worker", "--model", args.model, "--queue", QUEUE,
                               "--embedded-port", str(PORT), "--max-num-seqs", "16", "--log-format", "json"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = Client(f"redis://127.0.0.1:{PORT}", queue=QUEUE)
        deadline = time.monotonic() + 120
        while True:
            try:
                client.generate("warm up", max_tokens=4, timeout=5)
                break
            except Exception:  # noqa: BLE001 - the embedded server and the model are still starting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        runs: dict[str, list[float]] = {"direct": [], "batch": []}
        for _ in range(args.pairs):
            runs["direct"].append(round(direct(client, args.lines, args.tokens)))
            runs["batch"].append(round(batch(client, args.lines, args.tokens)))
        alone = ttfts(client, args.interactive, args.rate, seed=1)
        handle = client.submit_batch([{"custom_id": f"b{i}", "body": body(i, args.tokens)} for i in range(args.lines)])
        driver = threading.Thread(target=handle.wait, kwargs={"timeout": 3600})
        driver.start()
        while handle.progress().completed < 16:  # the batch fills the slots before the interactive ones come
            time.sleep(0.1)
        beside = ttfts(client, args.interactive, args.rate, seed=1)
        during = handle.progress().status == "in_progress"
        handle.cancel()
        driver.join()
        ratios = [round(b / d, 3) for b, d in zip(runs["batch"], runs["direct"], strict=True)]
        print(json.dumps({"model": args.model, "lines": args.lines, "tokens": args.tokens, "tok_s": runs,
                          "batch_over_direct": ratios, "ttft_ms_alone": percentiles(alone),
                          "ttft_ms_beside_batch": percentiles(beside), "batch_ran_throughout": during}))
    finally:
        worker.terminate()
        worker.wait(60)


if __name__ == "__main__":
    main()
