"""A worker of several models (`[[models]]`): each loaded model in a worker process of its
own, under one memory budget; loaded when requests wait on its queue, unloaded when idle
or to make room (least recently used first, never with requests in flight); one loader
per demand across the fleet."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import (
    HELD,
    KEYS,
    ROOT,
    ServiceProcess,
    check_stream,
    start_gateway,
    wait_for,
    wait_for_deltas,
    worker_url,
    xadd_json,
)

from client import Done, Error
from client.fleet import read_fleet
from mlxq.status import render

pytestmark = pytest.mark.process


@dataclass
class HostProcess(ServiceProcess):
    """A worker of several models (`mlxq worker --config` with `[[models]]`)."""

    process: subprocess.Popen[bytes]
    log_path: Path
    name: str


def write_config(path: Path, redis_url: str, name: str, models: list[dict], **settings) -> Path:
    lines = [f"redis_url = {json.dumps(redis_url)}", f"consumer = {json.dumps(name)}", "heartbeat_s = 0.5",
             'log_format = "json"', "cache_memory_mb = 0", "reclaim_interval_s = 0.5",
             *(f"{k} = {json.dumps(v)}" for k, v in settings.items())]
    for model in models:
        lines += ["", "[[models]]", *(f"{k} = {json.dumps(v)}" for k, v in model.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def start_host(redis_url: str, tmp: Path, name: str, models: list[dict], **settings) -> HostProcess:
    config = write_config(tmp / f"{name}.toml", worker_url(redis_url), name, models, **settings)
    log_path = tmp / f"{name}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "MLXQ_TEST_SLOW_ON_TOKEN": "1023"}
    with open(log_path, "ab") as log_file:  # a session of its own: kill -9 takes its model workers too
        process = subprocess.Popen([sys.executable, "-m", "mlxq", "worker", "--config", str(config)], cwd=ROOT,
                                   env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    return HostProcess(process, log_path, name)


def states(r, host: str) -> dict[str, str]:
    raw = r.get(KEYS.host(host))
    body = json.loads(raw) if raw else {}
    return {m["name"]: m["state"] for m in body.get("models", [])}


def looks(r, host: str) -> int:
    raw = r.get(KEYS.host(host))
    return json.loads(raw).get("looks", 0) if raw else 0


def model(name: str, demo_model: Path, **settings) -> dict:
    return {"name": name, "path": str(demo_model), "memory_gb": 1, **settings}


def submit(r, queue: str, n: int = 1, **body) -> list[str]:
    ids = [f"mm-{queue}-{uuid.uuid4().hex[:8]}" for _ in range(n)]
    for rid in ids:
        xadd_json(r, queue, rid, {"prompt": "Hello", "max_tokens": 16, **body})
    return ids


def finished(outputs, ids: list[str], timeout: float = 120) -> list[Done | Error]:
    return [check_stream(outputs.of(rid, timeout=timeout)) for rid in ids]


def test_three_models_under_a_budget_for_two(redis_url, demo_model, tmp_path, r, outputs):
    """The pinned model stays loaded; the other two take turns in the room left, the least
    recently used unloading for the one that has requests; every request completes."""
    tag = uuid.uuid4().hex[:6]
    pinned, beta, gamma = (f"{n}{tag}" for n in ("alpha", "beta", "gamma"))
    host = start_host(redis_url, tmp_path, f"host{tag}",
                      [model(pinned, demo_model, pin=True), model(beta, demo_model), model(gamma, demo_model)],
                      memory_budget_gb=2.5)
    try:
        wait_for(lambda: states(r, host.name).get(pinned) == "loaded", timeout=60, what="the pinned model")
        assert states(r, host.name)[beta] == "available"
        first = submit(r, beta, 3)  # waiting before its model loads: they complete once it has
        assert all(isinstance(d, Done) for d in finished(outputs, first))
        then = submit(r, gamma, 2)
        seen = []
        wait_for(lambda: seen.append(states(r, host.name)) or seen[-1].get(gamma) == "loaded", timeout=60,
                 what="the third model, once the idle one unloaded")
        assert all(isinstance(d, Done) for d in finished(outputs, then))
        assert any(s.get(beta) in ("draining", "available") for s in seen)  # made room
        assert not any(s.get(beta) == s.get(gamma) == "loaded" for s in seen)  # never both: the budget holds
        again = submit(r, beta, 2)
        assert all(isinstance(d, Done) for d in finished(outputs, again))
        assert all(s[pinned] == "loaded" for s in seen) and states(r, host.name)[pinned] == "loaded"
        assert states(r, host.name)[gamma] in ("draining", "available")
        assert finished(outputs, submit(r, pinned))[0].finish_reason in ("stop", "length")
        shown = render(read_fleet(r, KEYS))  # mlxq status: the models table
        row = next(line for line in shown.splitlines() if line.split()[:2] == [host.name, pinned])
        assert "loaded" in row and "yes" in row, shown
    finally:
        assert host.stop() == 0, host.log()
    assert r.get(KEYS.host(host.name)) is None


def test_unloading_waits_for_the_running_request(redis_url, demo_model, tmp_path, r, outputs):
    """A model with a request in flight is not unloaded to make room: the other waits, and
    loads once the request has ended (here, cancelled)."""
    from client import Client

    tag = uuid.uuid4().hex[:6]
    beta, gamma = f"beta{tag}", f"gamma{tag}"
    host = start_host(redis_url, tmp_path, f"host{tag}", [model(beta, demo_model), model(gamma, demo_model)],
                      memory_budget_gb=1.5)
    try:
        (held,) = _held(r, beta)
        wait_for_deltas(r, KEYS.output(beta, held), [held], timeout=60)
        (waiting,) = submit(r, gamma)
        since = looks(r, host.name)
        wait_for(lambda: looks(r, host.name) >= since + 20, what="twenty more looks of the host")
        assert states(r, host.name) == {beta: "loaded", gamma: "available"}  # beta is busy: gamma waits
        Client(worker_url(redis_url)).cancel(held, queue=beta)
        assert finished(outputs, [held])[0].finish_reason == "cancelled"
        assert isinstance(finished(outputs, [waiting])[0], Done)
        wait_for(lambda: states(r, host.name)[gamma] == "loaded", what="gamma seen loaded")
    finally:
        assert host.stop() == 0, host.log()


def _held(r, queue: str) -> list[str]:
    rid = f"mm-held-{uuid.uuid4().hex[:8]}"
    xadd_json(r, queue, rid, HELD)
    return [rid]


def test_an_idle_model_unloads_by_itself(redis_url, demo_model, tmp_path, r, outputs):
    """And it is counted for what its worker was seen to hold, where its estimate (here a
    kilobyte) is less: the next load needs that much room."""
    tag = uuid.uuid4().hex[:6]
    beta = f"beta{tag}"
    host = start_host(redis_url, tmp_path, f"host{tag}", [model(beta, demo_model, memory_gb=1e-6)],
                      memory_budget_gb=2, idle_unload_s=1)
    try:
        assert isinstance(finished(outputs, submit(r, beta))[0], Done)
        wait_for(lambda: states(r, host.name).get(beta) == "available", timeout=30, what="the idle unload")
        assert "unloading an idle model" in host.log()
        counted = json.loads(r.get(KEYS.host(host.name)))["models"][0]["memory_bytes"]
        assert counted > 100_000, counted  # the demo model's weights alone are ~550 KB
    finally:
        assert host.stop() == 0, host.log()


def test_a_model_unloaded_through_redis_is_unloaded_not_failed_and_loads_again(redis_url, demo_model, tmp_path, r,
                                                                                  outputs):
    """The dashboard's Unload: the drain key of the model's worker, which drains and exits 0;
    its host counts it unloaded (not a failure) and loads it again for the next request."""
    tag = uuid.uuid4().hex[:6]
    beta = f"beta{tag}"
    host = start_host(redis_url, tmp_path, f"host{tag}", [model(beta, demo_model, pin=True)], memory_budget_gb=2)
    try:
        wait_for(lambda: states(r, host.name).get(beta) == "loaded", timeout=60, what="the model loaded")
        consumer = json.loads(r.get(KEYS.host(host.name)))["models"][0]["consumer"]
        instance = json.loads(r.get(KEYS.worker(consumer)))["instance"]
        r.set(KEYS.drain(consumer), instance, ex=60)
        wait_for(lambda: "model unloaded" in host.log(), timeout=60, what="the host to count the model unloaded")
        assert "a model's worker exited" not in host.log()
        assert isinstance(finished(outputs, submit(r, beta))[0], Done)  # loaded again (pinned: at once)
    finally:
        assert host.stop() == 0, host.log()


def test_two_hosts_one_queue_nobody_holds_exactly_one_loads_it(redis_url, demo_model, tmp_path, r, outputs):
    """The one with more room: host 2's budget is the larger."""
    tag = uuid.uuid4().hex[:6]
    beta = f"beta{tag}"
    hosts = [start_host(redis_url, tmp_path, f"host{i}{tag}", [model(beta, demo_model)], memory_budget_gb=1 + i)
             for i in (1, 2)]
    try:
        wait_for(lambda: all(states(r, h.name) for h in hosts), timeout=30, what="both hosts")
        r.set(KEYS.host(f"junk{tag}"), "not json", ex=60)  # what another writer left: read past, never a crash
        r.zadd(KEYS.hosts, {f"junk{tag}": time.time()})
        ids = submit(r, beta, 4)
        seen = []
        wait_for(lambda: seen.append([states(r, h.name).get(beta) for h in hosts]) or "loaded" in seen[-1],
                 timeout=60, what="one host loading it")
        assert all(isinstance(d, Done) for d in finished(outputs, ids))
        seen.append([states(r, h.name).get(beta) for h in hosts])
        assert all(sum(s in ("loading", "loaded") for s in look) <= 1 for look in seen), seen
        assert seen[-1] == ["available", "loaded"], seen
    finally:
        stopped = [h.stop() for h in hosts]  # all, before any is judged
        for h, status in zip(hosts, stopped, strict=True):
            assert status == 0, h.log()


