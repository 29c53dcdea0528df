"""A LoRA adapter for a demo model, in mlx-lm's format (what `mlx_lm.lora` writes), with
random weights large enough that greedy text visibly changes: tests and the README's
examples serve adapters with no download and no training run."""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_KEYS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")


def write_adapter(out: Path, base: Path, seed: int = 0, rank: int = 8, scale: float = 4.0,
                  keys: tuple[str, ...] = DEFAULT_KEYS) -> Path:
    """Write `adapter_config.json` and `adapters.safetensors` for the model at `base` into
    `out`: every layer's `keys` changed, with rank `rank`."""
    import mlx.core as mx
    from mlx_lm import load

    from worker.engine.adapters.files import linear_shapes

    model, _ = load(str(base))  # type: ignore[misc]
    shapes = linear_shapes(model)
    layers = len(model.layers)
    mx.random.seed(seed)
    weights = {}
    for path, (inputs, outputs) in sorted(shapes.items()):
        if not any(path.endswith(f".{key}") for key in keys):
            continue
        bound = 1 / inputs ** 0.5
        weights[f"{path}.lora_a"] = mx.random.uniform(-bound, bound, (inputs, rank))
        weights[f"{path}.lora_b"] = mx.random.normal((rank, outputs)) * 0.5
    if not weights:
        raise ValueError(f"{base}: no linear layer named {', '.join(keys)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "model": str(base), "num_layers": layers,
              "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)}}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
