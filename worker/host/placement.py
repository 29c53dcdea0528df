"""What a host of several models does at each look: which models to load, which to
unload, which to answer `model_unavailable`. A pure function of what the look saw (its
models, their queues, the other hosts): no Redis, no processes, so each scenario is a
unit test (`tests/worker/host/test_placement.py`); the supervisor (`supervisor.py`) carries it out.

The rules, in order, for each model:
- a loaded model idle for `idle_unload_s` unloads (a pinned one only if it refuses);
- a model with requests waiting (unread, or read by a worker that died) and nobody
  loading it loads here if this host is the preferred one (the most free budget among
  those that offer it, then the lowest name), unless another worker serves its queue and
  its oldest request has waited less than `scale_up_after_s`;
- to fit it, idle models unload first: extra copies (queues others serve too), then the
  least recently used; it loads once they have exited;
- one seen holding more than the budget leaves beside the pinned models is given up,
  and a given-up model's requests are refused where nobody else serves its queue.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from client.heartbeat import ModelLoad
from client.hosts import HostRecord


@dataclass(frozen=True)
class Model:
    """One of this host's models, as the look found it."""

    queue: str
    footprint: int  # the bytes it is counted for
    pin: bool = False
    state: ModelLoad = "available"
    last_used: float = 0.0  # monotonic: when it last had work
    holds_memory: bool = False  # its process runs and serves (not refusing)
    refusing: bool = False  # its process answers its requests model_unavailable
    failed: str | None = None  # why it is not loaded, once given up


@dataclass(frozen=True)
class Demand:
    """A model's queue (with its lanes), as the look read it."""

    unread: bool = False  # requests nobody has read
    pending: bool = False  # requests read and not finished
    oldest_s: float | None = None  # how long the oldest unread one has waited


@dataclass(frozen=True)
class Look:
    """What the host saw of the fleet at one look."""

    now: float
    demand: dict[str, Demand]
    served_elsewhere: frozenset[str] = frozenset()  # queues a live worker not of this host serves
    loading_elsewhere: frozenset[str] = frozenset()  # queues another host holds the load lease of
    other_hosts: Sequence[HostRecord] = ()


@dataclass(frozen=True)
class Policy:
    """The host's own figures and settings."""

    name: str
    budget: int
    idle_unload_s: float
    scale_up_after_s: float
    tick_s: float  # a model used within one look is not idle


@dataclass(frozen=True)
class Decision:
    """One thing to do: `load`, `unload` (`why`: idle or room), `refuse` (start a worker
    that answers its requests with the reason it failed), or `give_up` (`why`: the reason)."""

    action: Literal["load", "unload", "refuse", "give_up"]
    queue: str
    why: str = ""


def decide(policy: Policy, models: Sequence[Model], look: Look) -> list[Decision]:
    """What to do at this look, in order; each decision is counted in before the next model."""
    plan = _Plan(policy, look, list(models))
    for index in range(len(plan.models)):
        plan.consider(index)
    return plan.decisions


class _Plan:
    """The decisions of one look, over the models as they will be once these are done."""

    def __init__(self, policy: Policy, look: Look, models: list[Model]) -> None:
        self.policy, self.look, self.models = policy, look, models
        self.decisions: list[Decision] = []

    def consider(self, index: int) -> None:
        model, look = self.models[index], self.look
        demand = look.demand.get(model.queue, Demand())
        served_elsewhere = model.queue in look.served_elsewhere
        # Entries read but unfinished are work only where no live worker holds them (a dead one's).
        waiting = demand.unread or (demand.pending and not served_elsewhere)
        unloadable = not model.pin or model.refusing  # a refusing one is tried again once idle
        if model.state == "loaded" and unloadable and look.now - model.last_used >= self.policy.idle_unload_s:
            self._do(index, Decision("unload", model.queue, "idle"), state="draining")
        elif model.state == "available" and waiting and model.queue not in look.loading_elsewhere:
            backlog = demand.oldest_s is not None and demand.oldest_s >= self.policy.scale_up_after_s
            if served_elsewhere and not backlog:
                return
            if model.failed is None:
                self._place(index)
            elif not served_elsewhere:
                self._do(index, Decision("refuse", model.queue), state="loading", refusing=True)

    def _place(self, index: int) -> None:
        model = self.models[index]
        if not self._preferred_for(model):
            return
        room = self.policy.budget - sum(m.footprint for m in self.models if m.pin and m is not model)
        if model.footprint > room:  # seen to hold more than its estimate: it cannot fit here at all
            why = (f"it needs {gb(model.footprint)} GB, more than the {gb(room)} GB memory_budget_gb leaves "
                   "beside the pinned models")
            self._do(index, Decision("give_up", model.queue, why), failed=why)
        elif model.footprint > self.free():
            self._make_room(model)  # it loads at a later look, once those unloaded have exited
        else:
            self._do(index, Decision("load", model.queue), state="loading", holds_memory=True)

    def _make_room(self, model: Model) -> None:
        """Unload idle models until `model` will fit, counting those already unloading."""
        coming = sum(m.footprint for m in self.models if m.state == "draining" and m.holds_memory)
        short = model.footprint - self.free() - coming
        idle = sorted((i for i, m in enumerate(self.models)
                       if m.state == "loaded" and not m.pin and m is not model
                       and self.look.now - m.last_used > self.policy.tick_s),
                      key=lambda i: (self.models[i].queue not in self.look.served_elsewhere,
                                     self.models[i].last_used))
        for victim in idle:
            if short <= 0:
                return
            self._do(victim, Decision("unload", self.models[victim].queue, "room"), state="draining")
            short -= self.models[victim].footprint

    def _preferred_for(self, model: Model) -> bool:
        """Whether this host has the most free budget (then the lowest name) among the
        live hosts that can load the model now."""
        mine = self.free()
        for other in self.look.other_hosts:
            offers = any(m.name == model.queue and m.offered for m in other.models)
            free = other.free_bytes
            if offers and free >= model.footprint and (free > mine or (free == mine and other.name < self.policy.name)):
                return False
        return True

    def free(self) -> int:
        return self.policy.budget - sum(m.footprint for m in self.models if m.holds_memory)

    def _do(self, index: int, decision: Decision, **after: object) -> None:
        self.decisions.append(decision)
        self.models[index] = replace(self.models[index], **after)  # type: ignore[arg-type]


def gb(nbytes: int) -> float:
    return round(nbytes / 1024 ** 3, 3)
