"""The engine thread: owns MLX, the model and its `EngineCore`, in the engine process.

Other threads only hand it commands through a queue; it applies them between steps,
runs the core's steps while there is work, blocks when idle, and hands out one
`StepOutput` per step (the engine process sends it to the I/O process). It never touches
Redis. A step's failure stays in the core (its requests fail, the batch is rebuilt);
anything else is fatal to the engine process.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import mlx.core as mx
import structlog

from client.engine_stats import CacheStats, EngineStats, EngineTime
from common.prefix_chain import DIGEST_HASHES
from worker.engine.backends import Loaded, ModelInfo
from worker.engine.cores import Core, make_core
from worker.engine.cpu_scheduling import use_batch_scheduling
from worker.engine.scheduler import SchedulingPolicy
from worker.faults import NONE, SLOW_STEP_S, Faults
from worker.messages import (
    Abandon,
    Cancel,
    Command,
    EngineRequest,
    Ping,
    PoolingRequest,
    SetAdapters,
    Shutdown,
    StepOutput,
    Submit,
)

log = structlog.get_logger("mlxq.engine")

HOUSEKEEPING_S = 5.0  # under steady load, how often cached buffers are released and stats refreshed


class EngineFailed(RuntimeError):
    """The model could not be loaded."""


class Engine:
    """Runs `load` and then the step loop on its own thread."""

    def __init__(self, load: Callable[[], Loaded], policy: SchedulingPolicy,
                 on_output: Callable[[StepOutput], None], on_fatal: Callable[[BaseException], None],
                 on_stats: Callable[[EngineStats], None] = lambda _: None, on_pong: Callable[[], None] = lambda: None,
                 faults: Faults = NONE, on_start: Callable[[list[str]], None] = lambda _: None,
                 preparing: Callable[[], int] = lambda: 0) -> None:
        self._load = load
        self._policy = policy
        self._on_output = on_output
        self._on_fatal = on_fatal
        self._on_stats = on_stats
        self._on_pong = on_pong
        self._on_start = on_start
        self._preparing = preparing
        self._faults = faults
        self._commands: queue.Queue[Command] = queue.Queue()
        self._thread = threading.Thread(target=self._main, name="mlxq-engine", daemon=True)
        self._ready = threading.Event()
        self._info: ModelInfo | None = None
        self._error: BaseException | None = None
        # Engine-thread state from here on.
        self._core: Core  # made once the model is loaded
        self._drain_until: float | None = None
        self._next_housekeeping = 0.0
        self._time = EngineTime()
        self._digest: tuple[int, ...] = ()  # the prefix cache's, made anew when it changed
        self._digested = 0
        # Chosen once: the tests' step faults, or nothing (the loop checks no fault per step).
        self._before_step: Callable[[StepOutput], None] = self._inject_faults if faults.in_steps else lambda _: None

    # ---- called from other threads -------------------------------------------------

    def start(self) -> None:
        """Start the thread; it loads the model first."""
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> ModelInfo:
        """Block until the model is loaded; raises `EngineFailed` if loading failed."""
        if not self._ready.wait(timeout):
            raise EngineFailed(f"model not loaded after {timeout} s")
        if self._info is None:
            raise EngineFailed(f"model failed to load: {self._error}") from self._error
        return self._info

    def submit(self, request: EngineRequest | PoolingRequest) -> None:
        self._commands.put(Submit(request))

    def cancel(self, request_id: str) -> None:
        self._commands.put(Cancel(request_id))

    def abandon(self, request_id: str) -> None:
        """Drop a request without output: another worker owns it now."""
        self._commands.put(Abandon(request_id))

    def post(self, command: Command) -> None:
        """Any command, applied at the next step boundary."""
        self._commands.put(command)

    def ping(self) -> None:
        """Have `on_pong` called from between two steps: the step loop is not stuck."""
        self._commands.put(Ping())

    def shutdown(self, drain_timeout_s: float) -> None:
        """Drop waiting requests, let running ones finish for `drain_timeout_s`, then stop."""
        self._commands.put(Shutdown(time.monotonic() + drain_timeout_s))

    def is_alive(self) -> bool:
        """Whether the engine thread runs (loading, idle or stepping)."""
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- the engine thread ---------------------------------------------------------

    def _main(self) -> None:
        use_batch_scheduling()  # before loading: MLX's stream threads, started then, inherit it
        try:
            self._run()
        finally:
            # MLX's per-thread streams are otherwise freed by this thread's C++ TLS
            # destructors, which take the GIL: if the main thread is finalizing by then
            # (it joined us and exited), the process aborts ("terminate called without an
            # active exception"). mlx's own advice, and what mlx-vlm's server threads do.
            mx.clear_streams()

    def _run(self) -> None:
        try:
            loaded = self._load()
            core = make_core(loaded, self._policy, self._time, self._faults, self._on_start, self._preparing)
        except BaseException as e:  # noqa: BLE001 - reported to the waiting thread
            self._error = e
            self._ready.set()
            return
        self._info, self._loaded, self._core = loaded.info, loaded, core
        self._housekeeping()
        self._ready.set()
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - engine death is loud and distinct
            log.critical("engine failed", error=repr(e), exc_info=True)
            self._on_fatal(e)
        finally:
            self._core.close()

    def _loop(self) -> None:
        core = self._core
        while True:
            out = StepOutput()
            waited = time.perf_counter()
            self._apply_commands(out, timeout=core.idle_s() if core.busy() else None)
            started = time.perf_counter()
            self._time.idle_s += started - waited
            model_before, handoff_before = self._time.model_s, self._time.handoff_s
            if self._drain_until is not None and time.monotonic() >= self._drain_until:
                out.abandoned.extend(core.abandon_running())  # past the drain deadline: left un-acked
            if core.busy():
                self._before_step(out)
                core.step(out)
            if out.outgoing or out.abandoned or out.first_tokens:
                self._hand_off(out)
            spent = time.perf_counter() - started
            self._time.other_s += spent - (self._time.model_s - model_before) - (self._time.handoff_s - handoff_before)
            if not core.busy() or time.monotonic() >= self._next_housekeeping:
                self._housekeeping()
            if self._drain_until is not None and not core.busy():
                return

    def _hand_off(self, out: StepOutput) -> None:
        """Give the step's events away (the engine process sends them to the I/O process),
        timed apart, while the model computes the step already launched."""
        started = time.perf_counter()
        self._on_output(out)
        self._time.handoff_s += time.perf_counter() - started

    def _housekeeping(self) -> None:
        """Release the framework's cached buffers (when idle, and now and then under load)
        and hand the event loop fresh stats."""
        self._loaded.release_memory()
        cache = self._loaded.prefix_cache
        caches: dict[str, CacheStats | None] = {"prefix_cache": None if cache is None else cache.stats()}
        if cache is not None and cache.changes != self._digested:
            self._digest, self._digested = cache.digest(DIGEST_HASHES), cache.changes
        caches.update(self._loaded.cache_stats())
        counts = self._core.stats()
        self._on_stats(EngineStats(counts.running, counts.waiting, self._loaded.memory(), caches["prefix_cache"],
                                   caches.get("vision_cache"), caches.get("ssd_cache"),
                                   None if self._loaded.speculation is None else self._loaded.speculation(),
                                   counts.mask_fills, counts.mask_fill_ms, replace(self._time),
                                   None if self._loaded.adapters is None else self._loaded.adapters.listing(),
                                   self._digest))
        self._next_housekeeping = time.monotonic() + HOUSEKEEPING_S

    def _set_adapters(self, command: SetAdapters) -> None:
        """Serve the adapters the I/O process asks for (refusals are logged and listed in
        the heartbeat), then say so at once."""
        bank = self._loaded.adapters
        if bank is None:
            log.warning("this model serves no adapters; ignored", adapters=[name for name, _ in command.adapters])
            return
        bank.serve(dict(command.adapters))
        self._housekeeping()

    def _apply_commands(self, out: StepOutput, timeout: float | None) -> None:
        """Apply the commands queued, first waiting up to `timeout` (None: until one comes)."""
        try:
            command = self._commands.get(timeout=timeout) if timeout is None or timeout > 0 \
                else self._commands.get_nowait()
            while True:
                self._apply(command, out)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _inject_faults(self, out: StepOutput) -> None:
        if self._faults.exit_decoding_token is not None:
            self._faults.exit_if_decoding(self._core.rows())
        self._hold_if_slowed(out)

    def _hold_if_slowed(self, out: StepOutput) -> None:
        """Fault injection (`MLXQ_TEST_SLOW_ON_TOKEN`): while a marked request runs, wait
        out `SLOW_STEP_S` before the step, applying commands as they come."""
        until = time.monotonic() + SLOW_STEP_S
        while self._core.slowed():
            try:
                self._apply(self._commands.get(timeout=max(0.0, until - time.monotonic())), out)
            except queue.Empty:
                return

    def _apply(self, command: Command, out: StepOutput) -> None:
        core = self._core
        if isinstance(command, Submit):
            if self._drain_until is not None:
                out.abandoned.append(command.request.ref)
            else:
                core.submit(command.request, out)
        elif isinstance(command, Cancel):
            core.cancel(command.request_id, out)
        elif isinstance(command, Abandon):
            core.abandon(command.request_id)
        elif isinstance(command, Shutdown):
            self._drain_until = command.drain_until
            out.abandoned.extend(core.abandon_waiting())
        elif isinstance(command, Ping):
            self._on_pong()
        elif isinstance(command, SetAdapters):
            self._set_adapters(command)
