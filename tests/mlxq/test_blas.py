"""The fast CPU path: a real BLAS is put in front of MLX's reference one on Linux."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mlxq import blas

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="macOS runs on Metal/Accelerate"),
              pytest.mark.process]  # runs Python processes with MLX

PROBE = "import mlx.core; from mlxq import blas; print(blas.in_use())"


def run_probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.APPLIED)}
    command = [sys.executable, "-m", "mlxq.blas", sys.executable, "-c", PROBE]
    return subprocess.run(command, env={**clean, **env}, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(blas.find() is None, reason="no real BLAS installed here (the worker extra brings one)")
def test_the_real_blas_is_found_and_put_in_front():
    assert run_probe() in ("mkl", "openblas")


def test_off_leaves_the_reference_blas():
    assert run_probe(MLXQ_BLAS="off") == "reference"


def test_environment_preloads_the_library_and_keeps_what_was_there(monkeypatch, tmp_path):
    library = tmp_path / "libmkl_rt.so.2"
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    env = blas.environment(library)
    assert env["LD_PRELOAD"] == f"{library} /other.so"
    assert env["MKL_THREADING_LAYER"] in ("INTEL", "GNU", os.environ.get("MKL_THREADING_LAYER"))
    assert env[blas.APPLIED] == "1"
