"""OpenAI's request bodies, read strictly, and turned into mlxq request bodies.

Every field OpenAI's API defines is either mapped onto the mlxq body or refused with a
400 that names it: nothing is silently ignored. vLLM's extra sampling fields (the ones
the OpenAI SDKs pass through `extra_body`) are accepted where mlxq has them. The values
themselves are checked by mlxq's own protocol (`client.protocol`) when submitted.
"""

from __future__ import annotations

import base64
import binascii
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from client.protocol import MEDIA_FIELDS, MediaKind, Task
from common.media_formats import AUDIO_FORMATS, audio_format

from .errors import ApiError

# What a request may carry beyond OpenAI's fields (extra_body): vLLM's names (`cache_salt`
# among them), and mlxq's `priority` and `stream_interval` (tokens per chunk).
_EXTRA_SAMPLING = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                   "include_stop_str_in_output", "priority", "stream_interval", "cache_salt")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """The fields chat and completions share."""

    model: str = Field(min_length=1, max_length=512)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras (extra_body)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    priority: int | None = None
    stream_interval: int | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=200)

    def _common_body(self) -> dict[str, Any]:
        if self.n not in (None, 1):
            raise ApiError.invalid(f"n: {self.n} choices asked for; mlxq generates one choice per request "
                                   "(send n requests)", param="n")
        if self.stream_options is not None and not self.stream:
            raise ApiError.invalid("stream_options: only with stream: true", param="stream_options")
        body: dict[str, Any] = {name: getattr(self, name) for name in (
            "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias", *_EXTRA_SAMPLING)}
        body["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        body["max_tokens"] = self.max_tokens
        if self.user is not None:
            body["metadata"] = {"user": self.user}
        return body

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ImageUrl(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class VideoUrl(_Strict):
    url: str


class InputAudio(_Strict):
    data: str  # base64
    format: str


class ContentPart(_Strict):
    type: Literal["text", "image_url", "video_url", "input_audio"]  # video_url: vLLM's extension
    text: str | None = None
    image_url: ImageUrl | None = None
    video_url: VideoUrl | None = None
    input_audio: InputAudio | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # a thinking model's earlier reasoning: not sent back to it
    refusal: str | None = None


class ChatRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # OpenAI fields mlxq cannot honour: accepted only at their "off" values, so that the 400 names them
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    service_tier: str | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    def to_body(self) -> dict[str, Any]:
        """The mlxq body; raises `ApiError` (400) for what mlxq cannot do."""
        self._refuse_unsupported()
        body = self._common_body()
        messages, media = _messages(self.messages)
        body.update({field: media[kind] or None for kind, field in MEDIA_FIELDS.items()})
        body.update(messages=messages, logprobs=self.logprobs, top_logprobs=self.top_logprobs, tools=self.tools,
                    tool_choice=self.tool_choice, chat_template_kwargs=self.chat_template_kwargs)
        body["max_tokens"] = self.max_completion_tokens or self.max_tokens
        if self.response_format is not None and self.response_format.get("type") != "text":
            body["response_format"] = self.response_format
        if self.metadata:
            body["metadata"] = {**self.metadata, **body.get("metadata", {})}
        return body

    def _refuse_unsupported(self) -> None:
        unsupported = {
            "audio": "audio output", "prediction": "predicted outputs", "reasoning_effort": "reasoning effort "
            "(use chat_template_kwargs, e.g. enable_thinking)", "web_search_options": "web search",
            "service_tier": "service tiers (use priority)", "functions": "functions (use tools)",
            "function_call": "function_call (use tool_choice)"}
        for name, what in unsupported.items():
            if getattr(self, name) is not None:
                raise ApiError.invalid(f"{name}: mlxq has no {what}", param=name)
        if self.modalities not in (None, ["text"]):
            raise ApiError.invalid(f"modalities: mlxq generates text only, not {self.modalities}", param="modalities")
        if self.store:
            raise ApiError.invalid("store: mlxq keeps no completions", param="store")
        if self.parallel_tool_calls is False:
            raise ApiError.invalid("parallel_tool_calls: false cannot be enforced (a named tool_choice forces "
                                   "exactly one call)", param="parallel_tool_calls")


class CompletionRequest(_Sampling):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None  # vLLM's extra: structured output on completions too

    def to_body(self) -> dict[str, Any]:
        """The mlxq body; raises `ApiError` (400) for what mlxq cannot do."""
        if self.echo:
            raise ApiError.invalid("echo: mlxq does not return the prompt", param="echo")
        if self.suffix:
            raise ApiError.invalid("suffix: mlxq has no fill-in-the-middle", param="suffix")
        if self.best_of not in (None, 1):
            raise ApiError.invalid(f"best_of: {self.best_of}; mlxq generates one choice per request", param="best_of")
        body = self._common_body()
        body.update(_prompt(self.prompt))
        if self.logprobs is not None:
            body.update(logprobs=True, top_logprobs=self.logprobs)
        if self.response_format is not None and self.response_format.get("type") != "text":
            body["response_format"] = self.response_format
        return body


def _prompt(prompt: str | list[str] | list[int] | list[list[int]]) -> dict[str, Any]:
    """One prompt: text, or token ids; a list of several prompts is refused."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if prompt and all(isinstance(p, int) for p in prompt):
        return {"prompt_tokens": prompt}
    if len(prompt) != 1:
        raise ApiError.invalid(f"prompt: {len(prompt)} prompts in one request; mlxq takes one (send one request "
                               "each)", param="prompt")
    only = prompt[0]
    return {"prompt": only} if isinstance(only, str) else {"prompt_tokens": only}


def _messages(messages: list[ChatMessage]) -> tuple[list[dict[str, Any]], dict[MediaKind, list[bytes]]]:
    """mlxq's messages and the request's media: OpenAI's content parts become mlxq's, an
    `image_url` part an `{"type": "image", "index": i}` part where it was, its bytes the
    request's i-th image (a `video_url` part likewise a video, an `input_audio` part audio)."""
    out: list[dict[str, Any]] = []
    media: dict[MediaKind, list[bytes]] = {kind: [] for kind in MEDIA_FIELDS}
    for i, message in enumerate(messages):
        content: Any = message.content
        if isinstance(message.content, list):
            content = []
            for j, part in enumerate(message.content):
                if part.type == "text":
                    content.append({"type": "text", "text": part.text or ""})
                    continue
                where = f"messages.{i}.content.{j}.{part.type}"
                kind: MediaKind
                if part.type == "input_audio":
                    kind, data = "audio", _input_audio(where, part.input_audio)
                else:
                    kind = "image" if part.type == "image_url" else "video"
                    data = _data_url(where, part.image_url if kind == "image" else part.video_url, kind)
                media[kind].append(data)
                content.append({"type": kind, "index": len(media[kind]) - 1})
        role = "system" if message.role == "developer" else message.role
        out.append({k: v for k, v in {"role": role, "content": content, "name": message.name,
                                      "tool_calls": message.tool_calls,
                                      "tool_call_id": message.tool_call_id}.items() if v is not None})
    return out, media


def _input_audio(where: str, part: InputAudio | None) -> bytes:
    """An input_audio part's bytes, in the format it says it is."""
    if part is None:
        raise ApiError.invalid(f"{where}: missing", param=where)
    if part.format not in AUDIO_FORMATS:
        raise ApiError.invalid(f"{where}.format: {part.format[:20]!r} is not one of {', '.join(AUDIO_FORMATS)}",
                               param=f"{where}.format")
    try:
        data = base64.b64decode(part.data, validate=True)
    except binascii.Error as e:
        raise ApiError.invalid(f"{where}.data: not valid base64 ({e})", param=f"{where}.data") from e
    found = audio_format(data)
    if found != part.format:
        raise ApiError.invalid(f"{where}: the format says {part.format}, the data is "
                               f"{found or 'none of ' + ', '.join(AUDIO_FORMATS)}", param=f"{where}.format")
    return data


def _data_url(where: str, part: ImageUrl | VideoUrl | None, kind: str) -> bytes:
    """A media part's bytes: only `data:` URLs; nothing is ever fetched."""
    if part is None:
        raise ApiError.invalid(f"{where}: missing", param=where)
    head, comma, data = part.url.partition(",")
    if not head.startswith("data:") or not comma:
        shown = part.url[:40] + ("..." if len(part.url) > 40 else "")
        raise ApiError.invalid(f"{where}: only data: URLs are accepted (nothing is fetched), not {shown!r}",
                               param=where)
    if not head.endswith(";base64"):
        example = "data:image/png;base64,..." if kind == "image" else "data:video/mp4;base64,..."
        raise ApiError.invalid(f"{where}: a data: URL must be base64 ({example})", param=where)
    try:
        return base64.b64decode(data, validate=True)
    except binascii.Error as e:
        raise ApiError.invalid(f"{where}: not valid base64 ({e})", param=where) from e


@dataclass(frozen=True)
class Call:
    """One HTTP request, read: what to submit and how to answer."""

    kind: Literal["chat", "completion", "embeddings", "rerank"]
    model: str
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    created: int
    offers_tools: bool
    returns_documents: bool = False  # a rerank call's response repeats each document

    @property
    def task(self) -> Task:
        """What the serving model must do: the `task` its workers' heartbeats name."""
        return "embed" if self.kind == "embeddings" else "rerank" if self.kind == "rerank" else "generate"


def read_call(kind: Literal["chat", "completion"], raw: Any) -> Call:
    """Validate an HTTP body as OpenAI's request of `kind`; raises `ApiError` (400)."""
    if not isinstance(raw, dict):
        raise ApiError.invalid("the request body must be a JSON object")
    model_type = ChatRequest if kind == "chat" else CompletionRequest
    try:
        request = model_type.model_validate(raw)
    except ValidationError as e:
        raise ApiError.invalid(*describe(e)) from e
    body = {k: v for k, v in request.to_body().items() if v is not None}
    offers_tools = isinstance(request, ChatRequest) and bool(request.tools) and request.tool_choice != "none"
    return Call(kind, request.model, body, request.stream, request.include_usage, int(time.time()), offers_tools)


def describe(error: ValidationError) -> tuple[str, str | None]:
    """One line for every problem, OpenAI's wording for an unknown field; and the first field's name."""
    problems = error.errors(include_url=False)
    parts = []
    for problem in problems:
        where = ".".join(str(p) for p in problem["loc"])
        if problem["type"] == "extra_forbidden":
            parts.append(f"Unrecognized request argument supplied: {where}")
        else:
            parts.append(f"{where}: {problem['msg']}")
    first = ".".join(str(p) for p in problems[0]["loc"]) if problems else None
    return "; ".join(parts), first
