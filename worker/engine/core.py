"""The engine core: one model's batch, stepped. Schedule, execute, update.

It holds the scheduler (the policy), the backend (the model's batch), each running
request's output side and the constrained rows' masks, and turns commands into changes
of the batch and each step into events (`Outgoing`). Its inputs and outputs are plain
messages: it knows nothing of threads, Redis or the event loop (`engine.Engine` runs it
on the thread that owns MLX). A step that raises fails the requests in the batch (each
gets one `error` event) and the batch is rebuilt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import structlog

from client.engine_stats import EngineTime
from client.protocol import ErrorCode
from common.prefix_chain import shared_blocks, worth_sharing
from worker.engine.adapters import AdapterRefused, UnknownAdapter
from worker.engine.backends import Coverage, Loaded
from worker.engine.constraints import Guides
from worker.engine.logprobs import token_logprobs
from worker.engine.output import RequestOutput, process_step
from worker.engine.prefix_cache import PrefixCache
from worker.engine.sampling import build_logits_processors, build_sampler
from worker.engine.scheduler import Scheduler, SchedulingPolicy
from worker.faults import NONE, Faults
from worker.messages import (
    CoreStats,
    EngineRequest,
    Outgoing,
    PoolingRequest,
    RequestRef,
    StepOutput,
    Thinking,
    deadline_exceeded,
    failed,
    not_started,
)

log = structlog.get_logger("mlxq.engine")


class AdapterProblem(ValueError):
    """A request's adapter that this worker cannot run: the request's error."""


class EngineCore:
    """One loaded model's continuous batch."""

    def __init__(self, loaded: Loaded, policy: SchedulingPolicy, clock: EngineTime, faults: Faults = NONE,
                 on_start: Callable[[list[str]], None] = lambda _: None,
                 preparing: Callable[[], int] = lambda: 0) -> None:
        self.loaded = loaded
        self.scheduler: Scheduler[EngineRequest] = Scheduler(policy)
        self.backend = loaded.make_backend()
        self.guides = Guides(loaded.info.vocab_size, policy.max_num_seqs)
        self.clock = clock  # the model's share of the thread's time is counted here
        self.faults = faults
        self.on_start = on_start  # told, before the step that starts them, which requests enter the batch
        self.preparing = preparing  # how many requests are being prepared for it: they come next
        self.running: dict[int, RequestOutput] = {}  # by the backend's uid
        self._alone: int | None = None  # the uid of a request that runs alone (`Queueing.alone`)
        self._flush_interval_s = policy.flush_interval_s
        self._next_flush = 0.0  # perf_counter time from which running streams' held tokens go out
        self._uids: dict[str, int] = {}  # request id -> uid
        self._adapted: dict[int, tuple[int, str]] = {}  # uid -> its adapter's slot, its caches' namespace
        self._shared: set[int] = set()  # running sequences whose cache the prefix cache took while they run

    def busy(self) -> bool:
        return bool(self.running or len(self.scheduler))

    def idle_s(self) -> float:
        """How long the engine thread may wait for commands before the next step: while
        nothing runs and the waiting requests are held for those being prepared, the
        rest of that wait; else none."""
        return 0.0 if self.running else self.scheduler.hold_left(time.perf_counter())

    def stats(self) -> CoreStats:
        return CoreStats(len(self.running), len(self.scheduler), self.guides.fills, self.guides.fill_s * 1000)

    def submit(self, request: EngineRequest | PoolingRequest, out: StepOutput) -> None:
        assert isinstance(request, EngineRequest), "the preparer makes generation requests for a generating model"
        try:
            self.scheduler.add(request)
        except Exception as e:  # noqa: BLE001 - a request the scheduler cannot rank fails alone
            out.outgoing.append(failed(request.ref, ErrorCode.INTERNAL, f"could not queue the request: {e!r}"))

    def cancel(self, request_id: str, out: StepOutput) -> None:
        """End a request `cancelled`: running, with what it made; waiting, with nothing."""
        uid = self._uids.get(request_id)
        if uid is not None:
            self.backend.remove([uid])
            output = self._retire([uid])[0]
            out.outgoing.extend(Outgoing(output.request.ref, e) for e in output.finish("cancelled", time.time()))
            return
        request = self.scheduler.remove(request_id)
        if request is not None:
            out.outgoing.append(not_started(request, time.time()))

    def abandon(self, request_id: str) -> None:
        """Drop a request without a word, running or waiting: another worker took it."""
        uid = self._uids.get(request_id)
        if uid is not None:
            self.backend.remove([uid])
            self._retire([uid])
        else:
            self.scheduler.remove(request_id)

    def abandon_waiting(self) -> list[RequestRef]:
        """Drop every waiting request (a shutdown), for the loop to hand back."""
        return [request.ref for request in self.scheduler.drain()]

    def abandon_running(self) -> list[RequestRef]:
        """Stop every running request without a word (past the drain deadline)."""
        uids = list(self.running)
        self.backend.remove(uids)
        return [output.request.ref for output in self._retire(uids)]

    def slowed(self) -> bool:
        """Whether a request marked by the test hook `MLXQ_TEST_SLOW_ON_TOKEN` runs."""
        return self.faults.slow_token is not None and any(
            self.faults.slows(o.request.prompt_tokens) for o in self.running.values())

    def rows(self) -> list[tuple[list[int], int | None]]:
        """For the test hooks: each running request's prompt, and the tokens it made here
        (None while in its prefill)."""
        return [(o.request.prompt_tokens, None if o.first_token_at is None else
                 o.completion_tokens - (len(o.request.resume.tokens) if o.request.resume else 0))
                for o in self.running.values()]

    def step(self, out: StepOutput) -> None:
        """Admit what the policy lets in, run one step of the batch, and turn its tokens into events."""
        self._admit(out)
        if not self.running:
            return
        try:
            if self.guides:  # every constrained row's mask for this step, in one fill
                self.guides.prefill(self.backend.upcoming_tokens())
            prefilling = [o for o in self.running.values() if o.first_token_at is None]
            plan = self.scheduler.plan(len(self.running) - len(prefilling), len(prefilling))
            started = time.perf_counter()
            tokens = self.backend.step(plan)
            self.clock.model_s += time.perf_counter() - started
            self.clock.steps += 1
        except Exception as e:  # noqa: BLE001 - fail this batch, keep serving
            self._fail_batch(e, out)
            return
        wanted = {uid: o.request.reporting.logprobs for uid, o in self.running.items()
                  if o.request.reporting.logprobs is not None}
        picked = token_logprobs(tokens, wanted, self.loaded.info.tokenizer) if wanted else {}
        outgoing, finished = process_step(self.running, tokens, time.time(), picked, self._flush_due())
        out.outgoing.extend(outgoing)
        out.first_tokens.extend(o.request.id for o in prefilling if o.first_token_at is not None)
        coverage = {t.uid: t.coverage for t in tokens if t.coverage is not None}
        # Those that ended on a stop string are still in the batch.
        coverage.update(self.backend.remove(finished, keep_caches=self.loaded.prefix_cache is not None))
        kept = [(coverage[uid], self._salt(uid), self.running[uid].request.prefix_chain)
                for uid in finished if uid in coverage]
        self._retire(finished)
        _keep_caches(self.loaded.prefix_cache, kept)

    def close(self) -> None:
        self.backend.close()

    def _flush_due(self) -> bool:
        """Whether this step's deltas go out, or wait to go out with later steps' tokens.
        A write costs the worker about as much CPU as a small model's step: with steps
        shorter than the interval, several steps' tokens share one write, one delta per
        request. First deltas and ends never wait (`RequestOutput.add`)."""
        now = time.perf_counter()
        if now < self._next_flush:
            return False
        self._next_flush = now + self._flush_interval_s
        return True

    def _admit(self, out: StepOutput) -> None:
        if self._alone is not None or \
                self.scheduler.holding(len(self.running), time.perf_counter(), self.preparing()):
            return
        now = time.time()
        starting = self._with_adapter_slots(self.scheduler.admit(len(self.running), self._waits_for_a_prefill),
                                            now, out)
        if not starting:
            return
        self.on_start([request.id for request, _ in starting])  # before anything of theirs can fail
        for request, adapted in starting:
            self.faults.fail_if_marked(request.prompt_tokens)
            try:
                self._admit_one(request, adapted, now, out)
            except Exception as e:  # noqa: BLE001 - this request alone fails
                _could_not_start(request, e, out)

    def _waits_for_a_prefill(self, request: EngineRequest, starting: list[EngineRequest]) -> bool:
        """Whether `request` should wait for the prefill of a request whose prompt starts
        as its own does (`worth_sharing`; running, or starting in this step), to reuse its
        cache once that prefill ends rather than compute the same prefix beside it
        (SGLang's in-batch prefix check). Only where the prefix cache can take a running
        sequence's cache (`_share_running_prefix`)."""
        chain, cache = request.prefix_chain, self.loaded.prefix_cache
        if not chain or cache is None or not cache.takes_running:
            return False
        prefilling = [o.request for o in self.running.values() if o.first_token_at is None]
        return any(worth_sharing(chain, other.prefix_chain) for other in prefilling + starting)

    def _with_adapter_slots(self, admitted: list[EngineRequest], now: float,
                            out: StepOutput) -> list[tuple[EngineRequest, tuple[int, str]]]:
        """The admitted requests with their adapter's slot and caches' namespace; those
        whose adapter has no free slot wait again, those it cannot serve fail, those past
        their deadline end."""
        starting, waiting = [], []
        for request in admitted:
            if request.queueing.expired(now):
                out.outgoing.append(deadline_exceeded(request))
                continue
            try:
                adapted = self._adapter_slot(request)
            except AdapterProblem as e:
                out.outgoing.append(failed(request.ref, ErrorCode.INVALID_REQUEST, str(e)))
                continue
            except Exception as e:  # noqa: BLE001 - this request alone fails
                _could_not_start(request, e, out)
                continue
            if adapted is None:
                waiting.append(request)
            else:
                starting.append((request, adapted))
        for request in waiting:
            self.scheduler.add(request)
        return starting

    def _admit_one(self, request: EngineRequest, adapted: tuple[int, str], now: float, out: StepOutput) -> None:
        """Start `request` in its adapter's slot (or end it, if it has nothing left to do)."""
        try:
            output = RequestOutput(request, self.loaded.new_detokenizer(), now,
                                   self.loaded.new_detokenizer() if request.reporting.thinking else None)
            if request.tokens_to_generate < 1:  # an earlier delivery generated all, then died
                out.outgoing.extend(Outgoing(request.ref, e) for e in output.finish("length", now))
                self._release(adapted[0])
                return
            uid = self._insert(request, output, *adapted)
        except Exception:
            self._release(adapted[0])
            raise
        self.running[uid] = output
        self._uids[request.id] = uid
        if request.queueing.alone:
            self._alone = uid
        if adapted[0]:
            self._adapted[uid] = adapted

    def _adapter_slot(self, request: EngineRequest) -> tuple[int, str] | None:
        """The slot of the request's adapter (0: none) and its caches' namespace; None
        while no slot is free for it."""
        if not request.adapter:
            return 0, request.cache_salt
        bank = self.loaded.adapters
        if bank is None:
            raise AdapterProblem(f"adapter {request.adapter!r}: this worker's model ({self.loaded.info.name}) "
                                 "serves no adapters")
        try:
            slot = bank.acquire(request.adapter)
            salt = f"{request.cache_salt}\x00adapter:{bank.identity(request.adapter)}"
        except (UnknownAdapter, AdapterRefused) as e:
            raise AdapterProblem(str(e)) from e
        return None if slot is None else (slot, salt)

    def _release(self, slot: int) -> None:
        if slot and self.loaded.adapters is not None:
            self.loaded.adapters.release(slot)

    def _salt(self, uid: int) -> str:
        """The namespace the sequence's caches are kept in: its salt, and its adapter's load."""
        adapted = self._adapted.get(uid)
        return self.running[uid].request.cache_salt if adapted is None else adapted[1]

    def _insert(self, request: EngineRequest, output: RequestOutput, slot: int, salt: str) -> int:
        """Start the request in the batch (its adapter in `slot`), reusing a cached prefix
        of its prompt (kept under `salt`) if there is one."""
        prompt = request.prompt_tokens + (request.resume.tokens if request.resume else [])
        cache = self.loaded.prefix_cache
        if cache is not None and cache.takes_running:
            self._share_running_prefix(request.prefix_chain, cache)
        cached = cache.fetch(prompt, salt) if cache is not None else None
        processors = build_logits_processors(request.sampling, len(request.resume.tokens) if request.resume else 0,
                                             request.stopping.stop_tokens, request.stopping.min_tokens)
        guide = None
        if request.constraint is not None:  # last: it masks what the others left
            guide = self.guides.processor(request.constraint, len(prompt), sorted(request.stopping.stop_tokens),
                                          _thinking_left(request))
            processors.append(guide)
        try:
            uid = self.backend.insert(prompt[len(cached.tokens):] if cached else prompt,
                                      request.tokens_to_generate, build_sampler(request.sampling), processors,
                                      cached, request.media, logprobs=request.reporting.logprobs is not None,
                                      speculative=request.speculative, cache_salt=request.cache_salt,
                                      adapter=slot)
        except Exception:
            if guide is not None:
                self.guides.discard(guide)  # its bitmask row goes back
            raise
        if cache is not None:
            cache.count(cached)
        if guide is not None:
            self.guides.attach(uid, guide)
        output.cached_tokens = 0 if cached is None else len(cached.tokens)
        return uid

    def _share_running_prefix(self, chain: tuple[int, ...], cache: PrefixCache) -> None:
        """Have the prefix cache take, now, the cache of the running sequence (past its
        prefill) whose prompt shares the most leading blocks with `chain`, if worth it
        (`worth_sharing`), so that a request on the same system prompt reuses it without
        waiting for it to end (at its end the cache keeps the whole sequence, sharing
        these blocks)."""
        shared, uid = max(((shared_blocks(chain, o.request.prefix_chain), uid) for uid, o in self.running.items()
                           if o.first_token_at is not None), default=(0, -1))
        if not shared or uid in self._shared or not worth_sharing(chain, self.running[uid].request.prefix_chain):
            return
        self._shared.add(uid)
        coverage = self.backend.running_cache(uid)
        if coverage is not None:
            _keep_caches(cache, [(coverage, self._salt(uid), self.running[uid].request.prefix_chain)])

    def _retire(self, uids: list[int]) -> list[RequestOutput]:
        outputs = [self.running.pop(uid) for uid in uids]
        for uid, output in zip(uids, outputs, strict=True):
            del self._uids[output.request.id]
            self._shared.discard(uid)
            if uid == self._alone:
                self._alone = None
            self.guides.release(uid)
            adapted = self._adapted.pop(uid, None)
            if adapted is not None:
                self._release(adapted[0])
        return outputs

    def _fail_batch(self, error: Exception, out: StepOutput) -> None:
        log.error("step failed; failing its requests and rebuilding the batch", error=repr(error), exc_info=True)
        for output in self._retire(list(self.running)):
            out.outgoing.append(failed(output.request.ref, ErrorCode.INTERNAL, f"generation failed: {error}"))
        self.backend.close()
        self.backend = self.loaded.make_backend()


def _could_not_start(request: EngineRequest, error: Exception, out: StepOutput) -> None:
    log.error("could not start a request", request_id=request.id, error=repr(error))
    out.outgoing.append(failed(request.ref, ErrorCode.INTERNAL, f"could not start the request: {error!r}"))


def _keep_caches(cache: PrefixCache | None, finished: list[tuple[Coverage, str, tuple[int, ...]]]) -> None:
    """Keep the finished sequences' caches (each with its request's cache salt and prefix
    chain) for later prompts that share their prefix."""
    if cache is None:
        return
    for coverage, salt, chain in finished:
        try:
            cache.store(coverage, salt, chain)
        except Exception as e:  # noqa: BLE001 - a cache that cannot be kept only costs a later prefill
            log.warning("could not keep a prompt cache", error=repr(e))


def _thinking_left(request: EngineRequest) -> Thinking | None:
    """Where a constrained thinking request stands before its first new token: still
    reasoning (the prompt opened it, or a resumed output is inside it), or not."""
    thinking = request.reporting.thinking
    if thinking is None:
        return None
    tokens = request.resume.tokens if request.resume else []
    if not tokens:
        return thinking
    inside, _ = thinking.after(tokens)
    return replace(thinking, open=True) if inside else None
