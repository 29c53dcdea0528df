"""A request's text and media turned into prompt tokens and `PreparedMedia`, off the engine thread.

Any family mlx-vlm serves goes through mlx-vlm's own steps, as its server takes them:
the chat template through `apply_chat_template` (which writes the family's media
markers), then `prepare_inputs`, where the family's processor resizes and patches the
images and videos and expands each marker into its media tokens. A family whose
processor takes no video gets a video as its sampled frames, as images in its place
(mlx-vlm's frames fallback). What this module adds is ours: media decoded under this
worker's limits (videos and audio in decoder processes, `isolated`), each media item
kept in its own turn, the embedding cache's key, and every failure made that request's
`RequestRejected`. The engine thread only runs the model's encoders.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from client.protocol import (
    MEDIA_FIELDS,
    ErrorCode,
    MediaKind,
    Message,
    RequestBody,
    RequestRejected,
    TextPart,
    decode_media,
)
from worker.media.audio import AudioLimits, decode_audio
from worker.media.images import decode_image
from worker.media.isolated import run_isolated, warm_up
from worker.media.videos import VideoLimits, decode_video
from worker.messages import PreparedMedia
from worker.settings import WorkerSettings

# Gemma's chat templates open with the bos token themselves; mlx-vlm's server
# tokenizes their prompts without adding another (`_cpu_preprocess`).
TEMPLATE_ADDS_BOS = ("gemma3", "gemma3n", "gemma4", "gemma4_unified")


# Each kind's setting for the most items of it one request may carry.
MOST_ITEMS: dict[MediaKind, str] = {"image": "max_images", "video": "max_videos", "audio": "max_audios"}
# Families whose get_input_embeddings takes images or videos in one request, not both.
ONE_VISUAL_KIND = ("qwen2_vl", "qwen2_5_vl")


class VisionPrompts:
    """Builds the token ids and media inputs of requests for one vision model."""

    def __init__(self, processor: Any, model_config: Any, model_name: str, limits: WorkerSettings) -> None:
        from mlx_vlm.generate.video import processor_handles_video

        self.processor = processor
        self.model_config = model_config
        self.model_name = model_name
        self.limits = limits  # the worker's media settings
        self.native_video = processor_handles_video(processor)
        extractor = getattr(processor, "feature_extractor", None)
        self.audio_rate: int | None = getattr(extractor, "sampling_rate", None) if extractor is not None else None
        self.add_special_tokens = not (model_config.model_type in TEMPLATE_ADDS_BOS
                                       and getattr(processor, "chat_template", None) is not None)
        if limits.max_videos or (limits.max_audios and self.audio_rate is not None):
            warm_up(limits.media_decode_memory_mb << 20)

    def prepare(self, body: RequestBody, template_kwargs: dict[str, Any] | None = None,
                ) -> tuple[list[int], PreparedMedia]:
        """The prompt's token ids, media tokens expanded, and its media; raises
        `RequestRejected`. `template_kwargs` go to the chat template (tools, the request's
        chat_template_kwargs)."""
        assert body.has_media
        self._check(body)
        sampling = self._video_sampling(body)
        data = {kind: decode_media(body.media_of(kind), MEDIA_FIELDS[kind]) for kind in MEDIA_FIELDS}
        images = [decode_image(item, i, self.limits.max_image_pixels) for i, item in enumerate(data["image"])]
        videos = [self._decode_video(item, i, sampling) for i, item in enumerate(data["video"])]
        clips = [self._decode_audio(item, i) for i, item in enumerate(data["audio"])]
        counts = {kind: len(items) for kind, items in data.items() if items}
        conversation, order = conversation_of(body, counts)
        key = self._cache_key(data, order, sampling)
        if videos and not self.native_video:
            conversation, order, images = _as_frames(conversation, order, images, [v[0] for v in videos])
            videos = []
        text = self._template(conversation, sum(kind == "image" for kind, _ in order), bool(videos or clips),
                              template_kwargs or {})
        inputs = self._process(text, [images[i] for kind, i in order if kind == "image"],
                               [videos[i] for kind, i in order if kind == "video"],
                               [clips[i] for kind, i in order if kind == "audio"])
        ids = np.asarray(inputs.pop("input_ids")).reshape(-1).tolist()
        return ids, PreparedMedia(key=key, inputs=inputs, counts=counts)

    def _cache_key(self, data: dict[MediaKind, list[bytes]], order: Order, sampling: VideoLimits) -> str:
        """The model, and each item's kind and content hash in prompt order; a video's with
        how it is sampled, which changes its features."""
        def item(kind: MediaKind, index: int) -> str:
            sampled = f"@{sampling.fps:g}fps/{sampling.max_frames}" if kind == "video" else ""
            return f"{kind}:{hashlib.sha256(data[kind][index]).hexdigest()}{sampled}"

        return f"{self.model_name}:" + ",".join(item(kind, index) for kind, index in order)

    def _check(self, body: RequestBody) -> None:
        for kind, setting in MOST_ITEMS.items():
            field, most, count = MEDIA_FIELDS[kind], getattr(self.limits, setting), len(body.media_of(kind))
            if count > most:
                raise RequestRejected(f"{field}: {count} {'clips' if field == 'audio' else field}; this worker's "
                                      f"{setting} is {most}",
                                      code=ErrorCode.TOO_LARGE)
        model_type = self.model_config.model_type
        if body.audio and self.audio_rate is None:
            raise RequestRejected(f"audio: this model ({self.model_name}, {model_type}) takes no audio")
        if len(body.audio or []) > 1 and not getattr(self.processor, "supports_multiple_audio", False):
            raise RequestRejected(f"audio: this model ({model_type}) takes one audio clip a request",
                                  code=ErrorCode.TOO_LARGE)
        if body.prompt_tokens is not None:
            raise RequestRejected(f"{body.first_media_field}: send them with prompt or messages, not prompt_tokens "
                                  "(the worker places the media tokens)")
        if body.images and body.videos and self.native_video and model_type in ONE_VISUAL_KIND:
            raise RequestRejected(f"videos: this model ({model_type}) takes images or videos in one request, "
                                  "not both")

    def _video_sampling(self, body: RequestBody) -> VideoLimits:
        """The request's frame rate and frame budget (each video gets its share), under the worker's."""
        limits = self.limits
        budget = min(body.max_video_frames or limits.max_video_frames, limits.max_video_frames)
        return VideoLimits(fps=body.video_fps or limits.default_video_fps,
                           max_frames=max(1, budget // max(1, len(body.videos or []))),
                           max_pixels=limits.max_image_pixels, max_seconds=limits.max_video_seconds)

    def _decode_video(self, data: bytes, index: int, sampling: VideoLimits) -> tuple[np.ndarray, Any]:
        return run_isolated(decode_video, data, sampling, where=f"videos.{index}",
                            timeout_s=self.limits.media_decode_timeout_s,
                            memory_bytes=self.limits.media_decode_memory_mb << 20)

    def _template(self, conversation: str | list[Any], images: int, parts_in_place: bool,
                  template_kwargs: dict[str, Any]) -> str:
        """The prompt text. mlx-vlm's formatting keeps image and text parts (and moves
        audio to the last user message), so a conversation with videos or audio goes to
        the model's own chat template as it is, each part in its place."""
        from mlx_vlm.prompt_utils import apply_chat_template

        try:
            if parts_in_place:
                assert isinstance(conversation, list)  # a request with videos or audio is always given as parts
                tokenizer = getattr(self.processor, "tokenizer", self.processor)
                return str(tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                                         **template_kwargs))
            return str(apply_chat_template(self.processor, self.model_config, conversation, num_images=images,
                                           **template_kwargs))
        except Exception as e:  # noqa: BLE001 - a template that fails on this request fails the request
            raise RequestRejected(f"messages: the model's chat template failed on them ({ascii(str(e)[:300])})") from e

    def _decode_audio(self, data: bytes, index: int) -> np.ndarray:
        assert self.audio_rate is not None
        return run_isolated(decode_audio, data, AudioLimits(self.audio_rate, self.limits.max_audio_seconds),
                            where=f"audio.{index}", timeout_s=self.limits.media_decode_timeout_s,
                            memory_bytes=self.limits.media_decode_memory_mb << 20)

    def _process(self, text: str, images: list[Any], videos: list[tuple[np.ndarray, Any]],
                 clips: list[np.ndarray]) -> dict[str, Any]:
        """The processor's outputs as numpy arrays (and plain values). mlx-vlm hands them
        over as MLX arrays, some not yet evaluated: they are evaluated here, on this
        thread, since an MLX graph made on one thread cannot be evaluated on another."""
        from mlx_vlm.utils import prepare_inputs

        extra: dict[str, Any] = {}
        if videos:
            extra = {"videos": [frames for frames, _ in videos], "video_metadata": [meta for _, meta in videos],
                     "fps": [meta.sampled_fps for _, meta in videos]}
        try:
            inputs = prepare_inputs(self.processor, images=images or None, audio=clips or None, prompts=text,
                                    add_special_tokens=self.add_special_tokens,
                                    image_token_index=getattr(self.model_config, "image_token_index", None), **extra)
        except Exception as e:  # noqa: BLE001 - the family's processor refusing this request's media
            field = "videos" if videos else "audio" if clips else "images"
            raise RequestRejected(f"{field}: the model's processor could not take them ({ascii(str(e)[:300])})") from e
        inputs.pop("attention_mask", None)  # one row: all ones, and the backend makes its own
        return {name: _host(value) for name, value in inputs.items() if value is not None}


