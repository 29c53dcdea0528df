"""The vision features of a request's images, computed on their own so that they can be cached.

A family's `get_input_embeddings` runs its vision tower and merges the features into
the token embeddings; given `cached_image_features`, it merges those instead. For the
vision-embedding cache to hold them, the tower must be run apart from the merge, which
each family does its own way: the families below are those where that gives exactly
what the merge would have computed (tested: a cached request reads as an uncached
one). The others run their tower on every request.
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


def _gemma4(model: Any, pixels: mx.array | None, inputs: Mapping[str, Any]) -> mx.array | None:
    """Its images' features (its videos' are not cached: it merges them apart)."""
    return None if pixels is None else model.encode_image(pixels, inputs.get("image_position_ids"))


ENCODERS: dict[str, Encoder] = {"qwen2_vl": _qwen2, "qwen2_5_vl": _qwen2, "gemma3": _gemma3, "gemma4": _gemma4}

# The families whose videos' features are cached too: natively, or as their frames' (Gemma 3).
CACHES_VIDEOS = ("qwen2_vl", "qwen2_5_vl", "gemma3")

# Why a family's features are not cached, where the reason is more than "not listed".
NOT_CACHED = {
    "qwen3_vl": "its tower also feeds features into the language model's first layers (deepstack), "
                "which cached features skip",
    "qwen3_vl_moe": "as qwen3_vl",
    "idefics3": "its tower's input is cut out of the request's padded image grid inside get_input_embeddings",
    "smolvlm": "as idefics3",
}


def encoder_for(model: Any) -> Encoder | None:
    """How to compute `model`'s vision features alone, or None (not cached). Only the
    families above, each checked to merge its cached features exactly as its own."""
    return ENCODERS.get(model.config.model_type)


def not_cached_because(model_type: str) -> str:
    """Why the vision features of `model_type` are not cached, for the start-up log."""
    return NOT_CACHED.get(model_type, "its tower has not been checked to run apart from the merge here")
