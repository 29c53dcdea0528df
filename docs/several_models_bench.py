"""A worker of several models: time to first token of a model not loaded (its load
included) against a loaded one, and throughput of two models stepping at once against
each alone.

    python -m mlxq.blas .venv/bin/python docs/several_models_bench.py MODEL [--requests 16] [--tokens 128]

Starts `mlxq worker --config` with two models of MODEL (`hot`, pinned; `cold`, loaded on
demand) on an embedded Valkey of its own, and measures through the client SDK.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PORT = 6431


def config(model: str, out: Path) -> Path:
    lines = [f"embedded_port = {PORT}", "heartbeat_s = 0.5", "memory_budget_gb = 8", "cache_memory_mb = 0",
             'log_format = "json"', "idle_unload_s = 3600"]
    for name, pin in (("hot", True), ("cold", False)):
        lines += ["[[models]]", f'name = "{name}"', f"path = {json.dumps(model)}", f"pin = {json.dumps(pin)}",
                  "memory_gb = 2", ""]
    path = out / "bench.toml"
    path.write_text("\n".join(lines))
    return path


def first_token_ms(client: object, queue: str) -> float:
    started = time.perf_counter()
    job = client.submit("Once upon a time", queue=queue, max_tokens=8)  # type: ignore[attr-defined]
    next(iter(job.stream(timeout=300)))
    elapsed = (time.perf_counter() - started) * 1000
    job.result(timeout=300)
    return round(elapsed, 1)


def burst(client: object, queues: list[str], requests: int, tokens: int) -> dict[str, float]:
    """`requests` on each queue at once: tok/s of each and of all."""
    started = time.perf_counter()
    jobs = {q: [client.submit(f"Story {i}:", queue=q, max_tokens=tokens, ignore_eos=True)  # type: ignore[attr-defined]
                for i in range(requests)] for q in queues}
    ends: dict[str, float] = {}
    with ThreadPoolExecutor(len(queues)) as pool:
        def finish(queue: str) -> None:
            for job in jobs[queue]:
                job.result(timeout=600)
            ends[queue] = time.perf_counter()
        list(pool.map(finish, queues))
    rates = {q: round(requests * tokens / (ends[q] - started)) for q in queues}
    rates["all"] = round(len(queues) * requests * tokens / (max(ends.values()) - started))
    return rates


def main() -> None:
    from client import Client

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        host = subprocess.Popen([sys.executable, "-m", "mlxq", "worker", "--config", str(config(args.model, Path(tmp)))],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client = Client(f"redis://127.0.0.1:{PORT}")
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    warm = first_token_ms(client, "hot")  # the pinned model, loaded at start
                    break
                except Exception:  # noqa: BLE001 - the embedded server and the model are still starting
                    time.sleep(0.5)
            results = {"ttft_loaded_ms": [first_token_ms(client, "hot") for _ in range(3)],
                       "ttft_cold_ms": first_token_ms(client, "cold"),  # started, loaded, then answered
                       "ttft_cold_then_loaded_ms": [first_token_ms(client, "cold") for _ in range(3)],
                       "warm_up_ms": warm}
            burst(client, ["hot", "cold"], 2, 8)  # warm-up
            results["alone_hot"] = burst(client, ["hot"], args.requests, args.tokens)
            results["alone_cold"] = burst(client, ["cold"], args.requests, args.tokens)
            results["together"] = burst(client, ["hot", "cold"], args.requests, args.tokens)
            print(json.dumps({"model": args.model, **results}))
        finally:
            host.terminate()
            host.wait(120)
            subprocess.run([sys.executable, "-m", "mlxq", "redis", "stop", "--port", str(PORT)],
                           capture_output=True)


if __name__ == "__main__":
    main()
