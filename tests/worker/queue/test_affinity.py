"""Placement by prefix, with two real workers on one queue: a request lands on the worker
whose prefix cache holds its prompt's start, and never waits there for what the shared
queue would give it elsewhere (a full worker, a dead one, an evicted prefix)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import uuid
from collections.abc import Iterator

import msgpack
import pytest
import redis
from support import (
    HELD,
    KEYS,
    ON_BOTH,
    SLOW_TOKEN,
    WorkerProcess,
    check_stream,
    mlxq,
    output_stream,
    start_worker,
    tokens_of,
    wait_for,
    wait_for_deltas,
    worker_url,
    xadd_json,
)

from client import Done
from common.prefix_chain import prefix_chain

SYSTEM = ("You are the support assistant of the {team} team. Answer in two sentences, cite the runbook, never "
          "guess, and say which on-call rotation owns the service. ") * 6  # ~1 KB: four blocks of the chain


def tenant(team: str, question: str, **extra: object) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM.format(team=team)},
                         {"role": "user", "content": question}], "max_tokens": 4, **extra}


def send(r: redis.Redis, queue: str, body: dict) -> str:
    request_id = f"p-{uuid.uuid4().hex[:10]}"
    xadd_json(r, queue, request_id, body)
    return request_id


def place(r: redis.Redis, queue: str, worker: WorkerProcess, body: dict) -> str:
    """Put a request straight into a worker's placement lane, as a peer that chose it would."""
    request_id = f"l-{uuid.uuid4().hex[:10]}"
    r.xadd(KEYS.affinity_lane(queue, worker.consumer), {"id": request_id, "json": json.dumps(body)})
    r.sadd(KEYS.affinity_lanes(queue), worker.consumer)
    return request_id


def beat(r: redis.Redis, worker: WorkerProcess) -> dict:
    return json.loads(r.get(KEYS.worker(worker.consumer)))


def holds(r: redis.Redis, queue: str, worker: WorkerProcess, body: dict) -> bool:
    """Whether the worker's published digest holds the start of the body's prompt."""
    raw = r.get(KEYS.digest(queue, worker.consumer))
    return bool(raw) and prefix_chain(body)[1] in set(msgpack.unpackb(raw))


def sees(r: redis.Redis, queue: str, viewer: WorkerProcess, peer: WorkerProcess, **wanted: object) -> bool:
    """Whether `viewer` knows `peer`'s digest as published now (its heartbeat may still name
    the one before), and its load, if asked."""
    known = (beat(r, viewer)["placement"] or {}).get("peers", {}).get(peer.consumer)
    published = hashlib.blake2b(r.get(KEYS.digest(queue, peer.consumer)) or b"", digest_size=6).hexdigest()
    return known is not None and known["version"] == published and all(known[k] == v for k, v in wanted.items())


def count(r: redis.Redis, worker: WorkerProcess, name: str) -> int:
    return beat(r, worker)["totals"].get(name, 0)


@pytest.fixture
def pair(redis_url: str, demo_model, logs_dir, request) -> Iterator[tuple[str, WorkerProcess, WorkerProcess]]:
    """Two workers on a new queue (settings from the test's `pair_settings` mark)."""
    marker = request.node.get_closest_marker("pair_settings")
    settings = {"max_num_seqs": 4, "affinity_wait_ms": 300, **(marker.kwargs if marker else {})}
    queue = f"q{uuid.uuid4().hex[:8]}"
    workers = [start_worker(worker_url(redis_url), demo_model, queue, logs_dir, consumer=f"{name}-{queue}",
                            **settings) for name in ("a", "b")]
    yield queue, *workers
    for worker in workers:
        if worker.process.poll() is None:
            worker.stop()


def warm(r, outputs, queue: str, pair: tuple, body: dict) -> tuple[WorkerProcess, WorkerProcess]:
    """Serve one request of a prefix; the worker that now holds it, and the other once it knows."""
    check_stream(outputs.of(send(r, queue, body)))
    a, b = pair
    holder = wait_for(lambda: next((w for w in (a, b) if holds(r, queue, w, body)), None),
                      what="a worker publishing the prefix it holds")
    other = b if holder is a else a
    wait_for(lambda: sees(r, queue, other, holder), what="the other worker reading the holder's digest")
    return holder, other


