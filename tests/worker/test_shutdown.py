"""SIGTERM: stop reading, let running requests finish up to the drain timeout, exit 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid

from support import HELD, KEYS, ROOT, Outputs, check_stream, start_worker, wait_for_deltas, xadd_json

from client import Done


def test_sigterm_lets_running_requests_finish(valkey, demo_model, logs_dir, r):
    """A request running at SIGTERM completes normally and the worker exits 0."""
    worker = start_worker(valkey, demo_model, f"drain-{uuid.uuid4().hex[:6]}", logs_dir, drain_timeout_s=60)
    rid = f"drain-{uuid.uuid4().hex}"
    xadd_json(r, worker.queue, rid, {"prompt": "Finish me", "max_tokens": 400})
    wait_for_deltas(r, KEYS.output(worker.queue, rid), [rid])
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0, worker.log()
    done = check_stream(Outputs(r).of(rid, timeout=5))
    assert isinstance(done, Done) and done.finish_reason == "length"
    assert r.xpending(KEYS.queue(worker.queue), "workers")["pending"] == 0
    assert "worker stopped" in worker.log()


def test_what_outlives_the_drain_timeout_stays_pending_for_another_worker(valkey, demo_model, logs_dir, r):
    """Requests still running (or waiting) when the drain time is up are left un-acked, with no terminal event."""
    worker = start_worker(valkey, demo_model, f"abandon-{uuid.uuid4().hex[:6]}", logs_dir, drain_timeout_s=0.3,
                          max_num_seqs=1)
    running, waiting = f"run-{uuid.uuid4().hex}", f"wait-{uuid.uuid4().hex}"
    xadd_json(r, worker.queue, running, HELD)  # runs until cancelled
    xadd_json(r, worker.queue, waiting, {"prompt": "Queued", "max_tokens": 5})
    wait_for_deltas(r, KEYS.output(worker.queue, running), [running])
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0, worker.log()
    pending = r.xpending_range(KEYS.queue(worker.queue), "workers", min="-", max="+", count=10)
    assert len(pending) == 2 and {p["consumer"].decode() for p in pending} == {worker.consumer}
    terminal = [f for _, f in r.xrange(KEYS.output(worker.queue, running)) if f[b"type"] != b"delta"]
    assert terminal == []
    assert not r.exists(KEYS.output(worker.queue, waiting))


# The shortest exit after an engine thread ends: load, shut down, join, leave. Before the
# thread freed its MLX streams itself, this aborted every time (SIGABRT): the thread's C++
# TLS destructors took the GIL while the main thread was already finalizing.
EXIT_RIGHT_AFTER_THE_ENGINE = """
import sys
from worker.engine.backends import load_model
from worker.engine.scheduler import SchedulingPolicy
from worker.engine.thread import Engine
from worker.settings import load_settings
settings = load_settings(model=sys.argv[1])
engine = Engine(lambda: load_model(settings), SchedulingPolicy.of(settings), on_output=lambda out: None,
                on_fatal=lambda error: None)
engine.start()
engine.wait_ready(60)
engine.shutdown(0)
assert engine.join(30)
"""


def test_a_process_exits_cleanly_right_after_its_engine_thread_ends(demo_model):
    for _ in range(3):
        process = subprocess.run([sys.executable, "-c", EXIT_RIGHT_AFTER_THE_ENGINE, str(demo_model)], cwd=ROOT,
                                 capture_output=True, text=True, timeout=120)
        assert process.returncode == 0, process.stderr[-2000:]
