"""A request's media as the engine gets them: one type for every kind.

Preparation (decoding, resizing, the model's processor) happens off the engine thread
and yields a `PreparedMedia` whose placeholder tokens are already in the prompt; the
engine thread only runs the model's encoders on `inputs`, through the embedding cache
under `key`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

MediaKind = Literal["image", "video", "audio"]


@dataclass(frozen=True)
class PreparedMedia:
    """A request's media items, ready for the model's encoders."""

    # The embedding cache's key: the model, and each item's kind and content hash (and how
    # it was sampled) in the order the prompt holds them.
    key: str
    inputs: Mapping[str, Any]  # the processor's outputs but the token ids (numpy arrays), by the model's names
    counts: Mapping[MediaKind, int]
