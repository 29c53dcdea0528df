"""A request's text and media turned into prompt tokens and `PreparedMedia`, off the engine thread.

Any family mlx-vlm serves goes through mlx-vlm's own steps, as its server takes them:
the chat template through `apply_chat_template` (which writes the family's media
markers), then `prepare_inputs`, where the family's processor resizes and patches the
images and expands each marker into its image tokens. What this module adds is ours:
media decoded under this worker's limits, each media item kept in its own turn, the
embedding cache's key, and every failure made that request's `RequestRejected`. The
engine thread only runs the model's encoders.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from client.protocol import ErrorCode, Message, RequestBody, RequestRejected, TextPart, decode_images

from .images import decode_image
from .media import PreparedMedia

# Gemma's chat templates open with the bos token themselves; mlx-vlm's server
# tokenizes their prompts without adding another (`_cpu_preprocess`).
TEMPLATE_ADDS_BOS = ("gemma3", "gemma3n", "gemma4", "gemma4_unified")


class VisionPrompts:
    """Builds the token ids and media inputs of requests for one vision model."""

    def __init__(self, processor: Any, model_config: Any, model_name: str, *, max_images: int,
                 max_image_pixels: int) -> None:
        self.processor = processor
        self.model_config = model_config
        self.model_name = model_name
        self.max_images = max_images
        self.max_image_pixels = max_image_pixels
        self.add_special_tokens = not (model_config.model_type in TEMPLATE_ADDS_BOS
                                       and getattr(processor, "chat_template", None) is not None)

    def prepare(self, body: RequestBody, template_kwargs: dict[str, Any] | None = None,
                ) -> tuple[list[int], PreparedMedia]:
        """The prompt's token ids, media tokens expanded, and its media; raises
        `RequestRejected`. `template_kwargs` go to the chat template (tools, the request's
        chat_template_kwargs)."""
        assert body.images
        if len(body.images) > self.max_images:
            raise RequestRejected(f"images: {len(body.images)} images; this worker's max_images is {self.max_images}",
                                 code=ErrorCode.TOO_LARGE)
        if body.prompt_tokens is not None:
            raise RequestRejected("images: send them with prompt or messages, not prompt_tokens "
                                 "(the worker places the image tokens)")
        data = decode_images(body.images)
        images = [decode_image(item, i, self.max_image_pixels) for i, item in enumerate(data)]
        conversation, order = conversation_of(body, len(images))
        text = self._template(conversation, len(images), template_kwargs or {})
        inputs = self._process(text, [images[i] for i in order])
        ids = np.asarray(inputs.pop("input_ids")).reshape(-1).tolist()
        key = f"{self.model_name}:" + ",".join(f"image:{hashlib.sha256(data[i]).hexdigest()}" for i in order)
        return ids, PreparedMedia(key=key, inputs=inputs, counts={"image": len(images)})

    def _template(self, conversation: str | list[Any], images: int, template_kwargs: dict[str, Any]) -> str:
        from mlx_vlm.prompt_utils import apply_chat_template

        try:
            return str(apply_chat_template(self.processor, self.model_config, conversation, num_images=images,
                                           **template_kwargs))
        except Exception as e:  # noqa: BLE001 - a template that fails on this request fails the request
            raise RequestRejected(f"messages: the model's chat template failed on them ({ascii(str(e)[:300])})") from e

    def _process(self, text: str, images: list[Any]) -> dict[str, Any]:
        """The processor's outputs as numpy arrays (and plain values). mlx-vlm hands them
        over as MLX arrays, some not yet evaluated: they are evaluated here, on this
        thread, since an MLX graph made on one thread cannot be evaluated on another."""
        from mlx_vlm.utils import prepare_inputs

        try:
            inputs = prepare_inputs(self.processor, images=images, prompts=text,
                                    add_special_tokens=self.add_special_tokens,
                                    image_token_index=getattr(self.model_config, "image_token_index", None))
        except Exception as e:  # noqa: BLE001 - the family's processor refusing this request's media
            raise RequestRejected(f"images: the model's processor could not take them ({ascii(str(e)[:300])})") from e
        inputs.pop("attention_mask", None)  # one row: all ones, and the backend makes its own
        return {name: _host(value) for name, value in inputs.items() if value is not None}


def _host(value: Any) -> Any:
    """An MLX array as numpy (evaluated here); anything else as it is."""
    import mlx.core as mx

    return np.asarray(value) if isinstance(value, mx.array) else value


def conversation_of(body: RequestBody, count: int) -> tuple[str | list[Any], list[int]]:
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

