"""Several workers on one queue: names that are never shared, takeover after kill -9,
a poison request that costs one worker and not the fleet, a burst as a worker starts."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
import redis
from support import AUTO, KEYS, ROOT, check_stream, settled, start_worker, wait_for, xadd_json

from client import Done, Error

HOST = socket.gethostname()


@pytest.fixture
def queue() -> str:
    return f"fleet{uuid.uuid4().hex[:8]}"


def submit(r: redis.Redis, queue: str, n: int, max_tokens: int, prefix: str = "req") -> list[str]:
    ids = [f"{prefix}-{uuid.uuid4().hex[:8]}" for _ in range(n)]
    for i, rid in enumerate(ids):
        xadd_json(r, queue, rid, {"prompt": f"Request number {i}", "max_tokens": max_tokens})
    return ids


def holders(r: redis.Redis, queue: str) -> dict[str, int]:
    """Consumer name -> entries it holds pending on the queue."""
    return {c["name"].decode(): int(c["pending"]) for c in r.xinfo_consumers(KEYS.queue(queue), "workers")}


def test_two_unnamed_workers_on_one_host_get_two_names_and_survive_kill_9(valkey, demo_model, logs_dir, r,
                                                                         outputs, queue):
    """Two workers started without a name take two different `<host>-<n>` names; kill -9
    of one mid-generation leaves its requests to the other, and every request completes
    with its output whole (no gap, no repeat)."""
    first = start_worker(valkey, demo_model, queue, logs_dir, consumer=AUTO, max_num_seqs=4)
    second = start_worker(valkey, demo_model, queue, logs_dir, consumer=AUTO, max_num_seqs=4,
                          reclaim_interval_s=0.2)
    try:
        assert first.consumer != second.consumer
        assert {first.consumer.rsplit("-", 1)[0], second.consumer.rsplit("-", 1)[0]} == {HOST}
        ids = submit(r, queue, 8, max_tokens=300)
        wait_for(lambda: holders(r, queue).get(first.consumer, 0) > 0 and
                   holders(r, queue).get(second.consumer, 0) > 0, what="both workers to hold requests")
        first.signal(signal.SIGKILL)
        first.wait(10)
        for rid in ids:
            done = check_stream(outputs.of(rid, timeout=90))
            assert isinstance(done, Done) and done.usage.completion_tokens == 300
        assert settled(r, KEYS.queue(queue))
    finally:
        first.stop()
        second.stop()


def test_a_worker_restarted_after_kill_9_gets_its_name_back(valkey, demo_model, logs_dir, r, outputs, queue):
    """With no name given, a worker started after another on this host died takes the
    dead one's name at once (its heartbeat has not even expired) and resumes its requests."""
    victim = start_worker(valkey, demo_model, queue, logs_dir, consumer=AUTO, heartbeat_s=30)
    ids = submit(r, queue, 3, max_tokens=200)
    wait_for(lambda: holders(r, queue).get(victim.consumer, 0) == 3, what="the victim to hold all three")
    victim.signal(signal.SIGKILL)
    victim.wait(10)
    assert r.exists(KEYS.worker(victim.consumer)), "its heartbeat outlives it (30 s here)"
    again = start_worker(valkey, demo_model, queue, logs_dir, consumer=AUTO)
    try:
        assert again.consumer == victim.consumer
        for rid in ids:
            assert isinstance(check_stream(outputs.of(rid, timeout=60)), Done)
        assert "resuming this consumer's own pending requests" in again.log()
    finally:
        again.stop()


def test_a_name_held_by_a_live_worker_is_refused(valkey, demo_model, logs_dir, queue):
    """A second worker asking for a live worker's name exits at once with status 2 and
    names the holder; the holder is undisturbed."""
    holder = start_worker(valkey, demo_model, queue, logs_dir, consumer=f"taken-{queue}")
    try:
        log_path = logs_dir / f"refused-{queue}.log"
        with open(log_path, "wb") as log_file:
            process = subprocess.run(
                [sys.executable, "-m", "mlxq", "worker", "--redis-url", valkey, "--model", str(demo_model),
                 "--queue", queue, "--consumer", holder.consumer, "--log-format", "json"],
                cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT, timeout=60)
        assert process.returncode == 2
        assert (f"the consumer name '{holder.consumer}' is held by a live worker (host {HOST}, pid "
                f"{holder.process.pid}") in log_path.read_text()
        assert holder.process.poll() is None
    finally:
        holder.stop()


