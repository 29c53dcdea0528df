"""Loading the model: a text model with mlx-lm or a vision model with mlx-vlm, chosen by
its config. Runs on the engine thread."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from . import demo_model
from .engine import Loaded, ModelInfo
from .generator import MlxBatchBackend
from .prefix_cache import PrefixCache
from .sampling import warm_up
from .settings import WorkerSettings


def model_path(settings: WorkerSettings) -> str:
    """The configured model, or the demo model (built on first use)."""
    if settings.model:
        return settings.model
    return str(demo_model.ensure(demo_model.default_path()))


def model_name(settings: WorkerSettings, path: str) -> str:
    """How logs, errors and the heartbeat name the model."""
    return settings.model or f"demo:{Path(path)}"


def load_model(settings: WorkerSettings) -> Loaded:
    """The configured model, loaded by mlx-vlm if its config has a vision tower, else by mlx-lm."""
    from .vision import is_vision_model, load_vision_model

    path = model_path(settings)
    if is_vision_model(path):
        return load_vision_model(settings, path, model_name(settings, path))
    return load_text_model(settings)


def load_text_model(settings: WorkerSettings) -> Loaded:
    """Load model and tokenizer (a local path or a Hugging Face id) through mlx-lm's `load()`."""
    from mlx_lm import load

    path = model_path(settings)
    model, tokenizer, config = load(path, return_config=True)  # type: ignore[misc]
    text_config: dict[str, Any] = config.get("text_config", config)  # type: ignore[union-attr,assignment]
    context = text_config.get("max_position_embeddings") or getattr(tokenizer, "model_max_length", 0) or 4096
    info = ModelInfo(name=model_name(settings, path), tokenizer=tokenizer,
                     context_length=int(context), vocab_size=int(text_config.get("vocab_size", len(tokenizer))))
    warm_up(info.vocab_size)

    def make_backend() -> MlxBatchBackend:
        return MlxBatchBackend(model, tokenizer.eos_token_ids,
                               completion_batch_size=settings.completion_batch_size,
                               prefill_batch_size=settings.prefill_batch_size,
                               prefill_step_size=settings.prefill_step_size)

    return Loaded(info=info, make_backend=make_backend, new_detokenizer=lambda: tokenizer.detokenizer,
                  prefix_cache=PrefixCache(settings.cache_budget_bytes(), settings.cache_max_entries),
                  memory=mlx_memory, release_memory=mx.clear_cache)


def mlx_memory() -> dict[str, int]:
    """MLX's memory figures, in bytes, for the heartbeat."""
    return {"active": mx.get_active_memory(), "peak": mx.get_peak_memory(), "cache": mx.get_cache_memory()}
