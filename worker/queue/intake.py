"""Taking requests in: reads entries as there is room, and turns each into an engine
request, an answer (a repeat, a cancel, an error) or a dead letter.

Each entry is taken in on its own, so whatever one holds stays with it. Its preparation
(decoding, validating, tokenizing) runs inside an attempt counted in Redis
(`RequestMarks.arrive` / `close_attempt`): a worker that dies in there leaves the count
up, and the next worker dead-letters the request instead of dying too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial

import structlog
from redis.exceptions import RedisError

from client.protocol import Envelope, ErrorCode, Undeliverable, read_envelope, read_id
from common.prefix_chain import Chain, prefix_chain
from worker.messages import (
    Admitted,
    Answered,
    DecoderCrashed,
    EngineInbox,
    EngineStopped,
    Outgoing,
    Prepare,
    Refused,
    Resume,
    Route,
    failed,
)
from worker.queue.affinity import Affinity
from worker.queue.fencing import Fencing, take_fence
from worker.queue.recovery import Delivery, Reclaimer
from worker.queue.requests import HeldRequest, RequestStatus, RequestTable
from worker.queue.retrying import describe, is_permission_error, outage, retrying
from worker.queue.streams import Arrival, RequestMarks, RequestStreams
from worker.queue.totals import Totals
from worker.settings import WorkerSettings

log = structlog.get_logger("mlxq.worker")

INLINE_BODY_BYTES = 4096  # bodies up to this size are read on the event loop
BATCH_PRIORITY = 1 << 20  # added to a batch line's priority: ~120 days of aging (10 s a level) behind


def entry_ms(entry_id: str) -> int:
    """The server's clock, in ms, when the entry was added (the first part of its id)."""
    return int(entry_id.split("-", 1)[0])