def test_a_name_held_by_another_hosts_lapsing_heartbeat_is_taken_once_it_lapses(valkey, demo_model, logs_dir, r,
                                                                                  queue):
    """A worker recreated on another host (a container's new hostname) asks for its old
    name while the old heartbeat still runs out: it waits for it to lapse, then takes it."""
    name = f"moved-{queue}"
    r.set(KEYS.worker(name), json.dumps({"host": "old-container", "pid": 1, "queue": queue}), px=6000)
    log_path = logs_dir / f"moved-{queue}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "mlxq", "worker", "--redis-url", valkey, "--model", str(demo_model),
             "--queue", queue, "--consumer", name, "--heartbeat-s", "1", "--log-format", "json"],
            cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "worker ready" not in log_path.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        assert "waiting for its heartbeat to lapse" in log_path.read_text()
        assert json.loads(r.get(KEYS.worker(name)))["pid"] == process.pid
    finally:
        process.terminate()
        process.wait(60)


def test_a_poison_request_costs_the_fleet_no_worker(valkey, demo_model, logs_dir, r, outputs, queue):
    """Three workers; a request that kills the engine process that prepares it (the test
    hook, like a crash in a tokenizer) kills `max_crashes` (2) engine processes, on one
    worker or two, and is then dead-lettered and answered `poisoned`; every worker stays
    up and the bystanders, those the dead engines held included, complete."""
    env = {"MLXQ_TEST_EXIT_ON": "POISON-PILL"}
    workers = [start_worker(valkey, demo_model, queue, logs_dir, consumer=AUTO, env=env, reclaim_interval_s=0.2,
                            max_num_seqs=4) for _ in range(3)]
    try:
        before = submit(r, queue, 3, max_tokens=120, prefix="before")
        poison = f"poison-{uuid.uuid4().hex[:8]}"
        xadd_json(r, queue, poison, {"prompt": "a POISON-PILL for the worker", "max_tokens": 5})
        after = submit(r, queue, 3, max_tokens=40, prefix="after")
        (error,) = outputs.of(poison, timeout=60)
        assert isinstance(error, Error) and error.code == "poisoned"
        assert "2 worker or engine process(es) died while they held it (max_crashes is 2)" in error.message
        for rid in before + after:
            assert isinstance(check_stream(outputs.of(rid, timeout=60)), Done)
        assert [w.process.poll() for w in workers] == [None, None, None]
        assert sum(w.log().count("the engine process died") for w in workers) == 2
        (letter,) = [f for _, f in r.xrange(KEYS.dead(queue))]
        assert letter[b"field:id"] == poison.encode()
        assert settled(r, KEYS.queue(queue))
    finally:
        for w in workers:
            w.stop()


@pytest.mark.parametrize("attempt", range(5))
def test_a_burst_as_a_worker_with_lanes_starts_is_all_answered(valkey, demo_model, logs_dir, r, outputs, queue,
                                                                attempt):
    """Twenty requests sent the moment a worker with a lane writes its heartbeat (while it
    still looks for its own pending entries) are all answered and none stays pending."""
    worker = start_worker(valkey, demo_model, queue, logs_dir, lanes="urgent", max_num_seqs=2, prefetch=1)
    try:
        ids = submit(r, queue, 20, max_tokens=3)
        for rid in ids:
            assert isinstance(check_stream(outputs.of(rid, timeout=60)), Done)
        assert "another worker took this request over" not in worker.log()
        wait_for(lambda: r.xpending(KEYS.queue(queue), "workers")["pending"] == 0, what="nothing pending")
    finally:
        worker.stop()
