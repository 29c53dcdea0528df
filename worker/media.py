"""A request's media as the engine gets them: one type for every kind.

Preparation (decoding, resizing, the model's processor) happens off the engine thread,
per kind, and yields a `PreparedMedia` whose placeholder tokens are already in the
prompt; the engine thread only runs the model's encoder on `payload`, through the
embedding cache under `key`. Images are the one kind served today (`images.py`); video
and audio are new kinds of this type, with their own preparation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

MediaKind = Literal["image", "video", "audio"]


@dataclass(frozen=True)
class PreparedMedia:
    """One media item of a request, ready for the model's encoder."""

    kind: MediaKind
    key: str  # the embedding cache's key: the model and a hash of the content (and how it was sampled)
    payload: Mapping[str, np.ndarray]  # the processor's arrays, by the name the model takes them under
    tokens: int  # placeholder tokens it takes in the prompt
