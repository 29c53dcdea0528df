"""The worker daemon: starts its parts, watches them, and stops them in order.

    Redis ──XREADGROUP──> intake ──Submit──> engine thread ──StepOutput──> publisher ──one call──> Redis
                            leases (heartbeat, name)      cancels (pub/sub)

The event loop owns every Redis connection; the engine thread owns MLX. The request
table (`requests`) owns where each held request stands; the loops go through it.
Stopping: stop reading, let running requests finish for `drain_timeout_s`, publish
what they made, hand back the rest.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import Callable
from functools import partial

import structlog
from redis.exceptions import RedisError

from client.connect import close_async, connect_async
from client.diagnose import redacted
from client.engine_stats import EngineStats
from client.keys import Keys
from client.protocol import Event
from worker.engine.backends import Loaded, ModelInfo
from worker.engine.scheduler import SchedulingPolicy
from worker.engine.thread import Engine, EngineFailed
from worker.faults import Faults
from worker.fleet import metrics
from worker.fleet.leases import Leases
from worker.fleet.membership import Membership
from worker.fleet.metrics import Metrics
from worker.fleet.naming import NameTaken
from worker.messages import StepOutput, ToolFormat
from worker.prepare.generation import Preparer
from worker.prepare.pooling import PoolingPreparer
from worker.queue.cancels import listen_for_cancels
from worker.queue.fencing import Fencing
from worker.queue.intake import Intake
from worker.queue.publisher import Publisher
from worker.queue.recovery import Reclaimer
from worker.queue.requests import RequestTable
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

ENGINE_EXIT_WAIT_S = 30.0  # an idle engine thread ends at once on a shutdown; this bounds a stuck one


class Worker:
    """One worker: a consumer in the queue's group, with one engine."""

    def __init__(self, settings: WorkerSettings, redis_url: str, load: Callable[[], Loaded],
                 blas: str = "platform", hosting: Hosting | None = None) -> None:
        self.settings = settings
        self.hosting = hosting or Hosting()  # set by a worker of several models that started this one
        self.blas = blas  # which BLAS MLX's CPU backend runs on (the command line put it in front)
        self.redis_url = redis_url
        self.keys = Keys(settings.prefix)
        self.faults = Faults.from_environment()
        self.redis = connect_async(redis_url, socket_timeout=10, health_check_interval=30)
        self.request_streams = request_streams(self.keys, settings.queue, settings.lanes)
        self.membership = Membership(self.redis, self.keys, self.request_streams)
        self.marks = RequestMarks(self.redis, self.keys, settings.queue, settings.dedupe_ttl_s)
        self.engine = Engine(load, SchedulingPolicy.of(settings), on_output=self._on_output, on_fatal=self._on_fatal,
                             on_stats=self._on_stats, faults=self.faults)
        self.requests = RequestTable(settings.max_num_seqs + settings.prefetch, abandon=self.engine.abandon)
        self.totals = Totals()
        self.metrics = Metrics(self.totals, self.requests, lambda: self._stats) \
            if settings.metrics_port is not None else None
        self.publisher: Publisher | None = None  # made with the consumer name, once claimed
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = asyncio.Event()
        self._fatal: BaseException | None = None
        self._stats: EngineStats | None = None  # the engine's latest, kept for the heartbeat
        self._scrapes: socket.socket | None = None  # the metrics port, bound at start

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
        self.engine.start()
        try:
            return await self._serve_with_engine(clock_offset_s)
        finally:
            await self._stop_engine()

    async def _serve_with_engine(self, clock_offset_s: float) -> int:
        """Once the engine thread runs: wait for the model, claim a name, serve."""
        try:
            info = await asyncio.to_thread(self.engine.wait_ready)
        except EngineFailed as e:
            log.critical("worker exiting: the model could not be loaded", error=str(e))
            return 1
        assert self._loop is not None
        self._install_signal_handlers(self._loop)
        tools = ToolFormat.of(info.tokenizer) if info.task == "generate" else None
        leases = Leases(self.settings, self.membership, self.requests, info.name, self.totals, self.blas,
                        (tools.start, tools.end) if tools else None, info.task, lambda: self._stats)
        try:
            consumer = await leases.claim_name()
        except NameTaken as e:
            log.critical("worker exiting: its consumer name is taken", error=str(e))
            await close_async(self.redis)
            return 2
        streams = RequestStreams(self.redis, self.keys, self.settings.queue, consumer,
                                 dedupe_ttl_s=self.settings.dedupe_ttl_s, lanes=self.settings.lanes,
                                 dead_letter_maxlen=self.settings.dead_letter_maxlen)
        fencing = Fencing(self.redis, self.keys, self.settings.queue, consumer, self.settings.result_ttl_s)
        publisher = self.publisher = Publisher(streams, fencing, self.requests, on_published=self._on_published)
        intake = self._intake(info, clock_offset_s, streams, fencing, publisher)
        await retrying(intake.reclaimer.list_own, "listing this consumer's pending requests")  # before the first read
        self._announce(info, consumer)
        return await self._serve(intake, leases, publisher)

    async def _stop_engine(self) -> None:
        """However the worker exits, not while the engine thread is still in MLX: its C++
        threads would be torn down under it ("terminate called", SIGABRT). After a drain
        it has ended already."""
        if self.engine.is_alive():
            self.engine.shutdown(0)
            await asyncio.to_thread(self.engine.join, ENGINE_EXIT_WAIT_S)

    def _listen_for_scrapes(self) -> socket.socket | None:
        """Bind the metrics port, if one is set; a busy port stops the start (`OSError`)."""
        if self.metrics is None or self.settings.metrics_port is None:
            return None
        return metrics.listen(self.settings.metrics_host, self.settings.metrics_port)

    async def _health(self) -> str | None:
        """None while the engine thread lives and Redis answers; else why not (`/healthz`)."""
        if not self.engine.is_alive():
            return "engine thread not running"
        try:
            await asyncio.wait_for(self.redis.ping(), timeout=2.0)
        except (RedisError, OSError, TimeoutError) as e:
            return f"redis: {describe(e)}"
        return None

    def _on_published(self, event: Event) -> None:
        """Count a written event; counting is upkeep: whatever fails in it must not stop publishing."""
        try:
            self.totals.observe(event)
            if self.metrics is not None:
                self.metrics.observe(event)
        except Exception as e:  # noqa: BLE001
            log.error("could not count a published event", request_id=event.id, error=repr(e))

    def _intake(self, info: ModelInfo, clock_offset_s: float, streams: RequestStreams, fencing: Fencing,
                publisher: Publisher) -> Intake:
        reclaimer = Reclaimer(streams, self.settings.reclaim_interval_s,
                              min_idle_ms=int(2000 * self.settings.heartbeat_s), totals=self.totals)
        return Intake(self.settings, streams, self.marks, fencing, self.requests, reclaimer,
                      Preparer(info, self.settings, self.faults, self.hosting.refusal) if info.task == "generate"
                      else PoolingPreparer(info, self.settings), self.engine, publisher.emit, clock_offset_s,
                      self.totals)

    async def _serve(self, intake: Intake, leases: Leases, publisher: Publisher) -> int:
        """Run the loops until a stop; then drain, hand back and close."""
        reading = asyncio.create_task(intake.run(self._stop), name="intake")
        others = [asyncio.create_task(publisher.run(), name="publisher"),
                  *([asyncio.create_task(metrics.serve(self.metrics, self._health, self._scrapes), name="metrics")]
                    if self.metrics is not None and self._scrapes is not None else []),
                  asyncio.create_task(listen_for_cancels(self.redis, self.marks, self.requests, self.engine,
                                                         self.settings.result_ttl_s), name="cancels"),
                  asyncio.create_task(leases.run(), name="leases"),
                  *([asyncio.create_task(self._watch_host(), name="host")] if self.hosting.host_pid else [])]
        for task in (reading, *others):
            task.add_done_callback(self._on_task_done)
        await self._stop.wait()
        stuck = await _cancel(reading)
        await leases.draining()
        status = await self._drain(publisher)
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

    # What the engine thread hands the loop, on the engine thread: a step's output, its
    # stats now and then, its death.

    def _on_output(self, out: StepOutput) -> None:
        assert self._loop is not None and self.publisher is not None  # the engine gets requests once both are
        self.publisher.hand_over(self._loop, out)

    def _on_stats(self, stats: EngineStats) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._update_stats, stats)

    def _on_fatal(self, error: BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._die, error)

    def _update_stats(self, stats: EngineStats) -> None:
        self._stats = stats  # the one copy: the heartbeat and the metrics read it

    def _announce(self, info: ModelInfo, consumer: str) -> None:
        if self.settings.completion_batch_size < self.settings.max_num_seqs:
            log.warning("completion_batch_size is below max_num_seqs: admitted requests beyond it wait inside "
                        "BatchGenerator", completion_batch_size=self.settings.completion_batch_size,
                        max_num_seqs=self.settings.max_num_seqs)
        log.info("worker ready", queue=self.keys.queue(self.settings.queue), consumer=consumer,
                 model=info.name, redis=redacted(self.redis_url), max_num_seqs=self.settings.max_num_seqs,
                 blas=self.blas)
        if self.blas == "reference":
            log.warning("MLX runs on the reference BLAS, which is slow: install the worker extra (mkl) or "
                        "`apt install libopenblas0-pthread`; see the README")

    async def _drain(self, publisher: Publisher) -> int:
        """Reading has stopped. Let running requests finish (cancels still apply) and publish
        what they produce, until the drain timeout."""
        if self._fatal is not None:
            log.critical("worker exiting on a fatal error", error=repr(self._fatal), held=len(self.requests))
            return 1
        log.info("draining", held=len(self.requests), drain_timeout_s=self.settings.drain_timeout_s)
        self.engine.shutdown(self.settings.drain_timeout_s)
        while not self.engine.join(timeout=0):  # no executor thread: the loop stays free to publish
            await asyncio.sleep(0.02)
        publisher.take_handed()
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
