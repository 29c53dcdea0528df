"""A 16-prompt burst with nobody streaming: 48 requests XADDed at once to a worker with 16
slots (`--max-num-seqs 16 --prefetch 0`), timed from the first XADD until the queue's
stream is empty; then the same prompts through BatchGenerator in this process.

    .venv/bin/python -m mlxq.blas .venv/bin/python docs/no_client_burst.py REDIS_URL QUEUE MODEL_DIR SEED
"""

from __future__ import annotations

import sys
import time

from client import Client
from client.keys import Keys
from mlxq.bench import Workload, in_process


def main(url: str, queue: str, model: str, seed: int) -> None:
    planned = Workload(requests=48, input_len=100, output_len=96, seed=seed).plan()
    with Client(url, queue=queue) as client:
        client.generate("warm up", max_tokens=2, timeout=60)
        started = time.monotonic()
        jobs = [client.submit(prompt_tokens=p.prompt_tokens, max_tokens=p.max_tokens) for p in planned]
        while client.redis.xlen(Keys().queue(queue)) > 0:
            time.sleep(0.02)
        elapsed = time.monotonic() - started
        tokens = sum(job.result(timeout=60).usage.completion_tokens for job in jobs)
    print(f"worker, nobody streaming: {tokens / elapsed:.1f} tok/s")
    timings = in_process(model, planned, 16, lambda _: None)
    span = max(t.done or 0.0 for t in timings) - min(t.submitted for t in timings)
    print(f"in process:               {sum(t.tokens for t in timings) / span:.1f} tok/s")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
