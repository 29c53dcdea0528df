"""How long after a request's first token its first delta reaches the client, at concurrency 1.

N requests (100 prompt + 32 new tokens) one after another through a running worker;
prints the p50 of each stage in `done.timing` (ms from arrival), of the client's own
TTFT, and of the client's first delta less the worker's first token (the same request's
two stamps, so the model's run-to-run speed cancels out):

    .venv/bin/python docs/first_delta.py REDIS_URL QUEUE SEED [N]
"""

from __future__ import annotations

import statistics
import sys
import time

from client import Client
from mlxq.bench import Workload


def main(url: str, queue: str, seed: int, requests: int) -> None:
    rows = []
    with Client(url, queue=queue) as client:
        client.generate("warm up", max_tokens=2, timeout=60)
        for planned in Workload(requests=requests, input_len=100, output_len=32, seed=seed).plan():
            sent = time.time()
            job = client.submit(prompt_tokens=planned.prompt_tokens, max_tokens=planned.max_tokens)
            first = None
            for _ in job.stream(timeout=60):
                first = first or time.time()
            timing = job.result(timeout=60).timing
            assert first is not None and timing.ttft_ms is not None
            rows.append({"read": timing.read_ms, "prepared": timing.prepared_ms, "admitted": timing.queued_ms,
                         "first token": timing.ttft_ms, "written": timing.published_ms,
                         "client TTFT": (first - sent) * 1000,
                         "client less first token": (first - sent) * 1000 - timing.ttft_ms})
    print(", ".join(f"{name} {statistics.median(r[name] for r in rows if r[name] is not None):.2f}"
                    for name in rows[0]) + " (p50, ms)")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 24)
