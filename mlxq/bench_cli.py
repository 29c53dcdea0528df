"""`mlxq bench`: runs, progress, the printed table, --json and --plot."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import random
import statistics
import sys
import time
from typing import Any, NamedTuple

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
                        response_format=args.response_format, constrained=args.constrained,
                        adapters=tuple(args.adapter or ()), tenants=args.tenants,
                        seed=random.randrange(2**31) if args.seed is None else args.seed)
    levels: list[int | None] = [None] if args.backlog else [int(c) or None for c in args.concurrency.split(",")]
    args.width = _served_width(args) if args.backlog else None  # the baselines' batch width for a backlog
    model = args.model or _served_model(args)
    print(f"workload: {_describe(workload)}; model {model}; queue {args.queue}; {args.repeat} run(s) per level",
          file=sys.stderr)
    rows: list[dict[str, Any]] = []
    pairs: dict[str, list[Pair]] = {baseline: [] for baseline in args.baseline}
    for i, level in enumerate(levels):
        baselines = [b for b in args.baseline if level == _paired_level(b, levels)]
        runs: dict[str, list[dict[str, Any]]] = {"redis": [], "gateway": [], **{b: [] for b in baselines}}
        for repeat in range(args.repeat):
            # New prompts for each run, so that no run hits what an earlier one left in the workers' prefix cache.
            planned = dataclasses.replace(workload, seed=workload.seed + i * args.repeat + repeat).plan()
            runs["redis"].append(_redis_run(args, planned, level))
            if workload.tenants:
                runs["redis"][-1]["ideal_cached_tokens"] = workload.ideal_cached(planned)
            for baseline in baselines:  # right after, on the same prompts: the machine's drift cancels in the ratio
                runs[baseline].append(_baseline_run(args, baseline, planned, level))
                pairs[baseline].append(Pair(runs["redis"][-1], runs[baseline][-1]))
            if args.gateway:  # the same prompts again would hit the prefix cache: the next seed's
                again = dataclasses.replace(workload, seed=workload.seed + 10_000 + i * args.repeat + repeat).plan()
                runs["gateway"].append(_gateway_run(args, again, level))
        rows += [_median_run(found) for found in runs.values() if found]
    report = _report(args, workload, rows, pairs)
    report["model"] = model
    print(f"workload: {_describe(workload)}; model {model}")
    print(result_table(rows))
    _print_ratios(report)
    _warn_if_unsteady(rows)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"report written to {args.json}")
    if args.plot and _plot(rows, args.plot, f"{model}: {_describe(workload)}"):
        print(f"plot written to {args.plot}")
    return 0


def _redis_run(args: argparse.Namespace, planned: list[Any], level: int | None) -> dict[str, Any]:
    name = "redis backlog" if args.backlog else f"redis c={level or 'all'}"
    with _progress(name, len(planned)) as tick:
        timings, redis_stats = asyncio.run(through_redis(args.redis_url, args.queue, planned, level,
                                                         args.stream_interval, tick, args.timeout))
    return {"name": name, "concurrency": level, **summarize(timings), "redis": redis_stats}


def _paired_level(baseline: str, levels: list[int | None]) -> int | None:
    """The concurrency level a baseline is compared at: sequential generation with the
    requests one at a time (concurrency 1, when the sweep has it), the batch with the
    highest level."""
    return 1 if baseline == "sequential" and 1 in levels else levels[-1]


def _baseline_run(args: argparse.Namespace, baseline: str, planned: list[Any], level: int | None) -> dict[str, Any]:
    with _progress(baseline, len(planned)) as tick:
        timings = in_process(args.model, planned, level, tick, sequential=baseline == "sequential",
                             detokenize=baseline == "detokenizing", backlog_width=args.width,
                             cpus=args.baseline_cpus)
    return {"name": baseline, "concurrency": 1 if baseline == "sequential" else level, **summarize(timings),
            **({"width": args.width} if args.width else {})}


def _gateway_run(args: argparse.Namespace, planned: list[Any], level: int | None) -> dict[str, Any]:
    from .bench_gateway import through_gateway

    name = f"gateway c={level or 'all'}"
    with _progress(name, len(planned)) as tick:
        timings, cost = asyncio.run(through_gateway(args.gateway, args.queue, planned, level, args.stream_interval,
                                                    tick, args.timeout, args.api_key))
    return {"name": name, "concurrency": level, **summarize(timings), "gateway": cost}


def _describe(workload: Workload) -> str:
    arrivals = f"Poisson {workload.rate}/s" if workload.rate else "a burst"
    text = (f"{workload.requests} requests ({arrivals}), {workload.input_len} prompt + {workload.output_len} new "
            f"tokens, seed {workload.seed}")
    if workload.tenants:
        text += f", {workload.tenants} tenants each with its own {workload.prefix_len}-token prefix"
    elif workload.shared_prefix:
        text += f", {workload.shared_prefix:.0%} sharing a {workload.prefix_len}-token prefix"
    if workload.adapters:
        text += f", adapters {', '.join(workload.adapters)} in turn"
    if workload.response_format != "none":
        text += f", {workload.constrained:.0%} constrained ({workload.response_format})"
    return text


def _served_model(args: argparse.Namespace) -> str:
    """The model the queue's live workers say they serve (for the report)."""
    import redis

    from client.connect import connect
    from client.fleet import read_fleet
    from client.keys import Keys

    try:
        with connect(args.redis_url, socket_timeout=5) as r:
            models = sorted({m.path for w in read_fleet(r, Keys()).serving(args.queue) for m in w.heartbeat.models
                             if m.queue == args.queue})
    except redis.RedisError:
        models = []
    return ", ".join(models) or "unknown model"


