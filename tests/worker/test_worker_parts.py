"""The worker's loops one by one, against a real Valkey and without a model: leases
(name, heartbeat, takeovers seen, hand-back), the reclaimer (own entries first, then a
silent consumer's), the cancel listener and intake's answers that need no engine."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from types import SimpleNamespace

import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError
from support import KEYS

from client import Error, decode_event
from client.heartbeat import Heartbeat
from client.keys import GROUP
from client.protocol import ErrorCode
from worker.fleet.leases import HAND_BACK_IDLE_MS, Leases
from worker.fleet.membership import Membership
from worker.fleet.naming import NameTaken
from worker.messages import Admitted, Outgoing, Prepare, Refused, Route
from worker.queue.cancels import listen_for_cancels
from worker.queue.fencing import Fencing
from worker.queue.intake import Intake
from worker.queue.recovery import Delivery, Reclaimer
from worker.queue.requests import RequestStatus, RequestTable
from worker.queue.streams import RequestMarks, RequestStreams, ensure_groups, request_streams
from worker.queue.totals import Totals
from worker.settings import load_settings


@pytest.fixture
async def r(valkey: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(valkey)
    yield client
    await client.aclose()


@pytest.fixture
def queue() -> str:
    return f"parts{uuid.uuid4().hex[:8]}"


async def pending_entry(r: aioredis.Redis, queue: str, consumer: str, request_id: str) -> str:
    """An entry of `request_id` that `consumer` read (so holds, pending); its id."""
    await ensure_groups(r, [KEYS.queue(queue)])
    entry_id = (await r.xadd(KEYS.queue(queue), {"id": request_id, "json": "{}"})).decode()
    await r.xreadgroup(GROUP, consumer, {KEYS.queue(queue): ">"}, count=1)
    return entry_id


def route(queue: str, request_id: str, entry_id: str) -> Route:
    return Route(request_id, entry_id, KEYS.output(queue, request_id), "json", KEYS.queue(queue))


def leases(r: aioredis.Redis, queue: str, consumer: str, requests: RequestTable) -> Leases:
    settings = load_settings(queue=queue, consumer=consumer, heartbeat_s=30)
    return Leases(settings, Membership(r, KEYS, request_streams(KEYS, queue)), requests, "demo", Totals(), "mkl")


# ---- leases ----------------------------------------------------------------------------

async def test_leases_claim_a_name_and_write_its_heartbeat(r, queue):
    first = leases(r, queue, f"w-{queue}", RequestTable(4, abandon=lambda _: None))
    assert await first.claim_name() == f"w-{queue}"
    beat = Heartbeat.from_json(await r.get(KEYS.worker(f"w-{queue}")))
    assert beat is not None and beat.consumer == f"w-{queue}" and beat.model is not None
    assert beat.model.queue == queue and beat.state == "ready"


async def test_leases_refuse_a_name_a_live_process_of_this_host_holds(r, queue):
    holder = Heartbeat(f"w-{queue}", host=socket.gethostname(), pid=1)  # pid 1 is always alive
    await r.set(KEYS.worker(f"w-{queue}"), holder.to_json(), px=60_000)
    with pytest.raises(NameTaken, match="held by a live worker"):
        await leases(r, queue, f"w-{queue}", RequestTable(4, abandon=lambda _: None)).claim_name()
    assert Heartbeat.from_json(await r.get(KEYS.worker(f"w-{queue}"))) == holder


async def test_leases_drop_a_request_another_worker_took_and_keep_their_own(r, queue):
    dropped: list[str] = []
    requests = RequestTable(4, abandon=dropped.append)
    mine = leases(r, queue, "c1", requests)
    await mine.claim_name()
    kept, taken = (await pending_entry(r, queue, "c1", "kept"), await pending_entry(r, queue, "c1", "taken"))
    requests.read(route(queue, "kept", kept))
    requests.read(route(queue, "taken", taken))
    await r.xclaim(KEYS.queue(queue), GROUP, "c2", 0, [taken])  # another worker took it over
    await mine._keep_alive()
    assert dropped == ["taken"] and requests.get("taken") is None and requests.get("kept") is not None
    (row,) = await r.xpending_range(KEYS.queue(queue), GROUP, kept, kept, 1)
    assert row["consumer"] == b"c1"


async def test_hand_back_removes_the_heartbeat_and_leaves_the_entries_long_idle(r, queue):
    requests = RequestTable(4, abandon=lambda _: None)
    mine = leases(r, queue, "c1", requests)
    await mine.claim_name()
    entry_id = await pending_entry(r, queue, "c1", "left")
    requests.read(route(queue, "left", entry_id))
    await mine.hand_back()
    assert not await r.exists(KEYS.worker("c1")) and len(requests) == 0
    (row,) = await r.xpending_range(KEYS.queue(queue), GROUP, entry_id, entry_id, 1)
    assert row["time_since_delivered"] >= HAND_BACK_IDLE_MS
    assert await r.hget(KEYS.stats("c1"), "state") == b"stopped"


# ---- the reclaimer -----------------------------------------------------------------------

async def test_the_reclaimer_resumes_its_own_entries_then_takes_a_silent_consumers(r, queue):
    own = await pending_entry(r, queue, "c1", "own")
    silent = await pending_entry(r, queue, "gone", "silent")
    alive = await pending_entry(r, queue, "alive", "alive")
    await r.set(KEYS.worker("alive"), "{}")  # a heartbeat: its entry must stay where it is
    reclaimer = Reclaimer(RequestStreams(r, KEYS, queue, "c1", dedupe_ttl_s=60), 0.0, min_idle_ms=0, totals=Totals())
    await reclaimer.list_own()
    (first,) = await reclaimer.take(10)
    assert (first.entry_id, first.deliveries) == (own, 2)
    (second,) = await reclaimer.take(10)
    assert second.entry_id == silent and second.fields[b"id"] == b"silent"
    assert await reclaimer.take(10) == []
    owners = {row["message_id"].decode(): row["consumer"] for row in
              await r.xpending_range(KEYS.queue(queue), GROUP, "-", "+", 10)}
    assert owners == {own: b"c1", silent: b"c1", alive: b"alive"}


# ---- cancels ------------------------------------------------------------------------------

async def test_a_published_cancel_reaches_the_engine_once_and_its_flag_gets_a_ttl(r, queue):
    requests = RequestTable(4, abandon=lambda _: None)
    held = requests.read(route(queue, "held", "1-0"))
    cancelled: list[str] = []
    engine = SimpleNamespace(cancel=cancelled.append)
    await r.set(KEYS.cancel_flag(queue, "held"), 1)  # set without a TTL, as a careless producer would
    listener = asyncio.create_task(listen_for_cancels(r, RequestMarks(r, KEYS, queue, 60), requests, engine,  # type: ignore[arg-type]
                                                      flag_ttl_s=60))
    try:
        while (await r.pubsub_numsub(KEYS.cancel_channel(queue)))[0][1] < 1:
            await asyncio.sleep(0.01)
        await r.publish(KEYS.cancel_channel(queue), "not-held")
        await r.publish(KEYS.cancel_channel(queue), "held")
        while not cancelled:
            await asyncio.sleep(0.01)
        while await r.ttl(KEYS.cancel_flag(queue, "held")) < 0:
            await asyncio.sleep(0.01)
    finally:
        listener.cancel()
    assert cancelled == ["held"] and held.cancel_requested
    assert 0 < await r.ttl(KEYS.cancel_flag(queue, "held")) <= 60


# ---- intake ---------------------------------------------------------------------------------

def intake(r: aioredis.Redis, queue: str, requests: RequestTable, emitted: list[Outgoing],
           submitted: list[object], engine: object = None, **settings: object) -> Intake:
    """Intake with everything real but the engine process (which records what it is asked
    to prepare: nothing, for the entries below; or `engine`, a stand-in of its own)."""
    settings = load_settings(queue=queue, consumer="c1", **settings)
    streams = RequestStreams(r, KEYS, queue, "c1", dedupe_ttl_s=60)
    reclaimer = Reclaimer(streams, 60.0, min_idle_ms=60_000, totals=Totals())
    engine = engine or SimpleNamespace(prepare=submitted.append, abandon=lambda _: None)
    marks, fencing = RequestMarks(r, KEYS, queue, 60), Fencing(r, KEYS, queue, "c1", 60)
    return Intake(settings, streams, marks, fencing, requests, reclaimer, engine, emitted.append, 0.0,
                  Totals())  # type: ignore[arg-type]


async def test_intake_settles_a_repeat_of_a_finished_request_and_dead_letters_an_entry_without_id(r, queue):
    requests, emitted, submitted = RequestTable(4, abandon=lambda _: None), [], []
    taking = intake(r, queue, requests, emitted, submitted)
    await r.set(KEYS.done(queue, "finished"), "0-1")
    repeat = await pending_entry(r, queue, "c1", "finished")
    no_id = (await r.xadd(KEYS.queue(queue), {"json": json.dumps({"prompt": "hi"})})).decode()
    await r.xreadgroup(GROUP, "c1", {KEYS.queue(queue): ">"}, count=1)
    await taking._accept(Delivery(KEYS.queue(queue), repeat, {b"id": b"finished", b"json": b"{}"}))
    await taking._accept(Delivery(KEYS.queue(queue), no_id, {b"json": b'{"prompt": "hi"}'}))
    assert submitted == [] and emitted == [] and len(requests) == 0
    assert await r.xlen(KEYS.queue(queue)) == 0 and (await r.xpending(KEYS.queue(queue), GROUP))["pending"] == 0
    ((_, letter),) = await r.xrange(KEYS.dead(queue))
    assert letter[b"entry_id"] == no_id.encode() and b"id" in letter[b"reason"]


async def test_intake_answers_a_request_whose_preparations_killed_workers_with_poisoned(r, queue):
    requests, emitted, submitted = RequestTable(4, abandon=lambda _: None), [], []
    taking = intake(r, queue, requests, emitted, submitted)
    entry_id = await pending_entry(r, queue, "c1", "poison")
    await r.sadd(KEYS.crashes(queue, "poison"), *[f"died-{i}" for i in range(taking.settings.max_crashes)])
    await taking._accept(Delivery(KEYS.queue(queue), entry_id, {b"id": b"poison", b"json": b"{}"}))
    (answer,) = emitted
    assert submitted == [] and isinstance(answer.event, Error) and answer.event.code == "poisoned"
    assert requests.get("poison").status is RequestStatus.FINISHING
    ((_, letter),) = await r.xrange(KEYS.dead(queue))
    assert letter[b"entry_id"] == entry_id.encode() and b"died while they held it" in letter[b"reason"]
    assert not [decode_event(f) for _, f in await r.xrange(KEYS.output(queue, "poison"))], "the publisher writes it"


class HeldPreparations:
    """The engine process's stand-in: keeps each request it is asked to prepare until
    `release` is set (after a round trip to Redis, as a preparation takes time), then
    refuses it, so that it ends without a model; or, with `admit`, queues it (never to
    run: the request stays held). The request named `hold` is never released; for the
    one named `deny`, Redis refuses the worker a command."""

    def __init__(self, r: aioredis.Redis, admit: bool = False, hold: str = "", deny: str = "") -> None:
        self.r = r
        self.admit = admit
        self.hold = hold
        self.deny = deny
        self.sent: list[str] = []  # in the order they were sent
        self.preparing: list[str] = []
        self.most_at_once = 0
        self.release = asyncio.Event()

    async def prepare(self, message: Prepare, sent: Callable[[], None]) -> Refused | Admitted:
        self.sent.append(message.ref.id)
        sent()
        self.preparing.append(message.ref.id)
        self.most_at_once = max(self.most_at_once, len(self.preparing))
        await self.r.ping()
        await self.release.wait()
        if message.ref.id == self.hold:
            await asyncio.Event().wait()  # never set
        if message.ref.id == self.deny:
            raise NoPermissionError("NOPERM User worker has no permissions to run the 'evalsha' command")
        self.preparing.remove(message.ref.id)
        if self.admit:
            return Admitted(message.ref, time.time())
        return Refused(message.ref, ErrorCode.INVALID_REQUEST, "refused by the test")

    def abandon(self, request_id: str) -> None:
        pass


async def read_new(r: aioredis.Redis, queue: str, count: int, first_prompt: str = "hi") -> list[Delivery]:
    """`count` new requests, read by consumer c1."""
    await ensure_groups(r, [KEYS.queue(queue)])
    for i in range(count):
        prompt = first_prompt if i == 0 else "hi"
        await r.xadd(KEYS.queue(queue), {"id": f"r{i}", "json": json.dumps({"prompt": prompt})})
    reply = await r.xreadgroup(GROUP, "c1", {KEYS.queue(queue): ">"}, count=count)
    return [Delivery(KEYS.queue(queue), entry_id.decode(), fields) for entry_id, fields in reply[0][1]]


async def until(condition: Callable[[], bool], what: str) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.005)
    try:
        await asyncio.wait_for(poll(), 30)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def test_intake_prepares_the_new_requests_of_one_read_side_by_side(r, queue):
    """Each request waits on Redis and on its preparation: a read's requests wait
    together, so that a backlog's first wave reaches the batch at once; they are sent to
    be prepared in the order they were read, the first one slower to read (a body
    decoded off the event loop) included; and the intake reads on once they are sent,
    without waiting for their preparations (a video's decoding holds back nobody)."""
    requests, emitted, engine = RequestTable(4, abandon=lambda _: None), [], HeldPreparations(r)
    taking = intake(r, queue, requests, emitted, [], engine)
    await asyncio.wait_for(taking._accept_all(await read_new(r, queue, 3, first_prompt="x" * 100_000)), 30)
    assert sorted(engine.preparing) == ["r0", "r1", "r2"] and not emitted, "all three in preparation, none ended"
    assert engine.sent == ["r0", "r1", "r2"], "sent in the order they were read"
    engine.release.set()
    await until(lambda: len(emitted) == 3, "all three answered")
    assert all(o.event.message == "refused by the test" for o in emitted)


async def test_intake_reads_on_while_a_request_is_prepared(r, queue):
    """A request whose preparation does not end (a decode that hangs) holds a slot, and
    nothing else: the requests read after it are prepared and answered meanwhile."""
    requests, emitted, engine = RequestTable(4, abandon=lambda _: None), [], HeldPreparations(r, hold="slow")
    engine.release.set()
    taking = intake(r, queue, requests, emitted, [], engine)
    await ensure_groups(r, [KEYS.queue(queue)])
    await r.xadd(KEYS.queue(queue), {"id": "slow", "json": json.dumps({"prompt": "hi"})})
    stop = asyncio.Event()
    running = asyncio.create_task(taking.run(stop))
    try:
        await until(lambda: engine.preparing == ["slow"], "the slow one in preparation")
        for i in range(3):
            await r.xadd(KEYS.queue(queue), {"id": f"r{i}", "json": json.dumps({"prompt": "hi"})})
        await until(lambda: len(emitted) == 3, "the three read after it answered")
        assert sorted(o.ref.id for o in emitted) == ["r0", "r1", "r2"] and engine.preparing == ["slow"]
    finally:
        stop.set()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


async def test_redis_refusing_the_worker_while_a_request_is_taken_in_stops_the_intake(r, queue):
    """An entry's intake runs beside the reads; Redis refusing the worker its own keys
    there is the worker's failure, not the entry's: `run` raises it (the worker stops)."""
    requests, engine = RequestTable(4, abandon=lambda _: None), HeldPreparations(r, deny="denied")
    engine.release.set()
    taking = intake(r, queue, requests, [], [], engine)
    await ensure_groups(r, [KEYS.queue(queue)])
    await r.xadd(KEYS.queue(queue), {"id": "denied", "json": json.dumps({"prompt": "hi"})})
    running = asyncio.create_task(taking.run(asyncio.Event()))
    try:
        await asyncio.wait([running], timeout=60)
        assert running.done(), "the intake went on reading"
        with pytest.raises(NoPermissionError, match="NOPERM"):
            running.result()
    finally:
        running.cancel()


async def test_intake_takes_in_entries_of_two_streams_that_share_an_id(r, queue):
    """Entry ids are per stream: a lane's entry and the queue's may have the same one,
    and read together, each still takes its own turn."""
    requests, emitted, engine = RequestTable(4, abandon=lambda _: None), [], HeldPreparations(r)
    engine.release.set()
    taking = intake(r, queue, requests, emitted, [], engine)
    deliveries = []
    for i, stream in enumerate((KEYS.lane(queue, "urgent"), KEYS.queue(queue))):
        await ensure_groups(r, [stream])
        await r.xadd(stream, {"id": f"r{i}", "json": json.dumps({"prompt": "hi"})}, id="5-0")
        reply = await r.xreadgroup(GROUP, "c1", {stream: ">"}, count=1)
        deliveries += [Delivery(stream, entry_id.decode(), fields) for entry_id, fields in reply[0][1]]
    await asyncio.wait_for(taking._accept_all(deliveries), 30)
    await until(lambda: len(emitted) == 2, "both answered")
    assert sorted(o.ref.id for o in emitted) == ["r0", "r1"] and engine.sent == ["r0", "r1"]


async def test_intake_prepares_requests_taken_over_one_at_a_time(r, queue):
    """A request delivered before may be the one that killed an engine process, and a
    death is blamed on every request in preparation: it is prepared alone."""
    requests, emitted, engine = RequestTable(4, abandon=lambda _: None), [], HeldPreparations(r)
    engine.release.set()
    taking = intake(r, queue, requests, emitted, [], engine)
    delivered_before = [replace(d, deliveries=2) for d in await read_new(r, queue, 3)]
    await taking._accept_all(delivered_before)
    assert sorted(o.ref.id for o in emitted) == ["r0", "r1", "r2"] and engine.most_at_once == 1


async def test_intake_reads_a_prefill_group_ahead_while_a_backlog_waits_and_no_more_after(r, queue):
    """Beside its 4 slots a worker holds `prefetch` (1); while at least a prefill group
    (4) waits unread in the queue it holds a group ahead, so that slots that free
    together start together; the backlog's last entries it leaves to the fleet."""
    requests, engine = RequestTable(4, abandon=lambda _: None), HeldPreparations(r, admit=True)
    engine.release.set()
    taking = intake(r, queue, requests, [], [], engine, max_num_seqs=4, prefill_batch_size=4, prefetch=1)
    await ensure_groups(r, [KEYS.queue(queue)])
    for i in range(12):
        await r.xadd(KEYS.queue(queue), {"id": f"r{i}", "json": json.dumps({"prompt": "hi"})})
    stop = asyncio.Event()
    running = asyncio.create_task(taking.run(stop))
    try:
        await until(lambda: len(requests) == 8, "4 slots and a group ahead held")
        assert taking._read_ahead() == 4 and (await r.xinfo_groups(KEYS.queue(queue)))[0]["lag"] == 4
        for held in list(requests)[:4]:  # four rows end: the worker reads again
            requests.end(held.route.id, RequestStatus.SETTLED)
        await until(lambda: len(requests) == 8, "the next group read")
        await until(lambda: taking._read_ahead() == 1, "none left unread seen (after the group was taken in)")
        assert (await r.xinfo_groups(KEYS.queue(queue)))[0]["lag"] == 0
        for held in list(requests)[:4]:  # none left unread: `prefetch` ahead again
            requests.end(held.route.id, RequestStatus.SETTLED)
        async with r.pipeline(transaction=True) as pipe:  # fewer than a group come: all at once
            for i in range(3):
                pipe.xadd(KEYS.queue(queue), {"id": f"late{i}", "json": json.dumps({"prompt": "hi"})})
            await pipe.execute()
        await until(lambda: len(requests) == 5, "one late request read")
        await until(lambda: taking._read_ahead() == 1, "fewer than a group left unread seen")
        assert len(requests) == 5 and (await r.xinfo_groups(KEYS.queue(queue)))[0]["lag"] == 2
    finally:
        stop.set()
        running.cancel()
