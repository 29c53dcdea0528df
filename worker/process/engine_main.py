"""The engine process: loads the model, prepares requests, runs the engine thread, and
talks to its I/O process over the socket it was started with.

    I/O process ──Prepare, Cancel, Abandon, Shutdown, Ping──> main thread (this loop)
                                                               ├─ preparing threads
                                                               └─ Engine (its thread: MLX)
                <──Step, Admitted/Answered/Refused, stats, Pong, Stopped──┘

It never touches Redis. It ends when its I/O process is gone (the socket's end), so it
never outlives it; a fatal engine error ends it non-zero, which the I/O process counts
as a crash of the requests it held. SIGINT and SIGTERM do nothing to it: a terminal's Ctrl-C
reaches the whole process group, and the drain it asks for is the I/O process's to run.

    python -m worker.process.engine_main     (started by `worker.process.engine_link`)
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

import structlog

from client.protocol import ErrorCode, RequestRejected
from common import logs
from worker.engine.backends import load_model
from worker.engine.scheduler import SchedulingPolicy
from worker.engine.thread import Engine, EngineFailed
from worker.faults import Faults
from worker.media.isolated import DecoderDied
from worker.messages import (
    Abandon,
    Admitted,
    Answered,
    Cancel,
    DecoderCrashed,
    EngineReady,
    EngineRequest,
    LoadFailed,
    Ping,
    Pong,
    PoolingRequest,
    Preparation,
    Prepare,
    Refused,
    SetAdapters,
    Shutdown,
    Started,
    Step,
    StepOutput,
    Stopped,
    ToolFormat,
    not_started,
)
from worker.prepare.generation import Preparer
from worker.prepare.pooling import PoolingPreparer
from worker.process.channel import BlockingChannel
from worker.process.engine_link import SOCKET_FD
from worker.process.group import load_leader
from worker.settings import Hosting, WorkerSettings

log = structlog.get_logger("mlxq.engine")

PREPARING_THREADS = 2  # tokenizing, templating and media decoding off the engine thread
FATAL_STATUS = 3  # the engine thread failed: every request it held is a crash's


class EngineProcess:
    """Dispatches the I/O process's messages: preparation to its threads, the rest to the engine."""

    def __init__(self, channel: BlockingChannel, settings: WorkerSettings, hosting: Hosting) -> None:
        self.channel = channel
        self.settings = settings
        self.faults = Faults.from_environment()
        load = partial(load_leader, settings) if settings.distributed \
            else partial(load_model, settings, refusing=hosting.refusal is not None)
        self.engine = Engine(load,
                             SchedulingPolicy.of(settings), on_output=self._on_output, on_fatal=self._on_fatal,
                             on_stats=channel.send, on_pong=lambda: channel.send(Pong()), faults=self.faults,
                             on_start=lambda request_ids: channel.send(Started(request_ids)),
                             preparing=lambda: self._numbered - self._outcomes.carried_out)
        self.hosting = hosting
        self._preparing = ThreadPoolExecutor(PREPARING_THREADS, thread_name_prefix="mlxq-prepare")
        # Requests being prepared, and those of them cancelled or dropped meanwhile (under
        # the lock: the main thread marks them, a preparing thread reads the marks).
        self._lock = threading.Lock()
        self._in_preparation: dict[str, str] = {}  # id -> "" | "cancelled" | "abandoned"
        # Preparations end in any order; what they lead to (queued, answered) goes out in
        # the order the requests came, so that the engine serves them first come first
        # served: each Prepare's number, and the outcomes waiting for an earlier one. A
        # request with media is not numbered: its decoding may take seconds, and the
        # requests read after it must not wait for that. It is queued when it is ready,
        # in its place by arrival (`Scheduler.rank`).
        self._numbered = 0
        self._outcomes = InOrder()
        self._drain = threading.Thread(target=self._await_drain, name="mlxq-drain", daemon=True)
        self._drained = threading.Event()

    def run(self) -> int:
        """Load, then serve the I/O process's messages until it is gone or the drain ends."""
        self.engine.start()
        try:
            info = self.engine.wait_ready()
        except EngineFailed as e:
            self.channel.send(LoadFailed(str(e)))
            return 1
        preparer = Preparer(info, self.settings, self.faults, self.hosting.refusal) if info.task == "generate" \
            else PoolingPreparer(info, self.settings)
        tools = ToolFormat.of(info.tokenizer) if info.task == "generate" else None
        self.channel.send(EngineReady(info.name, info.task, (tools.start, tools.end) if tools else None))
        while (message := self.channel.receive()) is not None:
            if isinstance(message, Prepare):
                with self._lock:
                    self._in_preparation[message.ref.id] = ""
                self._preparing.submit(self._prepare, preparer, message, self._number(message))
            elif isinstance(message, Ping):
                self.engine.ping()
            else:
                self._command(message)
                if isinstance(message, Shutdown) and not self._drain.is_alive():
                    self._drain.start()
        if self._drained.is_set():  # the I/O process closed its end after `Stopped`
            return 0
        # The I/O process is gone, and with it every reader of what this one would make. At
        # once, without finalizing: the engine thread may be inside MLX, whose C++ threads
        # torn down under it abort the process ("terminate called").
        os._exit(0)

    def _command(self, message: Cancel | Abandon | Shutdown | SetAdapters) -> None:
        if isinstance(message, (Cancel, Abandon)):
            with self._lock:
                if message.request_id in self._in_preparation:
                    self._in_preparation[message.request_id] = \
                        "cancelled" if isinstance(message, Cancel) else "abandoned"
        self.engine.post(message)

    def _await_drain(self) -> None:
        """On a thread of its own, so that the main thread still notices its I/O process
        gone: once the drain is over, say `Stopped` (the I/O process then closes its end)."""
        self.engine.join()
        self._preparing.shutdown(wait=True, cancel_futures=True)
        self._drained.set()
        self.channel.send(Stopped())

    def _number(self, message: Prepare) -> int | None:
        """The request's place among those whose outcomes go out in order; None for one
        with media (see `__init__`)."""
        if message.envelope.names_media:
            return None
        self._numbered += 1
        return self._numbered - 1

    def _prepare(self, preparer: Preparer | PoolingPreparer, message: Prepare, number: int | None) -> None:
        """On a preparing thread: prepare one request; queue it, or say how it went, once
        every numbered request received before it has been (`_in_order`)."""
        self._in_order(number, self._prepared(preparer, message))

    def _prepared(self, preparer: Preparer | PoolingPreparer, message: Prepare) -> Callable[[], None]:
        """Prepare one request; what to do with the outcome (under the lock)."""
        ref = message.ref
        try:
            request = preparer.prepare(message.envelope, ref, message.arrived_at, message.clock_offset_s,
                                       message.resume)
        except RequestRejected as e:
            return partial(self._answer, ref.id, Refused(ref, e.code, str(e)))
        except DecoderDied as e:
            return partial(self._answer, ref.id, DecoderCrashed(ref, str(e)))
        except Exception as e:  # noqa: BLE001 - a preparer's bug costs its request alone, never a silent hang
            reason = ascii(f"{type(e).__name__}: {e}"[:300])
            log.error("could not prepare a request", request_id=ref.id, error=reason, exc_info=e)
            return partial(self._answer, ref.id, Refused(ref, ErrorCode.INTERNAL,
                                                         f"the worker could not prepare this request: {reason}"))
        if message.priority_boost or message.alone:
            request = replace(request, queueing=replace(request.queueing, alone=message.alone,
                                                        priority=request.queueing.priority + message.priority_boost))
        return partial(self._queue, request, message.cancelled)

    def _in_order(self, number: int | None, outcome: Callable[[], None]) -> None:
        with self._lock:
            if number is None:
                outcome()
            else:
                self._outcomes.done(number, outcome)

    def _queue(self, request: EngineRequest | PoolingRequest, cancelled: bool) -> None:
        """(Under the lock.)"""
        now = time.time()
        mark = self._in_preparation.pop(request.id, "")
        if mark == "abandoned":
            return
        if cancelled or mark == "cancelled":  # flagged before it was read, or while prepared: never computed
            self.channel.send(Answered(request.ref, not_started(request, now), now))
        elif isinstance(request, EngineRequest) and request.counted_only:  # its prompt counted: the answer
            self.channel.send(Answered(request.ref, not_started(request, now, "length"), now))
        else:  # sent before the engine has it, so that its first events come after
            self.channel.send(Admitted(request.ref, now))
            self.engine.submit(request)

    def _answer(self, request_id: str, answer: Preparation) -> None:
        """(Under the lock.)"""
        if self._in_preparation.pop(request_id, "") != "abandoned":
            self.channel.send(answer)

    def _on_output(self, out: StepOutput) -> None:
        self.channel.send(Step(out.outgoing, out.abandoned, out.first_tokens))

    def _on_fatal(self, error: BaseException) -> None:
        """The engine thread failed: every request it held dies with this process."""
        sys.stderr.flush()
        os._exit(FATAL_STATUS)


class InOrder:
    """Carries out numbered outcomes (0, 1, 2, ...) in number order, each as soon as every
    earlier one has been."""

    def __init__(self) -> None:
        self.carried_out = 0  # and so the next number to carry out
        self._waiting: dict[int, Callable[[], None]] = {}

    def done(self, number: int, outcome: Callable[[], None]) -> None:
        self._waiting[number] = outcome
        while (ready := self._waiting.pop(self.carried_out, None)) is not None:
            self.carried_out += 1  # first: the engine must not count a request it has as on its way
            ready()


def main() -> int:
    # Handled, not ignored (SIG_IGN): an ignored signal stays ignored across exec, in the
    # media decoders this process starts, and SIGTERM is how they are stopped at exit.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _signum, _frame: None)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    channel = BlockingChannel(socket.socket(fileno=int(os.environ.pop(SOCKET_FD))))
    settings = channel.receive()
    if not isinstance(settings, WorkerSettings):
        return 2
    logs.configure(settings.log_format, settings.log_level)
    return EngineProcess(channel, settings, Hosting.from_environment()).run()


if __name__ == "__main__":
    sys.exit(main())