def _served_width(args: argparse.Namespace) -> int:
    """How many requests the queue's live workers run at once: their max_num_seqs, summed."""
    from client.connect import connect
    from client.fleet import read_fleet
    from client.keys import Keys

    with connect(args.redis_url, socket_timeout=5) as r:
        widths = [w.heartbeat.max_num_seqs or 0 for w in read_fleet(r, Keys()).serving(args.queue)]
    if not sum(widths):
        raise SystemExit(f"mlxq bench --backlog: no live worker serves queue {args.queue!r}, so the baselines' "
                         "width (the workers' max_num_seqs) is unknown")
    return sum(widths)


class Pair(NamedTuple):
    """A run through Redis and the baseline run right after it, on the same prompts."""

    ours: dict[str, Any]
    theirs: dict[str, Any]

    @property
    def ratio(self) -> float | None:
        return _ratio(self.ours["throughput_tok_s"], self.theirs["throughput_tok_s"])

    @property
    def ttft_gap_ms(self) -> float | None:
        return _gap(self.ours, self.theirs)


UNSTEADY = 0.10  # repeated runs whose throughput differs more than this from their median are flagged


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median throughput, and every run's throughput beside it."""
    ordered = sorted(runs, key=lambda r: r["throughput_tok_s"] or 0.0)
    median = dict(ordered[len(ordered) // 2])
    median["repeats_tok_s"] = [r["throughput_tok_s"] for r in runs]
    return median


def _warn_if_unsteady(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        figures = [f for f in row.get("repeats_tok_s", []) if f]
        if len(figures) > 1 and (max(figures) - min(figures)) / row["throughput_tok_s"] > UNSTEADY:
            print(f"warning: {row['name']}: repeated runs disagree by more than {UNSTEADY:.0%} "
                  f"({', '.join(f'{f:.1f}' for f in figures)} tok/s); the machine was not quiet, or the "
                  "workload is too short", file=sys.stderr)


def _report(args: argparse.Namespace, workload: Workload, rows: list[dict[str, Any]],
            pairs: dict[str, list[Pair]]) -> dict[str, Any]:
    """Everything, with the headline keys taken from the last Redis run, and each baseline
    compared run by run with the Redis runs it was paired with (medians and each pair's)."""
    main = [r for r in rows if r["name"].startswith("redis")][-1]
    by_name = {r["name"]: r for r in rows}
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.system()} {platform.machine()}, blas={blas.in_use()}",
        "queue": args.queue, "workload": workload_dict(workload), "runs": rows,
        "throughput_tok_s": main["throughput_tok_s"], "ttft_ms": main["ttft_ms"], "itl_ms": main["itl_ms"],
        "redis_commands_per_token": main["redis"]["per_token"],
        **({"backlog_width": args.width} if args.width else {}),
        **({"baseline_cpus": sorted(args.baseline_cpus)} if args.baseline_cpus else {}),
    }
    for name, paired in pairs.items():
        report[f"baseline_{name}_tok_s"] = by_name[name]["throughput_tok_s"]
        report[f"paired_with_{name}"] = {"concurrency": paired[0].ours["concurrency"],
                                         "ratios": [p.ratio for p in paired],
                                         "ttft_p50_gaps_ms": [p.ttft_gap_ms for p in paired]}
        report[f"ratio_to_{name}"] = _median(p.ratio for p in paired)
    if pairs.get("inprocess"):
        report["ttft_p50_over_inprocess_ms"] = _median(p.ttft_gap_ms for p in pairs["inprocess"])
    if pairs.get("sequential") and pairs["sequential"][0].ours["concurrency"] == 1:
        report["ttft_p50_c1_over_sequential_ms"] = _median(p.ttft_gap_ms for p in pairs["sequential"])
    report["gateway"] = _gateway_comparison(rows)
    return report


def _median(values: Any) -> float | None:
    found = [v for v in values if v is not None]
    return round(statistics.median(found), 3) if found else None


def _gateway_comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency level: the gateway's TTFT p50 over Redis's, its throughput over
    Redis's, and its CPU per 1,000 streamed tokens."""
    redis_runs = {r["concurrency"]: r for r in rows if r["name"].startswith("redis")}
    compared = []
    for run in (r for r in rows if r["name"].startswith("gateway")):
        direct = redis_runs[run["concurrency"]]
        compared.append({"concurrency": run["concurrency"], "ttft_p50_over_redis_ms": _gap(run, direct),
                         "throughput_over_redis": _ratio(run["throughput_tok_s"], direct["throughput_tok_s"]),
                         "cpu_ms_per_1k_tokens": run["gateway"]["gateway_cpu_ms_per_1k_tokens"]})
    return compared


def _gap(run: dict[str, Any], baseline: dict[str, Any]) -> float | None:
    """How much later the first token came through Redis than in process (p50, ms)."""
    ours, theirs = run["ttft_ms"]["p50"], baseline["ttft_ms"]["p50"]
    return None if ours is None or theirs is None else round(ours - theirs, 2)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 3)


