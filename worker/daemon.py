"""The worker daemon (its I/O process): starts its parts, watches them, and stops them in order.

    Redis ──XREADGROUP──> intake ──Prepare──> engine process ──Step──> publisher ──one call──> Redis
                            leases (heartbeat, name)   (its own MLX, scheduler, caches)
                            cancels (pub/sub)

This process owns every Redis connection and imports no MLX; the engine process owns
MLX (`worker.process`). The request table (`requests`) owns where each held request
stands; the loops go through it. An engine process that dies (or hangs) is a crash of
the requests it held: each is counted (`max_crashes`) and taken in afresh by a new
engine process, resuming after what was written. Stopping: stop reading, let running
requests finish for `drain_timeout_s`, publish what they made, hand back the rest.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from functools import partial

import structlog
from redis.exceptions import RedisError

from client.connect import close_async, connect_async
from client.diagnose import redacted
from client.engine_stats import EngineStats
from client.keys import Keys
from client.protocol import Delta, Event
from worker.fleet import metrics
from worker.fleet.adapters import follow_adapters
from worker.fleet.leases import Leases
from worker.fleet.membership import Membership
from worker.fleet.metrics import Metrics
from worker.fleet.naming import NameTaken
from worker.fleet.timeline import Timeline
from worker.messages import EngineReady, Step
from worker.process.engine_link import EngineFailed, EngineLink, blame
from worker.process.group_place import GroupPlace
from worker.queue.affinity import Affinity
from worker.queue.cancels import listen_for_cancels
from worker.queue.fencing import Fencing
from worker.queue.intake import Intake
from worker.queue.publisher import Publisher
from worker.queue.recovery import Reclaimer
from worker.queue.requests import RequestStatus, RequestTable
from worker.queue.retrying import describe, is_permission_error, retrying
from worker.queue.streams import (
    RequestMarks,
    RequestStreams,
    ensure_groups,
    publish_limits,
    request_streams,
    server_clock_offset_s,
)
from worker.queue.totals import Totals
from worker.settings import Hosting, WorkerSettings

log = structlog.get_logger("mlxq.worker")

DRAIN_GRACE_S = 10.0  # past the drain deadline, for the engine process to say it stopped

class Worker:
    """One worker: a consumer in the queue's group, with one engine process."""

    def __init__(self, settings: WorkerSettings, redis_url: str, blas: str = "platform",
                 hosting: Hosting | None = None) -> None:
        self.settings = settings
        # Which BLAS MLX's CPU backend runs on: the command line put it in front of both
        # processes (`LD_PRELOAD`), so this one's maps say.
        self.blas = blas
        self.hosting = hosting or Hosting()  # set by a worker of several models that started this one
        self.redis_url = redis_url
        self.keys = Keys(settings.prefix)
        self.redis = connect_async(redis_url, socket_timeout=10, health_check_interval=30)
        self.request_streams = request_streams(self.keys, settings.queue, settings.lanes)
        self.membership = Membership(self.redis, self.keys, self.request_streams)
        self.marks = RequestMarks(self.redis, self.keys, settings.queue, settings.dedupe_ttl_s)
        self.engine = EngineLink(settings, on_step=self._on_step, on_stats=self._update_stats)
        self.requests = RequestTable(settings.max_num_seqs, abandon=self.engine.abandon)
        self.totals = Totals()
        self.timeline = Timeline(self.redis, self.keys, settings.queue, self.request_streams, settings.timeline_s)
        self.metrics = Metrics(self.totals, self.requests, lambda: self._stats) \
            if settings.metrics_port is not None else None
        self.publisher: Publisher | None = None  # made with the consumer name, once claimed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = asyncio.Event()
        self._fatal: BaseException | None = None
        self._stats: EngineStats | None = None  # the engine's latest, kept for the heartbeat
        self._scrapes: socket.socket | None = None  # the metrics port, bound at start
        self._affinity: Affinity | None = None  # placement by prefix, made with the consumer name

    async def run(self) -> int:
        """Serve until told to stop; returns the process exit status."""
        self._loop = asyncio.get_running_loop()
        try:
            self._scrapes = self._listen_for_scrapes()
        except OSError as e:
            log.critical("worker exiting: the metrics port cannot be opened; choose another --metrics-port",
                         port=self.settings.metrics_port, host=self.settings.metrics_host, error=str(e))
            return 2
        await retrying(partial(ensure_groups, self.redis, self.request_streams),
                       f"connecting to {redacted(self.redis_url)}")
        await retrying(partial(publish_limits, self.redis, self.keys, self.settings.queue, self.settings.max_queue_len),
                       "publishing the queue's bound")
        clock_offset_s = await retrying(partial(server_clock_offset_s, self.redis), "reading the server clock")
        try:
            return await self._serve_with_engine(clock_offset_s)
        finally:
            await self.engine.stop()  # however the worker exits, its engine process goes with it

    async def _serve_with_engine(self, clock_offset_s: float) -> int:
        """Start the engine process and wait for its model, claim a name, serve."""
        try:
            ready = await self.engine.start()
        except EngineFailed as e:
            log.critical("worker exiting: the model could not be loaded", error=str(e))
            return 1
        assert self._loop is not None
        self._install_signal_handlers(self._loop)
        leases = Leases(self.settings, self.membership, self.requests, ready.name, self.totals, self.blas,
                        ready.tool_call, ready.task, lambda: self._stats, lambda: self.engine.pid, self._group(),
                        lambda: None if self._affinity is None else self._affinity.describe(), self._drain_asked)
        try:
            consumer = await leases.claim_name()
        except NameTaken as e:
            log.critical("worker exiting: its consumer name is taken", error=str(e))
            await close_async(self.redis)
            return 2
        streams = RequestStreams(self.redis, self.keys, self.settings.queue, consumer,
                                 dedupe_ttl_s=self.settings.dedupe_ttl_s, lanes=self.settings.lanes,
                                 dead_letter_maxlen=self.settings.dead_letter_maxlen)
        self._affinity = Affinity(self.redis, self.keys, streams, self.totals,
                                  enabled=self.settings.prefix_placement and ready.task == "generate",
                                  wait_ms=self.settings.affinity_wait_ms, ttl_s=leases.ttl_s,
                                  refresh_s=self.settings.heartbeat_s, clock_offset_s=clock_offset_s,
                                  in_flight=self.requests.chains)
        await retrying(streams.register_lane, "creating this worker's placement lane")
        fencing = Fencing(self.redis, self.keys, self.settings.queue, consumer, self.settings.result_ttl_s)
        publisher = self.publisher = Publisher(streams, fencing, self.requests, on_published=self._on_published)
        intake = self._intake(clock_offset_s, streams, fencing, publisher)
        await retrying(intake.reclaimer.list_own, "listing this consumer's pending requests")  # before the first read
        self._announce(ready, consumer)
        return await self._serve(intake, leases, publisher)

    def _listen_for_scrapes(self) -> socket.socket | None:
        """Bind the metrics port, if one is set; a busy port stops the start (`OSError`)."""
        if self.metrics is None or self.settings.metrics_port is None:
            return None
        return metrics.listen(self.settings.metrics_host, self.settings.metrics_port)

    async def _health(self) -> str | None:
        """None while the engine process lives and Redis answers; else why not (`/healthz`)."""
        if not self.engine.alive():
            return "engine process not running"
        try:
            await asyncio.wait_for(self.redis.ping(), timeout=2.0)
        except (RedisError, OSError, TimeoutError) as e:
            return f"redis: {describe(e)}"
        return None

    def _on_published(self, event: Event) -> None:
        """Count a written event; counting is upkeep: whatever fails in it must not stop publishing."""
        try:
            self.totals.observe(event)
            self.timeline.observe(event)
            if isinstance(event, Delta) and (held := self.requests.get(event.id)) is not None:
                held.tokens += len(event.tokens)
            if self.metrics is not None:
                self.metrics.observe(event)
        except Exception as e:  # noqa: BLE001
            log.error("could not count a published event", request_id=event.id, error=repr(e))

    def _intake(self, clock_offset_s: float, streams: RequestStreams, fencing: Fencing,
                publisher: Publisher) -> Intake:
        reclaimer = Reclaimer(streams, self.settings.reclaim_interval_s,
                              min_idle_ms=int(2000 * self.settings.heartbeat_s), totals=self.totals)
        return Intake(self.settings, streams, self.marks, fencing, self.requests, reclaimer, self.engine,
                      publisher.emit, clock_offset_s, self.totals, self._affinity)

    async def _serve(self, intake: Intake, leases: Leases, publisher: Publisher) -> int:
        """Run the loops until a stop; then drain, hand back and close."""
        reading = asyncio.create_task(intake.run(self._stop), name="intake")
        engine = asyncio.create_task(self._keep_engine(intake, publisher), name="engine")
        others = [engine, asyncio.create_task(publisher.run(), name="publisher"),
                  asyncio.create_task(self.engine.watch(lambda: len(self.requests) > 0), name="engine watch"),
                  *([asyncio.create_task(metrics.serve(self.metrics, self._health, self._scrapes), name="metrics")]
                    if self.metrics is not None and self._scrapes is not None else []),
                  asyncio.create_task(listen_for_cancels(self.redis, self.marks, self.requests, self.engine,
                                                         self.settings.result_ttl_s), name="cancels"),
                  asyncio.create_task(leases.run(), name="leases"),
                  asyncio.create_task(self.timeline.run(leases.consumer), name="timeline"),
                  *([asyncio.create_task(self._affinity.run(), name="placement")] if self._affinity else []),
                  asyncio.create_task(follow_adapters(self.redis, self.keys, self.settings, self.engine.set_adapters),
                                      name="adapters"),
                  *([asyncio.create_task(self._watch_host(), name="host")] if self.hosting.host_pid else [])]
        for task in (reading, *others):
            task.add_done_callback(self._on_task_done)
        await self._stop.wait()
        stuck = await _cancel(reading)
        await leases.draining()
        status = await self._drain(publisher, engine)
        stuck |= await _cancel(*others)
        await leases.hand_back()
        await close_async(self.redis)
        if stuck:  # a task that swallowed its cancellation would keep asyncio.run from returning
            log.error("exiting with tasks that did not stop", tasks=sorted(t.get_name() for t in stuck))
            os._exit(status)
        return status

    async def _watch_host(self) -> None:
        """As a model's worker of a worker of several models: drain and exit once that
        process is gone (killed with -9, its children would serve on, unseen)."""
        while os.getppid() == self.hosting.host_pid:
            await asyncio.sleep(1.0)
        log.warning("the worker of several models that started this one is gone; stopping",
                    host_pid=self.hosting.host_pid)
        self._stop.set()

    async def _keep_engine(self, intake: Intake, publisher: Publisher) -> None:
        """Deliver the engine process's output; when it dies, count a crash against each
        request it held and take them in afresh on a new one (they resume after what was
        written). Returns once it ended after a drain."""
        while reason := await self.engine.serve():
            if self._stop.is_set():  # it died in the drain: what it held stays pending for another worker
                log.error("the engine process died while draining", reason=reason)
                return
            await publisher.outputs.join()  # what it made before it died is written first
            lost, blamed = self._blame()
            if self.settings.distributed:  # its other ranks are gone with it: the group stops
                await self._record_crashes(blamed)
                raise RuntimeError(f"the worker group's engine process died ({reason}); the group stops and its "
                                   f"{len(lost)} request(s) go back to the queue")
            log.error("the engine process died; its requests resume on a new one", reason=reason,
                      requests=len(lost), counted_a_crash=sorted(blamed))
            self.totals.count("engine_restarts")
            await self._record_crashes(blamed)
            for request_id in lost:
                self.requests.end(request_id, RequestStatus.HANDED_BACK)
            try:
                await self.engine.start()
            except EngineFailed as e:
                raise RuntimeError(f"a new engine process could not load the model: {e}") from e
            if self._stop.is_set():  # told to stop while it loaded: the drain's shutdown found none to reach
                self.engine.shutdown(self.settings.drain_timeout_s)
            intake.retake_own()

    async def _record_crashes(self, blamed: set[str]) -> None:
        for request_id in sorted(blamed):
            await retrying(partial(self.marks.record_crash, request_id), "recording a crash")

    def _group(self) -> dict[str, object] | None:
        """A worker group's description for the heartbeat (this process is its rank 0)."""
        place = GroupPlace.from_environment() if self.settings.distributed else None
        return None if place is None or self.settings.distributed is None else place.describe(self.settings.distributed)

    def _blame(self) -> tuple[list[str], set[str]]:
        """The requests a dead engine process held, and those of them that count a crash
        (`max_crashes`): the one it was preparing (intake counts it), else what it was
        computing (`engine_link.blame`)."""
        lost = [held.route.id for held in self.requests if held.route.id in self.engine.holding]
        if self.engine.prepared_when_it_died:
            return lost, set()
        return lost, blame(lost, self.engine.batched, self.engine.decoding)

    def _on_step(self, step: Step) -> None:
        assert self.publisher is not None  # the engine gets requests once it is made
        self.publisher.take(step)

    def _update_stats(self, stats: EngineStats) -> None:
        self._stats = stats  # the one copy: the heartbeat and the metrics read it
        if self._affinity is not None:
            self._affinity.set_own(stats.prefix_digest)

    def _announce(self, ready: EngineReady, consumer: str) -> None:
        if self.settings.completion_batch_size < self.settings.max_num_seqs:
            log.warning("completion_batch_size is below max_num_seqs: admitted requests beyond it wait inside "
                        "BatchGenerator", completion_batch_size=self.settings.completion_batch_size,
                        max_num_seqs=self.settings.max_num_seqs)
        log.info("worker ready", queue=self.keys.queue(self.settings.queue), consumer=consumer,
                 model=ready.name, redis=redacted(self.redis_url), max_num_seqs=self.settings.max_num_seqs,
                 blas=self.blas, engine_pid=self.engine.pid)
        if self.blas == "reference":
            log.warning("MLX runs on the reference BLAS, which is slow: install the worker extra (mkl) or "
                        "`apt install libopenblas0-pthread`; see the README")

    async def _drain(self, publisher: Publisher, engine: asyncio.Task[None]) -> int:
        """Reading has stopped. Let running requests finish (cancels still apply) and publish
        what they produce, until the drain timeout."""
        if self._fatal is not None:
            log.critical("worker exiting on a fatal error", error=repr(self._fatal), held=len(self.requests))
            return 1
        log.info("draining", held=len(self.requests), drain_timeout_s=self.settings.drain_timeout_s)
        self.engine.shutdown(self.settings.drain_timeout_s)
        # It ends with the engine process, once the drain is over; one that does not (stuck
        # in a step, in a worker group's collective) is killed, and its requests handed back.
        done, _ = await asyncio.wait([engine], timeout=self.settings.drain_timeout_s + DRAIN_GRACE_S)
        if not done:
            log.error("the engine process did not stop after the drain; killing it", engine_pid=self.engine.pid)
            self.engine.kill()
            await asyncio.wait([engine])
        log.info("engine stopped; publishing what is left", events=publisher.outputs.qsize())
        await publisher.outputs.join()
        return 0

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        """Each loop runs until the worker stops; one that ends before, or fails, is a bug
        or a refusal of the worker's own keys: exit loudly."""
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

    def _drain_asked(self) -> None:
        """Someone asked through Redis (the dashboard's drain or unload) that this worker stop:
        as a SIGTERM does."""
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


async def _cancel(*tasks: asyncio.Task[None]) -> set[asyncio.Task[None]]:
    """Cancel the tasks and wait for them, but not forever: stopping must not hang.
    Returns those still running."""
    for task in tasks:
        task.cancel()
    _, pending = await asyncio.wait(tasks, timeout=5.0)
    for task in pending:
        log.error("a task did not stop when cancelled", task=task.get_name(), stack=repr(task.get_stack()))
    return pending
