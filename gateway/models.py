"""Which queue serves a model, from the workers' heartbeats (and the configured map).

A request's `model` is a configured name, the model a live worker serves (its path or
Hugging Face id, as `/v1/models` lists it), a queue's name, or a LoRA adapter a live
worker serves (its name: the request goes to its model's queue with `adapter` set, as
vLLM lists `--lora-modules`). A model a worker of
several models can load counts as served though not loaded yet: a request for it goes
to its queue and waits there for the load (bounded by the request's timeout). The
heartbeats are read at most once a second, however many requests arrive.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import redis.asyncio as aioredis

from client.fleet import read_hosted_models_async, read_workers_async
from client.heartbeat import Heartbeat
from client.hosts import HostedModel
from client.keys import Keys
from client.protocol import Task

from .errors import ApiError
from .tenants import ADMIN, Caller

REFRESH_S = 1.0


@dataclass(frozen=True)
class Served:
    """A model as live workers serve it on one queue."""

    model: str
    queue: str
    since: int  # when its longest-running worker started (unix seconds)
    tool_call: tuple[str, str] | None  # how its model marks a tool call (start, end), when it has a format
    task: Task | None = None  # None until a worker has loaded it
    adapter: str | None = None  # a LoRA adapter of the queue's model, served under its own name (`model`)


class ModelDirectory:
    """The models live workers serve, read from their heartbeats."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, aliases: dict[str, str]) -> None:
        self.redis = redis
        self.keys = keys
        self.aliases = aliases
        self._read_at = -REFRESH_S
        self._live: list[Served] = []
        self._recent: set[str] = set()  # models and queues of workers seen in the last hour: a 503, not a 404

    async def resolve(self, model: str, caller: Caller = ADMIN) -> Served:
        """The queue to send a request for `model` to; raises `ApiError` 404 or 503. A model
        the caller's key may not call is a 404, as one that does not exist."""
        await self._refresh()
        queue = self.aliases.get(model)
        for served in self._live:
            if served.queue == queue or (queue is None and model in (served.model, served.queue)):
                if caller.may_call(model, served.queue, served.model):
                    return served
                raise self._unknown(model, caller)
        if caller.may_call(model, queue or model) and (queue is not None or model in self._recent):
            where = f"queue {queue!r}" if queue else f"model {model!r}"
            raise ApiError(503, f"no live worker serves {where}; start one, or retry", "server_error",
                           "no_worker", headers={"Retry-After": "5"})
        raise self._unknown(model, caller)

    def _unknown(self, model: str, caller: Caller) -> ApiError:
        served = ", ".join(self.names(caller)) or "none"
        return ApiError(404, f"The model `{model}` does not exist or you do not have access to it (served now: "
                        f"{served})", "invalid_request_error", "model_not_found", "model")

    async def listing(self, caller: Caller = ADMIN) -> list[dict[str, Any]]:
        """`/v1/models`: each live model, and each configured name whose queue has live
        workers, that the caller may call."""
        await self._refresh()
        return [{"id": name, "object": "model", "created": since, "owned_by": "mlxq"}
                for name, (queue, since) in sorted(self._entries().items()) if caller.may_call(name, queue)]

    def names(self, caller: Caller = ADMIN) -> list[str]:
        return sorted(name for name, (queue, _) in self._entries().items() if caller.may_call(name, queue))

    def _entries(self) -> dict[str, tuple[str, int]]:
        """Each name a live model answers to: its queue, and since when it is served."""
        by_queue = {s.queue: s for s in self._live}
        entries = {s.model: (s.queue, s.since) for s in self._live}
        entries.update({name: (queue, by_queue[queue].since) for name, queue in self.aliases.items()
                        if queue in by_queue})
        return entries

    async def _refresh(self) -> None:
        if time.monotonic() - self._read_at < REFRESH_S:
            return
        workers = await read_workers_async(self.redis, self.keys)
        loadable = await read_hosted_models_async(self.redis, self.keys)
        self._live = _served([w.heartbeat for w in workers if w.state == "ready"], loadable)
        self._recent = {name for w in workers for m in w.heartbeat.models for name in (m.path, m.queue)}
        self._read_at = time.monotonic()


def _served(heartbeats: list[Heartbeat], loadable: list[HostedModel]) -> list[Served]:
    """One entry per (model, queue), its oldest worker's start (0 for a model no worker
    has loaded yet, whose tool-call format is unknown until then); ordered by queue."""
    found: dict[tuple[str, str], Served] = {(m.path, m.name): Served(m.path, m.name, 0, None)
                                            for m in loadable if m.failed is None}
    for beat in heartbeats:
        for model in beat.models:
            if model.state != "loaded":
                continue
            since = int(beat.started_at)
            served = Served(model.path, model.queue, since, model.tool_call, model.task)
            for one in [served, *(_adapters(beat, served) if len(beat.models) == 1 else [])]:
                known = found.get((one.model, one.queue))
                if known is None or known.since == 0 or since < known.since:
                    found[(one.model, one.queue)] = one
    return sorted(found.values(), key=lambda s: (s.queue, s.adapter or ""))


def _adapters(beat: Heartbeat, model: Served) -> list[Served]:
    """The adapters a worker serves beside its model (not those it refused)."""
    listed = [] if beat.stats is None or beat.stats.adapters is None else beat.stats.adapters
    names = [a["name"] for a in listed if isinstance(a.get("name"), str) and "error" not in a]
    return [replace(model, model=name, adapter=name) for name in names]
