"""The engine thread: owns the model, the tokenizer's detokenizers and the batch.

Other threads only hand it commands through a queue; it applies them between steps,
runs steps while there is work, blocks when idle, and hands out one `StepOutput` per
step. It never touches Redis. A step that raises fails the requests in the batch
(each gets one `error` event) and the batch is rebuilt; anything else is fatal.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import structlog

from client.protocol import ErrorCode

from .backends import Coverage, Loaded, ModelInfo
from .constraints import Guides
from .faults import NONE, SLOW_STEP_S, Faults
from .logprobs import token_logprobs
from .messages import (
    Abandon,
    CacheStats,
    Cancel,
    Command,
    EngineRequest,
    EngineStats,
    EngineTime,
    Outgoing,
    Shutdown,
    StepOutput,
    Submit,
)
from .output import RequestOutput, deadline_exceeded, failed, not_started, process_step
from .sampling import build_logits_processors, build_sampler
from .scheduler import Scheduler

log = structlog.get_logger("mlxq.engine")

HOUSEKEEPING_S = 5.0  # under steady load, how often cached buffers are released and stats refreshed


class EngineFailed(RuntimeError):
    """The engine thread died; the worker must exit."""


class Engine:
    """Runs `load` and then the step loop on its own thread."""

    def __init__(self, load: Callable[[], Loaded], max_num_seqs: int,
                 on_output: Callable[[StepOutput], None], on_fatal: Callable[[BaseException], None],
                 on_stats: Callable[[EngineStats], None] = lambda _: None, priority_aging_s: float = 10.0,
                 faults: Faults = NONE) -> None:
        self._load = load
        self._max_num_seqs = max_num_seqs
        self._on_output = on_output
        self._on_fatal = on_fatal
        self._on_stats = on_stats
        self._faults = faults
        self._commands: queue.Queue[Command] = queue.Queue()
        self._thread = threading.Thread(target=self._main, name="mlxq-engine", daemon=True)
        self._ready = threading.Event()
        self._info: ModelInfo | None = None
        self._error: BaseException | None = None
        # Engine-thread state from here on.
        self._scheduler = Scheduler(priority_aging_s)
        self._running: dict[int, RequestOutput] = {}
        self._uids: dict[str, int] = {}
        self._drain_until: float | None = None
        self._guides: Guides  # made with the backend, once the model is loaded
        self._next_housekeeping = 0.0
        self._time = EngineTime()


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

    def submit(self, request: EngineRequest) -> None:
        self._commands.put(Submit(request))

    def cancel(self, request_id: str) -> None:
        self._commands.put(Cancel(request_id))

    def abandon(self, request_id: str) -> None:
        """Drop a request without output: another worker owns it now."""
        self._commands.put(Abandon(request_id))

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
        try:
            loaded = self._load()
        except BaseException as e:  # noqa: BLE001 - reported to the waiting thread
            self._error = e
            self._ready.set()
            return
        self._info = loaded.info
        self._loaded = loaded
        self._backend = loaded.make_backend()
        self._guides = Guides(loaded.info.vocab_size, self._max_num_seqs)
        self._housekeeping()
        self._ready.set()
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - engine death is loud and distinct
            log.critical("engine failed", error=repr(e), exc_info=True)
            self._on_fatal(e)
        finally:
            self._backend.close()

    def _loop(self) -> None:
        while True:
            out = StepOutput()
            waited = time.perf_counter()
            self._apply_commands(out, block=not self._busy())
            started = time.perf_counter()
            self._time.idle_s += started - waited
            if self._drain_until is not None:
                self._abandon_if_drained(out)
            if self._busy():
                self._hold_if_slowed(out)
                self._step(out)
            if out.outgoing or out.abandoned:
                self._hand_off(out)
            self._time.other_s += time.perf_counter() - started  # less the model's and hand-off's shares
            if not self._busy() or time.monotonic() >= self._next_housekeeping:
                self._housekeeping()
            if self._drain_until is not None and not self._busy():
                return

    def _hand_off(self, out: StepOutput) -> None:
        """Give the step's events to the event loop. Timed apart: the worker's `on_output`
        returns once the loop has taken them (`Publisher.hand_over`), while the model
        computes the step already launched."""
        started = time.perf_counter()
        self._on_output(out)
        spent = time.perf_counter() - started
        self._time.handoff_s += spent
        self._time.other_s -= spent

    def _housekeeping(self) -> None:
        """Release the framework's cached buffers (when idle, and now and then under load)
        and hand the event loop fresh stats."""
        self._loaded.release_memory()
        cache = self._loaded.prefix_cache
        caches: dict[str, CacheStats | None] = {"prefix_cache": None if cache is None else cache.stats()}
        caches.update(self._loaded.cache_stats())
        self._on_stats(EngineStats(running=len(self._running), waiting=len(self._scheduler),
                                   memory=self._loaded.memory(), mask_fills=self._guides.fills,
                                   mask_fill_ms=self._guides.fill_s * 1000, time=replace(self._time),
                                   **caches))  # type: ignore[arg-type]
        self._next_housekeeping = time.monotonic() + HOUSEKEEPING_S

    def _busy(self) -> bool:
        return bool(self._running or len(self._scheduler))

    def _apply_commands(self, out: StepOutput, block: bool) -> None:
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
            while True:
                self._apply(command, out)
                command = self._commands.get_nowait()
        except queue.Empty:
            pass

    def _hold_if_slowed(self, out: StepOutput) -> None:
        """Fault injection (`MLXQ_TEST_SLOW_ON_TOKEN`): while a marked request runs, wait
        out `SLOW_STEP_S` before the step, applying commands as they come."""
        if self._faults.slow_token is None:
            return
        until = time.monotonic() + SLOW_STEP_S
        while any(self._faults.slows(o.request.prompt_tokens) for o in self._running.values()):
            try:
                self._apply(self._commands.get(timeout=max(0.0, until - time.monotonic())), out)
            except queue.Empty:
                return

    def _apply(self, command: Command, out: StepOutput) -> None:
        if isinstance(command, Submit):
            if self._drain_until is not None:
                out.abandoned.append(command.request.ref)
                return
            try:
                self._scheduler.add(command.request)
            except Exception as e:  # noqa: BLE001 - a request the scheduler cannot rank fails alone
                reason = f"could not queue the request: {e!r}"
                out.outgoing.append(failed(command.request.ref, ErrorCode.INTERNAL, reason))
        elif isinstance(command, Cancel):
            self._cancel(command.request_id, out)
        elif isinstance(command, Abandon):
            self._abandon(command.request_id)
        elif isinstance(command, Shutdown):
            self._drain_until = command.drain_until
            out.abandoned.extend(r.ref for r in self._scheduler.drain())

    def _cancel(self, request_id: str, out: StepOutput) -> None:
        uid = self._uids.get(request_id)
        if uid is not None:
            self._backend.remove([uid])
            output = self._retire([uid])[0]
            events = output.finish("cancelled", time.time())
            out.outgoing.extend(Outgoing(output.request.ref, e) for e in events)
            return
        request = self._scheduler.remove(request_id)
        if request is not None:
            out.outgoing.append(not_started(request, time.time()))

    def _abandon(self, request_id: str) -> None:
        uid = self._uids.get(request_id)
        if uid is not None:
            self._backend.remove([uid])
            self._retire([uid])
        else:
            self._scheduler.remove(request_id)

    def _step(self, out: StepOutput) -> None:
        self._admit(out)
        if not self._running:
            return
        try:
            if self._guides:  # every constrained row's mask for this step, in one fill
                self._guides.prefill(self._backend.upcoming_tokens())
            started = time.perf_counter()
            tokens = self._backend.step()
            in_model = time.perf_counter() - started
            self._time.steps += 1
            self._time.model_s += in_model
            self._time.other_s -= in_model
        except Exception as e:  # noqa: BLE001 - fail this batch, keep serving
            self._fail_batch(e, out)
            return
        wanted = {uid: o.request.logprobs for uid, o in self._running.items() if o.request.logprobs is not None}
        picked = token_logprobs(tokens, wanted, self._loaded.info.tokenizer) if wanted else {}
        outgoing, finished = process_step(self._running, tokens, time.time(), picked)
        out.outgoing.extend(outgoing)
        coverage = {t.uid: t.coverage for t in tokens if t.coverage is not None}
        # Those that ended on a stop string are still in the batch.
        coverage.update(self._backend.remove(finished, keep_caches=self._loaded.prefix_cache is not None))
        self._retire(finished)
        self._keep_caches([coverage[uid] for uid in finished if uid in coverage])

    def _keep_caches(self, finished: list[Coverage]) -> None:
        cache = self._loaded.prefix_cache
        if cache is None:
            return
        for coverage in finished:
            try:
                cache.store(coverage.tokens, coverage.cache)
            except Exception as e:  # noqa: BLE001 - a cache that cannot be kept only costs a later prefill
                log.warning("could not keep a prompt cache", error=repr(e))

    def _admit(self, out: StepOutput) -> None:
        now = time.time()
        for request in self._scheduler.take(self._max_num_seqs - len(self._running)):
            self._faults.fail_if_marked(request.prompt_tokens)
            try:
                self._admit_one(request, now, out)
            except Exception as e:  # noqa: BLE001 - this request alone fails
                log.error("could not start a request", request_id=request.id, error=repr(e))
                out.outgoing.append(failed(request.ref, ErrorCode.INTERNAL, f"could not start the request: {e!r}"))

    def _admit_one(self, request: EngineRequest, now: float, out: StepOutput) -> None:
        if request.deadline_at is not None and now > request.deadline_at:
            out.outgoing.append(deadline_exceeded(request))
            return
        output = RequestOutput(request, self._loaded.new_detokenizer(), now,
                               self._loaded.new_detokenizer() if request.thinking else None)
        if request.tokens_to_generate < 1:  # an earlier delivery generated all, then died
            out.outgoing.extend(Outgoing(request.ref, e) for e in output.finish("length", now))
            return
        uid = self._insert(request, output)
        self._running[uid] = output
        self._uids[request.id] = uid

    def _insert(self, request: EngineRequest, output: RequestOutput) -> int:
        """Start the request in the batch, reusing a cached prefix of its prompt if there is one."""
        prompt = request.prompt_tokens + (request.resume.tokens if request.resume else [])
        cache = self._loaded.prefix_cache
        hit = cache.fetch(prompt) if cache is not None else None
        cached = None if hit is None else Coverage(hit.cache, prompt[: hit.reused])
        processors = build_logits_processors(request.sampling, len(request.prompt_tokens), request.stop_tokens,
                                             request.min_tokens)
        guide = None
        if request.constraint is not None:  # last: it masks what the others left
            guide = self._guides.processor(request.constraint, len(prompt), sorted(request.stop_tokens),
                                           self._thinking_left(request))
            processors.append(guide)
        try:
            uid = self._backend.insert(prompt[len(cached.tokens):] if cached else prompt,
                                       request.tokens_to_generate, build_sampler(request.sampling), processors,
                                       cached, request.media)
        except Exception:
            if guide is not None:
                self._guides.discard(guide)  # its bitmask row goes back
            raise
        if cache is not None:
            cache.count(hit)
        if guide is not None:
            self._guides.attach(uid, guide)
        output.cached_tokens = 0 if hit is None else hit.reused
        return uid

    @staticmethod
    def _thinking_left(request: EngineRequest) -> Any:
        """Where a constrained thinking request stands before its first new token: still
        reasoning (the prompt opened it, or a resumed output is inside it), or not."""
        thinking = request.thinking
        if thinking is None:
            return None
        tokens = request.resume.tokens if request.resume else []
        if not tokens:
            return thinking
        inside, _ = thinking.after(tokens)
        return replace(thinking, open=True) if inside else None

    def _retire(self, uids: list[int]) -> list[RequestOutput]:
        outputs = [self._running.pop(uid) for uid in uids]
        for uid, output in zip(uids, outputs, strict=True):
            del self._uids[output.request.id]
            self._guides.release(uid)
        return outputs

    def _fail_batch(self, error: Exception, out: StepOutput) -> None:
        log.error("step failed; failing its requests and rebuilding the batch", error=repr(error), exc_info=True)
        for output in self._retire(list(self._running)):
            out.outgoing.append(failed(output.request.ref, ErrorCode.INTERNAL, f"generation failed: {error}"))
        self._backend.close()
        self._backend = self._loaded.make_backend()

    def _abandon_if_drained(self, out: StepOutput) -> None:
        """Past the drain deadline, stop running requests and leave them un-acked."""
        assert self._drain_until is not None
        if time.monotonic() < self._drain_until or not self._running:
            return
        uids = list(self._running)
        self._backend.remove(uids)
        out.abandoned.extend(s.request.ref for s in self._retire(uids))

