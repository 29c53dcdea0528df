"""Image bytes decoded under this worker's limits, before any model sees them."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from client.protocol import ErrorCode, RequestRejected

if TYPE_CHECKING:
    from PIL import Image


def decode_image(data: bytes, index: int, max_pixels: int) -> Image.Image:
    """An RGB image from bytes; raises `RequestRejected` naming the image and what is wrong."""
    from PIL import Image, UnidentifiedImageError  # the `vision` extra: only a vision model's worker gets here

    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise RequestRejected(f"images.{index}: not an image (Pillow cannot identify {len(data)} bytes "
                             f"starting {data[:8]!r})") from None
    except Image.DecompressionBombError as e:
        raise RequestRejected(f"images.{index}: {e}", code=ErrorCode.TOO_LARGE) from None
    width, height = image.size
    if width * height > max_pixels:
        raise RequestRejected(f"images.{index}: {width}x{height} is {width * height} pixels; this worker's "
                             f"max_image_pixels is {max_pixels}", code=ErrorCode.TOO_LARGE)
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as e:  # Pillow's ways of saying truncated or corrupt
        raise RequestRejected(f"images.{index}: a {image.format} image that cannot be decoded, "
                             f"truncated or corrupt ({e})") from None
    return image.convert("RGB")
