"""The scheduling policy, for every backend: which waiting request runs next, how many
run at once, and how much prompt each step may prefill beside the running streams.
Pure bookkeeping: no model, no tensors (the engine core applies it, its backend obeys).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from worker.messages import Queueing
from worker.settings import WorkerSettings

MIN_PREFILL_CHUNK = 16  # prompt tokens: smaller chunks would cost more in per-step overhead than they save
# How long free slots may wait for a group of prompts while a batch runs and requests
# wait (`Scheduler.holding`): ten of a small model's steps, less than one of a large one's.
GROUP_WAIT_S = 0.015


@dataclass(frozen=True)
class SchedulingPolicy:
    """The knobs of one engine: its slots, its step budget, how waiting ages and how
    often running streams' tokens go out."""

    max_num_seqs: int
    max_step_tokens: int = 256  # tokens one step may process while streams run
    prefill_batch_size: int = 8  # prompts prefilled together, at most
    prefill_step_size: int = 512  # prompt tokens per prefill chunk, at most
    priority_aging_s: float = 10.0
    flush_interval_s: float = 0.0  # how long running streams' new tokens may wait to go out together

    @classmethod
    def of(cls, settings: WorkerSettings) -> SchedulingPolicy:
        """The policy a worker's settings give."""
        return cls(settings.max_num_seqs, settings.max_step_tokens, settings.prefill_batch_size,
                   settings.prefill_step_size, settings.priority_aging_s, settings.flush_interval_ms / 1000)


@dataclass(frozen=True)
class StepPlan:
    """What the next step may prefill: chunks of `prefill_chunk` prompt tokens for up to
    `prefill_prompts` prompts together (each running sequence decodes one token too)."""

    prefill_chunk: int
    prefill_prompts: int


