"""The files that run workers for real: docker-compose.yml, the Dockerfile, the systemd
unit and the launchd agent. No Docker engine, systemd or launchd runs here, so they are
checked as their tools would read them: the compose file against the Compose
Specification's schema, the others parsed, and every command line through mlxq's own
argument parser."""

from __future__ import annotations

import configparser
import plistlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import tomllib
import yaml
from support import ROOT

from mlxq import blas
from mlxq.cli import _parser

COMPOSE = ROOT / "docker-compose.yml"


def _worker_args(argv: list[str]) -> object:
    """Parse a service's `mlxq worker ...` command line as the CLI would (SystemExit if it would not)."""
    assert Path(argv[0]).name == "mlxq" and argv[1] == "worker", argv
    return _parser().parse_args(argv[1:])


def test_compose_file_matches_the_compose_specification():
    checker = Path(sys.executable).parent / "check-jsonschema"
    result = subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_keeps_valkey_private_and_checks_the_worker():
    """Valkey needs a password and is published on loopback only; the worker has a stable
    name, the password in its URL, and a healthcheck on its own /healthz."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    valkey, worker = services["valkey"], services["worker"]
    assert all(port.startswith("127.0.0.1:") for port in valkey["ports"])
    assert "--requirepass" in " ".join(valkey["command"])
    assert valkey["environment"]["VALKEY_PASSWORD"].startswith("${VALKEY_PASSWORD:?")
    assert re.fullmatch(r"redis://:\$\{VALKEY_PASSWORD[^}]*\}@valkey:6379/0", worker["environment"]["MLXQ_REDIS_URL"])
    assert worker["environment"]["MLXQ_CONSUMER"]
    args = _worker_args(["mlxq", *worker["command"]])
    health = " ".join(worker["healthcheck"]["test"])
    assert f"http://127.0.0.1:{args.metrics_port}/healthz" in health  # type: ignore[attr-defined]
    assert worker["restart"] == "unless-stopped"


def test_dockerfile_copies_what_exists_and_installs_a_real_blas():
    """The build context leaves out the virtualenv and the git history (it was 2.2 GB);
    every COPY source exists, the extra it installs exists, and arm64 gets Debian's
    OpenBLAS, which the worker puts in front of MLX's reference BLAS."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignored)
    for source in re.findall(r"^COPY (.+) \S+$", dockerfile, re.MULTILINE):
        for path in source.split():
            assert (ROOT / path).exists(), path
            assert path.split("/")[0] not in ignored, f"{path} is copied but .dockerignore leaves it out"
    copied = set(re.findall(r"^COPY (\S+) ", dockerfile, re.MULTILINE))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for package in project["tool"]["setuptools"]["packages"]:
        assert package.split(".")[0] in copied, f"the image installs {package} but does not copy it"
    extras = project["project"]["optional-dependencies"]
    for wanted in re.findall(r'pip install [^\n]*"\.\[([a-z,]+)\]"', dockerfile):
        assert set(wanted.split(",")) <= set(extras)
    assert "libopenblas0-pthread" in dockerfile
    assert any("aarch64" in str(path) for path in blas.DEBIAN_OPENBLAS)


def test_systemd_unit_restarts_on_failure_with_a_stable_index():
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    unit.read(ROOT / "config" / "service" / "mlxq-worker@.service")
    service = unit["Service"]
    assert service["Restart"] == "on-failure"
    assert service["KillSignal"] == "SIGTERM" and int(service["TimeoutStopSec"]) > 30  # the drain fits
    argv = shlex.split(service["ExecStart"])
    assert argv[argv.index("--worker-index") + 1] == "%i"  # the instance name: mlxq-worker@0 is index 0
    args = _worker_args([arg.replace("%i", "0") for arg in argv])
    assert args.worker_index == 0  # type: ignore[attr-defined]
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_launchd_agent_restarts_on_failure_with_a_stable_index():
    with open(ROOT / "config" / "service" / "com.mlxq.worker.plist", "rb") as f:
        agent = plistlib.load(f)
    argv = agent["ProgramArguments"]
    args = _worker_args(argv)
    assert args.worker_index == 0  # type: ignore[attr-defined]
    assert (ROOT / "config" / Path(args.config).name).is_file()  # type: ignore[attr-defined]
    assert agent["KeepAlive"] == {"SuccessfulExit": False} and agent["RunAtLoad"] is True
    assert agent["ExitTimeOut"] > 30  # the drain fits before launchd's SIGKILL