@ON_BOTH
def test_requests_land_where_their_prefix_is_cached(pair, r, outputs, redis_url):
    queue, a, b = pair
    holder, other = warm(r, outputs, queue, (a, b), tenant("payments", "Who owns refunds?"))
    cached = []
    for wave in range(2):  # within the holder's slots, whoever reads them
        ids = [send(r, queue, tenant("payments", f"Question {wave}.{i}?")) for i in range(3)]
        ends = [check_stream(outputs.of(request_id)) for request_id in ids]
        assert all(isinstance(e, Done) for e in ends), ends
        cached += [e.usage.cached_tokens for e in ends]
    # The other worker holds nothing of this prefix: any request it served would show 0.
    assert all(c > 100 for c in cached), cached
    wait_for(lambda: count(r, holder, "placed:affine") + count(r, other, "placed:forwarded") >= 6,
             what="the placements counted")
    shown = mlxq("status", "--redis-url", redis_url, "--queue", queue)
    rows = {line.split()[0]: line for line in shown.stdout.splitlines() if line.strip()}
    assert f"affine={count(r, holder, 'placed:affine')}" in rows[holder.consumer], shown.stdout
    assert "DIGEST" in shown.stdout and str(beat(r, holder)["placement"]["digest"]) in rows[holder.consumer]


@pytest.mark.pair_settings(max_num_seqs=2, prefetch=0)
def test_a_full_or_dead_affine_worker_leaves_its_requests_to_another(pair, r, outputs):
    """Full: a request of its prefix is served by the other worker (at once, or after
    affinity_wait_ms from the full worker's lane); killed with -9: what it held in its
    lane, running or waiting, finishes on the other worker with no text twice."""
    queue, a, b = pair
    body = tenant("search", "Why is the index stale?")
    holder, other = warm(r, outputs, queue, (a, b), body)
    held = [place(r, queue, holder, HELD) for _ in range(2)]  # both of its slots, until cancelled
    for request_id in held:
        wait_for_deltas(r, wait_for(lambda rid=request_id: output_stream(r, rid), what="a held output"), [request_id])
    wait_for(lambda: sees(r, queue, other, holder, load=2), what="the other worker seeing the holder full")
    balanced = send(r, queue, tenant("search", "Is the crawler up?"))
    assert check_stream(outputs.of(balanced)).usage.cached_tokens == 0, "served by the other worker"
    wait_for(lambda: count(r, other, "placed:balanced") + count(r, other, "placed:stolen") >= 1,
             what="the other worker counting why it served it")
    late = place(r, queue, holder, tenant("search", "Which shard lags?"))  # placed before it filled up
    assert isinstance(check_stream(outputs.of(late)), Done)
    wait_for(lambda: count(r, other, "placed:stolen") >= 1, what="the steal counted")

    waiting = [place(r, queue, holder, dict(tenant("search", f"Summarise incident {i}."), max_tokens=24,
                                            ignore_eos=True)) for i in range(2)]
    os.kill(holder.process.pid, signal.SIGKILL)
    holder.process.wait(10)
    for request_id in held:  # resumed on the other worker after what was written, then cancelled
        wait_for(lambda rid=request_id: count(r, other, "takeovers") >= 1, timeout=60, what="the takeover")
        r.set(KEYS.cancel_flag(queue, request_id), 1, ex=60)
        r.publish(KEYS.cancel_channel(queue), request_id)
    assert [check_stream(outputs.of(i, timeout=90)).finish_reason for i in held] == ["cancelled"] * 2
    finished = [outputs.of(request_id, timeout=90) for request_id in waiting]
    again = [outputs.of(send(r, queue, dict(tenant("search", f"Summarise incident {i}."), max_tokens=24,
                                            ignore_eos=True)), timeout=90) for i in range(2)]
    assert [tokens_of(e) for e in finished] == [tokens_of(e) for e in again]


