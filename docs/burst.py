"""Submit N requests at once through the client and report total throughput.

    .venv/bin/python docs/burst.py 16            # against the embedded Valkey of `make run`

A stop-gap until `mlxq bench` exists.
"""

import sys
import time

from client import Client

n = int(sys.argv[1]) if len(sys.argv) > 1 else 16
url = sys.argv[2] if len(sys.argv) > 2 else "redis://127.0.0.1:6390"
with Client(url) as client:
    started = time.monotonic()
    jobs = [client.submit(f"Request {i}: tell me something", max_tokens=128) for i in range(n)]
    results = [job.result(timeout=600) for job in jobs]
    elapsed = time.monotonic() - started
tokens = sum(r.usage["completion_tokens"] for r in results)
ttfts = sorted(r.timing["ttft_ms"] for r in results)
print(f"{n} requests x 128 tokens: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.0f} tok/s, "
      f"TTFT p50 {ttfts[len(ttfts) // 2]:.1f} ms, max {ttfts[-1]:.1f} ms")
