"""The worker daemon's event loop: reads requests, feeds the engine, publishes its output.

    Redis ──XREADGROUP──> intake ──Submit──> engine thread ──StepOutput──> publisher ──pipeline──> Redis

The event loop owns every Redis connection; the engine thread owns MLX.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from client._keys import Keys
from client._protocol import Delta, Done, Envelope, Error, InvalidRequest, Undeliverable, read_envelope
from client._replies import StreamEntry

from .engine import Engine, EngineFailed, Loaded, ModelInfo
from .intake import Intake
from .messages import Outgoing, Route, StepOutput
from .output import deadline_exceeded, not_started
from .settings import WorkerSettings
from .streams import QueueStreams, retrying

log = structlog.get_logger("mlxq.worker")


def entry_ms(entry_id: str) -> int:
    """The server's clock, in ms, when the entry was added (the first part of its id)."""
    return int(entry_id.split("-", 1)[0])


class Worker:
    """One worker: a consumer in the queue's group, with one engine."""

    def __init__(self, settings: WorkerSettings, redis_url: str, load: Callable[[], Loaded]) -> None:
        self.settings = settings
        self.redis_url = redis_url
        self.keys = Keys(settings.prefix)
        self.consumer = settings.consumer or socket.gethostname()
        self.in_flight: dict[str, Route] = {}
        self._cancel_requested: set[str] = set()  # in flight, cancel seen (maybe before the engine had it)
        self._outputs: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._room = asyncio.Event()
        self._stop = asyncio.Event()
        self._fatal: BaseException | None = None
        self._load = load
        self.capacity = settings.max_num_seqs + settings.prefetch

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
        self._announce(info)
        intake = asyncio.create_task(self._intake_loop(), name="intake")
        others = [asyncio.create_task(self._publish_loop(), name="publisher"),
                  asyncio.create_task(self._cancel_loop(), name="cancels"),
                  asyncio.create_task(self._heartbeat_loop(info), name="heartbeat")]
        for task in (intake, *others):
            task.add_done_callback(self._on_task_done)
        await self._stop.wait()
        await _cancel(intake)
        status = await self._shut_down()
        await _cancel(*others)
        await self.redis.aclose()
        return status

    def _announce(self, info: ModelInfo) -> None:
        if self.settings.completion_batch_size < self.settings.max_num_seqs:
            log.warning("completion_batch_size is below max_num_seqs: admitted requests beyond it wait inside "
                        "BatchGenerator", completion_batch_size=self.settings.completion_batch_size,
                        max_num_seqs=self.settings.max_num_seqs)
        log.info("worker ready", queue=self.streams.stream, consumer=self.consumer, model=info.name,
                 redis=self.redis_url, max_num_seqs=self.settings.max_num_seqs)

    async def _connect(self) -> None:
        self.redis = aioredis.Redis.from_url(self.redis_url, socket_timeout=10, health_check_interval=30)
        self.streams = QueueStreams(self.redis, self.keys, self.settings.queue, self.consumer,
                                    result_ttl_s=self.settings.result_ttl_s, dedupe_ttl_s=self.settings.dedupe_ttl_s)
        await retrying(self.streams.ensure_group, f"connecting to {self.redis_url}")
        self.clock_offset_s = await retrying(self.streams.clock_offset_s, "reading the server clock")

    async def _start_engine(self, loop: asyncio.AbstractEventLoop) -> ModelInfo:
        """Start the engine thread; it loads the model. Its output comes back through the loop."""
        def on_output(out: StepOutput) -> None:
            loop.call_soon_threadsafe(self._outputs.put_nowait, out)

        def on_fatal(error: BaseException) -> None:
            loop.call_soon_threadsafe(self._die, error)

        self.engine = Engine(self._load, self.settings.max_num_seqs, on_output=on_output, on_fatal=on_fatal)
        self.engine.start()
        info = await asyncio.to_thread(self.engine.wait_ready)
        self.intake = Intake(info, self.settings)
        return info

    async def _shut_down(self) -> int:
        """Reading has stopped. Let running requests finish (cancels still apply) and publish
        what they produce; what is left stays pending in the group for another worker."""
        if self._fatal is not None:
            log.critical("worker exiting on a fatal error; in-flight requests stay pending for another worker",
                         error=repr(self._fatal), in_flight=len(self.in_flight))
            return 1
        log.info("draining", running=len(self.in_flight), drain_timeout_s=self.settings.drain_timeout_s)
        self.engine.shutdown(self.settings.drain_timeout_s)
        await asyncio.to_thread(self.engine.join)
        await self._outputs.join()
        try:
            await self.redis.delete(self.keys.worker(self.consumer))
        except (RedisError, OSError) as e:
            log.warning("could not remove the heartbeat", error=repr(e))
        log.info("worker stopped", left_pending=len(self.in_flight))
        return 0

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        """Each loop runs until cancelled; one that ends on its own is a bug: exit loudly."""
        if task.cancelled():
            return
        error = task.exception() or RuntimeError(f"task {task.get_name()} ended")
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
        while True:
            room = self.capacity - len(self.in_flight)
            if room <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            entries = await retrying(partial(self.streams.read, room, self.settings.block_ms), "reading requests")
            try:
                await self._accept(entries)
            except Exception:  # noqa: BLE001 - the intake keeps going; what it held stays pending in Redis
                log.exception("accepting requests failed")
                await asyncio.sleep(1.0)

    async def _accept(self, entries: list[StreamEntry]) -> None:
        """Register new entries, drop repeats, and start the rest."""
        accepted = [a for a in [await self._register(entry_id, fields) for entry_id, fields in entries] if a]
        ids = [route.id for _, route in accepted]
        done, cancelled = await retrying(partial(self.streams.flags, ids), "checking done and cancel flags")
        for envelope, route in accepted:
            if route.id in done:
                log.info("repeat of a finished request ignored", request_id=route.id, entry_id=route.entry_id)
                self._forget(route.id)
                await retrying(partial(self.streams.ack, [route.entry_id]), "acknowledging a repeat")
                continue
            try:
                await self._start(envelope, route, cancelled=route.id in cancelled)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the others
                log.exception("could not start a request", request_id=route.id)
                self._emit(Outgoing(route, Error(id=route.id, code="internal",
                                                 message=f"the worker could not start this request: {e!r}")))

    async def _register(self, entry_id: str, fields: dict[Any, Any] | None) -> tuple[Envelope, Route] | None:
        """The envelope and route of a new entry, now in flight; None if there is nothing to run."""
        if fields is None:  # deleted from the stream before we read it
            await retrying(partial(self.streams.ack, [entry_id]), "acknowledging a deleted entry")
            return None
        try:
            envelope = read_envelope(fields)
        except Undeliverable as e:
            reason = str(e)
            log.warning("dead letter", entry_id=entry_id, reason=reason)
            await retrying(partial(self.streams.dead_letter, entry_id, fields, reason), "dead-lettering")
            return None
        if envelope.id in self.in_flight:
            log.info("repeat of a running request ignored", request_id=envelope.id, entry_id=entry_id)
            await retrying(partial(self.streams.ack, [entry_id]), "acknowledging a repeat")
            return None
        reply_to = envelope.reply_to
        if reply_to is None or self.keys.reply_to_problem(reply_to):  # the error goes to the default stream
            reply_to = self.keys.output(envelope.id)
        route = Route(envelope.id, entry_id, reply_to, envelope.encoding)
        self.in_flight[envelope.id] = route  # before the flag check, so no cancel slips between
        return envelope, route

    async def _start(self, envelope: Envelope, route: Route, cancelled: bool) -> None:
        arrived_at = min(time.time(), entry_ms(route.entry_id) / 1000.0 - self.clock_offset_s)
        try:
            request = await asyncio.to_thread(self.intake.prepare, envelope, route, arrived_at, self.clock_offset_s)
        except InvalidRequest as e:
            self._emit(Outgoing(route, Error(id=route.id, code=e.code, message=str(e))))
            return
        if cancelled or route.id in self._cancel_requested:
            self._emit(not_started(request, time.time()))
        elif request.deadline_at is not None and time.time() > request.deadline_at:
            self._emit(deadline_exceeded(request))
        else:
            self.engine.submit(request)

    def _emit(self, outgoing: Outgoing) -> None:
        self._outputs.put_nowait(StepOutput(outgoing=[outgoing]))

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
            except (RedisError, OSError) as e:
                log.warning("cancel subscription lost; resubscribing", error=repr(e))
                await asyncio.sleep(1.0)
            finally:
                await pubsub.aclose()

    # ---- publishing --------------------------------------------------------------

    async def _publish_loop(self) -> None:
        while True:
            outputs = [await self._outputs.get()]
            while not self._outputs.empty():
                outputs.append(self._outputs.get_nowait())
            outgoing = [item for out in outputs for item in out.outgoing]
            if outgoing:
                await asyncio.shield(retrying(partial(self.streams.publish, outgoing), "publishing"))
            for item in outgoing:
                if not isinstance(item.event, Delta):
                    self._forget(item.route.id)
                    _log_finished(item)
            for out in outputs:
                for route in out.abandoned:
                    self._forget(route.id)
                self._outputs.task_done()

    def _forget(self, request_id: str) -> None:
        self.in_flight.pop(request_id, None)
        self._cancel_requested.discard(request_id)
        self._room.set()

    # ---- heartbeat ---------------------------------------------------------------

    async def _heartbeat_loop(self, info: ModelInfo) -> None:
        started = time.time()
        while True:
            state = {"consumer": self.consumer, "queue": self.settings.queue, "model": info.name,
                     "host": socket.gethostname(), "pid": os.getpid(), "started_at": started,
                     "in_flight": len(self.in_flight), "max_num_seqs": self.settings.max_num_seqs}
            try:
                await self.streams.heartbeat(self.consumer, state, ttl_s=3 * self.settings.heartbeat_s)
            except (RedisError, OSError) as e:
                log.warning("heartbeat failed", error=repr(e))
            await asyncio.sleep(self.settings.heartbeat_s)


async def _cancel(*tasks: asyncio.Task[None]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _log_finished(item: Outgoing) -> None:
    event = item.event
    if isinstance(event, Error):
        log.info("request failed", request_id=event.id, code=event.code, message=event.message)
        return
    assert isinstance(event, Done)
    log.info("request finished", request_id=event.id, finish_reason=event.finish_reason,
             prompt_tokens=event.usage["prompt_tokens"], completion_tokens=event.usage["completion_tokens"],
             ttft_ms=event.timing["ttft_ms"], total_ms=event.timing["total_ms"], tok_s=event.decode_tok_s)
