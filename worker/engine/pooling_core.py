"""The engine core of an embedding model or a reranker: every admitted request's inputs,
run in padded passes, one `done` per request once all its inputs have run.

A pass takes up to `max_num_seqs` inputs whose lengths fall in one bucket (a power of
two): first the best-ranked request's next input (ranked as the scheduler ranks, so a
batch line admitted earlier never holds back an interactive request), then whatever else
waits in its bucket, best-ranked first; at most `prefill_batch_size * prefill_step_size`
tokens with the padding (an input longer than that runs alone). So inputs of many
requests share a pass, and a short one is not padded to a long one's length. Like `EngineCore`, it knows nothing of
threads or Redis; a pass that raises fails only the requests it held inputs of.
"""

from __future__ import annotations

import time
from base64 import b64encode
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from client.engine_stats import EngineTime
from client.protocol import Done, ErrorCode, Ranked, Timing, Usage
from worker.engine.backends import Loaded
from worker.engine.scheduler import Scheduler, SchedulingPolicy
from worker.messages import (
    CoreStats,
    EngineRequest,
    Outgoing,
    PoolingRequest,
    RequestRef,
    StepOutput,
    deadline_exceeded,
    failed,
    not_started,
)

log = structlog.get_logger("mlxq.engine")

MIN_BUCKET = 16  # tokens: shorter inputs share one bucket


@dataclass
class Pooling:
    """One admitted request: which of its inputs are still to run, and what the others gave."""

    request: PoolingRequest
    admitted_at: float
    rank: float  # the scheduler's: lower runs first, whenever it was admitted
    pending: list[int]  # indexes of inputs not run yet, in order
    values: dict[int, Any] = field(default_factory=dict)  # by input index: a float32 vector (numpy) or a score

    def done(self, now: float) -> Done:
        request = self.request
        ordered = [self.values[i] for i in range(len(request.inputs))]
        embeddings: list[list[float] | str] | None = None
        results = None
        if isinstance(ordered[0], np.ndarray):
            embeddings = [_encoded(v, request.base64) for v in ordered]
        else:
            best = sorted(range(len(ordered)), key=lambda i: -ordered[i])[: request.top_n]
            results = [Ranked(i, ordered[i]) for i in best]
        queued = self.admitted_at - request.queueing.arrived_at
        return Done(id=request.id, finish_reason="stop", text="", usage=Usage(request.prompt_size, 0),
                    timing=Timing(queued_ms=round(queued * 1000, 1), ttft_ms=None,
                                  total_ms=round((now - request.queueing.arrived_at) * 1000, 1)),
                    metadata=request.queueing.metadata, embeddings=embeddings, results=results)


