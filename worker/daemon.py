"""The worker daemon's event loop: reads requests, feeds the engine, publishes its output.

    Redis ──XREADGROUP──> intake ──Submit──> engine thread ──StepOutput──> publisher ──one call──> Redis

The event loop owns every Redis connection; the engine thread owns MLX. Leases on the
requests it holds are renewed with the heartbeat; recovery takes over what dead workers left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Literal

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from client.keys import Keys
from client.protocol import Envelope, Error, RequestRejected, Undeliverable, read_envelope, read_id

from . import blas
from .engine import Engine, EngineFailed, Loaded, ModelInfo
from .intake import Intake
from .messages import Outgoing, Resume, Route, StepOutput
from .naming import NameTaken, claim_consumer_name
from .output import deadline_exceeded, not_started
from .publisher import InFlight, Publisher
from .recovery import Delivery, Reclaimer
from .retrying import describe, is_permission_error, retrying, stop_if_cancelled
from .settings import WorkerSettings
from .streams import Arrival, QueueStreams

log = structlog.get_logger("mlxq.worker")

INLINE_BODY_BYTES = 4096  # bodies up to this size are prepared on the event loop
HAND_BACK_IDLE_MS = 10**9  # entries handed back look long abandoned, so others take them at once


def entry_ms(entry_id: str) -> int:
    """The server's clock, in ms, when the entry was added (the first part of its id)."""
    return int(entry_id.split("-", 1)[0])