@dataclass(frozen=True)
class StepBudget:
    """How a step's token budget is shared: each running sequence decodes one token; the
    rest goes to prompt chunks, at most `prefill_step_size` tokens each and at least
    `MIN_PREFILL_CHUNK`, for as many prompts as fit (at least one, so prompts always
    advance), up to `prefill_batch_size`. With nothing decoding there is no stream to keep
    steady: the prompts get the configured sizes, and a burst of prompts into an idle
    worker is prefilled in as few steps as in process (docs/benchmarks.md, "Paired runs")."""

    max_step_tokens: int
    prefill_batch_size: int
    prefill_step_size: int

    def plan(self, decoding: int, prefilling: int) -> StepPlan:
        """The next step's prefill, with `decoding` sequences decoding and `prefilling` prompting."""
        if not decoding:
            return StepPlan(self.prefill_step_size, self.prefill_batch_size)
        left = max(self.max_step_tokens - decoding, MIN_PREFILL_CHUNK)
        prompts = max(1, min(self.prefill_batch_size, left // MIN_PREFILL_CHUNK))
        chunk = left // max(1, min(prompts, prefilling))
        return StepPlan(max(MIN_PREFILL_CHUNK, min(self.prefill_step_size, chunk)), prompts)


class Waiting(Protocol):
    """What ranks a waiting request."""

    @property
    def id(self) -> str: ...
    @property
    def queueing(self) -> Queueing: ...


R = TypeVar("R", bound=Waiting)


class Scheduler(Generic[R]):
    """Requests waiting for a slot, and the plan of each step.

    Waiting requests go lower `priority` first, first come first served among equals, and
    every `priority_aging_s` seconds of waiting counts as one priority level better, so
    that a low priority cannot starve forever. Aging is the same for every waiting
    request, so the order never changes while they wait: ranking by
    `priority + arrived_at / aging_s` once, at arrival, is exact.
    """

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self.budget = StepBudget(policy.max_step_tokens, policy.prefill_batch_size, policy.prefill_step_size)
        self._heap: list[tuple[float, int, str]] = []
        self._waiting: dict[str, tuple[int, R]] = {}
        self._order = itertools.count()
        self._free_since: float | None = None  # when free slots began waiting for a group (`holding`)

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def rank(self, request: R) -> float:
        """Lower runs first: its priority, less a level for each `priority_aging_s` it has waited."""
        return request.queueing.priority + request.queueing.arrived_at / self.policy.priority_aging_s

    def add(self, request: R) -> None:
        """Queue a request."""
        rank = self.rank(request)  # first: it is what can fail
        order = next(self._order)
        heapq.heappush(self._heap, (rank, order, request.id))
        self._waiting[request.id] = (order, request)

    def remove(self, request_id: str) -> R | None:
        """Take a waiting request out (cancelled); None if it is not waiting."""
        entry = self._waiting.pop(request_id, None)
        return None if entry is None else entry[1]

    def holding(self, running: int, now: float, preparing: int = 0) -> bool:
        """Whether to keep free slots empty a little longer, for a group of prompts to
        start together, at most GROUP_WAIT_S from when the wait began: while a batch runs
        and more requests wait than slots are free, until half a prefill group
        (`prefill_batch_size` // 2, or every waiting request) is free; and while requests
        are being prepared (`preparing`, on their way here) that would start beside
        those waiting.

        Every start costs model calls of its own (a prompt call, the call that starts its
        rows, the batch's caches joined), whatever its size: a backlog's prompts started
        one or two at a time cost more than together (docs/benchmarks.md, "Logprobs only
        when asked, and prefill groups"), and rows that start together end together, so
        the backlog's slots keep freeing in groups. A lone request never waits; with
        nothing on its way, neither do interactive traffic nor a closed loop (no more
        waiting than slots are free), nor an idle engine.
        """
        free, waiting = self.policy.max_num_seqs - running, len(self._waiting)
        group = min(max(1, self.policy.prefill_batch_size // 2), waiting)
        short_of_slots = running > 0 and 0 < free < group
        coming = preparing > 0 and 0 < waiting < min(free, self.policy.prefill_batch_size)
        if not (short_of_slots or coming):
            self._free_since = None
            return False
        if self._free_since is None:
            self._free_since = now
        if now - self._free_since < GROUP_WAIT_S:
            return True
        self._free_since = None
        return False

    def hold_left(self, now: float) -> float:
        """How much longer the wait that `holding` began may last (0: none began)."""
        return 0.0 if self._free_since is None else max(0.0, self._free_since + GROUP_WAIT_S - now)

    def admit(self, running: int, defer: Callable[[R, list[R]], bool] = lambda *_: False) -> list[R]:
        """The requests to start now, best first, into the slots `running` leave free. A
        request that was in an engine's death (`alone`) starts only into an empty batch,
        and on its own; until the batch is empty, it holds back those behind it. One that
        `defer` names (given those taken before it) keeps its place for a later step,
        and those behind it go first."""
        taken: list[R] = []
        deferred: list[tuple[float, int, str]] = []
        while len(taken) < self.policy.max_num_seqs - running and (best := self._best()) is not None:
            if best.queueing.alone and (running or taken):
                break
            if not best.queueing.alone and defer(best, taken):
                deferred.append(heapq.heappop(self._heap))  # still waiting; back in its place below
                continue
            taken.extend(self.take(1))
            if best.queueing.alone:
                break
        for entry in deferred:
            heapq.heappush(self._heap, entry)
        return taken

    def _best(self) -> R | None:
        """The waiting request that runs next, left waiting."""
        while self._heap:
            _, order, request_id = self._heap[0]
            entry = self._waiting.get(request_id)
            if entry is not None and entry[0] == order:
                return entry[1]
            heapq.heappop(self._heap)  # removed earlier: a stale heap entry
        return None

    def plan(self, decoding: int, prefilling: int) -> StepPlan:
        return self.budget.plan(decoding, prefilling)

    def take(self, slots: int) -> list[R]:
        """Up to `slots` requests to start now, best first."""
        taken: list[R] = []
        while self._heap and len(taken) < slots:
            _, order, request_id = heapq.heappop(self._heap)
            entry = self._waiting.get(request_id)
            if entry is not None and entry[0] == order:  # else removed earlier: a stale heap entry
                del self._waiting[request_id]
                taken.append(entry[1])
        return taken

    def drain(self) -> list[R]:
        """Take every waiting request out, in order."""
        return self.take(len(self._waiting))
