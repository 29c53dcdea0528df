"""Every status the fenced publish script can return, against a real Valkey and a real
Redis Cluster: applied (and applied again, writing nothing, when a call is retried), lost
(another taking of the fence), duplicate, gap, expired and refused, and what each leaves
in Redis."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot
from support import ON_BOTH

from client import Delta, Done, Timing, Usage, decode_event
from client.connect import connect_async
from client.keys import GROUP, Keys
from worker.messages import Route
from worker.queue.fencing import Fencing, Published, PublishStatus, encode_write
from worker.queue.streams import RequestMarks, RequestStreams

KEYS = Keys()
pytestmark = ON_BOTH


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect_async(redis_url)
    yield client
    await client.aclose()


def fencing_of(r: aioredis.Redis, queue: str, consumer: str) -> Fencing:
    return Fencing(r, KEYS, queue, consumer, result_ttl_s=60)


async def held_entry(r: aioredis.Redis, queue: str, consumer: str, request_id: str, reply_to: str | None = None,
                     ) -> Route:
    """An entry of `request_id`, read (so pending) by `consumer`, and its fence taken; its route."""
    stream = KEYS.queue(queue)
    if not await r.exists(stream):
        await r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    entry_id = (await r.xadd(stream, {"id": request_id, "json": "{}"})).decode()
    await r.xreadgroup(GROUP, consumer, {stream: ">"}, count=1)
    route = Route(request_id, entry_id, reply_to or KEYS.output(queue, request_id), "json", stream)
    taken = await fencing_of(r, queue, consumer).take(route)
    assert taken.taken and taken.written == 0 and not taken.finished
    return Route(request_id, entry_id, route.reply_to, "json", stream, taken.token)


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
    reply) is applied without writing twice; a terminal event, then `finish`, settles the entry."""
    queue, rid = names
    route = await held_entry(r, queue, "c1", rid)
    mine = fencing_of(r, queue, "c1")
    first = encode_write(route, 0, [delta(rid, 0)])
    assert await mine.publish([first]) == [Published(PublishStatus.APPLIED)]
    assert await mine.publish([first]) == [Published(PublishStatus.APPLIED)]
    assert await r.xlen(route.reply_to) == 1
    assert await r.hget(KEYS.progress(queue, rid), "next") == b"1"
    assert await mine.publish([encode_write(route, 1, [done(rid)])]) == [Published(PublishStatus.APPLIED)]
    assert await r.xlen(route.reply_to) == 2
    assert await r.hget(KEYS.progress(queue, rid), "finished") == b"1"
    await RequestStreams(r, KEYS, queue, "c1", dedupe_ttl_s=60).finish([route])
    assert await r.get(KEYS.done(queue, rid)) == route.entry_id.encode()
    assert (await r.xpending(route.stream, GROUP))["pending"] == 0 and await r.xlen(route.stream) == 0


async def test_a_cut_off_worker_cannot_write_after_a_takeover(r, names):
    """c1 writes, then c2 claims the entry and takes the fence: the fence tells c2 where the
    output stands, c1's next write is refused as lost and writes nothing, c2's lands."""
    queue, rid = names
    route = await held_entry(r, queue, "c1", rid)
    first = fencing_of(r, queue, "c1")
    assert await first.publish([encode_write(route, 0, [delta(rid, 0)])]) == [Published(PublishStatus.APPLIED)]
    await r.xclaim(route.stream, GROUP, "c2", 0, [route.entry_id])
    second = fencing_of(r, queue, "c2")
    taken = await second.take(route)
    assert taken.taken and taken.written == 1 and taken.token != route.fence
    assert await first.publish([encode_write(route, 1, [delta(rid, 1)])]) == [Published(PublishStatus.LOST)]
    assert await r.xlen(route.reply_to) == 1
    theirs = Route(rid, route.entry_id, route.reply_to, "json", route.stream, taken.token)
    assert await second.publish([encode_write(theirs, 1, [delta(rid, 1)])]) == [Published(PublishStatus.APPLIED)]
    assert [decode_event(f).seq for _, f in await r.xrange(route.reply_to)] == [0, 1]


async def test_duplicate_when_another_entry_writes_this_id(r, names):
    """A second entry with an id whose output another entry writes cannot take the fence,
    and its writes are told duplicate; the first entry's output is untouched."""
    queue, rid = names
    first = await held_entry(r, queue, "c1", rid)
    mine = fencing_of(r, queue, "c1")
    assert await mine.publish([encode_write(first, 0, [delta(rid, 0)])]) == [Published(PublishStatus.APPLIED)]
    second_id = (await r.xadd(first.stream, {"id": rid, "json": "{}"})).decode()
    await r.xreadgroup(GROUP, "c1", {first.stream: ">"}, count=1)
    second = Route(rid, second_id, first.reply_to, "json", first.stream)
    assert not (await mine.take(second)).taken
    statuses = await mine.publish([encode_write(second, 1, [delta(rid, 1)])])
    assert statuses == [Published(PublishStatus.DUPLICATE)]
    assert await r.xlen(first.reply_to) == 1


