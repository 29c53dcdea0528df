"""Which adapters a worker knows, which are loaded, which sit in the layers' slots, and
which running sequences use them. Owned by the engine thread.

Three levels, as vLLM has them: *known* adapters (name -> path: the settings' and those
loaded at runtime), *loaded* ones (read and checked, at most `max_loaded_adapters`, the
least recently used dropped and read again when next asked for) and *slotted* ones (in
the layers' stacked weights, at most `max_loras`: the distinct adapters one batch may
mix). A sequence holds its adapter's slot from admission to its end; a request whose
adapter finds no free slot waits for one.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import mlx.nn as nn
import structlog
from mlx.utils import tree_unflatten

from worker.engine.adapters.files import AdapterRefused, AdapterWeights, linear_shapes, read_adapter
from worker.engine.adapters.layers import AdapterModel, BatchedLoRALinear, StepSlots

log = structlog.get_logger("mlxq.engine")


class UnknownAdapter(LookupError):
    """A request named an adapter this worker does not serve."""


@dataclass
class _Slot:
    name: str | None = None
    identity: str = ""
    users: int = 0


class AdapterBank:
    """The adapters of one loaded text model, and its LoRA layers."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_loaded: int) -> None:
        self.step = StepSlots(max_loras + 1)
        self.model = AdapterModel(model, self.step)
        self._base = model
        self._shapes = linear_shapes(model)
        self._max_rank, self._max_loaded = max_rank, max_loaded
        self._known: dict[str, str] = {}  # name -> path
        self._refused: dict[str, tuple[str, str]] = {}  # name -> the path asked for, why it was refused
        self._loaded: OrderedDict[str, AdapterWeights] = OrderedDict()  # least recently used first
        self._loads = 0  # a new identity for each load: a reloaded name never hits the old one's caches
        self._identity: dict[str, str] = {}
        self._slots = [_Slot() for _ in range(max_loras + 1)]  # slot 0: no adapter, never handed out
        self._layers: dict[str, BatchedLoRALinear] = {}
        self._started: Counter[str] = Counter()  # sequences started with each adapter, by name

    # ---- what admins do ------------------------------------------------------------

    def load(self, name: str, path: str) -> AdapterWeights:
        """Read and check an adapter and serve it under `name` (a new path for a known
        name replaces it for requests admitted from now on)."""
        weights = read_adapter(name, path, self._shapes, self._max_rank)
        self._forget(name)
        self._known[name] = path
        self._loads += 1
        self._identity[name] = f"{name}#{self._loads}"
        self._keep(weights)
        return weights

    def serve(self, wanted: dict[str, str]) -> None:
        """Serve exactly `wanted` (name -> path): load what is new or moved, unload what
        is gone. A refused one is logged and listed with its reason; where it was to
        replace another path of its name, that one serves on."""
        for name in self._known.keys() - wanted.keys():
            self._forget(name)
        self._refused = {name: refused for name, refused in self._refused.items() if wanted.get(name) == refused[0]}
        for name, path in wanted.items():
            if self._known.get(name) == path or (name in self._refused and self._refused[name][0] == path):
                continue
            try:
                self.load(name, path)
            except AdapterRefused as e:
                log.error("adapter refused", adapter=name, path=path, reason=str(e))
                self._refused[name] = (path, str(e))

    def unload(self, name: str) -> None:
        """Stop serving `name`; sequences already running with it run to their end."""
        if name not in self._known:
            raise UnknownAdapter(self._unknown(name))
        self._forget(name)

    def listing(self) -> list[dict[str, object]]:
        """What the heartbeat says of each known adapter."""
        running = {slot.identity: slot.users for slot in self._slots if slot.name is not None}
        served = [{"name": name, "path": path, "loaded": name in self._loaded,
                   **({"rank": self._loaded[name].rank} if name in self._loaded else {}),
                   "running": running.get(self._identity[name], 0), "requests": self._started[name]}
                  for name, path in self._known.items()]
        refused: list[dict[str, object]] = [{"name": name, "path": path, "error": error}
                                            for name, (path, error) in self._refused.items()]
        return sorted(served + refused, key=lambda entry: str(entry["name"]))

    @property
    def names(self) -> list[str]:
        return sorted(self._known)

    # ---- what the engine core does -------------------------------------------------

    def identity(self, name: str) -> str:
        """What this load of `name` is called in the prefix cache's namespace."""
        if name not in self._known:
            raise UnknownAdapter(self._unknown(name))
        return self._identity[name]

    def acquire(self, name: str) -> int | None:
        """A slot holding `name` for one more sequence; None while every slot is in use
        by other adapters' sequences. Raises `UnknownAdapter`, or `AdapterRefused` when
        its files no longer read."""
        identity = self.identity(name)
        slot = next((i for i, s in enumerate(self._slots) if i and s.identity == identity), None)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self._install(slot, self._weights(name), identity)
        self._slots[slot].users += 1
        self._started[name] += 1
        return slot

    def release(self, slot: int) -> None:
        """A sequence holding `slot` ended."""
        self._slots[slot].users -= 1

    # ---- inside --------------------------------------------------------------------

    def _unknown(self, name: str) -> str:
        if name in self._refused:
            return f"adapter {name!r} is not served: it was refused at load ({self._refused[name][1]})"
        served = ", ".join(sorted(self._known)) or "none"
        return f"unknown adapter {name!r} (this worker's adapters: {served})"

    def _forget(self, name: str) -> None:
        self._known.pop(name, None)
        self._loaded.pop(name, None)
        self._identity.pop(name, None)  # its slot, once free, is reused like any other

    def _keep(self, weights: AdapterWeights) -> None:
        self._loaded[weights.name] = weights
        self._loaded.move_to_end(weights.name)
        while len(self._loaded) > self._max_loaded:
            self._loaded.popitem(last=False)

    def _weights(self, name: str) -> AdapterWeights:
        weights = self._loaded.get(name)
        if weights is None:  # dropped as least recently used: read it again
            weights = read_adapter(name, self._known[name], self._shapes, self._max_rank)
        self._keep(weights)
        return weights

    def _free_slot(self) -> int | None:
        """An empty slot, else one whose adapter no running sequence uses."""
        free = [i for i, s in enumerate(self._slots) if i and s.users == 0]
        empty = [i for i in free if self._slots[i].name is None]
        return (empty or free)[0] if free else None

    def _install(self, slot: int, weights: AdapterWeights, identity: str) -> None:
        for path in weights.pairs.keys() - self._layers.keys():
            self._wrap(path)
        for path, layer in self._layers.items():
            a, b = weights.pairs.get(path, (None, None))
            layer.put(slot, a, b)
        self._slots[slot] = _Slot(weights.name, identity)
        scales = self.step.scales
        scales[slot] = weights.scale
        self.step.scales = scales

    def _wrap(self, path: str) -> None:
        """Put a batched LoRA layer around the linear layer at `path` (its other slots zeros)."""
        base = dict(self._base.named_modules())[path]
        layer = BatchedLoRALinear(base, self.step, len(self._slots), self._shapes[path])
        self._base.update_modules(tree_unflatten([(path, layer)]))
        self._layers[path] = layer


__all__ = ["AdapterBank", "AdapterRefused", "UnknownAdapter"]