class Worker:
    """One worker: a consumer in the queue's group, with one engine."""

    def __init__(self, settings: WorkerSettings, redis_url: str, load: Callable[[], Loaded]) -> None:
        self.settings = settings
        self.redis_url = redis_url
        self.keys = Keys(settings.prefix)
        self.consumer = ""  # claimed once the model is loaded (see `naming`)
        self.instance = uuid.uuid4().hex  # this process, in its heartbeat: tells it from a later holder of its name
        self.in_flight: dict[str, InFlight] = {}  # read and not settled; what is left at exit is handed back
        self._cancel_requested: set[str] = set()  # in flight, cancel seen (maybe before the engine had it)
        self._room = asyncio.Event()
        self._stop = asyncio.Event()
        self._fatal: BaseException | None = None
        self._load = load
        self.capacity = settings.max_num_seqs + settings.prefetch
        self._started_at = time.time()

    async def run(self) -> int:
        """Serve until told to stop; returns the process exit status."""
        loop = asyncio.get_running_loop()
        await self._connect()
        try:
            info = await self._start_engine(loop)
        except EngineFailed as e:
            log.critical("worker exiting: the model could not be loaded", error=str(e))
            return 1
        self._install_signal_handlers(loop)
        try:
            await self._claim_name(info)
        except NameTaken as e:
            log.critical("worker exiting: its consumer name is taken", error=str(e))
            self.engine.shutdown(0)
            await self.redis.aclose()
            return 2
        await retrying(self.reclaimer.list_own, "listing this consumer's pending requests")  # before the first read
        self._announce(info)
        intake = asyncio.create_task(self._intake_loop(), name="intake")
        publisher = asyncio.create_task(self.publisher.run(), name="publisher")
        others = [asyncio.create_task(self._cancel_loop(), name="cancels"),
                  asyncio.create_task(self._heartbeat_loop(info), name="heartbeat")]
        for task in (intake, publisher, *others):
            task.add_done_callback(self._on_task_done)
        await self._stop.wait()
        stuck = await _cancel(intake)
        status = await self._drain()
        stuck |= await _cancel(publisher, *others)
        await self._hand_back()
        await self.redis.aclose()
        if stuck:  # a task that swallowed its cancellation would keep asyncio.run from returning
            log.error("exiting with tasks that did not stop", tasks=sorted(t.get_name() for t in stuck))
            os._exit(status)
        return status

    def _announce(self, info: ModelInfo) -> None:
        if self.settings.completion_batch_size < self.settings.max_num_seqs:
            log.warning("completion_batch_size is below max_num_seqs: admitted requests beyond it wait inside "
                        "BatchGenerator", completion_batch_size=self.settings.completion_batch_size,
                        max_num_seqs=self.settings.max_num_seqs)
        log.info("worker ready", queue=self.streams.stream, consumer=self.consumer, model=info.name,
                 redis=self.redis_url, max_num_seqs=self.settings.max_num_seqs, blas=blas.in_use())
        if blas.in_use() == "reference":
            log.warning("MLX runs on the reference BLAS, which is slow: install the worker extra (mkl) or "
                        "`apt install libopenblas0-pthread`; see the README")

    async def _connect(self) -> None:
        self.redis = aioredis.Redis.from_url(self.redis_url, socket_timeout=10, health_check_interval=30)
        self.streams = QueueStreams(self.redis, self.keys, self.settings.queue, self.consumer,
                                    result_ttl_s=self.settings.result_ttl_s, dedupe_ttl_s=self.settings.dedupe_ttl_s,
                                    lanes=self.settings.lanes, dead_letter_maxlen=self.settings.dead_letter_maxlen)
        self.reclaimer = Reclaimer(self.streams, self.settings.reclaim_interval_s,
                                   min_idle_ms=int(2000 * self.settings.heartbeat_s))
        await retrying(self.streams.ensure_group, f"connecting to {self.redis_url}")
        self.clock_offset_s = await retrying(self.streams.clock_offset_s, "reading the server clock")

    async def _claim_name(self, info: ModelInfo) -> None:
        """Take a consumer name no live worker holds; its heartbeat is written with it."""
        def heartbeat(name: str) -> str:
            self.consumer = name
            return self._heartbeat(info)

        ttl_s = 3 * self.settings.heartbeat_s
        self.consumer = await claim_consumer_name(self.streams, self.settings, heartbeat, ttl_s)
        self.streams.consumer = self.consumer

    async def _start_engine(self, loop: asyncio.AbstractEventLoop) -> ModelInfo:
        """Start the engine thread; it loads the model. Its output comes back through the loop."""
        def on_output(out: StepOutput) -> None:
            loop.call_soon_threadsafe(self.publisher.outputs.put_nowait, out)

        def on_fatal(error: BaseException) -> None:
            loop.call_soon_threadsafe(self._die, error)

        self.engine = Engine(self._load, self.settings.max_num_seqs, on_output=on_output, on_fatal=on_fatal,
                             priority_aging_s=self.settings.priority_aging_s)
        self.engine.start()
        info = await asyncio.to_thread(self.engine.wait_ready)
        self.intake = Intake(info, self.settings)
        self.publisher = Publisher(self.streams, self.in_flight, self.engine, self._forget)
        return info

    async def _drain(self) -> int:
        """Reading has stopped. Let running requests finish (cancels still apply) and publish
        what they produce, until the drain timeout."""
        if self._fatal is not None:
            log.critical("worker exiting on a fatal error", error=repr(self._fatal), in_flight=len(self.in_flight))
            return 1
        log.info("draining", running=len(self.in_flight), drain_timeout_s=self.settings.drain_timeout_s)
        self.engine.shutdown(self.settings.drain_timeout_s)
        while not self.engine.join(timeout=0):  # no executor thread: the loop stays free to publish
            await asyncio.sleep(0.02)
        log.info("engine stopped; publishing what is left", events=self.publisher.outputs.qsize())
        await self.publisher.outputs.join()
        return 0

    async def _hand_back(self) -> None:
        """Remove our heartbeat and mark what we still hold as long idle, so that another
        worker takes it over (and resumes it) at its next scan, not after a timeout."""
        left = _by_stream(self.in_flight.values())
        try:
            await self.streams.keep_mine(left, heartbeat="", ttl_s=0, instance=self.instance,
                                         idle_ms=HAND_BACK_IDLE_MS)
        except (RedisError, OSError) as e:
            log.warning("could not hand back; others take over when the heartbeat expires", reason=describe(e))
        log.info("worker stopped", handed_back=len(self.in_flight))

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        """Each loop runs until the worker stops; one that ends before, or fails, is a bug: exit loudly."""
        if task.cancelled() or (self._stop.is_set() and task.exception() is None):
            return
        error = task.exception() or RuntimeError(f"task {task.get_name()} ended")
        if is_permission_error(error):
            log.critical("redis refuses the worker one of its own keys or commands; stopping", task=task.get_name(),
                         reason=describe(error), needs=f"an ACL user with ~{self.keys.prefix}:* "
                         f"&{self.keys.prefix}:* and the commands listed in docs/protocol.md")
        elif isinstance(error, RedisError):
            log.critical("redis refused the worker's own keys; stopping", task=task.get_name(),
                         reason=describe(error))
        else:
            log.critical("worker task died", task=task.get_name(), error=repr(error), exc_info=error)
        self._die(error)

    def _die(self, error: BaseException) -> None:
        self._fatal = error
        self._stop.set()

    def _install_signal_handlers(self, loop: asyncio.AbstractEventLoop) -> None:
        def on_signal(name: str) -> None:
            if self._stop.is_set():
                log.warning("second signal: exiting now; unfinished requests stay pending", signal=name)
                os._exit(1)
            log.info("stop requested", signal=name)
            self._stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig.name)

    # ---- intake ------------------------------------------------------------------

    async def _intake_loop(self) -> None:
        while not self._stop.is_set():  # also ends by itself if a cancellation gets lost in a Redis call
            room = self.capacity - len(self.in_flight)
            if room <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            deliveries = await self._reclaimed(room)
            if not deliveries:
                entries = await retrying(partial(self.streams.read, room, self.settings.block_ms), "reading requests")
                deliveries = [Delivery(stream, entry_id, fields) for stream, entry_id, fields in entries]
            for delivery in deliveries:
                await self._accept(delivery)

    async def _reclaimed(self, room: int) -> list[Delivery]:
        """Entries to take over, if any; a scan that fails (no group after Redis restarted
        empty, a consumer name that is not text) is tried again at the next interval."""
        try:
            return await retrying(partial(self.reclaimer.take, room), "looking for abandoned requests")
        except Exception as e:  # noqa: BLE001 - finding abandoned work is upkeep: it must not stop the worker
            if is_permission_error(e):
                raise
            log.warning("could not look for abandoned requests", error=describe(e))
            return []

    async def _accept(self, delivery: Delivery) -> None:
        """Take one entry in; whatever goes wrong with it stays with it."""
        try:
            await self._take_in(delivery)
        except Exception as e:  # noqa: BLE001 - one entry's failure must not stop the others
            if is_permission_error(e):
                raise  # Redis refuses the worker's own keys: that is the worker's failure, not the entry's
            await self._fail_entry(delivery, e)

    async def _take_in(self, delivery: Delivery) -> None:
        """Register a new entry and start it, unless it is a repeat, poisoned or cancelled.
        Its preparation (decoding, validating, tokenizing) runs inside an attempt counted
        in Redis, so a worker that dies there leaves a mark that poisons the request."""
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
            return
        held = self.in_flight.get(request_id)
        if held is not None:
            if held.route.entry_id != entry_id:  # the same id in another entry: a repeat
                log.info("repeat of a running request ignored", request_id=request_id, entry_id=entry_id)
                await retrying(partial(self.streams.settle, stream, [entry_id]), "settling a repeat")
            return
        flight = InFlight(Route(request_id, entry_id, self.keys.output(request_id), "json", stream))
        self.in_flight[request_id] = flight  # before the flag check, so no cancel slips between
        arrival = await retrying(partial(self.streams.arrive, request_id, self.settings.result_ttl_s),
                                 "checking an arriving request")
        try:
            await self._admit(delivery, flight, arrival)
        finally:
            await retrying(partial(self.streams.close_attempt, request_id), "closing an attempt")

    async def _admit(self, delivery: Delivery, flight: InFlight, arrival: Arrival) -> None:
        route = flight.route
        if arrival.done:
            log.info("repeat of a finished request ignored", request_id=route.id, entry_id=route.entry_id)
            self._forget(route.id)
            await retrying(partial(self.streams.settle, route.stream, [route.entry_id]), "settling a repeat")
            return
        if arrival.crashes >= self.settings.max_crashes:
            await self._poisoned(delivery, route, f"{arrival.crashes} worker(s) died while preparing it "
                                 f"(max_crashes is {self.settings.max_crashes})")
            return
        assert delivery.fields is not None
        envelope = read_envelope(delivery.fields, max_body_bytes=self.settings.max_body_bytes,
                                 max_depth=self.settings.max_nesting_depth)
        if envelope.reply_to is not None and not self.keys.reply_to_problem(envelope.reply_to):
            route = flight.route = replace(route, reply_to=envelope.reply_to)
        route = flight.route = replace(route, encoding=envelope.encoding)
        await self._start(delivery, envelope, flight, cancelled=arrival.cancelled)

    async def _fail_entry(self, delivery: Delivery, error: Exception) -> None:
        """An entry whose intake failed in a way nobody foresaw: its reader gets an
        `internal` error, or, if not even its id was read, it is dead-lettered."""
        reason = ascii(f"{type(error).__name__}: {error}"[:300])
        log.error("could not take in a request", entry_id=delivery.entry_id, error=reason, exc_info=error)
        flight = next((f for f in self.in_flight.values() if f.route.entry_id == delivery.entry_id), None)
        if flight is not None:
            self._emit(Outgoing(flight.route, Error(id=flight.route.id, code="internal",
                                                    message=f"the worker could not start this request: {reason}")))
            return
        if delivery.fields is not None:
            await retrying(partial(self.streams.dead_letter, delivery.stream, delivery.entry_id, delivery.fields,
                                   f"the worker could not read this entry: {reason}",
                                   deliveries=delivery.deliveries), "dead-lettering")

    async def _start(self, delivery: Delivery, envelope: Envelope, flight: InFlight, cancelled: bool) -> None:
        route = flight.route
        resume = None
        if delivery.deliveries > 1:  # an earlier delivery may have written output: continue after it
            point = await self._resume_point(flight)
            if point is False:
                return
            resume = point
        if delivery.deliveries > self.settings.max_deliveries:
            await self._poisoned(delivery, route, f"delivered {delivery.deliveries} times (max_deliveries is "
                                 f"{self.settings.max_deliveries}); the workers that took it stopped without "
                                 "finishing it")
            return
        arrived_at = min(time.time(), entry_ms(route.entry_id) / 1000.0 - self.clock_offset_s)
        prepare = partial(self.intake.prepare, envelope, route, arrived_at, self.clock_offset_s, resume)
        try:
            # Tokenizing a long prompt would stall the loop; a short one costs less than a thread hop.
            request = prepare() if envelope.size <= INLINE_BODY_BYTES else await asyncio.to_thread(prepare)
        except RequestRejected as e:
            self._emit(Outgoing(route, Error(id=route.id, code=e.code, message=str(e))))
            return
        if cancelled or route.id in self._cancel_requested:
            self._emit(not_started(request, time.time()))
        elif request.deadline_at is not None and time.time() > request.deadline_at:
            self._emit(deadline_exceeded(request))
        else:
            self.engine.submit(request)

    async def _resume_point(self, flight: InFlight) -> Resume | Literal[False] | None:
        """What earlier deliveries wrote: a `Resume`, None if nothing, False if it cannot go on."""
        route = flight.route
        progress = await retrying(partial(self.streams.progress, route), "reading earlier output")
        flight.written = progress.written
        if progress.written == 0:
            return None
        if len(progress.deltas) != progress.written:
            self._emit(Outgoing(route, Error(id=route.id, code="internal", message=(
                f"{progress.written} events were written by an earlier delivery but only {len(progress.deltas)} "
                "remain in the output stream (expired?); continuing would repeat or skip text"))))
            return False
        log.info("resuming a request", request_id=route.id, deltas=progress.written)
        return Resume(tokens=[t for d in progress.deltas for t in d.tokens],
                      text="".join(d.text for d in progress.deltas), deltas=progress.written)

    async def _poisoned(self, delivery: Delivery, route: Route, reason: str) -> None:
        """An entry that keeps killing or outliving workers: dead letter, and say so."""
        log.error("poisoned request", request_id=route.id, entry_id=route.entry_id, reason=reason)
        assert delivery.fields is not None
        await retrying(partial(self.streams.record_dead, route.stream, route.entry_id, delivery.fields, reason,
                               deliveries=delivery.deliveries), "dead-lettering")
        self._emit(Outgoing(route, Error(id=route.id, code="poisoned",
                                         message=f"{reason}; moved to {self.streams.dead}")))

    def _emit(self, outgoing: Outgoing) -> None:
        self.publisher.outputs.put_nowait(StepOutput(outgoing=[outgoing]))

    # ---- cancels -----------------------------------------------------------------

    async def _cancel_loop(self) -> None:
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.cancel_channel)
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        request_id = message["data"].decode(errors="replace")
                        if request_id in self.in_flight:
                            self._cancel_requested.add(request_id)
                            self.engine.cancel(request_id)
                            await self.streams.limit_cancel_flag(request_id, self.settings.result_ttl_s)
            except (RedisError, OSError) as e:
                stop_if_cancelled(e)
                log.warning("cancel subscription lost; resubscribing", reason=describe(e))
                await asyncio.sleep(1.0)
            finally:
                await pubsub.aclose()

    def _forget(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)
        self._cancel_requested.discard(request_id)
        self._room.set()

    # ---- heartbeat ---------------------------------------------------------------

    async def _heartbeat_loop(self, info: ModelInfo) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            await retrying(partial(self._keep_alive, info), "renewing the heartbeat and leases")

    def _heartbeat(self, info: ModelInfo) -> str:
        """What this worker tells the fleet about itself (`mlxq:workers:<consumer>`)."""
        return json.dumps({
            "consumer": self.consumer, "instance": self.instance, "queue": self.settings.queue, "model": info.name,
            "host": socket.gethostname(), "pid": os.getpid(), "started_at": self._started_at,
            "in_flight": len(self.in_flight), "max_num_seqs": self.settings.max_num_seqs, **self.engine.stats})

    async def _keep_alive(self, info: ModelInfo) -> None:
        """Refresh the heartbeat and our entries' idle times; drop what another worker took."""
        held = {flight.route.entry_id: request_id for request_id, flight in self.in_flight.items()}
        lost = await self.streams.keep_mine(_by_stream(self.in_flight.values()), self._heartbeat(info),
                                            ttl_s=3 * self.settings.heartbeat_s, instance=self.instance)
        for entry_id in lost:
            request_id = held[entry_id]
            flight = self.in_flight.get(request_id)
            if flight is not None and flight.route.entry_id == entry_id:
                log.warning("another worker took this request over; dropping it here", request_id=request_id)
                self.engine.abandon(request_id)
                self._forget(request_id)


def _by_stream(flights: Iterable[InFlight]) -> dict[str, list[str]]:
    """Entry ids grouped by the request stream they are in."""
    grouped: dict[str, list[str]] = {}
    for flight in flights:
        grouped.setdefault(flight.route.stream, []).append(flight.route.entry_id)
    return grouped


async def _cancel(*tasks: asyncio.Task[None]) -> set[asyncio.Task[None]]:
    """Cancel the tasks and wait for them, but not forever: stopping must not hang.
    Returns those still running."""
    for task in tasks:
        task.cancel()
    _, pending = await asyncio.wait(tasks, timeout=5.0)
    for task in pending:
        log.error("a task did not stop when cancelled", task=task.get_name(), stack=repr(task.get_stack()))
    return pending
