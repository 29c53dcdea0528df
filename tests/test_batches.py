"""Batches on the queue: the client's `submit_batch`, the low lane behind interactive
requests, cancelling, expiry; real Valkey, real workers on the demo model."""

from __future__ import annotations

import threading
import uuid
from collections import Counter

import pytest
from support import HELD, KEYS, start_worker, wait_for

from client import Client, Done, Error, RequestRejected
from client.replies import as_text

PROMPTS = ["Tell me about queues.", "A haiku on Redis", "Why batch?", "Continuous batching is", "Hello there"]


def lines_of(prompts: list[str], max_tokens: int = 12) -> list[dict]:
    return [{"custom_id": f"line-{i}", "body": {"prompt": p, "max_tokens": max_tokens, "temperature": 0}}
            for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def worker(valkey, demo_model, logs_dir):
    process = start_worker(valkey, demo_model, f"bq{uuid.uuid4().hex[:6]}", logs_dir, max_num_seqs=4)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def one_slot(valkey, demo_model, logs_dir):
    """A worker that runs one request at a time."""
    process = start_worker(valkey, demo_model, f"b1{uuid.uuid4().hex[:6]}", logs_dir, max_num_seqs=1)
    yield process
    process.stop()


def test_a_batch_computes_each_line_as_a_direct_request_would(worker):
    """Every line ends once, in line order, with the text the same request gets when sent
    directly; a body the worker would refuse is that line's error and the rest go on."""
    lines = lines_of(PROMPTS)
    lines.insert(2, {"custom_id": "bad", "body": {"prompt": "x", "max_tokens": 0}})
    with Client(worker.redis_url, queue=worker.queue) as client:
        handle = client.submit_batch(lines)
        batch = handle.wait(timeout=120)
        direct = [client.generate(**line["body"], timeout=60).text for line in lines_of(PROMPTS)]
    assert batch.status == "completed", batch
    assert batch.request_counts == {"total": 6, "completed": 5, "failed": 1}
    results = handle.results()
    assert [r.custom_id for r in results] == [line["custom_id"] for line in lines]
    texts = [r.event.text for r in results if isinstance(r.event, Done)]
    assert texts == direct
    (bad,) = [r for r in results if isinstance(r.event, Error)]
    assert bad.custom_id == "bad" and bad.event.code == "invalid_request" and "max_tokens" in bad.event.message


def test_malformed_lines_refuse_the_batch_before_anything_is_stored(worker):
    with Client(worker.redis_url, queue=worker.queue) as client:
        with pytest.raises(RequestRejected, match="used twice"):
            client.submit_batch([{"custom_id": "a", "body": {"prompt": "x"}}] * 2)
        with pytest.raises(RequestRejected, match="custom_id"):
            client.submit_batch([{"body": {"prompt": "x"}}])
        with pytest.raises(RequestRejected, match="completion_window"):
            client.submit_batch(lines_of(PROMPTS[:1]), completion_window="forever")


def test_interactive_requests_go_before_a_batch_waiting_on_the_same_queue(one_slot):
    """While the only slot is busy, a batch's lines wait in the batch lane and are not read
    ahead: an interactive request sent after the batch still runs before all of them."""
    with Client(one_slot.redis_url, queue=one_slot.queue) as client:
        held = client.submit(**HELD)
        wait_for(lambda: _running(client, one_slot) == 1, what="the held request to run")
        handle = client.submit_batch(lines_of(PROMPTS[:3]))
        driving = threading.Thread(target=handle.wait, kwargs={"timeout": 120})
        driving.start()
        wait_for(lambda: client.redis.xlen(KEYS.batch_lane(one_slot.queue)) == 3, what="the lines to be fed")
        interactive = client.submit("An interactive question", max_tokens=8, temperature=0)
        client.cancel(held.id)
        done = interactive.result(timeout=60)
        driving.join(120)
        out = client.redis.xrange(KEYS.output(interactive.id))
        finished_at = max(as_text(entry_id) for entry_id, _ in out)
        results = handle.results()
    assert done.finish_reason == "length" and len(results) == 3
    assert all(_ms(finished_at) <= _ms(r.entry) for r in results), (finished_at, [r.entry for r in results])


def _running(client: Client, worker) -> int:
    import json

    raw = client.redis.get(KEYS.worker(worker.consumer))
    return 0 if raw is None else int(json.loads(raw).get("running", 0))


def _ms(entry_id: str | None) -> int:
    assert entry_id is not None
    return int(entry_id.split("-")[0])


def test_cancelling_a_batch_stops_its_running_lines_and_runs_no_more(one_slot):
    with Client(one_slot.redis_url, queue=one_slot.queue) as client:
        held_body = {k: v for k, v in HELD.items()}
        handle = client.submit_batch([{"custom_id": f"slow-{i}", "body": held_body} for i in range(3)])
        driving = threading.Thread(target=handle.wait, kwargs={"timeout": 120})
        driving.start()
        wait_for(lambda: _running(client, one_slot) == 1, what="a line to run")
        assert handle.cancel().status == "cancelling"
        driving.join(120)
        batch = handle.progress()
    assert batch.status == "cancelled" and batch.request_counts == {"total": 3, "completed": 0, "failed": 0}
    assert handle.results() == []


def test_a_batch_past_its_window_expires_with_what_finished(one_slot):
    """Lines that ended are kept; every other line is an error `batch_expired`."""
    with Client(one_slot.redis_url, queue=one_slot.queue) as client:
        lines = lines_of(PROMPTS[:1]) + [{"custom_id": "slow", "body": dict(HELD)}]
        handle = client.submit_batch(lines, completion_window="4s")
        batch = handle.wait(timeout=60)
        results = handle.results()
    assert batch.status == "expired"
    kinds = Counter(type(r.event).__name__ for r in results)
    assert kinds == {"Done": 1, "Error": 1}
    assert results[1].custom_id == "slow" and results[1].event.code == "batch_expired"
