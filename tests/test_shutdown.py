"""SIGTERM: stop reading, let running requests finish up to the drain timeout, exit 0."""

from __future__ import annotations

import signal
import uuid

from support import HELD, Outputs, check_stream, start_worker, wait_for_deltas, xadd_json

from client import Done


def test_sigterm_lets_running_requests_finish(valkey, demo_model, logs_dir, r):
    """A request running at SIGTERM completes normally and the worker exits 0."""
    worker = start_worker(valkey, demo_model, f"drain-{uuid.uuid4().hex[:6]}", logs_dir, drain_timeout_s=60)
    rid = f"drain-{uuid.uuid4().hex}"
    xadd_json(r, worker.queue, rid, {"prompt": "Finish me", "max_tokens": 400})
    wait_for_deltas(r, f"mlxq:out:{{{rid}}}", [rid])
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0, worker.log()
    done = check_stream(Outputs(r).of(rid, timeout=5))
    assert isinstance(done, Done) and done.finish_reason == "length"
    assert r.xpending(f"mlxq:q:{worker.queue}", "workers")["pending"] == 0
    assert "worker stopped" in worker.log()


def test_what_outlives_the_drain_timeout_stays_pending_for_another_worker(valkey, demo_model, logs_dir, r):
    """Requests still running (or waiting) when the drain time is up are left un-acked, with no terminal event."""
    worker = start_worker(valkey, demo_model, f"abandon-{uuid.uuid4().hex[:6]}", logs_dir, drain_timeout_s=0.3,
                          max_num_seqs=1)
    running, waiting = f"run-{uuid.uuid4().hex}", f"wait-{uuid.uuid4().hex}"
    xadd_json(r, worker.queue, running, HELD)  # runs until cancelled
    xadd_json(r, worker.queue, waiting, {"prompt": "Queued", "max_tokens": 5})
    wait_for_deltas(r, f"mlxq:out:{{{running}}}", [running])
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0, worker.log()
    pending = r.xpending_range(f"mlxq:q:{worker.queue}", "workers", min="-", max="+", count=10)
    assert len(pending) == 2 and {p["consumer"].decode() for p in pending} == {worker.consumer}
    terminal = [f for _, f in r.xrange(f"mlxq:out:{{{running}}}") if f[b"type"] != b"delta"]
    assert terminal == []
    assert not r.exists(f"mlxq:out:{{{waiting}}}")