async def test_gap_when_written_output_went_missing(r, names):
    """If the fence says three events are written but we write from position one (Redis
    lost our writes), the status is a gap, with the fence's count, and nothing is written."""
    queue, rid = names
    route = await held_entry(r, queue, "c1", rid)
    await r.hset(KEYS.progress(queue, rid), "next", 3)
    statuses = await fencing_of(r, queue, "c1").publish([encode_write(route, 1, [delta(rid, 1)])])
    assert statuses == [Published(PublishStatus.GAP, "3")]
    assert await r.exists(route.reply_to) == 0


async def test_expired_when_the_fence_is_gone(r, names):
    """A fence that expired before any write leaves the write nowhere to land: expired,
    nothing written."""
    queue, rid = names
    route = await held_entry(r, queue, "c1", rid)
    await r.delete(KEYS.progress(queue, rid))
    statuses = await fencing_of(r, queue, "c1").publish([encode_write(route, 0, [delta(rid, 0)])])
    assert statuses == [Published(PublishStatus.EXPIRED)]
    assert await r.exists(route.reply_to) == 0


async def test_a_finished_output_is_seen_by_the_next_taker(r, names):
    """A worker that died after writing the terminal event but before settling leaves the
    fence finished: whoever takes it next is told so, and settles instead of computing."""
    queue, rid = names
    route = await held_entry(r, queue, "c1", rid)
    mine = fencing_of(r, queue, "c1")
    assert await mine.publish([encode_write(route, 0, [done(rid)])]) == [Published(PublishStatus.APPLIED)]
    taken = await fencing_of(r, queue, "c2").take(route)
    assert taken.taken and taken.finished and taken.written == 1


async def test_a_reply_stream_and_its_fences_share_a_slot(r, names):
    """The fence of a request writing to a shared reply stream lies in that stream's slot
    (so one script may check it and write), with or without a hash tag in the name."""
    queue, rid = names
    for reply in (KEYS.reply(queue, f"plain-{rid}"), KEYS.reply(queue, f"{{tag-{rid}}}-x")):
        assert key_slot(KEYS.progress(queue, rid, reply).encode()) == key_slot(reply.encode())
        route = await held_entry(r, queue, "c1", f"{rid}-{len(reply)}", reply_to=reply)
        write = encode_write(route, 0, [delta(route.id, 0)])
        assert await fencing_of(r, queue, "c1").publish([write]) == [Published(PublishStatus.APPLIED)]
        assert await r.xlen(reply) == 1


async def test_refused_stays_with_its_request(r, names):
    """A reply stream that is a string key refuses that request alone (WRONGTYPE), leaving
    its entry pending for the worker to answer elsewhere; a request beside it in the same
    step is applied."""
    queue, rid = names
    reply = KEYS.reply(queue, f"s-{rid}")
    bad = await held_entry(r, queue, "c1", rid, reply_to=reply)
    await r.set(reply, "not a stream")
    good = await held_entry(r, queue, "c1", f"{rid}-ok")
    statuses = await fencing_of(r, queue, "c1").publish([encode_write(bad, 0, [delta(rid, 0)]),
                                                        encode_write(good, 0, [delta(good.id, 0)])])
    assert statuses[0].status is PublishStatus.REFUSED and statuses[0].detail.startswith("WRONGTYPE")
    assert statuses[1] == Published(PublishStatus.APPLIED)
    assert await r.get(bad.reply_to) == b"not a stream"
    assert (await r.xpending(bad.stream, GROUP))["pending"] == 2


async def test_only_attempts_left_open_count_as_crashes(r, names):
    """An attempt closed after its work leaves no trace; one left open (its worker died)
    is counted by every later arrival."""
    queue, rid = names
    mine = RequestMarks(r, KEYS, queue, dedupe_ttl_s=60)
    first = await mine.arrive(rid, cancel_ttl_s=60)
    assert first.crashes == 0
    await mine.close_attempt(rid, first.attempt)
    died = await mine.arrive(rid, cancel_ttl_s=60)  # never closed: this worker "died"
    assert died.crashes == 0
    after = await mine.arrive(rid, cancel_ttl_s=60)
    assert after.crashes == 1
    await mine.close_attempt(rid, after.attempt)
    assert (await mine.arrive(rid, cancel_ttl_s=60)).crashes == 1