class Intake:
    """Reads the queue as room allows and starts what it reads."""

    def __init__(self, settings: WorkerSettings, streams: RequestStreams, marks: RequestMarks, fencing: Fencing,
                 requests: RequestTable, reclaimer: Reclaimer, engine: EngineInbox,
                 emit: Callable[[Outgoing], None], clock_offset_s: float, totals: Totals,
                 affinity: Affinity | None = None) -> None:
        self.settings = settings
        self.streams = streams
        self.marks = marks
        self.fencing = fencing
        self.requests = requests
        self.reclaimer = reclaimer
        self.engine = engine
        self.emit = emit  # hands an event straight to the publisher
        self.clock_offset_s = clock_offset_s
        self.totals = totals  # counts its dead letters and placements
        self.affinity = affinity  # placement by prefix
        self._outages_seen = outage.ended
        self._retake = False  # requests were let go when the engine died: list our pending entries again
        self._backlogged = False  # the last read got all it asked for, and left a group unread
        # (stream, entry id) -> the turns of the entries read before it and its own
        # (`_accept_all`); by stream too: two streams' entries may share an id.
        self._turns: dict[tuple[str, str], tuple[list[asyncio.Event], asyncio.Event]] = {}
        self._accepting: set[asyncio.Task[None]] = set()  # entries still being taken in
        self._fatal: BaseException | None = None  # what an entry's intake raised that stops the worker

    async def run(self, stop: asyncio.Event) -> None:
        """Take requests in until `stop` is set (or the task is cancelled); raises what
        stops the worker (Redis refusing its own keys), in the loop or in an entry's intake."""
        try:
            await self._read_while(stop)
        finally:
            for task in self._accepting:
                task.cancel()
            await asyncio.gather(*self._accepting, return_exceptions=True)
        if self._fatal is not None:
            raise self._fatal

    async def _read_while(self, stop: asyncio.Event) -> None:
        # Also ends by itself if a cancellation gets lost in a Redis call; and once an entry's
        # intake failed the worker (`_accepted`), at the end of the read or wait under way:
        # cancelled inside a Redis call, redis-py can hang in its disconnect.
        while not stop.is_set() and self._fatal is None:
            read_ahead = self._read_ahead()
            room = self.requests.room(read_ahead)
            if room <= 0:
                await self.requests.wait_for_room(read_ahead)
                continue
            # The batch lane only into free slots: read ahead, its lines would make an
            # interactive request that comes next wait behind them.
            free = max(0, room - read_ahead)
            if not free and self.streams.batch_lines_waiting:
                # Every slot is held and batch lines wait: the next slot to free goes to what
                # waits then (interactive first), so wait for it rather than block on Redis.
                deliveries = await self._reclaimed(room) or await self._read(room, 0, 0)
                if not deliveries:
                    await self.requests.wait_for_leave(self.settings.block_ms / 1000)
                    continue
            else:
                deliveries = await self._reclaimed(room) or await self._stolen(free) or \
                    await self._read(room, self._block_ms(), free)
            await self._accept_all(deliveries)
            if self._backlogged:  # only now: the round trip is not on the way of what was read
                self._backlogged = await self._backlog_left()

    def _read_ahead(self) -> int:
        """How many entries to hold beyond the free slots: `prefetch`, or while the queue
        has a backlog a prefill group's worth, so that slots that free together are
        refilled together, in one prefill, rather than one by one as each refill comes
        back from Redis."""
        prefetch = self.settings.prefetch
        return max(prefetch, self._prefill_group()) if prefetch and self._backlogged else prefetch

    def _prefill_group(self) -> int:
        return min(self.settings.prefill_batch_size, self.settings.max_num_seqs)

    async def _read(self, room: int, block_ms: int, free: int) -> list[Delivery]:
        read = partial(self.streams.read, room, block_ms, free)
        deliveries = [Delivery(stream, entry_id, fields) for stream, entry_id, fields in
                      await retrying(read, "reading requests")]
        self._backlogged = len(deliveries) >= room  # looked at further once they are taken in (`run`)
        return deliveries

    async def _backlog_left(self) -> bool:
        """Whether the queue still holds a prefill group's worth that nobody has read: only
        then may this worker read ahead that much, or it would take entries an idle
        worker of the queue could start at once (a burst the size of the fleet's slots
        must spread over the fleet)."""
        try:
            return await self.streams.undelivered() >= self._prefill_group()
        except RedisError as e:
            log.debug("could not look at the queue's backlog", error=describe(e))
            return False

    def _block_ms(self) -> int:
        """How long a read may wait for new entries: with other workers' placement lanes
        to watch, no longer than their bound."""
        if self.affinity is None or not self.affinity.peers:
            return self.settings.block_ms
        return max(1, min(self.settings.block_ms, self.settings.affinity_wait_ms))

    async def _stolen(self, free: int) -> list[Delivery]:
        """Entries placed on other workers that waited for them too long (`affinity`), into
        free slots only: one that would wait here too is better off where its prefix is."""
        if self.affinity is None or free <= 0:
            return []
        try:
            stolen = await retrying(partial(self.affinity.steal, free), "looking at other workers' placement lanes")
        except Exception as e:  # noqa: BLE001 - upkeep, as the reclaim scan
            if is_permission_error(e):
                raise
            log.warning("could not look at other workers' placement lanes", error=describe(e))
            return []
        return [Delivery(stream, entry_id, fields) for stream, entry_id, fields in stolen]

    async def _reclaimed(self, room: int) -> list[Delivery]:
        """Entries to take over, if any; a scan that fails (no group after Redis restarted
        empty, a consumer name that is not text) is tried again at the next interval."""
        try:
            # A read in flight may have been lost with its reply; or the engine died and
            # its requests were let go, to be taken in afresh.
            if outage.ended != self._outages_seen or self._retake:
                self._outages_seen, self._retake = outage.ended, False
                await retrying(partial(self.reclaimer.list_own, self._holds), "listing our own pending requests")
            return await retrying(partial(self.reclaimer.take, room), "looking for abandoned requests")
        except Exception as e:  # noqa: BLE001 - finding abandoned work is upkeep: it must not stop the worker
            if is_permission_error(e):
                raise
            log.warning("could not look for abandoned requests", error=describe(e))
            return []

    def retake_own(self) -> None:
        """Take in afresh, at the next read, this consumer's pending entries not held."""
        self._retake = True

    def _holds(self, stream: str, entry_id: str) -> bool:
        held = self.requests.by_entry(entry_id)
        return held is not None and held.route.stream == stream

    async def _accept_all(self, deliveries: list[Delivery]) -> None:
        """Take new entries in side by side (each waits on Redis and on its preparation;
        one after another, a backlog's first wave would reach the batch a step or two
        apart, to be started in as many prefills), and return once each has been sent to
        be prepared or has ended: the next read does not wait for preparations, so a
        request slow to prepare (a long video to decode) holds back nobody read after it.
        Entries delivered before go one at a time, each to its end: one may be what
        killed an engine process, and a death is blamed on every request in preparation
        (`_prepared`), so it must be prepared with nothing beside it for the next death
        to be blamed on it alone."""
        if any(delivery.deliveries > 1 for delivery in deliveries):
            for delivery in deliveries:
                await self._accept(delivery)
            return
        # Each sends its request to be prepared once every entry read before it has been
        # sent (or has ended without): the engine process takes them in that order.
        turns = [asyncio.Event() for _ in deliveries]
        self._turns.update(((d.stream, d.entry_id), (turns[:i], turns[i])) for i, d in enumerate(deliveries))
        for delivery in deliveries:
            task = asyncio.create_task(self._accept(delivery))
            self._accepting.add(task)
            task.add_done_callback(self._accepted)
        await asyncio.gather(*(turn.wait() for turn in turns))

    def _accepted(self, task: asyncio.Task[None]) -> None:
        """An entry's intake ended; one that raised stops the worker (`_accept`)."""
        self._accepting.discard(task)
        if task.cancelled() or task.exception() is None or self._fatal is not None:
            return
        self._fatal = task.exception()  # `run` raises it
        self.requests.wake()

    async def _accept(self, delivery: Delivery) -> None:
        """Take one entry in; whatever goes wrong with it stays with it."""
        try:
            await self._take_in(delivery)
        except Exception as e:  # noqa: BLE001 - one entry's failure must not stop the others
            if is_permission_error(e):
                raise  # Redis refuses the worker's own keys: that is the worker's failure, not the entry's
            await self._fail_entry(delivery, e)
        finally:
            _, mine = self._turns.pop((delivery.stream, delivery.entry_id), ([], None))
            if mine is not None:  # (ended without being sent: the next ones need not wait for it)
                mine.set()

    async def _take_in(self, delivery: Delivery) -> None:
        """Hold a new entry and start it, unless it has no id or is a repeat."""
        stream, entry_id, fields = delivery.stream, delivery.entry_id, delivery.fields
        if fields is None:  # deleted from the stream before we read it
            await retrying(partial(self.streams.settle, stream, [entry_id]), "settling a deleted entry")
            return
        try:
            request_id = read_id(fields)
        except Undeliverable as e:
            log.warning("dead letter", entry_id=entry_id, reason=str(e))
            await retrying(partial(self.streams.dead_letter, stream, entry_id, fields, str(e),
                                   deliveries=delivery.deliveries), "dead-lettering")
            self.totals.count("dead_letters")
            return
        held = self.requests.get(request_id)
        if held is not None:
            if held.route.entry_id != entry_id:  # the same id in another entry: a repeat
                log.info("repeat of a running request ignored", request_id=request_id, entry_id=entry_id)
                await retrying(partial(self.streams.settle, stream, [entry_id]), "settling a repeat")
            return
        own = self.streams.keys.output(self.streams.queue, request_id)
        # read before the flag check, so that no cancel slips between
        held = self.requests.read(Route(request_id, entry_id, own, "json", stream))
        arrival = await retrying(partial(self.marks.arrive, request_id, self.settings.result_ttl_s),
                                 "checking an arriving request")
        try:
            await self._start(delivery, held, arrival)
        finally:
            await retrying(partial(self.marks.close_attempt, request_id, arrival.attempt), "closing an attempt")

    async def _start(self, delivery: Delivery, held: HeldRequest, arrival: Arrival) -> None:
        """Answer a finished or poisoned request; else prepare it and hand it to the engine."""
        route = held.route
        if arrival.done:
            log.info("repeat of a finished request ignored", request_id=route.id, entry_id=route.entry_id)
            await retrying(partial(self.streams.settle, route.stream, [route.entry_id]), "settling a repeat")
            self.requests.end(route.id, RequestStatus.SETTLED)
            return
        if arrival.crashes >= self.settings.max_crashes:
            await self._poisoned(delivery, route, f"{arrival.crashes} worker or engine process(es) died while they "
                                 f"held it (max_crashes is {self.settings.max_crashes})")
            return
        fields = delivery.fields
        assert fields is not None
        read = partial(read_envelope, fields, max_body_bytes=self.settings.max_body_bytes,
                       max_depth=self.settings.max_nesting_depth)
        # Decoding and walking megabytes of body would stall every stream's publishing: off the loop.
        large = sum(len(v) for v in fields.values() if isinstance(v, (bytes, str))) > INLINE_BODY_BYTES
        envelope = await asyncio.to_thread(read) if large else read()
        chain = prefix_chain(envelope.raw) if self.affinity is not None and self.affinity.enabled else ()
        if await self._placed_elsewhere(delivery, envelope, route, chain, arrival.attempt):
            self.requests.end(route.id, RequestStatus.SETTLED)
            return
        held.chain = chain  # served here: peers send the next requests on its prompt here too
        reply_to = envelope.reply_to
        if reply_to is not None and self.streams.keys.reply_to_problem(self.streams.queue, reply_to):
            reply_to = None  # its error goes to the request's own stream
        if self.requests.reroute(route.id, reply_to=reply_to or route.reply_to, encoding=envelope.encoding) is None:
            return  # taken over while it was read: the other worker serves it
        taken = await take_fence(self.fencing, self.streams, self.requests, held)
        if taken is None:  # a repeat, or its output already complete
            return
        route, resume = held.route, None
        if taken.written:  # an earlier delivery wrote output: continue after it
            earlier = await retrying(partial(self.fencing.earlier_output, route, taken.written),
                                     "reading earlier output")
            if not earlier.whole:
                self._answer(failed(route.ref, ErrorCode.INTERNAL, (
                    f"{earlier.written} events were written by an earlier delivery but only {len(earlier.deltas)} "
                    "remain in the output stream (expired?); continuing would repeat or skip text")))
                return
            resume = earlier.resume()
        if delivery.deliveries > self.settings.max_deliveries:
            await self._poisoned(delivery, route, f"delivered {delivery.deliveries} times (max_deliveries is "
                                 f"{self.settings.max_deliveries}); the workers that took it stopped without "
                                 "finishing it")
            return
        await self._submit(delivery, envelope, held, arrival, resume)

    async def _placed_elsewhere(self, delivery: Delivery, envelope: Envelope, route: Route, chain: Chain,
                                attempt: str) -> bool:
        """Move a fresh entry of the queue to the worker whose prefix cache holds more of
        its prompt, if one has room (`affinity`); count where it is served and why."""
        if self.affinity is None:
            return False
        if route.stream == self.streams.own_lane:
            self.totals.count("placed:affine")
            return False
        if delivery.deliveries > 1 or route.stream not in self.streams.interactive_streams or envelope.raw is None:
            return False  # taken over, stolen, or a batch line: served where it is
        others_held = len(self.requests) - 1  # (this one is held already)
        choice = await retrying(partial(self.affinity.choose, chain, others_held),
                                "reading the load of the worker that caches its prefix")
        if choice.reason:
            self.totals.count(f"placed:{choice.reason}")
        if choice.peer is None:
            return False
        assert delivery.fields is not None
        # Closed before the peer can read it: an attempt still open when it arrives there
        # would count as a worker that died preparing it, and make it run alone.
        await retrying(partial(self.marks.close_attempt, route.id, attempt), "closing an attempt")
        await retrying(partial(self.affinity.forward, route.stream, route.entry_id, delivery.fields, choice.peer),
                       "placing a request on the worker that caches its prefix")
        log.debug("placed on the worker that caches its prefix", request_id=route.id, worker=choice.peer)
        return True

    async def _submit(self, delivery: Delivery, envelope: Envelope, held: HeldRequest, arrival: Arrival,
                      resume: Resume | None) -> None:
        route = held.route
        arrived_at = min(time.time(), entry_ms(route.entry_id) / 1000.0 - self.clock_offset_s)
        boost = BATCH_PRIORITY if route.stream == self.streams.batch_lane else 0  # behind every interactive request
        # Flagged before it was read: prepared (to count its prompt), never computed.
        cancelled = arrival.cancelled or held.cancel_requested
        held.alone = arrival.crashes > 0
        prepare = Prepare(envelope, route.ref, arrived_at, self.clock_offset_s, resume, boost, cancelled,
                          alone=held.alone)
        prepared = await self._prepared(delivery, route, prepare, arrival.crashes)
        if prepared is None:
            return
        if self.requests.holding(route.ref) is None:
            return  # taken over while it was prepared (the table had the engine drop it), or let go with a dead engine
        self.requests.prepared(route.id, arrived_at, prepared.prepared_at)  # (on the engine process's clock)
        if isinstance(prepared, Answered):  # cancelled before it started, or only counted
            self._answer(prepared.outgoing)
            return
        if resume is not None:
            log.info("resuming a request", request_id=route.id, deltas=resume.deltas)
        if held.status is RequestStatus.READ:  # (its first delta may be written already)
            self.requests.advance(route.id, RequestStatus.ADMITTED)

    async def _prepared(self, delivery: Delivery, route: Route, prepare: Prepare,
                        crashes: int) -> Admitted | Answered | None:
        """How the engine took the request (queued it, or answered it at once); None once it
        is answered or let go instead: refused; dead-lettered when a media decoder died on
        it as often as `max_crashes` allows (a decoder's death counts as a crash, beside the
        workers that died on it); let go when the engine process died with it (a crash
        recorded in Redis: the request is taken in afresh once a new engine runs)."""
        earlier, mine = self._turns.get((delivery.stream, delivery.entry_id), ([], None))
        for turn in earlier:
            await turn.wait()
        while True:
            try:
                prepared = await self.engine.prepare(prepare, mine.set if mine is not None else lambda: None)
            except EngineStopped:
                await retrying(partial(self.marks.record_crash, route.id), "recording a crash")
                self.requests.end(route.id, RequestStatus.HANDED_BACK)
                self.retake_own()
                return None
            if isinstance(prepared, Refused):
                self._answer(failed(route.ref, prepared.code, prepared.message))
                return None
            if not isinstance(prepared, DecoderCrashed):
                return prepared
            crashes += 1
            log.warning("media decoder died", request_id=route.id, reason=prepared.reason, crashes=crashes)
            if crashes >= self.settings.max_crashes:
                await self._poisoned(delivery, route, f"{prepared.reason}; it has crashed {crashes} time(s) while "
                                     f"prepared (max_crashes is {self.settings.max_crashes})")
                return None

    async def _poisoned(self, delivery: Delivery, route: Route, reason: str) -> None:
        """An entry that keeps killing or outliving workers: dead letter, and say so."""
        log.error("poisoned request", request_id=route.id, entry_id=route.entry_id, reason=reason)
        assert delivery.fields is not None
        await retrying(partial(self.streams.record_dead, route.stream, route.entry_id, delivery.fields, reason,
                               deliveries=delivery.deliveries), "dead-lettering")
        self.totals.count("dead_letters")
        self._answer(failed(route.ref, ErrorCode.POISONED, f"{reason}; moved to {self.streams.dead}"))

    async def _fail_entry(self, delivery: Delivery, error: Exception) -> None:
        """An entry whose intake failed in a way nobody foresaw: its reader gets an
        `internal` error, or, if not even its id was read, it is dead-lettered."""
        reason = ascii(f"{type(error).__name__}: {error}"[:300])
        log.error("could not take in a request", entry_id=delivery.entry_id, error=reason, exc_info=error)
        held = self.requests.by_entry(delivery.entry_id)
        if held is not None:
            self._answer(failed(held.route.ref, ErrorCode.INTERNAL,
                                f"the worker could not start this request: {reason}"))
            return
        if delivery.fields is not None:
            await retrying(partial(self.streams.dead_letter, delivery.stream, delivery.entry_id, delivery.fields,
                                   f"the worker could not read this entry: {reason}",
                                   deliveries=delivery.deliveries), "dead-lettering")
            self.totals.count("dead_letters")

    def _answer(self, outgoing: Outgoing) -> None:
        """The request's terminal event, made here rather than by the engine. One that
        already reached the engine (its intake failed after the hand-over) is dropped
        there: a written terminal tells the engine nothing (`RequestTable.end`)."""
        held = self.requests.get(outgoing.ref.id)
        if held is not None and held.status is RequestStatus.ADMITTED:
            self.engine.abandon(outgoing.ref.id)
        self.requests.advance(outgoing.ref.id, RequestStatus.FINISHING)
        self.emit(outgoing)
