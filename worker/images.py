"""A request's images and text turned into prompt tokens and `PreparedMedia`, off the engine thread.

Image bytes are decoded with Pillow under this worker's limits, resized and cut into
patches by the model's own image processor (numpy, no MLX), and keyed by a hash of
their bytes for the vision-embedding cache. The prompt gets the model's image
placeholders through mlx-vlm's chat formatting, each expanded to as many image tokens
as its image has patches after merging. The engine thread only runs the vision tower.
"""

from __future__ import annotations

import hashlib
import io
from typing import TYPE_CHECKING, Any

import numpy as np

from client.protocol import ErrorCode, Message, RequestBody, RequestRejected, TextPart, decode_images

from .media import PreparedMedia

if TYPE_CHECKING:
    from PIL import Image

# The families whose processor and vision tower this module drives: numpy patches
# with a (t, h, w) grid per image, and a tower that takes them one image at a time.
SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


class VisionPrompts:
    """Builds the token ids and image inputs of requests for one vision model."""

    def __init__(self, processor: Any, model_config: Any, model_name: str, *, max_images: int,
                 max_image_pixels: int) -> None:
        self.processor = processor
        self.model_config = model_config
        self.model_name = model_name
        self.max_images = max_images
        self.max_image_pixels = max_image_pixels
        self.image_token: str = processor.image_token
        self.merge = processor.image_processor.merge_size ** 2

    def prepare(self, body: RequestBody, template_kwargs: dict[str, Any] | None = None,
                ) -> tuple[list[int], list[PreparedMedia]]:
        """The prompt's token ids, image tokens expanded, and its images; raises
        `RequestRejected`. `template_kwargs` go to the chat template (tools, the request's
        chat_template_kwargs)."""
        assert body.images
        if len(body.images) > self.max_images:
            raise RequestRejected(f"images: {len(body.images)} images; this worker's max_images is {self.max_images}",
                                 code=ErrorCode.TOO_LARGE)
        if body.prompt_tokens is not None:
            raise RequestRejected("images: send them with prompt or messages, not prompt_tokens "
                                 "(the worker places the image tokens)")
        images = [self._prepare_image(i, data) for i, data in enumerate(decode_images(body.images))]
        conversation, order = self._conversation(body, len(images))
        in_prompt = [images[i] for i in order]
        return self._tokens(conversation, in_prompt, template_kwargs or {}), in_prompt

    @staticmethod
    def _conversation(body: RequestBody, count: int) -> tuple[str | list[Any], list[int]]:
        """What mlx-vlm's chat formatting takes, and the images in the order their
        placeholders come. Parts keep each image in its message; with no parts at all, the
        images go into the last user message, as mlx-vlm places them; with parts, those no
        part points to go first in the last user message."""
        if body.messages is None:  # a plain prompt with images: one user message
            return body.prompt or "", list(range(count))
        if not any(m.media_parts() for m in body.messages):
            return [m.model_dump(exclude_none=True) for m in body.messages], list(range(count))
        pointed = {part.index for m in body.messages for part in m.media_parts()}
        loose = [i for i in range(count) if i not in pointed]
        last_user = max(i for i, m in enumerate(body.messages) if m.role == "user")
        conversation: list[Any] = []
        order: list[int] = []
        for i, message in enumerate(body.messages):
            entry = message.model_dump(exclude_none=True)
            first = loose if i == last_user else []
            if message.media_parts() or first:
                entry["content"] = _parts_with_images(message, first, order)
            elif isinstance(message.content, list):
                entry["content"] = message.text  # no image here: what a text model gets
            conversation.append(entry)
        return conversation, order

    def _prepare_image(self, index: int, data: bytes) -> PreparedMedia:
        """The processor's patches (`pixel_values`: t * h * w rows) and their (t, h, w) grid
        (`image_grid_thw`); one image token per `merge` patches."""
        image = decode_image(data, index, self.max_image_pixels)
        out = self.processor.image_processor([image])
        grid = np.asarray(out["image_grid_thw"][:1], dtype=np.int64)
        key = f"{self.model_name}:{hashlib.sha256(data).hexdigest()}"
        return PreparedMedia("image", key, {"pixel_values": np.asarray(out["pixel_values"]), "image_grid_thw": grid},
                             int(np.prod(grid)) // self.merge)

    def _tokens(self, conversation: str | list[Any], images: list[PreparedMedia],
                template_kwargs: dict[str, Any]) -> list[int]:
        from mlx_vlm.prompt_utils import apply_chat_template

        try:
            text = str(apply_chat_template(self.processor, self.model_config, conversation, num_images=len(images),
                                           **template_kwargs))
        except Exception as e:  # noqa: BLE001 - a template that fails on this request fails the request
            raise RequestRejected(f"messages: the model's chat template failed on them ({ascii(str(e)[:300])})") from e
        pieces = text.split(self.image_token)
        if len(pieces) != len(images) + 1:
            raise RequestRejected(f"images: the prompt has {len(pieces) - 1} image placeholders for "
                                 f"{len(images)} images")
        expanded = pieces[0]
        for image, piece in zip(images, pieces[1:], strict=True):
            expanded += self.image_token * image.tokens + piece
        return list(self.processor.tokenizer.encode(expanded, add_special_tokens=False))


def _parts_with_images(message: Message, first: list[int], order: list[int]) -> list[dict[str, Any]]:
    """The message's parts as mlx-vlm takes them, images `first` ahead of its own; the
    index of each image placed is appended to `order`."""
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in first]
    order += first
    for part in message.content if isinstance(message.content, list) else [TextPart(type="text", text=message.text)]:
        if isinstance(part, TextPart):
            parts.append({"type": "text", "text": part.text})
        else:
            parts.append({"type": "image"})
            order.append(part.index)
    return parts


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
