"""The vision features of a request's images, computed on their own so that they can be cached.

A family's `get_input_embeddings` runs its vision tower and merges the features into
the token embeddings; given `cached_image_features`, it merges those instead. For the
vision-embedding cache to hold them, the tower must be run apart from the merge, which
each family does its own way: the families below are those where that gives exactly
what the merge would have computed. The others run their tower on every request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx

Encoder = Callable[[Any, mx.array | None, Mapping[str, Any]], Any]  # (model, pixel_values, other inputs)


def _qwen2(model: Any, pixels: mx.array | None, inputs: Mapping[str, Any]) -> mx.array:
    """Its tower over the request's images, or else its videos (it takes one kind a request)."""
    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    if pixels is None:
        pixels, grid = inputs["pixel_values_videos"], inputs["video_grid_thw"]
    else:
        grid = inputs["image_grid_thw"]
    return model.vision_tower(pixels.astype(dtype), grid, output_hidden_states=False)


def _gemma3(model: Any, pixels: mx.array | None, inputs: Mapping[str, Any]) -> mx.array:
    assert pixels is not None, "Gemma 3 takes videos as frames, images"
    dtype = model.language_model.model.embed_tokens.weight.dtype
    hidden, _, _ = model.vision_tower(pixels.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True)
    return model.multi_modal_projector(hidden)


OWN_ENCODERS: dict[str, Encoder] = {"qwen2_vl": _qwen2, "qwen2_5_vl": _qwen2, "gemma3": _gemma3}

# Why a family's features are not cached, where the reason is more than "not listed".
NOT_CACHED = {
    "qwen3_vl": "its tower also feeds features into the language model's first layers (deepstack), "
                "which cached features skip",
    "qwen3_vl_moe": "as qwen3_vl",
    "idefics3": "its tower's input is cut out of the request's padded image grid inside get_input_embeddings",
    "smolvlm": "as idefics3",
}


def encoder_for(model: Any) -> Encoder | None:
    """How to compute `model`'s image features alone: its family's own way, mlx-vlm's
    `encode_images` / `encode_image` where the model has them, or None (not cached)."""
    model_type = model.config.model_type
    if model_type in NOT_CACHED:
        return None
    if model_type in OWN_ENCODERS:
        return OWN_ENCODERS[model_type]
    if hasattr(model, "encode_images"):
        return lambda model, pixels, inputs: model.encode_images(pixels, **inputs)
    if hasattr(model, "encode_image"):
        return lambda model, pixels, inputs: model.encode_image(pixels)
    return None


def not_cached_because(model_type: str) -> str:
    """Why the image features of `model_type` are not cached, for the start-up log."""
    return NOT_CACHED.get(model_type, "mlx-vlm runs its tower only inside get_input_embeddings")
