"""The I/O process's side of its engine process: starts it, hands it work, delivers what
it makes, and notices when it dies or hangs.

The engine process is a child that shares nothing with this one but a socket pair
(`channel`). Its death, whatever the cause (a crash, an out-of-memory kill, a hang
this link ended), is reported by `serve` returning; the worker then counts it against
the requests the engine held and starts a new one (`worker.daemon`). This module, like
the whole I/O process, imports no MLX.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import structlog

from client.engine_stats import EngineStats
from client.protocol import Delta
from worker.messages import (
    Abandon,
    Admitted,
    Cancel,
    EngineReady,
    EngineStopped,
    LoadFailed,
    Ping,
    Pong,
    Preparation,
    Prepare,
    SetAdapters,
    Shutdown,
    Started,
    Step,
    Stopped,
)
from worker.process.channel import AsyncChannel
from worker.settings import AdapterEntry, WorkerSettings

log = structlog.get_logger("mlxq.worker")

SOCKET_FD = "MLXQ_ENGINE_FD"  # where the engine process finds its end of the socket pair
EXIT_WAIT_S = 10.0  # after its socket closed, how long an engine process may take to exit before it is killed


class EngineFailed(RuntimeError):
    """The engine process could not load its model, or died before it had."""


class EngineLink:
    """One engine process at a time: started by `start`, served by `serve` until it ends."""

    def __init__(self, settings: WorkerSettings, on_step: Callable[[Step], None],
                 on_stats: Callable[[EngineStats], None]) -> None:
        self.settings = settings
        self.on_step = on_step
        self.on_stats = on_stats
        self.ready = asyncio.Event()  # set while a live engine process takes work
        self.process: subprocess.Popen[bytes] | None = None
        self._channel: AsyncChannel | None = None
        self._preparing: dict[str, asyncio.Future[Preparation]] = {}
        # The requests this engine process holds (`Admitted` and not ended); of them, those
        # in its batch (`Started`), and of those, the ones past their prefill: what it dies
        # with, and what its death is blamed on (`blame`).
        self.holding: set[str] = set()
        self.batched: set[str] = set()
        self.decoding: set[str] = set()
        self.prepared_when_it_died: set[str] = set()
        self._heard_at = time.monotonic()
        self._stopped = False  # it said `Stopped`: it ended after a drain, as asked
        self.adapters: tuple[tuple[str, str], ...] | None = None  # as last set; None: the settings'

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    async def start(self) -> EngineReady:
        """Start an engine process and wait until its model is loaded; raises `EngineFailed`."""
        ours, theirs = socket.socketpair()
        self._stopped = False
        for held in (self.holding, self.batched, self.decoding):
            held.clear()
        self.process = subprocess.Popen([sys.executable, "-m", "worker.process.engine_main"],
                                        env={**os.environ, SOCKET_FD: str(theirs.fileno())},
                                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()  # the child's copy is the only one: its death closes the pair
        self._channel = await AsyncChannel.over(ours)
        # As a `WorkerSettings` of its own: the loaded one's class is made per config file.
        # A new engine process after a death loads the adapters served by then.
        adapters = {} if self.adapters is None else \
            {"adapters": [AdapterEntry(name=name, path=path) for name, path in self.adapters]}
        self._channel.send(WorkerSettings.model_construct(**(dict(self.settings) | adapters)))
        first = await self._channel.receive()
        while isinstance(first, EngineStats):  # its figures as it loads
            self.on_stats(first)
            first = await self._channel.receive()
        if isinstance(first, EngineReady):
            self._heard_at = time.monotonic()
            self.ready.set()
            log.info("engine process ready", engine_pid=self.process.pid, model=first.name)
            return first
        status = await self._reap()
        raise EngineFailed(first.reason if isinstance(first, LoadFailed)
                           else f"the engine process exited with status {status} while it loaded the model")

    async def serve(self) -> str:
        """Deliver the engine process's messages until it ends; then say why it did
        ("" after a drain it was asked for)."""
        assert self._channel is not None
        while (message := await self._channel.receive()) is not None:
            self._heard_at = time.monotonic()
            if isinstance(message, Step):
                self._track(message)
                self.on_step(message)
            elif isinstance(message, Started):
                self.batched.update(message.request_ids)
            elif isinstance(message, EngineStats):
                self.on_stats(message)
            elif isinstance(message, Stopped):  # the drain is over: closing our end lets it exit
                self._stopped = True
                break
            elif not isinstance(message, Pong):
                self._prepared(message)
        self.ready.clear()
        self._channel.close()
        status = await self._reap()
        reason = "" if self._stopped else _why(status)
        self.prepared_when_it_died = set(self._preparing)
        for future in self._preparing.values():
            if not future.done():
                future.set_exception(EngineStopped(reason))
        self._preparing.clear()
        return reason

    def _track(self, step: Step) -> None:
        self.decoding.update(step.first_tokens)
        for item in step.outgoing:
            if not isinstance(item.event, Delta):
                self._forget(item.ref.id)

    def _forget(self, request_id: str) -> None:
        for held in (self.holding, self.batched, self.decoding):
            held.discard(request_id)

    def _prepared(self, answer: Preparation) -> None:
        if isinstance(answer, Admitted):
            self.holding.add(answer.ref.id)
        future = self._preparing.pop(answer.ref.id, None)
        if future is not None and not future.done():
            future.set_result(answer)

    async def prepare(self, message: Prepare, sent: Callable[[], None] = lambda: None) -> Preparation:
        """Have the engine process prepare a request (and queue it there, if it is to be
        computed, after those sent before it); raises `EngineStopped` if the process ends
        first. While a new engine process loads, it waits for it."""
        await self.ready.wait()
        assert self._channel is not None
        future = asyncio.get_running_loop().create_future()
        self._channel.send(message)  # first: a message that cannot be sent leaves nothing waiting
        self._preparing[message.ref.id] = future
        sent()
        return await future

    def cancel(self, request_id: str) -> None:
        self._send(Cancel(request_id))

    def abandon(self, request_id: str) -> None:
        self._forget(request_id)
        self._send(Abandon(request_id))

    def shutdown(self, drain_timeout_s: float) -> None:
        """Drop what waits, let what runs finish for `drain_timeout_s`, then end (`serve` returns "")."""
        self._send(Shutdown(time.monotonic() + drain_timeout_s))

    def set_adapters(self, adapters: tuple[tuple[str, str], ...]) -> None:
        """Serve exactly these LoRA adapters (name, path), in this engine process and in any
        started after it."""
        self.adapters = adapters
        self._send(SetAdapters(adapters))

    def kill(self) -> None:
        """SIGKILL the engine process (`serve` then reports its death)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    async def watch(self, busy: Callable[[], bool]) -> None:
        """Kill an engine process that takes no step for `engine_stall_s` while it has
        work: `serve` then reports its death. Asks it for a `Pong` once it is quiet for
        half that, so that a slow but live engine (a long prefill) is not taken for hung."""
        stall_s = self.settings.group_stall_s if self.settings.distributed else self.settings.engine_stall_s
        while True:
            await asyncio.sleep(stall_s / 4)
            if not self.ready.is_set() or not busy():
                self._heard_at = time.monotonic()
                continue
            quiet_s = time.monotonic() - self._heard_at
            if quiet_s > stall_s and self.process is not None:
                log.error("engine process took no step for engine_stall_s; killing it", engine_pid=self.process.pid,
                          engine_stall_s=stall_s)
                self.process.kill()
                self._heard_at = time.monotonic()
            elif quiet_s > stall_s / 2:
                self._send(Ping())

    async def stop(self) -> None:
        """However the worker exits: the engine process goes with it, never left behind."""
        if self.process is None or self.process.poll() is not None:
            return
        self._send(Shutdown(0.0))
        try:
            await asyncio.wait_for(asyncio.to_thread(self.process.wait), EXIT_WAIT_S)
        except TimeoutError:
            self.process.kill()
            await asyncio.to_thread(self.process.wait)

    def _send(self, message: object) -> None:
        if self.ready.is_set() and self._channel is not None:
            self._channel.send(message)

    async def _reap(self) -> int:
        """Wait for the process to exit (killing it if it lingers); its status."""
        assert self.process is not None
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.process.wait), EXIT_WAIT_S)
        except TimeoutError:
            self.process.kill()
            return await asyncio.to_thread(self.process.wait)


def blame(lost: list[str], batched: set[str], decoding: set[str]) -> set[str]:
    """Of the requests a dead engine process held (`lost`), those that count a crash
    (`max_crashes`): what it was computing. Those still in their prefill, if any (the
    usual place of a crash a request causes: its prompt, its media, its memory); else, it
    died in a decode step, the whole batch (no row can be told from another there). Those
    waiting in it count nothing. Each one counted then runs alone (`Queueing.alone`), so
    a poison request's next death is its own, and its batch-mates, counted once, finish."""
    in_batch = {request_id for request_id in lost if request_id in batched}
    return (in_batch - decoding) or in_batch or set(lost)


def _why(status: int) -> str:
    if status < 0:
        return f"the engine process was killed by {signal.Signals(-status).name}"
    return f"the engine process exited with status {status}"
