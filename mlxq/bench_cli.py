"""`mlxq bench`: runs, progress, the printed table, --json and --plot."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import random
import sys
import time
from typing import Any

from . import blas
from .bench import Workload, in_process, result_table, through_redis, workload_dict
from .bench_metrics import summarize


def run(args: argparse.Namespace) -> int:
    if args.baseline and not args.model:
        print("mlxq bench: --baseline needs --model (the model the workers serve)", file=sys.stderr)
        return 2
    workload = Workload(requests=args.requests, rate=args.rate, input_len=args.input_len, output_len=args.output_len,
                        len_jitter=args.len_jitter, shared_prefix=args.shared_prefix, prefix_len=args.prefix_len,
                        stream_interval=args.stream_interval, vocab=args.vocab,
                        seed=random.randrange(2**31) if args.seed is None else args.seed)
    levels = [int(c) or None for c in args.concurrency.split(",")]
    rows: list[dict[str, Any]] = []
    for i, level in enumerate(levels):
        # New prompts for each run, so that no run hits what an earlier one left in the workers' prefix cache.
        planned = dataclasses.replace(workload, seed=workload.seed + i).plan()
        with _progress(f"redis c={level or 'all'}", len(planned)) as tick:
            timings, redis_stats = asyncio.run(through_redis(args.redis_url, args.queue, planned, level,
                                                             args.stream_interval, tick, args.timeout))
        rows.append({"name": f"redis c={level or 'all'}", "concurrency": level, **summarize(timings),
                     "redis": redis_stats})
    for baseline in args.baseline:
        with _progress(baseline, len(planned)) as tick:
            timings = in_process(args.model, planned, levels[-1], tick, sequential=baseline == "sequential")
        rows.append({"name": baseline, "concurrency": 1 if baseline == "sequential" else levels[-1],
                     **summarize(timings)})
    report = _report(args, workload, rows)
    print(result_table(rows))
    _print_ratios(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        _plot([r for r in rows if r["name"].startswith("redis")], args.plot)
    return 0


def _report(args: argparse.Namespace, workload: Workload, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Everything, with the headline keys taken from the last Redis run."""
    main = [r for r in rows if r["name"].startswith("redis")][-1]
    by_name = {r["name"]: r for r in rows}
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.system()} {platform.machine()}, blas={blas.in_use()}",
        "queue": args.queue, "workload": workload_dict(workload), "runs": rows,
        "throughput_tok_s": main["throughput_tok_s"], "ttft_ms": main["ttft_ms"], "itl_ms": main["itl_ms"],
        "redis_commands_per_token": main["redis"]["per_token"],
    }
    for name in ("inprocess", "sequential"):
        if name in by_name:
            report[f"baseline_{name}_tok_s"] = by_name[name]["throughput_tok_s"]
            report[f"ratio_to_{name}"] = _ratio(main["throughput_tok_s"], by_name[name]["throughput_tok_s"])
    if "inprocess" in by_name:
        report["ttft_p50_over_inprocess_ms"] = _gap(main, by_name["inprocess"])
    single = [r for r in rows if r["name"] == "redis c=1"]
    if single and "sequential" in by_name:
        report["ttft_p50_c1_over_sequential_ms"] = _gap(single[0], by_name["sequential"])
    return report


def _gap(run: dict[str, Any], baseline: dict[str, Any]) -> float | None:
    """How much later the first token came through Redis than in process (p50, ms)."""
    ours, theirs = run["ttft_ms"]["p50"], baseline["ttft_ms"]["p50"]
    return None if ours is None or theirs is None else round(ours - theirs, 2)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 3)


def _print_ratios(report: dict[str, Any]) -> None:
    for name in ("inprocess", "sequential"):
        if f"ratio_to_{name}" in report:
            print(f"through Redis / {name}: {report[f'ratio_to_{name}']}x throughput")
    if "ttft_p50_over_inprocess_ms" in report:
        print(f"TTFT p50 through Redis minus in process: {report['ttft_p50_over_inprocess_ms']} ms")
    if "ttft_p50_c1_over_sequential_ms" in report:
        print(f"TTFT p50 at concurrency 1 through Redis minus sequential in process: "
              f"{report['ttft_p50_c1_over_sequential_ms']} ms")
    print(f"Redis commands per generated token: {report['redis_commands_per_token']}")


class _progress:
    """A progress bar on stderr (tqdm), closed on exit."""

    def __init__(self, label: str, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False)

    def __enter__(self) -> Any:
        return self.bar.update

    def __exit__(self, *exc: object) -> None:
        self.bar.close()


def _plot(rows: list[dict[str, Any]], path: Any) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("mlxq bench: --plot needs matplotlib (pip install '.[bench]' in the mlxq checkout)", file=sys.stderr)
        return
    levels = [r["concurrency"] or r["requests"] for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(levels, [r["throughput_tok_s"] for r in rows], marker="o")
    left.set(xlabel="concurrency", ylabel="tokens/s", title="throughput")
    right.plot(levels, [r["ttft_ms"]["p50"] for r in rows], marker="o", label="p50")
    right.plot(levels, [r["ttft_ms"]["p99"] for r in rows], marker="o", label="p99")
    right.set(xlabel="concurrency", ylabel="ms", title="time to first token")
    right.legend()
    figure.tight_layout()
    figure.savefig(path)