class PoolingCore:
    """One pooling model's admitted requests, run pass by pass."""

    def __init__(self, loaded: Loaded, policy: SchedulingPolicy, clock: EngineTime) -> None:
        assert loaded.pooler is not None
        self.pool = loaded.pooler
        self.scheduler: Scheduler[PoolingRequest] = Scheduler(policy)
        self.running: dict[str, Pooling] = {}  # by request id
        self.clock = clock
        self.max_inputs = policy.max_num_seqs
        self.max_tokens = policy.prefill_batch_size * policy.prefill_step_size

    def busy(self) -> bool:
        return bool(self.running or len(self.scheduler))

    def idle_s(self) -> float:
        return 0.0

    def stats(self) -> CoreStats:
        return CoreStats(len(self.running), len(self.scheduler))

    def submit(self, request: EngineRequest | PoolingRequest, out: StepOutput) -> None:
        assert isinstance(request, PoolingRequest), "the preparer makes pooling requests for a pooling model"
        self.scheduler.add(request)

    def cancel(self, request_id: str, out: StepOutput) -> None:
        """End a request `cancelled`, with nothing: its vectors are all or none."""
        pooling = self.running.pop(request_id, None)
        request = pooling.request if pooling is not None else self.scheduler.remove(request_id)
        if request is not None:
            out.outgoing.append(not_started(request, time.time()))

    def abandon(self, request_id: str) -> None:
        if self.running.pop(request_id, None) is None:
            self.scheduler.remove(request_id)

    def abandon_waiting(self) -> list[RequestRef]:
        return [request.ref for request in self.scheduler.drain()]

    def abandon_running(self) -> list[RequestRef]:
        refs = [pooling.request.ref for pooling in self.running.values()]
        self.running.clear()
        return refs

    def slowed(self) -> bool:
        return False

    def rows(self) -> list[tuple[list[int], int | None]]:
        return []

    def close(self) -> None:
        pass

    def step(self, out: StepOutput) -> None:
        """Admit what fits, run one pass, and end the requests whose last inputs it ran."""
        now = time.time()
        for request in self.scheduler.admit(len(self.running)):
            if request.queueing.expired(now):
                out.outgoing.append(deadline_exceeded(request))
            else:
                rank = self.scheduler.rank(request)  # it runs its passes in the order it was admitted in
                self.running[request.id] = Pooling(request, now, rank, list(range(len(request.inputs))))
        taken = self._next_pass()
        if not taken:
            return
        started = time.perf_counter()
        try:
            values = self._run(taken)
        except Exception as e:  # noqa: BLE001 - fail the requests of this pass, keep serving
            self._fail(taken, e, out)
            return
        finally:
            self.clock.model_s += time.perf_counter() - started
            self.clock.steps += 1
        now = time.time()
        for (pooling, index), value in zip(taken, values, strict=True):
            pooling.values[index] = value
        for pooling in {id(p): p for p, _ in taken}.values():
            if not pooling.pending:
                del self.running[pooling.request.id]
                out.outgoing.append(_ending(pooling, now))

    def _next_pass(self) -> list[tuple[Pooling, int]]:
        """The inputs of the next pass: the best-ranked request's next, and the others of its bucket."""
        ranked = sorted((p for p in self.running.values() if p.pending), key=lambda p: p.rank)
        if not ranked:
            return []
        head = ranked[0]
        bucket = _bucket(len(head.request.inputs[head.pending[0]].tokens))
        taken: list[tuple[Pooling, int]] = []
        width = 0
        for pooling in ranked:
            for index in pooling.pending:
                length = len(pooling.request.inputs[index].tokens)
                if _bucket(length) != bucket:
                    continue
                if taken and (len(taken) == self.max_inputs or (len(taken) + 1) * max(width, length) > self.max_tokens):
                    return self._take(taken)
                taken.append((pooling, index))
                width = max(width, length)
        return self._take(taken)

    @staticmethod
    def _take(taken: list[tuple[Pooling, int]]) -> list[tuple[Pooling, int]]:
        chosen: dict[int, set[int]] = {}
        for pooling, index in taken:
            chosen.setdefault(id(pooling), set()).add(index)
        for pooling in {id(p): p for p, _ in taken}.values():
            pooling.pending = [i for i in pooling.pending if i not in chosen[id(pooling)]]
        return taken

    def _run(self, taken: Sequence[tuple[Pooling, int]]) -> list[Any]:
        """One pass: each input's vector (cut and normalized again where its request asked) or score."""
        values = self.pool([pooling.request.inputs[index] for pooling, index in taken])
        if values.ndim == 1:
            return list(values.tolist())
        vectors = np.array(values, dtype=np.float32)  # kept compact until their request ends
        rows: list[Any] = list(vectors)
        for row, (pooling, _) in enumerate(taken):
            size = pooling.request.dimensions
            if size is not None:  # a Matryoshka cut: the model's vectors are unit length, and so are these
                cut = vectors[row, :size]
                rows[row] = cut / max(float(np.linalg.norm(cut)), 1e-12)
        return rows

    def _fail(self, taken: Sequence[tuple[Pooling, int]], error: Exception, out: StepOutput) -> None:
        log.error("a pooled pass failed; failing its requests", error=repr(error), exc_info=True)
        for pooling in {id(p): p for p, _ in taken}.values():
            self.running.pop(pooling.request.id, None)
            out.outgoing.append(failed(pooling.request.ref, ErrorCode.INTERNAL, f"the model's pass failed: {error}"))


def _ending(pooling: Pooling, now: float) -> Outgoing:
    """The request's `done`, or its error if that cannot be made."""
    try:
        return Outgoing(pooling.request.ref, pooling.done(now))
    except Exception as e:  # noqa: BLE001 - this request alone fails
        log.error("could not make a pooled request's answer", request_id=pooling.request.id, error=repr(e))
        return failed(pooling.request.ref, ErrorCode.INTERNAL, f"could not make the answer: {e!r}")


def _encoded(vector: np.ndarray, base64: bool) -> list[float] | str:
    """A vector as it travels: floats, or base64 of its little-endian float32 bytes (OpenAI's)."""
    if base64:
        return b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()  # type: ignore[no-any-return]


def _bucket(length: int) -> int:
    return max(MIN_BUCKET, 1 << (length - 1).bit_length())