def _host(value: Any) -> Any:
    """An MLX array as numpy (evaluated here); anything else as it is."""
    import mlx.core as mx

    return np.asarray(value) if isinstance(value, mx.array) else value


Order = list[tuple[MediaKind, int]]


def conversation_of(body: RequestBody, counts: dict[MediaKind, int]) -> tuple[str | list[Any], Order]:
    """What mlx-vlm's chat formatting takes, and the media in the order their
    placeholders come. Parts keep each item in its message; with no parts and only
    images, the images go into the last user message, as mlx-vlm places them; otherwise
    those no part points to go first in the last user message (images, videos, audio)."""
    loose_order: Order = [(kind, i) for kind, count in counts.items() for i in range(count)]
    messages = body.messages or []
    if not any(m.media_parts() for m in messages) and not counts.get("video") and not counts.get("audio"):
        if body.messages is None:  # a plain prompt with images: one user message
            return body.prompt or "", loose_order
        return [m.model_dump(exclude_none=True) for m in messages], loose_order
    if body.messages is None:
        messages = [Message(role="user", content=body.prompt or "")]
    pointed = {(part.type, part.index) for m in messages for part in m.media_parts()}
    loose = [item for item in loose_order if item not in pointed]
    last_user = max(i for i, m in enumerate(messages) if m.role == "user")
    conversation: list[Any] = []
    order: Order = []
    for i, message in enumerate(messages):
        entry = message.model_dump(exclude_none=True)
        first = loose if i == last_user else []
        if message.media_parts() or first:
            entry["content"] = _parts_with_media(message, first, order)
        elif isinstance(message.content, list):
            entry["content"] = message.text  # no media here: what a text model gets
        conversation.append(entry)
    return conversation, order


