"""Embeddings per second through the queue against the model run in process, by inputs per pass.

    python -m mlxq.blas .venv/bin/python docs/embed_bench.py MODEL [--sizes 1,8,16,64] [--inputs 1024]
        [--length 64] [--pairs 3] [--per-request 0] [--no-pin]

MODEL is an embedding model (`mlxq demo-model --embedding PATH`, or a local
sentence-transformers model). For each size B, alternated `--pairs` times:

- in process: mlx-vlm's embedding model called as its own server calls it (the tokenizer
  pads B texts, one forward pass, `.tolist()`), over `--inputs` texts of ~`--length` tokens;
- through the queue: an `mlxq worker --max-num-seqs B` (its pass budget, `prefill_batch_size`
  x `prefill_step_size`, B x 512 tokens, so that a pass holds B inputs) on a Valkey of its own, sent the
  same texts as requests of `--per-request` inputs each (0: B, so each request is one
  pass; 1: one input per request, which the worker batches) all at once, base64 answers.

Pinned (Linux, the default): the model on core 0 (the worker, and the baseline while
the worker waits), Valkey and this client on core 1, MKL single-threaded. Prints one
JSON object; docs/benchmarks.md, "Embeddings", has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("queue worker stream batch token model redis embed vector search index document query answer "
         "python mlx metal apple fleet").split()


def texts(count: int, length: int) -> list[str]:
    """Texts of about `length` tokens, each different."""
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(length - 1)) + f" {i}" for i in range(count)]


def in_process(model_path: str, inputs: list[str], size: int) -> float:
    import mlx.core as mx
    from mlx_vlm.embedding_loader import load_embedding_model
    from mlx_vlm.models.pooling import read_pooling_config
    from mlx_vlm.utils import load_processor

    model = load_embedding_model(Path(model_path))
    model.pooling_config = read_pooling_config(Path(model_path))
    tokenizer = load_processor(Path(model_path), add_detokenizer=False)
    for _ in range(2):  # warm up
        encoded = tokenizer(inputs[:size], padding=True, return_tensors="np")
        model(mx.array(encoded["input_ids"]), attention_mask=mx.array(encoded["attention_mask"])).text_embeds.tolist()
    started = time.perf_counter()
    for start in range(0, len(inputs), size):
        encoded = tokenizer(inputs[start:start + size], padding=True, return_tensors="np")
        out = model(mx.array(encoded["input_ids"]), attention_mask=mx.array(encoded["attention_mask"]))
        out.text_embeds.tolist()
    return len(inputs) / (time.perf_counter() - started)


def through_queue(model_path: str, inputs: list[str], size: int, per_request: int, port: int, pin: bool) -> float:
    from client import Client

    queue = f"embed-{size}-{os.getpid()}"
    on_model = ["taskset", "-c", "0"] if pin else []
    with tempfile.TemporaryDirectory() as logs:
        log = Path(logs) / "worker.log"
        worker = subprocess.Popen([*on_model, sys.executable, "-m", "mlxq", "worker", "--model", model_path,
                                   "--queue", queue, "--redis-url", f"redis://127.0.0.1:{port}", "--max-num-seqs",
                                   str(size), "--prefill-batch-size", str(size), "--prefill-step-size", "512",
                                   "--log-format", "json"], stdout=log.open("wb"), stderr=subprocess.STDOUT)
        try:
            with Client(f"redis://127.0.0.1:{port}", queue=queue) as client:
                while b'"worker ready"' not in log.read_bytes():
                    if worker.poll() is not None:
                        raise RuntimeError(log.read_text())
                    time.sleep(0.2)
                client.embed(inputs[:size], timeout=60)  # warm up
                step = per_request or size
                started = time.perf_counter()
                jobs = [client.submit(input=inputs[i:i + step], encoding_format="base64")
                        for i in range(0, len(inputs), step)]
                for job in jobs:
                    assert len(job.result(timeout=600).embeddings or []) == len(inputs[:step])
                return len(inputs) / (time.perf_counter() - started)
        finally:
            worker.terminate()
            worker.wait(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--sizes", default="1,8,16,64")
    parser.add_argument("--inputs", type=int, default=1024)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--per-request", type=int, default=0)
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    args = parser.parse_args()
    os.environ["MKL_NUM_THREADS"] = "1"
    inputs = texts(args.inputs, args.length)
    port = free_port()
    data = tempfile.mkdtemp()
    on_rest = ["taskset", "-c", "1"] if args.pin else []
    valkey = subprocess.Popen([*on_rest, sys.executable, "-m", "mlxq", "redis", "--port", str(port), "--dir", data],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        while True:
            try:
                redis.Redis(port=port).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.2)
        results = {}
        for size in map(int, args.sizes.split(",")):
            runs: dict[str, list[float]] = {"in_process": [], "queue": []}
            for _ in range(args.pairs):
                if args.pin:
                    os.sched_setaffinity(0, {0})
                runs["in_process"].append(round(in_process(args.model, inputs, size), 1))
                if args.pin:
                    os.sched_setaffinity(0, {1})
                runs["queue"].append(round(through_queue(args.model, inputs, size, args.per_request, port, args.pin),
                                           1))
            ratios = [round(q / p, 3) for q, p in zip(runs["queue"], runs["in_process"], strict=True)]
            results[size] = {**runs, "ratios": ratios, "median_ratio": statistics.median(ratios)}
        print(json.dumps({"model": args.model, "inputs": args.inputs, "length": args.length,
                          "per_request": args.per_request or "size", "pinned": args.pin, "inputs_per_s": results}))
    finally:
        subprocess.run([sys.executable, "-m", "mlxq", "redis", "stop", "--port", str(port)], capture_output=True)
        valkey.wait(30)


if __name__ == "__main__":
    main()
