"""The fleet simulation runs: simulated workers, one Valkey, every stream checked.
(The simulated engine serves only this; every other test runs the real model.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support import ROOT

pytestmark = pytest.mark.process  # runs the mlxq command in processes


@pytest.mark.parametrize("redis", [[], ["--cluster", "3"]], ids=["single", "cluster"])
def test_a_small_simulated_fleet_loses_and_repeats_nothing(tmp_path, redis):
    """On one Valkey and on a 3-primary cluster, where each node carries a share of the
    output streams."""
    out = tmp_path / "fleet.json"
    run = subprocess.run([sys.executable, "-m", "mlxq.fleet_sim", "--workers", "2", "--slots", "8", "--step-ms",
                          "5", "--requests", "120", "--output-len", "12", *redis, "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert (report["lost"], report["bad_streams"]) == (0, 0)
    assert report["tokens_per_s"] > 0 and report["redis_commands_per_s"] > 0
    assert report["worker_cpu_us_per_token"] > 0 and report["redis_cpu_us_per_token"] > 0
    assert set(report["latency"]["ttft_ms"]) == {"p50", "p90", "p95", "p99", "max"}
    assert len(report["redis_node_commands_per_s"]) == report["redis_nodes"] == (3 if redis else 1)
    assert all(n > 0 for n in report["redis_node_commands_per_s"]), "every node serves part of the traffic"
