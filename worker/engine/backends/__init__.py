"""Engine backends: the batch generators the engine drives, and loading a model for one.

The engine sees only `BatchBackend` and `Loaded`; each backend module owns one library's
batching API, which moves between minor releases:

    mlx_lm    text models, mlx-lm's BatchGenerator
    mlx_vlm   vision-language models, mlx-vlm's BatchGenerator (the `vision` extra)
    sim       a simulated engine for fleet-scale runs (`--model sim:...`)

`load_model` picks mlx-vlm when the model's config has a vision tower or a setting asks
for what only mlx-vlm's batch has (a quantized KV cache, an SSD tier), else mlx-lm. It runs on the
engine thread; this module imports no MLX itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from worker.engine.backends.base import (
    VISION_EXTRA,
    BatchBackend,
    Coverage,
    Loaded,
    ModelInfo,
    PoolingInfo,
    RerankFormat,
    Task,
    TokenOut,
)

if TYPE_CHECKING:
    from worker.settings import WorkerSettings

__all__ = ["VISION_EXTRA", "BatchBackend", "Coverage", "Loaded", "ModelInfo", "PoolingInfo", "RerankFormat", "Task",
           "TokenOut", "has_model_file", "is_vision_model", "load_model", "mlx_vlm_only", "model_file", "task_of"]


def load_model(settings: WorkerSettings, refusing: bool = False) -> Loaded:
    """The configured model (a local path or a Hugging Face id), loaded by mlx-vlm if its
    config has a vision tower, else by mlx-lm; nothing (a simulated model under its name)
    for a worker `refusing` every request."""
    assert settings.model is not None, "the command line resolves the demo model"
    if settings.model.startswith("sim:") or refusing:
        from worker.engine.backends.sim import load_sim

        return load_sim("sim:" if refusing else settings.model, name=settings.model)
    task = task_of(settings)
    if task != "generate":
        try:
            from worker.engine.backends.pooling import load_pooling_model
        except ImportError as e:
            raise RuntimeError(f"{settings.model} serves {task}: {VISION_EXTRA} ({e})") from e
        return load_pooling_model(settings, task)
    vision = is_vision_model(settings.model)
    needs = mlx_vlm_only(settings)
    if vision or needs:
        try:
            from worker.engine.backends.mlx_vlm import load_through_mlx_vlm
        except ImportError as e:
            why = "is a vision model" if vision else f"with {needs}"
            raise RuntimeError(f"{settings.model} {why}: {VISION_EXTRA} ({e})") from e
        return load_through_mlx_vlm(settings, vision=vision)
    from worker.engine.backends.mlx_lm import load_text_model

    return load_text_model(settings)


def mlx_vlm_only(settings: WorkerSettings) -> str | None:
    """The settings that only mlx-vlm's batch serves (mlx-lm 0.32's has no quantized
    KV cache, and its prefix cache no disk tier), named for a message; None when
    mlx-lm's batch serves them all."""
    named = [name for name in ("kv_bits", "ssd_cache_dir") if getattr(settings, name) is not None]
    return " and ".join(named) or None


def task_of(settings: WorkerSettings) -> Task:
    """The configured task, or the one the model's files say (`WorkerSettings.task`)."""
    if settings.task != "auto":
        return settings.task
    assert settings.model is not None
    config = json.loads(model_file(settings.model, "config.json").read_text())
    if any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        return "rerank"
    return "embed" if has_model_file(settings.model, "modules.json") else "generate"


def is_vision_model(path: str) -> bool:
    """Whether the model's config describes a vision-language model (it has a vision tower)."""
    return "vision_config" in json.loads(model_file(path, "config.json").read_text())


def has_model_file(path: str, name: str) -> bool:
    """Whether a model directory or Hugging Face repository has this file."""
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return model_file(path, name).exists()
    except EntryNotFoundError:
        return False


def model_file(path: str, name: str) -> Path:
    """One file of a model directory, or of a Hugging Face repository (fetched alone)."""
    local = Path(path)
    if local.is_dir():
        return local / name
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(path, name))
    except EntryNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - offline, unknown repo, bad id, no access: one message for all
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise RuntimeError(f"model {path!r} is not a local directory, and Hugging Face did not provide it "
                           f"({type(e).__name__}: {reason}); give a model directory or a Hugging Face id "
                           "such as mlx-community/Qwen3-0.6B-8bit") from e
