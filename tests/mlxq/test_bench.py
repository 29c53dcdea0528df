"""`mlxq bench`: its metric math, its workload, and one small run against a real worker."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading

import pytest
from support import ROOT, start_gateway, worker_fixture

from mlxq.bench import Workload, _threads_on
from mlxq.bench_cli import _median_run, _warn_if_unsteady
from mlxq.bench_metrics import RequestTiming, command_stats, percentiles, summarize


def test_percentiles_interpolate_linearly():
    assert percentiles([float(v) for v in range(1, 101)]) == {"p50": 50.5, "p90": 90.1, "p95": 95.05, "p99": 99.01,
                                                              "max": 100.0}
    assert percentiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p95": 7.0, "p99": 7.0, "max": 7.0}
    assert percentiles([]) == {"p50": None, "p90": None, "p95": None, "p99": None, "max": None}


def test_request_latencies_from_arrival_times():
    """TTFT from submit to the first delta; ITL spreads each later delta's gap over its tokens."""
    t = RequestTiming(submitted=10.0, token_times=[(10.1, 1), (10.3, 2), (10.4, 1)], done=10.5, tokens=4)
    assert t.ttft_ms == pytest.approx(100.0)
    assert t.itl_ms() == pytest.approx([100.0, 100.0, 100.0])
    assert t.e2e_ms == pytest.approx(500.0)


def test_summary_rates_span_first_submit_to_last_done():
    a = RequestTiming(submitted=0.0, token_times=[(0.5, 1), (1.0, 1)], done=1.0, tokens=2, queued_ms=3.0)
    b = RequestTiming(submitted=1.0, token_times=[(1.2, 1), (2.0, 2)], done=2.0, tokens=3, cached_tokens=9)
    summary = summarize([a, b])
    assert summary["throughput_tok_s"] == 2.5 and summary["requests_s"] == 1.0
    assert summary["ttft_ms"]["p50"] == pytest.approx(350.0)
    assert summary["itl_ms"]["p50"] == pytest.approx(400.0)  # gaps 500, 400, 400
    assert summary["itl_ms"]["max"] == pytest.approx(500.0)
    assert summary["queue_ms"]["p50"] == 3.0 and summary["cached_tokens"] == 9


def test_command_stats_count_the_run_only():
    before = {"cmdstat_evalsha": {"calls": 10}, "cmdstat_xadd": {"calls": 5}}
    after = {"cmdstat_evalsha": {"calls": 30}, "cmdstat_xadd": {"calls": 7}, "cmdstat_xread": {"calls": 8}}
    assert command_stats(before, after, tokens=100) == {
        "commands": 30, "per_token": 0.3, "by_command": {"evalsha": 20, "xread": 8, "xadd": 2}}


