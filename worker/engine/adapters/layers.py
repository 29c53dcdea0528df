"""The batched LoRA layer and how each row's adapter travels with the batch.

Every row of a step may use another adapter: a layer computes the base output once for
the batch and adds `scale[i] * (x[i] @ A[i]) @ B[i]`, with A and B stacked over the
layer's slots and `mx.gather_mm` picking row i's slot (slot 0 holds zeros: no adapter).
That is mlx-lm's `LoRALinear` computation, row by row.

Which row is which is mlx-lm's business: its batches filter, extend, split and merge
their caches as sequences come and go. So each sequence's cache list ends with one more
entry, `AdapterRows`, that holds its slot and is filtered, extended and merged with the
others; `AdapterModel` takes it off the list before the model sees the caches and tells
the layers the step's slots.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


class StepSlots:
    """The current forward pass's adapter slot per row (None: no row uses an adapter),
    and each slot's scale; shared by the model wrapper and every LoRA layer."""

    def __init__(self, slots: int) -> None:
        self.scales = mx.zeros((slots,), dtype=mx.float32)
        self.rows: mx.array | None = None  # (batch,) slot indices
        self.row_scales: mx.array | None = None  # (batch, 1, 1)

    def use(self, rows: AdapterRows) -> None:
        if not any(rows.slots):
            self.rows = self.row_scales = None
            return
        self.rows = mx.array(rows.slots, dtype=mx.uint32)
        self.row_scales = self.scales[self.rows].reshape(-1, 1, 1)


class BatchedLoRALinear(nn.Module):
    """A linear layer (plain or quantized) plus one LoRA update per row, from its slot."""

    def __init__(self, base: nn.Module, step: StepSlots, slots: int, shape: tuple[int, int]) -> None:
        super().__init__()
        self.base = base
        self._step = step
        inputs, out = shape
        self.lora_a = mx.zeros((slots, inputs, 1), dtype=mx.float32)
        self.lora_b = mx.zeros((slots, 1, out), dtype=mx.float32)

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[-1])

    def put(self, slot: int, a: mx.array | None, b: mx.array | None) -> None:
        """Fill `slot` with (A, B), zeros where None; ranks below the layer's are padded
        with zeros (which add nothing), a larger one pads every other slot."""
        rank = max(self.rank, 0 if a is None else int(a.shape[-1]))
        if rank > self.rank:
            grow = rank - self.rank
            self.lora_a = mx.pad(self.lora_a, [(0, 0), (0, 0), (0, grow)])
            self.lora_b = mx.pad(self.lora_b, [(0, 0), (0, grow), (0, 0)])
        if a is None or b is None:
            self.lora_a[slot] = 0
            self.lora_b[slot] = 0
        else:
            r = int(a.shape[-1])
            self.lora_a[slot] = mx.pad(a, [(0, 0), (0, rank - r)])
            self.lora_b[slot] = mx.pad(b, [(0, rank - r), (0, 0)])
        mx.eval(self.lora_a, self.lora_b)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        step = self._step
        if step.rows is None or step.row_scales is None:
            return y
        z = mx.gather_mm(mx.gather_mm(x, self.lora_a, rhs_indices=step.rows), self.lora_b, rhs_indices=step.rows)
        return y + (step.row_scales * z).astype(x.dtype)


class AdapterRows:
    """The last entry of a sequence's cache list: its adapter slot (0: none). mlx-lm
    merges, filters, extends and extracts it with the sequence's KV caches, so the slots
    stay in the batch's row order; it holds no keys or values."""

    def __init__(self, slots: list[int]) -> None:
        self.slots = slots

    @classmethod
    def one(cls, slot: int) -> AdapterRows:
        return cls([slot])

    def merge(self, caches: list[AdapterRows]) -> AdapterRows:
        return AdapterRows([slot for cache in caches for slot in cache.slots])

    def extend(self, other: AdapterRows) -> None:
        self.slots.extend(other.slots)

    def filter(self, keep: list[int]) -> None:
        self.slots = [self.slots[i] for i in keep]

    def extract(self, index: int) -> AdapterRows:
        return AdapterRows([self.slots[index]])

    def prepare(self, **_: Any) -> None:
        """Padding is the KV caches' concern."""

    def finalize(self) -> None:
        """Nothing to settle."""

    @property
    def state(self) -> list[mx.array]:
        return []

    @property
    def nbytes(self) -> int:
        return 0


class AdapterModel:
    """What the batch generator calls instead of the model: it takes the `AdapterRows`
    entry off the cache list and sets the step's slots before the model runs. Anything
    else is the model's own."""

    def __init__(self, model: nn.Module, step: StepSlots) -> None:
        self.model = model
        self.step = step

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kwargs: Any) -> mx.array:
        assert cache is not None and isinstance(cache[-1], AdapterRows), "every sequence carries its adapter slot"
        self.step.use(cache[-1])
        return self.model(inputs, cache=cache[:-1], **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
