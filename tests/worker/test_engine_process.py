"""The engine in a process of its own: its death or hang costs the requests it held a
crash, never the worker; the worker's own process never loads MLX; the engine process
lives exactly as long as its worker.

Real worker processes on the demo model against a real Valkey, as in test_recovery.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import redis
from support import (
    HELD,
    KEYS,
    Outputs,
    WorkerProcess,
    check_stream,
    output_stream,
    settled,
    start_worker,
    wait_for,
    wait_for_deltas,
    xadd_json,
)

from client import Client, Done, Error
from worker.process.engine_link import blame
from worker.process.engine_main import InOrder

PROMPTS = [f"Story number {i}:" for i in range(4)]
LONG = 400  # tokens: long enough to stop the engine in the middle of a generation
FATAL_TOKEN = 1000  # the test hooks' marker token (in no test prompt)


@pytest.fixture
def queue() -> str:
    return f"eng{uuid.uuid4().hex[:8]}"


def submit_all(r: redis.Redis, queue: str, tag: str = "", max_tokens: int = LONG) -> list[str]:
    ids = [f"{tag}{i}-{uuid.uuid4().hex[:8]}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(ids, PROMPTS, strict=True):
        xadd_json(r, queue, request_id, {"prompt": prompt, "max_tokens": max_tokens})
    return ids


def streaming(r: redis.Redis, ids: list[str], at_least: int) -> None:
    for request_id in ids:
        stream = wait_for(lambda rid=request_id: output_stream(r, rid), what=f"the output of {request_id}")
        wait_for_deltas(r, stream, [request_id], at_least)


def finished(outputs: Outputs, ids: list[str]) -> list[Done]:
    ends = [check_stream(outputs.of(request_id, timeout=90)) for request_id in ids]
    assert all(isinstance(end, Done) for end in ends), ends
    return ends  # type: ignore[return-value]


def engine_pid(r: redis.Redis, worker: WorkerProcess) -> int:
    """The engine process's pid, from the worker's heartbeat."""
    pid = json.loads(r.get(KEYS.worker(worker.consumer)) or "{}").get("engine_pid")
    assert isinstance(pid, int), "the heartbeat names the engine process"
    return pid


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_kill_9_of_the_engine_mid_batch_resumes_its_requests_on_a_new_one(valkey, demo_model, logs_dir, r, outputs,
                                                                          queue):
    """The engine process killed with SIGKILL in the middle of four generations: the
    worker stays up, starts a new engine process, and each request continues from its last
    written delta: one `done` each, the same text as an uninterrupted run. New requests are
    served after it. Each counts a crash (it died in a decode step: no one request can be
    told from the others), one less than the `max_crashes` (2) that would poison them, and
    then runs alone."""
    worker = start_worker(valkey, demo_model, queue, logs_dir)
    try:
        ids = submit_all(r, queue)
        streaming(r, ids, at_least=20)
        first = engine_pid(r, worker)
        os.kill(first, signal.SIGSTOP)  # frozen mid-generation: the kill lands in the middle on any machine
        time.sleep(0.2)  # a write already sent lands
        written_before = {i: r.xlen(KEYS.output(queue, i)) for i in ids}
        os.kill(first, signal.SIGKILL)
        texts = [done.text for done in finished(outputs, ids)]
        assert all(written_before[i] < LONG for i in ids), "the kill came after a request had finished"
        assert worker.process.poll() is None, "the worker outlives its engine process"
        assert texts == [done.text for done in finished(outputs, submit_all(r, queue, tag="reference"))]
        assert engine_pid(r, worker) != first
        log = worker.log()
        assert "the engine process died; its requests resume on a new one" in log
        assert "killed by SIGKILL" in log
        assert settled(r, KEYS.queue(queue))
    finally:
        worker.stop()
    assert worker.process.returncode == 0


def test_a_request_that_kills_the_engine_is_dead_lettered_and_the_worker_serves_on(valkey, demo_model, logs_dir, r,
                                                                                    outputs, queue):
    """A request that breaks the engine thread as it starts (the test hook) kills an engine
    process `max_crashes` times, then goes to the dead-letter stream and its reader gets
    `poisoned`; the worker, never down, serves the next request."""
    worker = start_worker(valkey, demo_model, queue, logs_dir, max_crashes=2,
                          env={"MLXQ_TEST_FATAL_ON_TOKEN": str(FATAL_TOKEN)})
    try:
        poison = f"poison-{uuid.uuid4().hex[:8]}"
        xadd_json(r, queue, poison, {"prompt_tokens": [5, FATAL_TOKEN, 7], "max_tokens": 3})
        (error,) = outputs.of(poison, timeout=90)
        assert isinstance(error, Error) and error.code == "poisoned", error
        assert "2 worker or engine process(es) died while they held it (max_crashes is 2)" in error.message
        ((_, letter),) = r.xrange(KEYS.dead(queue))
        assert letter[b"field:id"] == poison.encode()
        after = f"after-{uuid.uuid4().hex[:8]}"
        xadd_json(r, queue, after, {"prompt": "Fine", "max_tokens": 3})
        assert isinstance(check_stream(outputs.of(after, timeout=90)), Done)
        assert worker.process.poll() is None
        assert worker.log().count("the engine process died") == 2
        assert settled(r, KEYS.queue(queue))
    finally:
        worker.stop()


def test_a_request_that_kills_the_engine_decoding_is_dead_lettered_and_its_batch_mates_live(
        valkey, demo_model, logs_dir, r, outputs, queue):
    """A request that kills the engine process in a decode step (the test hook), with three
    others decoding beside it: that death is the whole batch's (one crash each), and each
    of them then runs alone. Alone, the poison request kills the next engine process by
    itself and is dead-lettered at `max_crashes` (2); the three others, counted once,
    each run alone in turn (slowed: until cancelled) and end `cancelled`, not `poisoned`.
    While they do, the worker reads nothing new: a fresh request waits unread in the queue
    (for any other worker), and is served once they are gone."""
    worker = start_worker(valkey, demo_model, queue, logs_dir, max_crashes=2,
                          env={"MLXQ_TEST_EXIT_DECODING_ON_TOKEN": str(FATAL_TOKEN)})
    try:
        mates = [f"mate{i}-{uuid.uuid4().hex[:8]}" for i in range(3)]
        for request_id in mates:
            xadd_json(r, queue, request_id, HELD)  # slowed: nothing but a cancel ends them
        streaming(r, mates, at_least=2)
        poison = f"poison-{uuid.uuid4().hex[:8]}"
        xadd_json(r, queue, poison, {"prompt_tokens": [5, FATAL_TOKEN, 7], "max_tokens": 50, "ignore_eos": True})
        wait_for(lambda: "the engine process died" in worker.log(), what="the first engine process's death")
        written = {request_id: r.xlen(KEYS.output(queue, request_id)) for request_id in mates}
        left = set(mates)
        fresh, fresh_entry = None, ""
        with Client(valkey, queue=queue) as client:
            while left:  # whichever runs (alone, so it gains 5 deltas while no other runs) is cancelled
                def grown(left: set[str] = left) -> list[str]:
                    return [i for i in left if r.xlen(KEYS.output(queue, i)) >= written[i] + 5]

                running = wait_for(grown, timeout=90, what="a batch-mate running alone on a new engine process")
                if fresh is None:  # sent while one runs alone; unread after five more of its (slowed) steps
                    fresh = f"fresh-{uuid.uuid4().hex[:8]}"
                    fresh_entry = xadd_json(r, queue, fresh, {"prompt": "Fine", "max_tokens": 3})
                    at = r.xlen(KEYS.output(queue, running[0]))
                    wait_for(lambda at=at, i=running[0]: r.xlen(KEYS.output(queue, i)) >= at + 5,
                             what="five more steps of the one running alone")
                    assert r.xpending_range(KEYS.queue(queue), "workers", fresh_entry, fresh_entry, 1) == []
                    assert output_stream(r, fresh) is None
                for request_id in running:
                    client.cancel(request_id)
                    end = check_stream(outputs.of(request_id, timeout=90))
                    assert isinstance(end, Done) and end.finish_reason == "cancelled", end
                left -= set(running)
        (*_, error) = outputs.of(poison, timeout=90)
        assert isinstance(error, Error) and error.code == "poisoned", error
        assert "2 worker or engine process(es) died while they held it" in error.message
        assert worker.log().count("the engine process died; its requests resume on a new one") == 2
        assert [fields[b"field:id"] for _, fields in r.xrange(KEYS.dead(queue))] == [poison.encode()]
        assert isinstance(check_stream(outputs.of(fresh, timeout=90)), Done)
        assert worker.process.poll() is None
    finally:
        worker.stop()


def test_a_death_is_blamed_on_what_the_engine_was_computing():
    """Those in their prefill, if any; else the whole batch (a decode step); never the
    requests waiting in the engine, unless nothing ran."""
    lost = ["waiting", "decoding1", "decoding2", "prefilling"]
    batched = {"decoding1", "decoding2", "prefilling"}
    assert blame(lost, batched, {"decoding1", "decoding2"}) == {"prefilling"}
    assert blame(lost, batched, batched) == batched
    assert blame(["waiting"], set(), set()) == {"waiting"}


def test_a_hung_engine_is_killed_and_the_request_that_hung_it_alone_counts_a_crash(valkey, demo_model, logs_dir, r,
                                                                                   outputs, queue):
    """A request that stops the engine thread for good (the test hook) while another
    streams: after `engine_stall_s` without a step the worker kills the engine process.
    The hanging request, never started, is the one that counts the crash (`max_crashes`
    1: poisoned at once); the running one resumes on the new engine and finishes."""
    worker = start_worker(valkey, demo_model, queue, logs_dir, max_crashes=1, engine_stall_s=2,
                          env={"MLXQ_TEST_HANG_ON_TOKEN": str(FATAL_TOKEN)})
    try:
        (running,) = submit_all(r, queue)[:1]
        streaming(r, [running], at_least=5)
        hang = f"hang-{uuid.uuid4().hex[:8]}"
        xadd_json(r, queue, hang, {"prompt_tokens": [5, FATAL_TOKEN, 7], "max_tokens": 3})
        (error,) = outputs.of(hang, timeout=90)
        assert isinstance(error, Error) and error.code == "poisoned", error
        finished(outputs, [running])
        assert worker.process.poll() is None
        assert "engine process took no step for engine_stall_s; killing it" in worker.log()
    finally:
        worker.stop()


def test_the_engine_process_lives_as_long_as_its_worker(valkey, demo_model, logs_dir, r, outputs, queue):
    """SIGTERM drains with the engine process alive until the running requests are
    written, and it is gone once the worker exits; a worker killed with SIGKILL leaves no
    engine process behind either. Only the engine process maps MLX."""
    worker = start_worker(valkey, demo_model, queue, logs_dir, drain_timeout_s=600)  # a drain no machine outlasts
    engine = engine_pid(r, worker)
    assert "libmlx" in maps(engine) and "libmlx" not in maps(worker.process.pid)
    ids = submit_all(r, queue, max_tokens=200)
    streaming(r, ids, at_least=5)
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    finished(outputs, ids)  # drained: written by the engine process to their end
    wait_for(lambda: gone(engine), what="the engine process to exit with its worker")

    worker = start_worker(valkey, demo_model, queue, logs_dir)
    engine = engine_pid(r, worker)
    worker.process.kill()
    worker.wait()
    wait_for(lambda: gone(engine), what="the engine process to exit when its worker was killed")


def test_a_preparer_that_fails_unforeseen_refuses_its_request_and_nothing_waits_on():
    """A bug in preparation (any exception, not a refusal) answers its request `internal`
    over the channel, rather than leaving the I/O process waiting for an answer forever."""
    import threading
    from types import SimpleNamespace

    from client.protocol import Envelope
    from worker.messages import Prepare, Refused, RequestRef
    from worker.process.engine_main import EngineProcess

    sent: list[object] = []
    engine = EngineProcess.__new__(EngineProcess)  # its dispatch alone: no model, no engine thread
    engine.channel, engine._lock, engine._in_preparation = SimpleNamespace(send=sent.append), threading.Lock(), {}
    engine._outcomes = InOrder()
    ref = RequestRef("r1", "1-0")
    engine._in_preparation[ref.id] = ""

    def broken(*_: object) -> object:
        raise KeyError("a bug")

    engine._prepare(SimpleNamespace(prepare=broken), Prepare(Envelope("r1", {}, "json", None), ref, 0.0, 0.0), 0)
    (answer,) = sent
    assert isinstance(answer, Refused) and answer.code == "internal" and "KeyError" in answer.message
    assert engine._in_preparation == {}


def test_preparations_that_end_out_of_order_reach_the_engine_in_the_order_they_came():
    """Two preparing threads end in any order; what each leads to (queued, answered) is
    carried out in the order the requests came: first come first served."""
    carried: list[int] = []
    order = InOrder()
    order.done(2, lambda: carried.append(2))
    order.done(1, lambda: carried.append(1))
    assert carried == []
    order.done(0, lambda: carried.append(0))
    assert carried == [0, 1, 2]
    order.done(3, lambda: carried.append(3))
    assert carried == [0, 1, 2, 3]
    # Counted as carried out while its outcome runs: a request queued in the engine is no
    # longer one on its way, which the engine would hold a start for (`preparing`).
    order.done(4, lambda: carried.append(order.carried_out))
    assert carried[-1] == 5


def test_a_request_with_media_holds_back_nobody_while_it_is_prepared():
    """Decoding media may take seconds: a request with media takes no place in the order
    in which outcomes are carried out, nor among the requests the engine holds a start
    for (`preparing`), so the text request that came after it is answered without
    waiting for it, and it is answered as soon as it is ready, behind nobody."""
    import threading
    from types import SimpleNamespace

    from client.protocol import Envelope, RequestRejected
    from worker.messages import Prepare, Refused, RequestRef
    from worker.process.engine_main import EngineProcess

    sent: list[object] = []
    engine = EngineProcess.__new__(EngineProcess)  # its dispatch alone: no model, no engine thread
    engine.channel, engine._lock, engine._in_preparation = SimpleNamespace(send=sent.append), threading.Lock(), {}
    engine._outcomes, engine._numbered = InOrder(), 0
    bodies = {"t0": {"prompt": "hi"}, "video": {"prompt": "what is it?", "videos": ["AAAA"]}, "t1": {"prompt": "hi"}}
    messages = {rid: Prepare(Envelope(rid, body, "json", None), RequestRef(rid, "1-0"), 0.0, 0.0)
                for rid, body in bodies.items()}
    numbers = {rid: engine._number(message) for rid, message in messages.items()}
    engine._in_preparation.update(dict.fromkeys(bodies, ""))
    assert numbers == {"t0": 0, "video": None, "t1": 1}
    assert engine._numbered - engine._outcomes.carried_out == 2, "the video is not waited for"

    def refusing(envelope: Envelope, *_: object) -> object:
        raise RequestRejected(f"{envelope.id} refused")

    def prepared(rid: str) -> None:
        engine._prepare(SimpleNamespace(prepare=refusing), messages[rid], numbers[rid])

    prepared("t1")  # before t0: it waits for t0
    assert sent == []
    prepared("video")  # behind nobody
    prepared("t0")
    assert [answer.ref.id for answer in sent if isinstance(answer, Refused)] == ["video", "t0", "t1"]
    assert engine._numbered - engine._outcomes.carried_out == 0 and engine._in_preparation == {}