def _print_ratios(report: dict[str, Any]) -> None:
    for name in ("inprocess", "detokenizing", "sequential"):
        if f"ratio_to_{name}" in report:
            paired = report[f"paired_with_{name}"]
            each = f" (median of {len(paired['ratios'])} pairs: {', '.join(map(str, paired['ratios']))})" \
                if len(paired["ratios"]) > 1 else ""
            mode = f"backlog (width {report['backlog_width']})" if "backlog_width" in report \
                else f"c={paired['concurrency'] or 'all'}"
            print(f"through Redis {mode} / {name}: {report[f'ratio_to_{name}']}x throughput{each}")
    if "ttft_p50_over_inprocess_ms" in report:
        print(f"TTFT p50 through Redis minus in process: {report['ttft_p50_over_inprocess_ms']} ms")
        print("(inprocess is raw BatchGenerator, without the worker's token budget per step: a burst costs it "
              "fewer, longer steps, and its streams stall longer; compare ITL max)")
    if "ttft_p50_c1_over_sequential_ms" in report:
        print(f"TTFT p50 at concurrency 1 through Redis minus sequential in process: "
              f"{report['ttft_p50_c1_over_sequential_ms']} ms")
    for row in report["runs"]:
        if row.get("ideal_cached_tokens"):
            print(f"{row['name']}: cached prompt tokens {row['cached_tokens']} of an ideal "
                  f"{row['ideal_cached_tokens']} ({row['cached_tokens'] / row['ideal_cached_tokens']:.2f}); TTFT "
                  f"p50 {row['ttft_ms']['p50']} ms, p90 {row['ttft_ms']['p90']} ms")
        stages = row.get("stages_ms") or {}
        if any(v is not None for v in stages.values()):
            print(f"{row['name']}: worker stages p50, ms from arrival: " + ", ".join(
                f"{name.removesuffix('_ms')} {value}" for name, value in stages.items() if value is not None))
    for row in report["gateway"]:
        print(f"gateway c={row['concurrency'] or 'all'} vs Redis: TTFT p50 {row['ttft_p50_over_redis_ms']:+} ms, "
              f"{row['throughput_over_redis']}x throughput, gateway CPU {row['cpu_ms_per_1k_tokens']} ms "
              "per 1,000 tokens")
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


def _plot(rows: list[dict[str, Any]], path: Any, title: str) -> bool:
    """Throughput and TTFT against concurrency (log 2), through Redis and for each
    baseline; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("mlxq bench: --plot needs matplotlib (pip install '.[bench]' in the mlxq checkout)", file=sys.stderr)
        return False
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for label, marker in (("redis", "o"), ("gateway", "D"), ("inprocess", "s"), ("detokenizing", "v"),
                          ("sequential", "^")):
        series = [r for r in rows if r["name"].split(" ")[0] == label]
        if not series:
            continue
        levels = [r["concurrency"] or r["requests"] for r in series]
        name = {"redis": "through Redis", "gateway": "through the gateway", "inprocess": "BatchGenerator in process",
                "detokenizing": "BatchGenerator + detokenizer", "sequential": "sequential in process"}[label]
        left.plot(levels, [r["throughput_tok_s"] for r in series], marker=marker, label=name)
        right.plot(levels, [r["ttft_ms"]["p50"] for r in series], marker=marker, label=f"{name}, p50")
        right.plot(levels, [r["ttft_ms"]["p99"] for r in series], marker=marker, linestyle="--",
                   label=f"{name}, p99")
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("requests outstanding (concurrency)")
        axis.legend(fontsize="small")
    left.set(ylabel="tokens/s", title="throughput")
    left.set_ylim(bottom=0)
    right.set(ylabel="ms", title="time to first token")
    figure.suptitle(title, fontsize="medium")
    figure.tight_layout()
    figure.savefig(path)
    return True