def _parts_with_media(message: Message, first: Order, order: Order) -> list[dict[str, Any]]:
    """The message's parts as mlx-vlm takes them, media `first` ahead of its own; each
    item placed is appended to `order`."""
    parts: list[dict[str, Any]] = [{"type": kind} for kind, _ in first]
    order += first
    for part in message.content if isinstance(message.content, list) else [TextPart(type="text", text=message.text)]:
        if isinstance(part, TextPart):
            parts.append({"type": "text", "text": part.text})
        else:
            parts.append({"type": part.type})
            order.append((part.type, part.index))
    return parts


def _as_frames(conversation: str | list[Any], order: Order, images: list[Any], videos: list[np.ndarray],
               ) -> tuple[list[Any], Order, list[Any]]:
    """mlx-vlm's frames fallback, for a processor that takes no video: each video becomes
    its sampled frames, as images where the video was."""
    from PIL import Image

    assert isinstance(conversation, list)
    frames = [[Image.fromarray(np.transpose(frame, (1, 2, 0))) for frame in video] for video in videos]
    all_images = list(images)
    placed: dict[int, list[int]] = {}
    for index, stills in enumerate(frames):
        placed[index] = list(range(len(all_images), len(all_images) + len(stills)))
        all_images += stills
    items = iter(order)
    new_order: Order = []
    for message in conversation:
        if not isinstance(message.get("content"), list):
            continue
        content = []
        for part in message["content"]:
            if part["type"] == "text":
                content.append(part)
                continue
            kind, index = next(items)  # the media parts come in `order`
            if kind != "video":
                content.append(part)
                new_order.append((kind, index))
            else:
                content += [{"type": "image"} for _ in placed[index]]
                new_order += [("image", i) for i in placed[index]]
        message["content"] = content
    return conversation, new_order, all_images
