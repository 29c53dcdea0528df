"""Reading a LoRA adapter in mlx-lm's format, and checking that it fits the model.

`mlx_lm.lora` writes a directory with `adapter_config.json` (`fine_tune_type`,
`num_layers`, `lora_parameters {rank, scale, dropout, keys}`) and `adapters.safetensors`
(`<module path>.lora_a` of shape (in, rank) and `.lora_b` of shape (rank, out)). Only
plain LoRA on linear layers batches: a DoRA adapter rescales each weight per adapter and
a full fine-tune is a model of its own, so both are refused with the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

Shape = tuple[int, int]  # a linear layer's (input, output) dimensions


class AdapterRefused(ValueError):
    """An adapter that cannot be served with this model; the message says why."""


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter, read and checked: for each linear layer it changes, its A (in, rank)
    and B (rank, out) in float32, and the scale its update is multiplied by."""

    name: str
    path: str
    rank: int
    scale: float
    pairs: dict[str, tuple[mx.array, mx.array]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())


def linear_shapes(model: nn.Module) -> dict[str, Shape]:
    """Every linear layer of `model` an adapter may change, by module path, with its
    (input, output) dimensions (a quantized layer's unpacked input)."""
    shapes: dict[str, Shape] = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            out, packed = module.weight.shape
            shapes[path] = (packed * 32 // module.bits, out)
        elif isinstance(module, nn.Linear):
            out, inputs = module.weight.shape
            shapes[path] = (inputs, out)
    return shapes


def read_adapter(name: str, path: str, shapes: dict[str, Shape], max_rank: int) -> AdapterWeights:
    """Read the adapter at `path` and check it against the model's linear layers."""
    where = Path(path).expanduser()
    config = _config(name, where)
    kind = config.get("fine_tune_type", "lora")
    if kind == "dora":
        raise AdapterRefused(f"adapter {name!r}: DoRA rescales each weight per adapter, which does not batch; "
                             "fuse it into the model (mlx_lm.fuse) and serve that as a model")
    if kind != "lora":
        raise AdapterRefused(f"adapter {name!r}: fine_tune_type {kind!r} is not a LoRA adapter (a full "
                             "fine-tune is a model of its own: serve it as one)")
    parameters = config.get("lora_parameters")
    if not isinstance(parameters, dict):
        raise AdapterRefused(f"adapter {name!r}: adapter_config.json has no lora_parameters")
    rank, scale = parameters.get("rank"), parameters.get("scale")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterRefused(f"adapter {name!r}: lora_parameters.rank must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise AdapterRefused(f"adapter {name!r}: its rank {rank} is above this worker's max_lora_rank {max_rank}")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise AdapterRefused(f"adapter {name!r}: lora_parameters.scale must be a number, not {scale!r}")
    pairs = _pairs(name, where, _weights(name, where), shapes, rank)
    return AdapterWeights(name, str(where), rank, float(scale), pairs)


def _config(name: str, where: Path) -> dict[str, Any]:
    file = where / "adapter_config.json"
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterRefused(f"adapter {name!r}: no adapter_config.json in {where}") from None
    except (OSError, ValueError) as e:
        raise AdapterRefused(f"adapter {name!r}: cannot read {file}: {e}") from None
    if not isinstance(config, dict):
        raise AdapterRefused(f"adapter {name!r}: {file} is not a JSON object")
    return config


def _weights(name: str, where: Path) -> dict[str, mx.array]:
    file = where / "adapters.safetensors"
    if not file.is_file():
        raise AdapterRefused(f"adapter {name!r}: no adapters.safetensors in {where}")
    try:
        loaded = mx.load(str(file))
    except Exception as e:  # noqa: BLE001 - any unreadable file is the adapter's fault
        raise AdapterRefused(f"adapter {name!r}: cannot read {file}: {e}") from None
    assert isinstance(loaded, dict)
    return loaded


def _pairs(name: str, where: Path, weights: dict[str, mx.array], shapes: dict[str, Shape],
           rank: int) -> dict[str, tuple[mx.array, mx.array]]:
    """Each changed layer's (A, B), checked: both halves, the rank, the layer's shape."""
    halves: dict[str, dict[str, mx.array]] = {}
    for key, array in weights.items():
        module, _, leaf = key.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            raise AdapterRefused(f"adapter {name!r}: {key} is not a LoRA weight (lora_a, lora_b); "
                                 "only LoRA adapters batch")
        halves.setdefault(module, {})[leaf] = array
    if not halves:
        raise AdapterRefused(f"adapter {name!r}: {where / 'adapters.safetensors'} holds no LoRA weights")
    pairs = {}
    for module, half in sorted(halves.items()):
        if module not in shapes:
            raise AdapterRefused(f"adapter {name!r}: it changes {module}, which is not a linear layer of this "
                                 "model (an adapter for another base?)")
        if set(half) != {"lora_a", "lora_b"}:
            raise AdapterRefused(f"adapter {name!r}: {module} has {', '.join(half)} only")
        a, b = half["lora_a"], half["lora_b"]
        (inputs, out) = shapes[module]
        if a.shape != (inputs, rank) or b.shape != (rank, out):
            raise AdapterRefused(f"adapter {name!r}: {module} is {inputs} -> {out} in this model, but its lora_a "
                                 f"is {tuple(a.shape)} and lora_b {tuple(b.shape)} with rank {rank} (an adapter "
                                 "for another base?)")
        pairs[module] = (a.astype(mx.float32), b.astype(mx.float32))
    mx.eval([p for pair in pairs.values() for p in pair])
    return pairs