def test_a_host_killed_mid_load_leaves_the_load_to_another(redis_url, demo_model, tmp_path, r, outputs):
    """kill -9 of a host (and its model's worker) while it loads: its lease expires, the
    other host loads the model, and every request completes."""
    tag = uuid.uuid4().hex[:6]
    beta = f"beta{tag}"
    first = start_host(redis_url, tmp_path, f"hostA{tag}", [model(beta, demo_model)], memory_budget_gb=3)
    wait_for(lambda: states(r, first.name), timeout=30, what="the first host")
    ids = submit(r, beta, 3)
    wait_for(lambda: states(r, first.name).get(beta) == "loading", timeout=30, what="the load")
    os.killpg(first.process.pid, signal.SIGKILL)
    first.wait()
    second = start_host(redis_url, tmp_path, f"hostB{tag}", [model(beta, demo_model)], memory_budget_gb=2)
    try:
        assert all(isinstance(d, Done) for d in finished(outputs, ids, timeout=180))
        wait_for(lambda: states(r, second.name)[beta] == "loaded", what="the second host's load")
    finally:
        assert second.stop() == 0, second.log()


@pytest.mark.parametrize(("models", "settings", "message"), [
    ([{"name": "a", "path": "PATH"}, {"name": "a", "path": "PATH"}], {}, "the name 'a' is given twice"),
    ([{"name": "a", "path": "PATH", "memory_gb": 4}], {"memory_budget_gb": 2}, "a needs 4.0 GB, more than"),
    ([{"name": "a", "path": "PATH", "redis_url": "redis://x"}], {}, "'redis_url' is the whole worker's"),
    ([{"name": "a", "path": "PATH", "max_num_seqs": 0}], {}, "models: a: max_num_seqs"),
    ([{"name": "a", "path": "PATH"}], {"model": "PATH"}, "give one model, or a list of them"),
])
def test_bad_configs_are_refused_at_start_in_one_line(redis_url, demo_model, tmp_path, models, settings, message):
    models = [{k: str(demo_model) if v == "PATH" else v for k, v in m.items()} for m in models]
    settings = {k: str(demo_model) if v == "PATH" else v for k, v in settings.items()}
    config = write_config(tmp_path / "bad.toml", worker_url(redis_url), "bad", models, **settings)
    done = subprocess.run([sys.executable, "-m", "mlxq", "worker", "--config", str(config)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], done.stderr


def test_the_gateway_routes_to_a_model_not_loaded_and_waits_for_its_load(redis_url, demo_model, tmp_path, r, logs_dir):
    import httpx

    tag = uuid.uuid4().hex[:6]
    beta = f"beta{tag}"
    host = start_host(redis_url, tmp_path, f"host{tag}", [model(beta, demo_model)], memory_budget_gb=2)
    gateway = start_gateway(redis_url, logs_dir)
    try:
        wait_for(lambda: states(r, host.name).get(beta) == "available", what="the host")
        # No worker serves its queue yet: without the host's listing this is a 404.
        reply = httpx.post(f"{gateway.url}/v1/completions", timeout=120,
                           json={"model": beta, "prompt": "Hello", "max_tokens": 8})
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        assert states(r, host.name)[beta] in ("loading", "loaded")
    finally:  # both stopped before either is judged: a process left running fails a later test
        stopped = gateway.stop(), host.stop()
        assert stopped[0] in (0, -signal.SIGTERM), gateway.log()
        assert stopped[1] == 0, host.log()


def test_a_model_that_cannot_load_answers_its_requests_with_the_reason(redis_url, demo_model, tmp_path, r, outputs):
    """Its worker exits three times; the host reports it (its key, `mlxq status`, its log)
    and answers the requests waiting on its queue with `model_unavailable`."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(demo_model, broken)
    (broken / "model.safetensors").write_bytes(b"not weights")
    tag = uuid.uuid4().hex[:6]
    name = f"broken{tag}"
    host = start_host(redis_url, tmp_path, f"host{tag}", [model(name, broken)], memory_budget_gb=2)
    try:
        ids = submit(r, name, 2)
        for ended in finished(outputs, ids):
            assert isinstance(ended, Error) and ended.code == "model_unavailable", ended
            assert f"model {name}" in ended.message and "could not be loaded" in ended.message
        raw = json.loads(r.get(KEYS.host(host.name)))
        assert "exited 3 times" in raw["models"][0]["failed"]
        assert "failed: its worker exited 3 times" in render(read_fleet(r, KEYS))
        assert host.log().count("model left unloaded") == 1
    finally:
        assert host.stop() == 0, host.log()


def test_a_backlog_loads_a_second_copy_where_there_is_room(redis_url, demo_model, tmp_path, r, outputs):
    """Host A's copy has one slot, taken by a request that runs until cancelled; a request
    behind it waits past scale_up_after_s, and host B loads a copy that serves it."""
    from client import Client

    tag = uuid.uuid4().hex[:6]
    beta = f"beta{tag}"
    one_slot = model(beta, demo_model, max_num_seqs=1, prefetch=0)
    first = start_host(redis_url, tmp_path, f"hostA{tag}", [one_slot], memory_budget_gb=2, scale_up_after_s=1)
    second = None
    try:
        (held,) = _held(r, beta)
        wait_for_deltas(r, KEYS.output(beta, held), [held], timeout=60)
        second = start_host(redis_url, tmp_path, f"hostB{tag}", [one_slot], memory_budget_gb=2, scale_up_after_s=1)
        (behind,) = submit(r, beta)
        assert isinstance(finished(outputs, [behind])[0], Done)
        wait_for(lambda: states(r, second.name)[beta] == "loaded", what="the second copy seen loaded")
        assert states(r, first.name)[beta] == "loaded"
        assert not any(isinstance(e, (Done, Error)) for e in outputs.all_on(KEYS.output(beta, held)))  # still running
        Client(worker_url(redis_url)).cancel(held, queue=beta)
        assert finished(outputs, [held])[0].finish_reason == "cancelled"
    finally:
        for host in (first, second):
            if host is not None:
                assert host.stop() == 0, host.log()


def test_model_workers_stop_when_their_host_is_killed(redis_url, demo_model, tmp_path, r):
    """kill -9 of the host alone: its model's worker sees it gone, drains and exits, rather
    than serving on unseen."""
    tag = uuid.uuid4().hex[:6]
    pinned = f"alpha{tag}"
    host = start_host(redis_url, tmp_path, f"host{tag}", [model(pinned, demo_model, pin=True)], memory_budget_gb=2)
    wait_for(lambda: states(r, host.name).get(pinned) == "loaded", timeout=60, what="the pinned model")
    child = json.loads(r.get(KEYS.worker(f"{host.name}.{pinned}")))["pid"]
    host.process.kill()
    host.wait()
    wait_for(lambda: not _running(child), timeout=60, what="the model's worker to stop")
    assert r.get(KEYS.worker(f"{host.name}.{pinned}")) is None  # it left cleanly: its heartbeat is gone


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody reaped yet does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_the_hosts_metrics_port_serves_every_model_labelled(redis_url, demo_model, tmp_path, r, outputs):
    """And one model busy with a long request does not hold up the other's."""
    from support import free_port, scrape_metrics

    from client import Client

    tag = uuid.uuid4().hex[:6]
    alpha, beta = f"alpha{tag}", f"beta{tag}"
    port = free_port()
    host = start_host(redis_url, tmp_path, f"host{tag}", [model(alpha, demo_model, pin=True),
                                                          model(beta, demo_model, pin=True)],
                      memory_budget_gb=3, metrics_port=port)
    try:
        wait_for(lambda: set(states(r, host.name).values()) == {"loaded"}, timeout=60, what="both models")
        (held,) = _held(r, alpha)  # alpha busy with a request that runs until cancelled: beta is not held up
        wait_for_deltas(r, KEYS.output(alpha, held), [held], timeout=60)
        assert all(isinstance(d, Done) for d in finished(outputs, submit(r, beta, 2, max_tokens=4)))
        Client(worker_url(redis_url)).cancel(held, queue=alpha)
        assert finished(outputs, [held])[0].finish_reason == "cancelled"
        assert isinstance(finished(outputs, submit(r, alpha, max_tokens=4))[0], Done)

        def finished_by_model() -> dict[str, float]:
            by_model: dict[str, float] = {}
            for labels, value in scrape_metrics(port).get("mlxq_request_success_total", {}).items():
                by_model[dict(labels)["model"]] = by_model.get(dict(labels)["model"], 0) + value
            return by_model

        assert wait_for(lambda: finished_by_model() == {alpha: 2, beta: 2} and finished_by_model(),
                        what="both models' requests in the host's metrics")
    finally:
        assert host.stop() == 0, host.log()


def test_an_extra_copy_is_unloaded_before_a_model_used_longer_ago(redis_url, demo_model, tmp_path, r, outputs):
    """Host B holds gamma (used first) and an extra copy of beta (host A serves beta too,
    used since); delta needs room: the copy goes, not the least recently used gamma."""
    from client import Client

    tag = uuid.uuid4().hex[:6]
    beta, gamma, delta = f"beta{tag}", f"gamma{tag}", f"delta{tag}"
    one_slot = model(beta, demo_model, max_num_seqs=1, prefetch=0)
    first = start_host(redis_url, tmp_path, f"hostA{tag}", [{**one_slot, "pin": True}], memory_budget_gb=2)
    second = start_host(redis_url, tmp_path, f"hostB{tag}", [one_slot, model(gamma, demo_model),
                                                             model(delta, demo_model)],
                        memory_budget_gb=2.5, scale_up_after_s=1)
    try:
        wait_for(lambda: states(r, first.name).get(beta) == "loaded", timeout=60, what="host A's beta")
        assert isinstance(finished(outputs, submit(r, gamma))[0], Done)  # B loads gamma
        (held,) = _held(r, beta)  # A's one slot, taken
        wait_for_deltas(r, KEYS.output(beta, held), [held], timeout=60)
        assert isinstance(finished(outputs, submit(r, beta))[0], Done)  # waited: B loaded a copy and served it
        wait_for(lambda: states(r, second.name).get(beta) == "loaded", what="B's copy seen loaded")
        assert isinstance(finished(outputs, submit(r, delta))[0], Done)
        seen = states(r, second.name)
        assert seen[gamma] == "loaded" and seen[beta] in ("draining", "available"), seen
        Client(worker_url(redis_url)).cancel(held, queue=beta)
        assert finished(outputs, [held])[0].finish_reason == "cancelled"
    finally:
        for host in (first, second):
            assert host.stop() == 0, host.log()


def test_a_model_seen_larger_than_the_room_left_is_answered_with_why(redis_url, demo_model, tmp_path, r, outputs):
    """Its estimate (a kilobyte) let it load once; its worker was seen holding more than
    the budget leaves beside the pinned model, so its next requests get the reason."""
    tag = uuid.uuid4().hex[:6]
    pinned, small = f"alpha{tag}", f"small{tag}"
    host = start_host(redis_url, tmp_path, f"host{tag}", [model(pinned, demo_model, pin=True),
                                                          model(small, demo_model, memory_gb=1e-6)],
                      memory_budget_gb=1 + 300_000 / 1024 ** 3, idle_unload_s=1)
    try:
        assert isinstance(finished(outputs, submit(r, small))[0], Done)
        wait_for(lambda: states(r, host.name).get(small) == "available", timeout=30, what="the idle unload")
        (ended,) = finished(outputs, submit(r, small))
        assert isinstance(ended, Error) and ended.code == "model_unavailable", ended
        assert "more than the" in ended.message and "memory_budget_gb leaves beside the pinned models" in ended.message
    finally:
        assert host.stop() == 0, host.log()


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory):
    from support import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("model") / "embedding", "--embedding")


