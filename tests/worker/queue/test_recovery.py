"""Workers die, restart and stop; requests are neither lost nor told twice.

Every test here runs real worker processes against a real Valkey. `check_stream`
asserts that seq runs 0, 1, 2, ... with no gap or repeat and that the joined deltas
equal the terminal text; the autouse `never_told_twice` fixture checks that no request
got two terminal events.
"""

from __future__ import annotations

import signal
import time
import uuid

import pytest
import redis
from support import (
    HELD,
    KEYS,
    ON_BOTH,
    Outputs,
    check_stream,
    output_stream,
    settled,
    start_worker,
    wait_for,
    wait_for_deltas,
    xadd_json,
)

from client import Client, Done, Error

PROMPTS = [f"Story number {i}:" for i in range(6)]
LONG = 1000  # tokens: long enough to kill a worker in the middle of a generation


@pytest.fixture
def queue() -> str:
    return f"rec{uuid.uuid4().hex[:8]}"


def submit_all(r: redis.Redis, queue: str, max_tokens: int = LONG, tag: str = "") -> list[str]:
    ids = [f"{tag}{i}-{uuid.uuid4().hex[:8]}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(ids, PROMPTS, strict=True):
        xadd_json(r, queue, request_id, {"prompt": prompt, "max_tokens": max_tokens})
    return ids


def streaming(r: redis.Redis, ids: list[str], at_least: int) -> None:
    """Wait until each request's own stream holds `at_least` deltas."""
    for request_id in ids:
        stream = wait_for(lambda rid=request_id: output_stream(r, rid), what=f"the output of {request_id}")
        wait_for_deltas(r, stream, [request_id], at_least)


def finished(outputs: Outputs, ids: list[str]) -> dict[str, Done]:
    """Each request's `done`, after checking its stream's invariants."""
    result = {}
    for request_id in ids:
        terminal = check_stream(outputs.of(request_id, timeout=90))
        assert isinstance(terminal, Done), terminal
        result[request_id] = terminal
    return result


def uninterrupted(outputs: Outputs, r: redis.Redis, queue: str) -> list[str]:
    """The greedy texts of the same prompts run without interruption."""
    ids = submit_all(r, queue, tag="reference")
    return [done.text for done in finished(outputs, ids).values()]


@ON_BOTH
def test_kill_9_mid_generation_resumes_on_the_other_worker(redis_url, demo_model, logs_dir, r, outputs, queue):
    """A worker killed with SIGKILL in the middle of six generations: the other worker
    takes them over and continues each from the last written delta. Every reader sees
    seq without gap or repeat, one `done`, and the same text as an uninterrupted run."""
    victim = start_worker(redis_url, demo_model, queue, logs_dir, consumer="victim")
    ids = submit_all(r, queue)
    streaming(r, ids, at_least=20)
    # Frozen mid-generation, then killed once the survivor is up: how long a worker takes to
    # start must not decide whether the kill lands in the middle.
    victim.signal(signal.SIGSTOP)
    time.sleep(0.2)  # a write already sent lands
    written_before = {i: r.xlen(KEYS.output(queue, i)) for i in ids}
    survivor = start_worker(redis_url, demo_model, queue, logs_dir, consumer="survivor", reclaim_interval_s=0.2)
    try:
        victim.process.kill()
        victim.wait()
        done = finished(outputs, ids)
        assert all(d.usage.completion_tokens == LONG for d in done.values())
        assert all(written_before[i] < LONG for i in ids), "the kill came after a request had finished"
        assert [d.text for d in done.values()] == uninterrupted(outputs, r, queue)
        assert "took over the requests of a silent worker" in survivor.log()
        assert settled(r, KEYS.queue(queue)), "finished entries are deleted from the request stream"
        consumers = [c["name"] for c in r.xinfo_consumers(KEYS.queue(queue), "workers")]
        assert consumers == [b"survivor"], "the dead consumer is removed once its entries were taken"
    finally:
        survivor.stop()


@ON_BOTH
def test_a_frozen_worker_that_wakes_after_a_takeover_writes_nothing(redis_url, demo_model, logs_dir, r, outputs,
                                                                     queue):
    """A worker frozen (SIGSTOP) mid-generation loses its requests to another worker; when
    it wakes, its next writes are refused by the fences the other worker took: readers see
    no seq twice and the text of an uninterrupted run, and the woken worker drops them."""
    sleeper = start_worker(redis_url, demo_model, queue, logs_dir, consumer="sleeper")
    ids = submit_all(r, queue)
    streaming(r, ids, at_least=20)
    sleeper.signal(signal.SIGSTOP)
    taker = start_worker(redis_url, demo_model, queue, logs_dir, consumer="taker", reclaim_interval_s=0.2)
    try:
        wait_for(lambda: "took over the requests of a silent worker" in taker.log(), what="the takeover")
        sleeper.signal(signal.SIGCONT)
        done = finished(outputs, ids)
        assert [d.text for d in done.values()] == uninterrupted(outputs, r, queue)
        dropped = "another worker took this request over"
        wait_for(lambda: dropped in sleeper.log(), timeout=10, what="the woken worker to drop its requests")
    finally:
        sleeper.stop()
        taker.stop()


def test_a_live_worker_with_a_long_generation_is_not_robbed(valkey, demo_model, logs_dir, r, outputs, queue):
    """A generation that outlasts the reclaim idle time (2 heartbeats of 0.5 s) many times
    over stays with its worker: its lease is renewed, so the other worker, scanning every
    0.1 s, never takes it."""
    owner = start_worker(valkey, demo_model, queue, logs_dir, consumer="owner")
    request_id = f"long-{uuid.uuid4().hex[:8]}"
    entry_id = xadd_json(r, queue, request_id, HELD)  # runs until cancelled
    streaming(r, [request_id], at_least=1)
    other = start_worker(valkey, demo_model, queue, logs_dir, consumer="other", reclaim_interval_s=0.1)
    try:
        until = time.monotonic() + 4.0  # four times the idle time after which an entry may be taken
        while time.monotonic() < until:
            (owners,) = r.xpending_range(KEYS.queue(queue), "workers", entry_id, entry_id, 1)
            assert (owners["consumer"], owners["times_delivered"]) == (b"owner", 1)
            time.sleep(0.1)
        with Client(valkey, queue=queue) as client:
            client.cancel(request_id)
        assert finished(outputs, [request_id])[request_id].finish_reason == "cancelled"
        assert "took over" not in other.log()
    finally:
        other.stop()
        owner.stop()


@ON_BOTH
def test_a_worker_restarted_under_its_name_resumes_its_own_pending(redis_url, demo_model, logs_dir, r, outputs, queue):
    """After kill -9, the same consumer name starting again first takes up its own
    pending entries (no waiting for a heartbeat to expire) and resumes them."""
    worker = start_worker(redis_url, demo_model, queue, logs_dir, consumer="phoenix")
    ids = submit_all(r, queue)
    streaming(r, ids, at_least=20)
    worker.process.kill()
    worker.wait()
    worker = start_worker(redis_url, demo_model, queue, logs_dir, consumer="phoenix")
    try:
        done = finished(outputs, ids)
        assert "resuming this consumer's own pending requests" in worker.log()
        assert [d.text for d in done.values()] == uninterrupted(outputs, r, queue)
    finally:
        worker.stop()
    assert worker.process.returncode == 0


def test_an_entry_that_kills_the_engine_while_prepared_is_dead_lettered(valkey, demo_model, logs_dir, r, outputs,
                                                                          queue):
    """A request that makes the engine process exit while it is prepared (the test hook,
    like an OOM kill in a tokenizer) costs `max_crashes` engine processes, then goes to
    the dead-letter stream with its history; its reader gets `poisoned`. The request that
    was streaming meanwhile resumes each time, counts no crash, and finishes; the worker
    never stops."""
    worker = start_worker(valkey, demo_model, queue, logs_dir, consumer="crashy", max_crashes=2,
                          env={"MLXQ_TEST_EXIT_ON": "CRASH-ME"})
    try:
        (bystander,) = submit_all(r, queue)[:1]
        streaming(r, [bystander], at_least=5)
        poison = f"poison-{uuid.uuid4().hex[:8]}"
        xadd_json(r, queue, poison, {"prompt": "CRASH-ME now", "max_tokens": 5})
        (error,) = outputs.of(poison, timeout=90)
        assert isinstance(error, Error)
        assert error.code == "poisoned"
        assert "2 worker or engine process(es) died while they held it (max_crashes is 2)" in error.message
        ((_, dead),) = r.xrange(KEYS.dead(queue))
        assert dead[b"deliveries"] == b"3"
        assert dead[b"field:id"] == poison.encode()
        finished(outputs, [bystander])
        after = f"after-{uuid.uuid4().hex[:8]}"
        xadd_json(r, queue, after, {"prompt": "Fine", "max_tokens": 3})
        assert isinstance(check_stream(outputs.of(after)), Done)
        assert worker.process.poll() is None
        assert worker.log().count("the engine process died") == 2
        assert settled(r, KEYS.queue(queue))
    finally:
        worker.stop()


def test_sigterm_hands_back_what_the_drain_could_not_finish(valkey, demo_model, logs_dir, r, outputs, queue):
    """SIGTERM with a 0.3 s drain: the stopping worker exits 0 and hands its unfinished
    requests back; the second worker resumes them at its next scan, without waiting for
    the first one's heartbeat (15 s here) to expire."""
    leaving = start_worker(valkey, demo_model, queue, logs_dir, consumer="leaving", heartbeat_s=5,
                           drain_timeout_s=0.3)
    ids = submit_all(r, queue)
    streaming(r, ids, at_least=20)
    staying = start_worker(valkey, demo_model, queue, logs_dir, consumer="staying", reclaim_interval_s=0.2)
    try:
        leaving.signal(signal.SIGTERM)
        assert leaving.wait() == 0
        stopped = time.monotonic()
        done = finished(outputs, ids)
        assert time.monotonic() - stopped < 10, "taken over at once, not when the 15 s heartbeat expired"
        assert [d.text for d in done.values()] == uninterrupted(outputs, r, queue)
        assert "handed_back" in leaving.log()
    finally:
        staying.stop()


def test_a_second_sigterm_exits_at_once_and_nothing_is_corrupted(valkey, demo_model, logs_dir, r, outputs, queue):
    """Two SIGTERMs: the worker exits 1 without waiting for its 60 s drain; the request it
    was running is resumed by the next worker with its stream intact."""
    worker = start_worker(valkey, demo_model, queue, logs_dir, consumer="impatient", drain_timeout_s=60)
    ids = submit_all(r, queue)
    streaming(r, ids, at_least=20)
    worker.signal(signal.SIGTERM)
    time.sleep(0.1)
    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=5) == 1
    worker = start_worker(valkey, demo_model, queue, logs_dir, consumer="impatient")
    try:
        finished(outputs, ids)
    finally:
        worker.stop()
