"""The publisher's answers to what a fenced write finds, against a real Valkey: a request
taken over by another worker is dropped; one whose fence a failover lost while the
group still says it is ours is failed with `internal`, never left unanswered."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis

from client import Delta, Done, Error, Timing, Usage, decode_event
from client.keys import GROUP, Keys
from worker.messages import Outgoing, Route
from worker.queue.fencing import Fencing
from worker.queue.publisher import Publisher
from worker.queue.requests import RequestTable
from worker.queue.streams import RequestStreams

KEYS = Keys()


@pytest.fixture
async def r(valkey: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(valkey)
    yield client
    await client.aclose()


@dataclass
class Sides:
    """What a publisher writes through: a consumer's request streams and fences."""

    streams: RequestStreams
    fencing: Fencing

    def publisher(self, requests: RequestTable, **kwargs: Any) -> Publisher:
        return Publisher(self.streams, self.fencing, requests, **kwargs)


async def serving(r: aioredis.Redis, consumer: str) -> tuple[Sides, RequestTable, Route]:
    """A worker's streams, fences and table holding one request it read and whose fence it took."""
    queue, request_id = f"pub{uuid.uuid4().hex[:8]}", f"req-{uuid.uuid4().hex[:8]}"
    sides = Sides(RequestStreams(r, KEYS, queue, consumer, dedupe_ttl_s=60), Fencing(r, KEYS, queue, consumer, 60))
    await sides.streams.ensure_group()
    entry_id = (await r.xadd(KEYS.queue(queue), {"id": request_id, "json": "{}"})).decode()
    await r.xreadgroup(GROUP, consumer, {KEYS.queue(queue): ">"}, count=1)
    requests = RequestTable(4, abandon=lambda _: None)
    route = Route(request_id, entry_id, KEYS.output(queue, request_id), "json", KEYS.queue(queue))
    requests.read(route)
    taken = await sides.fencing.take(route)
    return sides, requests, requests.reroute(request_id, fence=taken.token)


async def publish(sides: Sides, requests: RequestTable, route: Route) -> None:
    publisher = sides.publisher(requests)
    task = asyncio.create_task(publisher.run())
    publisher.emit(Outgoing(route.ref, Delta(id=route.id, seq=0, text="a", tokens=[1])))
    await asyncio.wait_for(publisher.outputs.join(), 10)
    task.cancel()


async def test_a_request_taken_over_is_dropped_without_a_write(r):
    sides, requests, route = await serving(r, "c1")
    await r.xclaim(route.stream, GROUP, "c2", 0, [route.entry_id])
    await sides.fencing.take(route)  # as c2 would
    await publish(sides, requests, route)
    assert await r.xlen(route.reply_to) == 0
    assert requests.get(route.id) is None


async def test_a_fence_lost_while_the_entry_is_ours_fails_the_request(r):
    """A failover that kept our claim of the entry but lost our taking of its fence (here:
    another token written over it) must not strand the request: it ends with `internal`
    and its entry is settled."""
    sides, requests, route = await serving(r, "c1")
    await r.hset(KEYS.progress(sides.streams.queue, route.id), "token", "a-token-from-before-the-failover")
    await publish(sides, requests, route)
    (event,) = [decode_event(fields) for _, fields in await r.xrange(route.reply_to)]
    assert isinstance(event, Error) and event.code == "internal" and "fence was lost" in event.message
    assert requests.get(route.id) is None
    assert (await r.xpending(route.stream, GROUP))["pending"] == 0


async def test_a_fence_key_redis_refuses_settles_that_request_alone(r):
    """Whatever a request's keys hold (here its fence key is a string: WRONGTYPE), the
    publisher settles that request unanswered and keeps publishing for the others."""
    sides, requests, first = await serving(r, "c1")
    broken = Route(f"{first.id}-x", (await r.xadd(first.stream, {"id": f"{first.id}-x", "json": "{}"})).decode(),
                   KEYS.output(sides.streams.queue, f"{first.id}-x"), "json", first.stream)
    await r.xreadgroup(GROUP, "c1", {first.stream: ">"}, count=1)
    requests.read(broken)
    await r.set(KEYS.progress(sides.streams.queue, broken.id), "not a fence")
    publisher = sides.publisher(requests)
    task = asyncio.create_task(publisher.run())
    publisher.emit(Outgoing(broken.ref, Error(id=broken.id, code="internal", message="x")))
    publisher.emit(Outgoing(first.ref, Delta(id=first.id, seq=0, text="a", tokens=[1])))
    await asyncio.wait_for(publisher.outputs.join(), 10)
    assert not task.done(), "the publisher must keep running"
    task.cancel()
    assert requests.get(broken.id) is None
    assert await r.get(KEYS.done(sides.streams.queue, broken.id)) == broken.entry_id.encode()
    assert await r.xlen(first.reply_to) == 1
    assert (await r.xpending(first.stream, GROUP))["pending"] == 1  # only the healthy request's, still running


async def test_a_queue_stream_redis_refuses_to_settle_leaves_the_publisher_running(r):
    """The request's `done` is written, then settling its entry is refused (the queue's
    stream was replaced by a string: WRONGTYPE): the reader has its answer, the request
    leaves the table, and the publisher keeps running."""
    sides, requests, route = await serving(r, "c1")
    await r.delete(route.stream)
    await r.set(route.stream, "not a stream")
    publisher = sides.publisher(requests)
    task = asyncio.create_task(publisher.run())
    publisher.emit(Outgoing(route.ref, Error(id=route.id, code="internal", message="the end")))
    await asyncio.wait_for(publisher.outputs.join(), 10)
    assert not task.done(), "the publisher must keep running"
    task.cancel()
    (event,) = [decode_event(fields) for _, fields in await r.xrange(route.reply_to)]
    assert isinstance(event, Error) and requests.get(route.id) is None


async def test_a_lost_fence_whose_group_is_gone_is_dropped(r):
    """Another token in the fence and no group to ask (NOGROUP): the request is dropped
    as taken over, nothing is written, and the publisher keeps running."""
    sides, requests, route = await serving(r, "c1")
    await r.hset(KEYS.progress(sides.streams.queue, route.id), "token", "someone-else")
    await r.delete(route.stream)
    await publish(sides, requests, route)
    assert await r.xlen(route.reply_to) == 0
    assert requests.get(route.id) is None


async def test_a_written_done_is_counted_before_its_entry_is_settled(r):
    """A reader sees a `done` as soon as Redis has it; the worker counts it (its totals and
    metrics) right then, not one settling round trip later, so a scrape made after a
    reader saw the `done` includes it."""
    sides, requests, route = await serving(r, "c1")
    counted: list[object] = []
    counted_when_settling: list[object] = []
    settle = sides.streams.finish

    async def finish(ended: list[Route]) -> None:
        counted_when_settling.extend(counted)
        await settle(ended)

    sides.streams.finish = finish  # type: ignore[method-assign]
    publisher = sides.publisher(requests, on_published=counted.append)
    task = asyncio.create_task(publisher.run())
    last = Done(id=route.id, finish_reason="length", text="a", usage=Usage(1, 1),
                timing=Timing(queued_ms=1.0, ttft_ms=2.0, total_ms=3.0))
    publisher.emit(Outgoing(route.ref, last))
    await asyncio.wait_for(publisher.outputs.join(), 10)
    task.cancel()
    assert counted_when_settling == [last] and counted == [last]
    assert (await r.xpending(route.stream, GROUP))["pending"] == 0
