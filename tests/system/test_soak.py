"""Soak: 2,000 short requests through one worker. The request stream ends empty and
the worker's memory does not grow (RSS after a warm-up against RSS at the end)."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from support import KEYS, rss_mb, settled, worker_fixture

from client import decode_event

pytestmark = pytest.mark.soak
worker = worker_fixture(max_num_seqs=16)
WARM_UP, TOTAL = 200, 2000


def run_requests(r, queue: str, count: int) -> list[str]:
    """Submit `count` one-token requests and wait for every one to end with `done`."""
    ids = [f"soak-{uuid.uuid4().hex}" for _ in range(count)]
    with r.pipeline(transaction=False) as pipe:
        for i, request_id in enumerate(ids):
            pipe.xadd(KEYS.queue(queue), {"id": request_id, "json": json.dumps({"prompt": f"Item {i}:",
                                                                                 "max_tokens": 2})})
        pipe.execute()
    deadline = time.monotonic() + 300
    while r.xlen(KEYS.queue(queue)):
        assert time.monotonic() < deadline, "the requests did not finish"
        time.sleep(0.1)
    with r.pipeline(transaction=False) as pipe:
        for request_id in ids:
            pipe.xrevrange(KEYS.output(queue, request_id), count=1)
        last_events = pipe.execute()
    assert all(decode_event(entries[0][1]).type == "done" for entries in last_events)
    return ids


def test_two_thousand_requests_leave_no_entries_and_no_memory_growth(worker, r):
    run_requests(r, worker.queue, WARM_UP)
    before = rss_mb(worker.process.pid)
    run_requests(r, worker.queue, TOTAL - WARM_UP)
    after = rss_mb(worker.process.pid)
    print(f"\nworker RSS after {WARM_UP} requests: {before:.1f} MB; after {TOTAL}: {after:.1f} MB")
    assert settled(r, KEYS.queue(worker.queue))
    assert after - before < 30, f"RSS grew from {before:.1f} MB to {after:.1f} MB"