@pytest.mark.pair_settings(max_num_seqs=2, prefetch=0, affinity_wait_ms=600_000)
def test_a_busy_affine_worker_still_gets_its_prefix_while_the_gap_is_under_a_batch(pair, r, outputs):
    """The holder full (2 of 2) and the other worker busy too (1 of 2): a gap of one, under
    a batch, so affinity wins: the request waits in the holder's lane (no steal within the
    test: the bound is ten minutes) and the holder serves it, cached, once a slot frees."""
    queue, a, b = pair
    holder, other = warm(r, outputs, queue, (a, b), tenant("ledger", "Why is the balance off?"))
    held = [place(r, queue, holder, HELD) for _ in range(2)] + [place(r, queue, other, HELD)]
    for request_id in held:
        wait_for_deltas(r, wait_for(lambda rid=request_id: output_stream(r, rid), what="a held output"), [request_id])
    wait_for(lambda: sees(r, queue, other, holder, load=2), what="the other worker seeing the holder full")
    forwarded = count(r, other, "placed:forwarded")
    waiting = send(r, queue, tenant("ledger", "Who approved the transfer?"))
    wait_for(lambda: count(r, other, "placed:forwarded") > forwarded, what="the request moved to the holder's lane")
    r.set(KEYS.cancel_flag(queue, held[0]), 1, ex=60)
    r.publish(KEYS.cancel_channel(queue), held[0])
    assert check_stream(outputs.of(waiting)).usage.cached_tokens > 100, "served by the holder, from its cache"
    for request_id in held[1:]:
        r.set(KEYS.cancel_flag(queue, request_id), 1, ex=60)
        r.publish(KEYS.cancel_channel(queue), request_id)
    assert [check_stream(outputs.of(i)).finish_reason for i in held] == ["cancelled"] * 3


def test_a_prefix_still_running_draws_its_next_requests_to_its_worker(pair, r, outputs):
    """A worker publishes the prompts it is computing, not only those it has cached: while
    the first request on a new system prompt runs on one worker (held: only a cancel ends
    it), the next ones go there, whichever worker reads them, and reuse its prefill."""
    queue, a, b = pair
    rng = random.Random(7)
    system = [SLOW_TOKEN] + [rng.randrange(10, 1000) for _ in range(300)]
    first = {"prompt_tokens": system + [40], "max_tokens": 2000, "ignore_eos": True}
    held = place(r, queue, a, first)
    wait_for_deltas(r, wait_for(lambda: output_stream(r, held), what="the held output"), [held])
    wait_for(lambda: holds(r, queue, a, first), what="its worker publishing the prompt it runs")
    wait_for(lambda: sees(r, queue, b, a), what="the other worker reading that digest")
    ends = [check_stream(outputs.of(send(r, queue, {"prompt_tokens": system + [50 + i], "max_tokens": 2})))
            for i in range(4)]
    assert [e.usage.cached_tokens for e in ends] == [len(system)] * 4, "each served where the prompt runs"
    r.set(KEYS.cancel_flag(queue, held), 1, ex=60)
    r.publish(KEYS.cancel_channel(queue), held)
    assert check_stream(outputs.of(held)).finish_reason == "cancelled"


@pytest.mark.pair_settings(cache_max_entries=1)
def test_a_worker_that_evicted_a_prefix_stops_attracting_it(pair, r, outputs):
    queue, a, b = pair
    body = tenant("billing", "Why was I charged twice?")
    holder, other = warm(r, outputs, queue, (a, b), body)
    check_stream(outputs.of(place(r, queue, holder, tenant("growth", "What is our funnel?"))))  # its one entry now
    wait_for(lambda: not holds(r, queue, holder, body), what="the holder's digest without the evicted prefix")
    wait_for(lambda: sees(r, queue, other, holder), what="the other worker reading the new digest")
    forwarded = count(r, other, "placed:forwarded")
    check_stream(outputs.of(send(r, queue, tenant("billing", "And the refund?"))))
    assert count(r, other, "placed:forwarded") == forwarded


def test_a_request_without_a_long_enough_prefix_has_no_chain():
    assert prefix_chain({"prompt": "short"}) == ()
    assert prefix_chain({"prompt": "x" * 600, "images": ["..."]}) == ()
    long = {"messages": [{"role": "system", "content": "y" * 600}, {"role": "user", "content": "q"}]}
    assert len(prefix_chain(long)) == 2
    other_salt = prefix_chain({**long, "cache_salt": "team-b"})
    assert other_salt and not set(other_salt) & set(prefix_chain(long)), "a salt is a namespace"
    extended = {"messages": [long["messages"][0], {"role": "user", "content": "z" * 600}]}
    assert prefix_chain(extended)[:2] == prefix_chain(long), "a shared start shares its hashes"
