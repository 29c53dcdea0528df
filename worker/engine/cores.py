"""The seam between the engine thread and what it steps: a `Core`, for generation
(`core.EngineCore`, a continuous batch) or pooling (`pooling_core.PoolingCore`, passes of
embeddings or scores), chosen once from the model's task."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from client.engine_stats import EngineTime
from worker.engine.backends import Loaded
from worker.engine.core import EngineCore
from worker.engine.pooling_core import PoolingCore
from worker.engine.scheduler import SchedulingPolicy
from worker.faults import Faults
from worker.messages import CoreStats, EngineRequest, PoolingRequest, RequestRef, StepOutput


class Core(Protocol):
    """One loaded model's requests, stepped by the engine thread alone. Each call that
    ends requests writes their events into `out`."""

    def busy(self) -> bool:
        """Whether any request runs or waits."""

    def idle_s(self) -> float:
        """While busy: how long the engine thread may wait for commands before the next step."""

    def stats(self) -> CoreStats:
        """Its part of the engine's stats."""

    def submit(self, request: EngineRequest | PoolingRequest, out: StepOutput) -> None:
        """Queue a request (the preparer made the kind this core runs)."""

    def cancel(self, request_id: str, out: StepOutput) -> None:
        """End a request `cancelled`, running or waiting; an unknown id is ignored."""

    def abandon(self, request_id: str) -> None:
        """Drop a request without a word: another worker took it."""

    def abandon_waiting(self) -> list[RequestRef]:
        """Drop every waiting request (a shutdown), for the loop to hand back."""

    def abandon_running(self) -> list[RequestRef]:
        """Stop every running request without a word (past the drain deadline)."""

    def slowed(self) -> bool:
        """Whether a request marked by the test hook `MLXQ_TEST_SLOW_ON_TOKEN` runs."""

    def rows(self) -> list[tuple[list[int], int | None]]:
        """For the test hooks: each running request's prompt and the tokens it made (None: in its prefill)."""

    def step(self, out: StepOutput) -> None:
        """Admit what fits and run one step."""

    def close(self) -> None:
        """Release what the core holds (the backend's batch)."""


def make_core(loaded: Loaded, policy: SchedulingPolicy, clock: EngineTime, faults: Faults,
              on_start: Callable[[list[str]], None], preparing: Callable[[], int]) -> Core:
    """The core for the loaded model's task. A generating core says which requests enter
    its batch (`on_start`), before the step that starts them, and asks how many are
    being prepared for it (`preparing`)."""
    if loaded.info.task == "generate":
        return EngineCore(loaded, policy, clock, faults, on_start, preparing)
    return PoolingCore(loaded, policy, clock)