def test_a_generating_model_and_an_embedding_model_on_one_host(redis_url, demo_model, embedding_model, tmp_path, r,
                                                              outputs):
    """What a retrieval service runs on one Mac: a chat model and an embedding model, each
    loaded on demand in its own worker process, each answering its own kind of request
    (and refusing the other kind with why)."""
    tag = uuid.uuid4().hex[:6]
    chat, embed = f"chat{tag}", f"embed{tag}"
    host = start_host(redis_url, tmp_path, f"host{tag}", [model(chat, demo_model), model(embed, embedding_model)],
                      memory_budget_gb=2.5)
    try:
        vector = f"mm-{uuid.uuid4().hex[:8]}"
        xadd_json(r, embed, vector, {"input": ["a query", "a document"], "dimensions": 8})
        (text,) = submit(r, chat)
        (wrong,) = submit(r, embed)  # a generation body on the embedding model's queue
        embedded, generated, refused = finished(outputs, [vector, text, wrong])
        assert isinstance(embedded, Done) and [len(v) for v in embedded.embeddings] == [8, 8]
        assert isinstance(generated, Done) and generated.text
        assert isinstance(refused, Error) and "serves embed, not generation" in refused.message
        wait_for(lambda: states(r, host.name) == {chat: "loaded", embed: "loaded"}, timeout=30,
                 what="the host to see both models loaded")
    finally:
        assert host.stop() == 0, host.log()
