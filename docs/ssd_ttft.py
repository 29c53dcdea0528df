"""Time to first token of a long shared prompt: cold, from the prefix cache in RAM, and
from its SSD tier after a restart (a new process), through the worker's own backend.

    python -m mlxq.blas .venv/bin/python docs/ssd_ttft.py MODEL [--shared 2000] [--tier DIR]
        [--kv-bits 4|8 [--start N]]

Each request is the shared prompt and a few tokens of its own, greedy, 4 new tokens;
TTFT is from insert to the first token out of the backend's step (no queue, no Redis).
The tier directory is emptied first. Each row also says what the prefix cache in RAM
holds per cached token (its blocks' bytes over their tokens: packed codes under
`kv_bits` from the first token, dense blocks otherwise).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def ttft(backend: object, prompt: list[int]) -> tuple[float, int]:
    from mlx_lm.sample_utils import greedy_sampler

    from worker.engine.scheduler import StepPlan

    start = time.perf_counter()
    uid = backend.insert(prompt, 4, greedy_sampler, [])  # type: ignore[attr-defined]
    while True:
        out = backend.step(StepPlan(prefill_chunk=512, prefill_prompts=8))  # type: ignore[attr-defined]
        if out:
            elapsed = time.perf_counter() - start
            cached = out[0].cached_tokens or 0
            break
    backend.remove([uid])  # type: ignore[attr-defined]
    return elapsed, cached


def entry_bytes_per_token(backend: object) -> float:
    """What the prefix cache's blocks in RAM hold, per token they cover."""
    pool = [b for b in backend._generator.apc_manager.pool if b.block_hash is not None]  # type: ignore[attr-defined]
    return sum(b.resident_bytes() for b in pool) / max(1, 16 * len(pool))


def measure(model: str, tier: Path, shared: int, phase: str, quantization: dict) -> None:
    from worker.engine.backends import load_model
    from worker.settings import WorkerSettings

    loaded = load_model(WorkerSettings(model=model, ssd_cache_dir=tier, cache_memory_mb=1024, **quantization))
    backend = loaded.make_backend()
    vocab = loaded.info.vocab_size
    common = random.Random(1).choices(range(10, vocab), k=shared)

    def request(n: int) -> list[int]:
        return common + random.Random(100 + n).choices(range(10, vocab), k=7)

    ttft(backend, random.Random(9).choices(range(10, vocab), k=64))  # warm-up, unrelated
    rows = [("cold", 0), ("ram", 1)] if phase == "first" else [("ssd_after_restart", 2)]
    for name, n in rows:
        seconds, cached = ttft(backend, request(n))
        print(json.dumps({"model": Path(model).name, **quantization, "shared_tokens": shared, "from": name,
                          "ttft_ms": round(seconds * 1000, 1), "cached_tokens": cached,
                          "entry_bytes_per_token": round(entry_bytes_per_token(backend))}), flush=True)
    backend.close()  # the tier's queued writes land


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--shared", type=int, default=2000)
    parser.add_argument("--tier", type=Path)
    parser.add_argument("--kv-bits", type=int)
    parser.add_argument("--start", type=int, default=0, help="quantized_kv_start")
    parser.add_argument("--phase", choices=["first", "restart"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    quantization = {} if args.kv_bits is None else {"kv_bits": args.kv_bits, "quantized_kv_start": args.start}
    if args.phase:
        measure(args.model, args.tier, args.shared, args.phase, quantization)
        return
    tier = args.tier or Path(tempfile.mkdtemp(prefix="mlxq-ssd-"))
    shutil.rmtree(tier, ignore_errors=True)
    for phase in ("first", "restart"):
        quantized = [] if args.kv_bits is None else ["--kv-bits", str(args.kv_bits), "--start", str(args.start)]
        subprocess.run([sys.executable, __file__, args.model, "--shared", str(args.shared), "--tier", str(tier),
                        *quantized, "--phase", phase], check=True)


if __name__ == "__main__":
    main()
