"""Every status the fenced publish script can return, against a real Valkey: applied
(and applied again, writing nothing, when a call is retried), lost, duplicate, gap and
refused, and what each leaves in Redis."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from client import Delta, Done, Timing, Usage
from client.keys import GROUP, Keys
from worker.messages import Route
from worker.redis_queue import Published, PublishStatus, RedisQueue, encode_write

KEYS = Keys()


@pytest.fixture
async def r(valkey: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(valkey)
    yield client
    await client.aclose()


def queue_of(r: aioredis.Redis, name: str, consumer: str) -> RedisQueue:
    return RedisQueue(r, KEYS, name, consumer, result_ttl_s=60, dedupe_ttl_s=60)


async def held_entry(r: aioredis.Redis, queue: str, consumer: str, request_id: str) -> Route:
    """An entry of `request_id`, read (so pending) by `consumer`; its route."""
    stream = KEYS.queue(queue)
    await r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    entry_id = (await r.xadd(stream, {"id": request_id, "json": "{}"})).decode()
    await r.xreadgroup(GROUP, consumer, {stream: ">"}, count=1)
    return Route(request_id, entry_id, KEYS.output(request_id), "json", stream)


def delta(request_id: str, seq: int) -> Delta:
    return Delta(id=request_id, seq=seq, text=f"t{seq}", tokens=[seq])


def done(request_id: str) -> Done:
    return Done(id=request_id, finish_reason="stop", text="t0", usage=Usage(1, 1),
                timing=Timing(queued_ms=1.0, ttft_ms=2.0, total_ms=3.0))


@pytest.fixture
def names() -> tuple[str, str]:
    return f"pub{uuid.uuid4().hex[:8]}", f"req-{uuid.uuid4().hex[:8]}"


async def test_applied_writes_once_even_when_the_call_is_retried(r, names):
    """A delta is written and the fence moves; the same call again (a retry after a lost
    reply) is applied without writing twice; a terminal event settles the entry."""
    queue, rid = names
    route = await held_entry(r, queue, "c1", rid)
    mine = queue_of(r, queue, "c1")
    first = encode_write(route, 0, [delta(rid, 0)])
    assert await mine.publish([first]) == [Published(PublishStatus.APPLIED)]
    assert await mine.publish([first]) == [Published(PublishStatus.APPLIED)]
    assert await r.xlen(route.reply_to) == 1
    assert await r.hget(KEYS.progress(rid), "next") == b"1"
    assert await mine.publish([encode_write(route, 1, [done(rid)])]) == [Published(PublishStatus.APPLIED)]
    assert await r.xlen(route.reply_to) == 2
    assert await r.get(KEYS.done(rid)) == route.entry_id.encode()
    assert (await r.xpending(route.stream, GROUP))["pending"] == 0 and await r.xlen(route.stream) == 0


async def test_lost_when_another_consumer_holds_the_entry(r, names):
    """After another worker claimed the entry, our write is refused as lost and writes nothing."""
    queue, rid = names
    route = await held_entry(r, queue, "c1", rid)
    await r.xclaim(route.stream, GROUP, "c2", 0, [route.entry_id])
    statuses = await queue_of(r, queue, "c1").publish([encode_write(route, 0, [delta(rid, 0)])])
    assert statuses == [Published(PublishStatus.LOST)]
    assert await r.exists(route.reply_to) == 0


async def test_duplicate_when_another_entry_writes_this_id(r, names):
    """A second entry with an id whose output another entry writes is told duplicate, and
    the first entry's output is untouched."""
    queue, rid = names
    first = await held_entry(r, queue, "c1", rid)
    mine = queue_of(r, queue, "c1")
    assert await mine.publish([encode_write(first, 0, [delta(rid, 0)])]) == [Published(PublishStatus.APPLIED)]
    second_id = (await r.xadd(first.stream, {"id": rid, "json": "{}"})).decode()
    await r.xreadgroup(GROUP, "c1", {first.stream: ">"}, count=1)
    second = Route(rid, second_id, first.reply_to, "json", first.stream)
    statuses = await mine.publish([encode_write(second, 1, [delta(rid, 1)])])
    assert statuses == [Published(PublishStatus.DUPLICATE)]
    assert await r.xlen(first.reply_to) == 1


async def test_gap_when_written_output_went_missing(r, names):
    """If the fence says three events are written but we write from position one (Redis
    lost our writes), the status is a gap, with the fence's count, and nothing is written."""
    queue, rid = names
    route = await held_entry(r, queue, "c1", rid)
    await r.hset(KEYS.progress(rid), mapping={"entry": route.entry_id, "next": 3})
    statuses = await queue_of(r, queue, "c1").publish([encode_write(route, 1, [delta(rid, 1)])])
    assert statuses == [Published(PublishStatus.GAP, "3")]
    assert await r.exists(route.reply_to) == 0


async def test_refused_stays_with_its_request(r, names):
    """A reply stream that is a string key refuses that request alone (WRONGTYPE), leaving
    its entry pending for the worker to answer elsewhere; a request beside it in the same
    call is applied."""
    queue, rid = names
    bad = await held_entry(r, queue, "c1", rid)
    bad = Route(rid, bad.entry_id, KEYS.reply(f"s-{rid}"), "json", bad.stream)
    await r.set(bad.reply_to, "not a stream")
    good_id = f"{rid}-ok"
    good_entry = (await r.xadd(bad.stream, {"id": good_id, "json": "{}"})).decode()
    await r.xreadgroup(GROUP, "c1", {bad.stream: ">"}, count=1)
    good = Route(good_id, good_entry, KEYS.output(good_id), "json", bad.stream)
    statuses = await queue_of(r, queue, "c1").publish([encode_write(bad, 0, [delta(rid, 0)]),
                                                        encode_write(good, 0, [delta(good_id, 0)])])
    assert statuses[0].status is PublishStatus.REFUSED and statuses[0].detail.startswith("WRONGTYPE")
    assert statuses[1] == Published(PublishStatus.APPLIED)
    assert await r.get(bad.reply_to) == b"not a stream"
    assert (await r.xpending(bad.stream, GROUP))["pending"] == 2


async def test_only_attempts_left_open_count_as_crashes(r, names):
    """An attempt closed after its work leaves no trace; one left open (its worker died)
    is counted by every later arrival."""
    queue, rid = names
    mine = queue_of(r, queue, "c1")
    first = await mine.arrive(rid, cancel_ttl_s=60)
    assert first.crashes == 0
    await mine.close_attempt(rid, first.attempt)
    died = await mine.arrive(rid, cancel_ttl_s=60)  # never closed: this worker "died"
    assert died.crashes == 0
    after = await mine.arrive(rid, cancel_ttl_s=60)
    assert after.crashes == 1
    await mine.close_attempt(rid, after.attempt)
    assert (await mine.arrive(rid, cancel_ttl_s=60)).crashes == 1
