"""The host key (`mlxq:hosts:<name>`): what a worker of several models writes of itself
and its models each look, for the other hosts (who loads a cold queue) and for readers
(`mlxq status`, the gateway's `/v1/models`). One record, with its encoding, read here alone.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, cast, get_args

from .heartbeat import ModelLoad


@dataclass(frozen=True)
class HostedModel:
    """One model of a worker of several models, and where it stands there."""

    name: str  # the model's, and its queue's
    path: str
    state: ModelLoad  # loaded, loading, draining, available
    memory_bytes: int | None = None  # what it is counted for in the host's budget
    pin: bool = False
    failed: str | None = None  # why the host left it unloaded, if it did
    consumer: str = ""  # its worker process's consumer name
    host: str = ""  # the host's name (the key's, filled in as it is read)

    @property
    def offered(self) -> bool:
        """Whether its host could load it now: unloaded and not failed."""
        return self.state == "available" and self.failed is None

    @classmethod
    def from_wire(cls, raw: Any, host: str) -> HostedModel | None:
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
            return None
        state, memory, failed = raw.get("state"), raw.get("memory_bytes"), raw.get("failed")
        return cls(raw["name"], str(raw.get("path", "?")),
                   cast(ModelLoad, state if state in get_args(ModelLoad) else "available"),
                   memory if isinstance(memory, int) else None, raw.get("pin") is True,
                   failed if isinstance(failed, str) else None, str(raw.get("consumer", "")), host)


@dataclass(frozen=True)
class HostRecord:
    """A host's key: its name, budget and free bytes, how many looks it has taken, its models."""

    name: str
    host: str = ""  # the machine's hostname
    pid: int = 0
    budget_bytes: int = 0
    free_bytes: int = 0
    looks: int = 0  # looks taken: a reader can wait for the host to have looked again
    models: tuple[HostedModel, ...] = field(default_factory=tuple)

    def to_wire(self) -> str:
        body = asdict(self)
        # each model's queue is its name; written too, as docs/protocol.md has it
        body["models"] = [{**{k: v for k, v in asdict(m).items() if k != "host"}, "queue": m.name} for m in self.models]
        return json.dumps(body)

    @classmethod
    def from_wire(cls, raw: bytes | str | None) -> HostRecord | None:
        """The record, or None for a key that is gone or that does not read as one."""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return None
        name = body["name"]
        models = body.get("models")
        found = [HostedModel.from_wire(m, name) for m in models] if isinstance(models, list) else []
        numbers = {k: v if isinstance(v := body.get(k), int) else 0
                   for k in ("pid", "budget_bytes", "free_bytes", "looks")}
        return cls(name, str(body.get("host", "")), **numbers, models=tuple(m for m in found if m is not None))