def test_workload_lengths_arrivals_and_shared_prefix():
    burst = Workload(requests=200, input_len=50, output_len=20, len_jitter=0.5, shared_prefix=0.5, prefix_len=30)
    plan = burst.plan()
    assert all(p.send_at == 0 for p in plan)
    assert {len(p.prompt_tokens) for p in plan} <= set(range(25, 76)) and len({len(p.prompt_tokens) for p in plan}) > 10
    prefix = max((tuple(p.prompt_tokens[:20]) for p in plan), key=[tuple(p.prompt_tokens[:20]) for p in plan].count)
    sharing = sum(tuple(p.prompt_tokens[:20]) == prefix for p in plan)
    assert 70 <= sharing <= 130, "about half share the prefix"
    poisson = Workload(requests=400, rate=20.0).plan()
    gaps = [b.send_at - a.send_at for a, b in zip(poisson, poisson[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.15)
    assert Workload(seed=3).plan() == Workload(seed=3).plan()


def test_a_tenants_workload_gives_each_request_its_tenants_prefix_and_counts_the_ideal():
    workload = Workload(requests=40, input_len=10, prefix_len=50, tenants=4)
    plan = workload.plan()
    prefixes = [tuple(p.prompt_tokens[:50]) for p in plan]
    assert len(set(prefixes)) == 4 and all(len(p.prompt_tokens) == 60 for p in plan)
    assert len({tuple(p.prompt_tokens[50:]) for p in plan}) == 40, "each question its own"
    assert workload.ideal_cached(plan) == (40 - 4) * 50, "every request after its tenant's first hits the prefix"


worker = worker_fixture()


def test_repeated_runs_that_disagree_are_flagged(capsys):
    """A spread over 10 % of the median between repeated runs is warned about; within it, not."""
    steady = _median_run([{"name": "redis c=4", "throughput_tok_s": t} for t in (100.0, 104.0, 98.0)])
    unsteady = _median_run([{"name": "redis c=16", "throughput_tok_s": t} for t in (100.0, 125.0, 110.0)])
    assert steady["throughput_tok_s"] == 100.0 and unsteady["throughput_tok_s"] == 110.0
    _warn_if_unsteady([steady, unsteady])
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("warning: redis c=16: repeated runs disagree by more than 10%")


def test_bench_runs_against_a_worker_and_writes_json(worker, demo_model, tmp_path):
    """A small sweep through Redis plus the three baselines, each run right after the
    Redis run it is compared with (sequential with concurrency 1, the batch with the top
    level): the JSON has the documented keys and every pair's ratio."""
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "mlxq", "bench", "--redis-url", worker.redis_url, "--queue",
                          worker.queue, "--requests", "8", "--concurrency", "1,4", "--input-len", "20",
                          "--output-len", "8", "--vocab", "900", "--baseline", "inprocess", "--baseline",
                          "detokenizing", "--baseline", "sequential", "--model", str(demo_model), "--json", str(out),
                          "--seed", "5", "--repeat", "2", "--plot", str(tmp_path / "bench.png")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "through Redis c=4 / inprocess" in run.stdout and "(median of 2 pairs: " in run.stdout
    assert "through Redis c=4 / detokenizing" in run.stdout
    assert f"workload: 8 requests (a burst), 20 prompt + 8 new tokens, seed 5; model {demo_model}" in run.stdout
    assert f"plot written to {tmp_path / 'bench.png'}" in run.stdout
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")
    report = json.loads(out.read_text())
    for key in ("throughput_tok_s", "ttft_ms", "itl_ms", "baseline_inprocess_tok_s", "baseline_detokenizing_tok_s",
                "baseline_sequential_tok_s"):
        assert report[key] is not None, key
    assert set(report["ttft_ms"]) == {"p50", "p90", "p95", "p99", "max"}
    redis_runs = [r for r in report["runs"] if r["name"].startswith("redis")]
    assert [r["concurrency"] for r in redis_runs] == [1, 4]
    assert all(r["finished"] == 8 and r["tokens"] == 64 and len(r["repeats_tok_s"]) == 2 for r in redis_runs)
    assert redis_runs[0]["redis"]["by_command"]["evalsha"] > 0
    assert [(r["name"], r["concurrency"]) for r in report["runs"]] == [
        ("redis c=1", 1), ("sequential", 1), ("redis c=4", 4), ("inprocess", 4), ("detokenizing", 4)]
    for name, level in (("sequential", 1), ("inprocess", 4), ("detokenizing", 4)):
        paired = report[f"paired_with_{name}"]
        assert paired["concurrency"] == level and len(paired["ratios"]) == len(paired["ttft_p50_gaps_ms"]) == 2
        assert report[f"ratio_to_{name}"] == pytest.approx(statistics.median(paired["ratios"]), abs=1e-3)
    assert report["ttft_p50_c1_over_sequential_ms"] is not None
    stages = redis_runs[0]["stages_ms"]  # the worker's stages, in order
    assert 0 <= stages["read_ms"] <= stages["prepared_ms"] <= stages["queued_ms"] <= stages["ttft_ms"] \
        <= stages["total_ms"]
    assert "redis c=1: worker stages p50, ms from arrival: read" in run.stdout


def test_bench_backlog_pushes_everything_at_once_against_a_batch_as_wide_as_the_worker(worker, demo_model, tmp_path):
    """`--backlog`: every request through Redis at once, the worker reading as slots
    free; the baseline inserts them all into one batch as wide as the worker's
    max_num_seqs (from its heartbeat). The report says the width and pairs the two."""
    out = tmp_path / "backlog.json"
    run = subprocess.run([sys.executable, "-m", "mlxq", "bench", "--redis-url", worker.redis_url, "--queue",
                          worker.queue, "--backlog", "--requests", "12", "--input-len", "20", "--output-len", "6",
                          "--vocab", "900", "--baseline", "inprocess", "--model", str(demo_model), "--json", str(out),
                          "--seed", "7", "--baseline-cpus", str(min(os.sched_getaffinity(0)))],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["backlog_width"] == 16  # the worker's max_num_seqs
    assert report["baseline_cpus"] == [min(os.sched_getaffinity(0))]
    assert [(r["name"], r["concurrency"]) for r in report["runs"]] == [("redis backlog", None), ("inprocess", None)]
    assert all(r["finished"] == 12 and r["tokens"] == 72 for r in report["runs"])
    assert report["runs"][1]["width"] == 16
    assert report["ratio_to_inprocess"] == pytest.approx(
        report["runs"][0]["throughput_tok_s"] / report["runs"][1]["throughput_tok_s"], abs=1e-3)
    assert f"through Redis backlog (width 16) / inprocess: {report['ratio_to_inprocess']}x throughput" in run.stdout


def test_bench_compares_the_gateway_with_redis(worker, valkey, logs_dir, tmp_path):
    """`--gateway`: the same workload through the OpenAI API, with the TTFT gap, the
    throughput ratio and the gateway's CPU per 1,000 tokens in the report."""
    gateway = start_gateway(valkey, logs_dir)
    out = tmp_path / "gateway.json"
    try:
        run = subprocess.run([sys.executable, "-m", "mlxq", "bench", "--redis-url", worker.redis_url, "--queue",
                              worker.queue, "--requests", "6", "--concurrency", "1,3", "--input-len", "20",
                              "--output-len", "8", "--vocab", "900", "--seed", "5", "--gateway", gateway.url,
                              "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        gateway.stop()
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    gateway_runs = [r for r in report["runs"] if r["name"].startswith("gateway")]
    assert [r["concurrency"] for r in gateway_runs] == [1, 3]
    assert all(r["finished"] == 6 and r["tokens"] > 0 and r["ttft_ms"]["p50"] > 0 for r in gateway_runs)
    assert [c["concurrency"] for c in report["gateway"]] == [1, 3]
    # The gateway's CPU is counted in clock ticks (10 ms): a run this small may count none.
    assert all(c["throughput_over_redis"] > 0 and c["cpu_ms_per_1k_tokens"] >= 0 for c in report["gateway"])
    assert "gateway c=1 vs Redis: TTFT p50" in run.stdout


def test_baselines_run_with_every_thread_on_the_cpus_given_then_back():
    """`--baseline-cpus`: every thread of the bench process, those made before included
    (MLX's), runs the baselines on those CPUs, and goes back where it was after."""
    cpus = os.sched_getaffinity(0)
    one = {min(cpus)}
    ready, done = threading.Event(), threading.Event()
    earlier = threading.Thread(target=lambda: (ready.set(), done.wait(30)))
    earlier.start()
    ready.wait(30)
    try:
        with _threads_on(one):
            assert {tid: os.sched_getaffinity(tid) for tid in map(int, os.listdir("/proc/self/task"))} == \
                {tid: one for tid in map(int, os.listdir("/proc/self/task"))}
        assert os.sched_getaffinity(earlier.native_id) == cpus and os.sched_getaffinity(0) == cpus
    finally:
        done.set()
        earlier.join(30)


@pytest.mark.parametrize("cpus", ["99999", "0,x", "-1"])
def test_baseline_cpus_that_are_not_this_machines_are_refused_before_anything_runs(cpus):
    run = subprocess.run([sys.executable, "-m", "mlxq", "bench", "--baseline-cpus", cpus], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--baseline-cpus" in run.stderr
    assert "not a list of CPU numbers" in run.stderr or "this machine's CPUs are 0 to" in run.stderr
