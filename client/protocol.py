"""The wire format: request entries and output events (docs/protocol.md).

A request is a stream entry `id <id> json <object>` (or `msgpack <map>`). An output
event is an entry `type <delta|done|error> json|msgpack <body>`. Producers, workers
and readers all go through the functions here, so the format lives in one place.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from dataclasses import fields as fields_of
from typing import Annotated, Any, Literal, TypeVar

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ._errors import ErrorCode, RequestRejected, Undeliverable
from .replies import as_text

Encoding = Literal["json", "msgpack"]
# What a queue's model serves: the one declaration of the tasks (a new task is one entry
# here, plus its preparer and its engine core).
Task = Literal["generate", "embed", "rerank"]
PoolingTask = Literal["embed", "rerank"]
ENCODINGS: tuple[Encoding, ...] = ("json", "msgpack")
ID_PATTERN = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")
MAX_NESTING_DEPTH = 32  # maps and lists inside a body, metadata included
MAX_TOP_LOGPROBS = 20  # alternatives per token, as in the OpenAI API
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 1024
MAX_TOOLS = 128
MAX_VIDEO_FPS = 60.0  # frames sampled per second of video, at most
# The kinds of media a request can carry, and the request field that holds each: the one
# declaration of them (a new kind is one entry here, plus its decoder in worker/media/).
MediaKind = Literal["image", "video", "audio"]
MEDIA_FIELDS: dict[MediaKind, str] = {"image": "images", "video": "videos", "audio": "audio"}

FinishReason = Literal["stop", "length", "cancelled", "tool_calls"]
T = TypeVar("T")


class _Format(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JsonObjectFormat(_Format):
    """Any JSON object."""

    type: Literal["json_object"]


class JsonSchema(_Format):
    """OpenAI's `json_schema` member: the schema and its name."""

    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class JsonSchemaFormat(_Format):
    """JSON that validates against a JSON schema (OpenAI's shape)."""

    type: Literal["json_schema"]
    json_schema: JsonSchema


class RegexFormat(_Format):
    """Text that matches a regular expression (Rust `regex` syntax, as llguidance reads it)."""

    type: Literal["regex"]
    pattern: str = Field(min_length=1)


class ChoiceFormat(_Format):
    """Exactly one of these strings."""

    type: Literal["choice"]
    choices: list[str] = Field(min_length=1, max_length=MAX_CHOICES)

    @field_validator("choices")
    @classmethod
    def _choices_not_empty(cls, choices: list[str]) -> list[str]:
        if any(c == "" for c in choices):
            raise ValueError("choices must not be empty strings")
        return choices


class GrammarFormat(_Format):
    """Text in a Lark grammar (llguidance's dialect)."""

    type: Literal["grammar"]
    lark: str = Field(min_length=1)


ResponseFormat = Annotated[JsonObjectFormat | JsonSchemaFormat | RegexFormat | ChoiceFormat | GrammarFormat,
                           Field(discriminator="type")]


class TextPart(_Format):
    """Text in a message's content."""

    type: Literal["text"]
    text: str


class MediaPart(_Format):
    """A media item's place in a message: `index` points into the request's list of that kind."""

    type: MediaKind
    index: int = Field(ge=0, lt=2**31)


ContentPart = Annotated[TextPart | MediaPart, Field(discriminator="type")]


class Message(BaseModel):
    """One chat message: `content` (text, or a list of text and media parts), or an
    assistant's `tool_calls` (OpenAI's shape), or a tool's answer (`role` "tool", with the
    `tool_call_id` it answers)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _content_or_tool_calls(self) -> Message:
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs content (or, from the assistant, tool_calls)")
        if self.content == []:
            raise ValueError("content: an empty list of parts")
        return self

    @property
    def text(self) -> str:
        """Its text: the content, or its text parts joined by newlines (as vLLM joins them)."""
        if not isinstance(self.content, list):
            return self.content or ""
        return "\n".join(part.text for part in self.content if isinstance(part, TextPart))

    def media_parts(self) -> list[MediaPart]:
        return [part for part in self.content if isinstance(part, MediaPart)] if isinstance(self.content, list) else []


class FunctionSpec(_Format):
    """A function the model may call: its name and its parameters' JSON schema."""

    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Format):
    """OpenAI's function tool."""

    type: Literal["function"]
    function: FunctionSpec


class FunctionName(_Format):
    name: str


class NamedToolChoice(_Format):
    """Call this function."""

    type: Literal["function"]
    function: FunctionName


class RequestBody(BaseModel):
    """The body of a request entry. Unknown fields are an error, not ignored."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: str | None = Field(None, min_length=1)
    messages: list[Message] | None = Field(None, min_length=1)
    prompt_tokens: list[int] | None = Field(None, min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list)
    stream_interval: int | None = Field(None, ge=1, lt=2**31)
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    deadline_ms: int | None = Field(None, ge=0, lt=2**53)
    reply_to: str | None = Field(None, min_length=1, max_length=512)
    encoding: Encoding | None = None
    images: list[bytes | str] | None = None
    videos: list[bytes | str] | None = None
    video_fps: float | None = Field(None, gt=0.0, le=MAX_VIDEO_FPS)
    max_video_frames: int | None = Field(None, ge=1, lt=2**31)
    audio: list[bytes | str] | None = None
    metadata: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str | int, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    speculative: bool = True  # False opts out of the worker's speculative decoding
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # prefix and vision caches: only this salt's
    adapter: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:\-]{1,128}$")  # a LoRA adapter of the queue's model
    count_only: bool = False  # prepare only: `done` with usage.prompt_tokens, nothing generated

    @field_validator("prompt_tokens")
    @classmethod
    def _token_ids_not_negative(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and any(i < 0 for i in ids):
            raise ValueError("token ids must be >= 0")
        return ids

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_by_token_id(cls, bias: dict[str | int, float] | None) -> dict[str | int, float] | None:
        """Token ids as keys (JSON writes them as strings), biases in [-100, 100] as in OpenAI's API."""
        if bias is None:
            return None
        for key, value in bias.items():
            if not (isinstance(key, int) or key.isdigit()) or int(key) < 0:
                raise ValueError(f"keys are token ids (integers >= 0), not {str(key)[:40]!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"token {key}: a bias of {value} is outside [-100, 100]")
        return {int(key): value for key, value in bias.items()}

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids_not_negative(cls, ids: list[int]) -> list[int]:
        if any(i < 0 for i in ids):
            raise ValueError("token ids must be >= 0")
        return ids

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, stop: list[str]) -> list[str]:
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        return stop

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> RequestBody:
        given = [name for name in ("prompt", "messages", "prompt_tokens") if getattr(self, name) is not None]
        if len(given) != 1:
            found = f"got {', '.join(given)}" if given else "got none"
            raise ValueError(f"exactly one of prompt, messages, prompt_tokens is required ({found})")
        return self

    @model_validator(mode="after")
    def _tools_in_a_chat(self) -> RequestBody:
        if self.tool_choice is not None and not self.tools:
            raise ValueError("tool_choice needs tools")
        if (self.tools or self.chat_template_kwargs) and self.messages is None:
            raise ValueError("tools and chat_template_kwargs go with messages (the chat template renders them)")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [tool.function.name for tool in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice: no tool named {self.tool_choice.function.name!r} "
                                 f"(tools: {', '.join(names)})")
        if self.response_format is not None and self.tool_choice not in (None, "none", "auto"):
            raise ValueError("response_format cannot be combined with a tool_choice that forces a call")
        return self

    @model_validator(mode="after")
    def _parts_point_into_the_media(self) -> RequestBody:
        """Each media part names an item of the request's list of its kind, in a user
        message, once; video and audio are not taken yet."""
        pointed: set[tuple[str, int]] = set()
        for i, message in enumerate(self.messages or []):
            for part in message.media_parts():
                where = f"messages.{i}.content: the {part.type} part with index {part.index}"
                if message.role != "user":
                    raise ValueError(f"{where}: media parts go in user messages, not {message.role!r} ones")
                items = len(self.media_of(part.type))
                if part.index >= items:
                    raise ValueError(f"{where}: the request has {items} {MEDIA_FIELDS[part.type]}")
                if (part.type, part.index) in pointed:
                    raise ValueError(f"{where}: points to an item another part points to")
                pointed.add((part.type, part.index))
        return self

    @model_validator(mode="after")
    def _video_sampling_with_videos(self) -> RequestBody:
        if (self.video_fps is not None or self.max_video_frames is not None) and not self.videos:
            raise ValueError("video_fps and max_video_frames go with videos")
        return self

    def media_of(self, kind: MediaKind) -> list[bytes | str]:
        """The request's items of one media kind (`image`, `video`, `audio`)."""
        return getattr(self, MEDIA_FIELDS[kind]) or []

    @property
    def first_media_field(self) -> str | None:
        """The first of the media fields the request fills (for an error naming it)."""
        return next((field for kind, field in MEDIA_FIELDS.items() if self.media_of(kind)), None)

    @property
    def has_media(self) -> bool:
        return bool(self.images or self.videos or self.audio)

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self) -> RequestBody:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


@dataclass(frozen=True)
class Envelope:
    """What can be read of a request entry before its body is validated.

    `reply_to` and `encoding` fall back to the defaults when the body cannot say,
    so that even a broken request's error reaches its reader.
    """

    id: str
    raw: dict[str, Any] | None
    encoding: Encoding
    reply_to: str | None
    error: RequestRejected | None = None
    size: int = 0  # bytes of the encoded body

    @property
    def names_media(self) -> bool:
        """Whether the body fills a media field (images, videos, audio), before it is validated."""
        return isinstance(self.raw, dict) and any(self.raw.get(field) for field in MEDIA_FIELDS.values())


def read_envelope(fields: dict[Any, Any], max_body_bytes: int | None = None,
                  max_depth: int = MAX_NESTING_DEPTH) -> Envelope:
    """Read the id and body of a request entry; raise `Undeliverable` without an id.
    A body over `max_body_bytes` is not decoded at all; one nested deeper than
    `max_depth`, or holding text that is not valid Unicode, is refused."""
    request_id = read_id(fields)
    fields = {_field_name(k): v for k, v in fields.items()}
    bodies = [name for name in ENCODINGS if name in fields]
    extra = sorted(set(fields) - {"id", *ENCODINGS})
    if len(bodies) != 1 or extra:
        named = ", ".join(repr(name[:40]) for name in extra[:5])
        named += f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        problem = f"unknown entry fields {named}" if extra else f"found {bodies or 'neither'}"
        return Envelope(request_id, None, "json", None,
                        RequestRejected(f"an entry needs 'id' and exactly one of 'json' or 'msgpack' ({problem})"))
    encoding: Encoding = bodies[0]  # type: ignore[assignment]
    size = len(fields[encoding])
    if max_body_bytes is not None and size > max_body_bytes:
        return Envelope(request_id, None, encoding, None, RequestRejected(
            f"body: {size} bytes is above this worker's max_body_bytes ({max_body_bytes})", code=ErrorCode.TOO_LARGE))
    try:
        raw = _decode_body(fields[encoding], encoding)
        check_values(raw, max_depth)
    except RequestRejected as e:
        return Envelope(request_id, None, encoding, None, e, size=size)
    reply_to = raw.get("reply_to")
    reply_to = reply_to if isinstance(reply_to, str) and reply_to else None
    wanted = raw.get("encoding")
    out_encoding: Encoding = wanted if wanted in ENCODINGS else encoding
    return Envelope(request_id, raw, out_encoding, reply_to, size=size)


def read_id(fields: dict[Any, Any]) -> str:
    """The id of a request entry; raises `Undeliverable` if it has none that is valid."""
    raw_id = next((v for k, v in fields.items() if k in (b"id", "id")), None)
    try:
        request_id = as_text(raw_id) if isinstance(raw_id, (bytes, str)) else None
    except UnicodeDecodeError:
        request_id = None
    if request_id is None or not ID_PATTERN.fullmatch(request_id):
        shown = ascii(raw_id[:140]) if isinstance(raw_id, (bytes, str)) else "missing"
        raise Undeliverable("missing field 'id'" if raw_id is None else
                            f"invalid id {shown}: use 1-128 of A-Za-z0-9_.:-")
    return request_id


def _field_name(name: bytes | str) -> str:
    """An entry field's name as text; bytes that are not UTF-8 are escaped, not fatal."""
    return name.decode("utf-8", "backslashreplace") if isinstance(name, bytes) else name


class _DuplicateKey(ValueError):
    """A JSON object or msgpack map that names one key twice."""


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A map from its pairs, refusing a key given twice (decoders would keep the last silently)."""
    body = dict(pairs)
    if len(body) != len(pairs):
        twice = next(key for key, n in Counter(key for key, _ in pairs).items() if n > 1)
        raise _DuplicateKey(f"body: the key {ascii(twice)} is given twice")
    return body


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _decode_body(data: bytes | str, encoding: Encoding) -> dict[str, Any]:
    try:
        if encoding == "json":
            body = json.loads(data, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
        else:
            packed = data if isinstance(data, bytes) else data.encode()
            body = msgpack.unpackb(packed, raw=False, object_pairs_hook=_unique_keys)
    except _DuplicateKey as e:
        raise RequestRejected(str(e)) from e
    except (RecursionError, msgpack.StackError) as e:
        raise RequestRejected("body: nested too deeply to decode", code=ErrorCode.TOO_LARGE) from e
    except (ValueError, msgpack.UnpackException, TypeError) as e:
        message = str(e).encode("ascii", "backslashreplace").decode()
        raise RequestRejected(f"body is not valid {'JSON' if encoding == 'json' else 'msgpack'}: {message}") from e
    if not isinstance(body, dict):
        kind = "a JSON object" if encoding == "json" else "a msgpack map"
        raise RequestRejected(f"body must be {kind}, not {type(body).__name__}")
    return body


def check_values(body: dict[str, Any], max_depth: int) -> None:
    """Refuse a decoded body nested deeper than `max_depth`, or holding a string that
    cannot be written back as UTF-8 (a lone surrogate, which JSON's `\\ud800` makes).
    Walks without recursion, so no body can exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, where, depth = stack.pop()
        if depth > max_depth:
            raise RequestRejected(f"{where or 'body'}: nested deeper than {max_depth} levels", code=ErrorCode.TOO_LARGE)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:  # a path only for what needs one: a prompt's token list has hundreds of ints
            if isinstance(key, str):
                _check_text(key, where or "body")
            if isinstance(item, str):
                _check_text(item, _path(where, key))
            elif isinstance(item, (dict, list)):
                stack.append((item, _path(where, key), depth + 1))


def _path(where: str, key: object) -> str:
    return f"{where}.{key}" if where else str(key)


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestRejected(f"{ascii(where)[1:-1]}: text holding {ascii(text[e.start:e.end])}, a lone surrogate "
                             "that is not valid Unicode") from e


def validate_body(raw: dict[str, Any]) -> RequestBody:
    """Validate a decoded body; raise `RequestRejected` naming each bad field and why."""
    try:
        return RequestBody.model_validate(raw)
    except ValidationError as e:
        raise RequestRejected(describe_validation_error(e)) from e


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem: `field: reason`."""
    parts = []
    for problem in error.errors(include_url=False):
        where = ".".join(str(p) for p in problem["loc"]) or "body"
        message = problem["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}")
    return "; ".join(parts)


def encode_metadata(metadata: dict[str, Any], encoding: Encoding) -> bytes:
    """Metadata as it will travel in `done`; raises TypeError or ValueError if it cannot."""
    return _encode(metadata, encoding)


def decode_media(items: list[bytes | str], field: str) -> list[bytes]:
    """Media bytes from a request's `field`: raw bytes (msgpack) or base64 strings (JSON)."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, bytes):
            out.append(item)
            continue
        try:
            out.append(base64.b64decode(item, validate=True))
        except binascii.Error as e:
            raise RequestRejected(f"{field}.{i}: not valid base64 ({e})") from e
    return out


def encode_request(request_id: str, body: dict[str, Any], encoding: Encoding = "json") -> dict[str, bytes | str]:
    """The stream entry fields of a request. Image bytes travel raw in msgpack, as base64 in JSON."""
    if not ID_PATTERN.fullmatch(request_id):
        raise RequestRejected(f"invalid id {request_id!r}: use 1-128 of A-Za-z0-9_.:-")
    if encoding == "json":
        body = {**body, **{field: [base64.b64encode(i).decode() if isinstance(i, bytes) else i for i in body[field]]
                           for field in MEDIA_FIELDS.values() if body.get(field)}}
    return {"id": request_id, encoding: _encode(body, encoding)}


# ---- output events ---------------------------------------------------------------


@dataclass(frozen=True)
class TopLogprob:
    """One alternative the model weighed for a token: its id, text and log probability."""

    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability under the model (before sampling's filters
    and temperature), and the most likely alternatives at that step, most likely first."""

    token_id: int
    text: str
    logprob: float
    top_logprobs: list[TopLogprob]


@dataclass(frozen=True)
class Delta:
    """New text (never a broken UTF-8 sequence) and the token ids that made it; with
    `logprobs` asked for, one `TokenLogprob` per token."""

    id: str
    seq: int
    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None
    reasoning: str | None = None  # a thinking model's new reasoning text; never part of `text`
    type: Literal["delta"] = field(default="delta", repr=False)


@dataclass(frozen=True)
class Usage:
    """Tokens a request used: its prompt, what it generated, and the prompt tokens whose
    KV came from a prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class Timing:
    """Milliseconds from the request's arrival (its entry id's stamp, on Redis's clock);
    then, over the tokens after the first, mean inter-token latency and tokens per second.
    None where there was nothing to time.

    The stages, in order: read by a worker (`read_ms`), decoded, validated and tokenized
    (`prepared_ms`), admitted to the batch (`queued_ms`), first token made (`ttft_ms`),
    first delta written to Redis (`published_ms`; None when the first delta went out with
    the terminal event), the terminal event made (`total_ms`). A resumed request's stages
    are those of the run that finished it."""

    queued_ms: float
    ttft_ms: float | None
    total_ms: float
    itl_ms: float | None = None
    tok_s: float | None = None
    read_ms: float | None = None
    prepared_ms: float | None = None
    published_ms: float | None = None


@dataclass(frozen=True)
class FunctionCall:
    """The function a call names, and its arguments as a JSON string (OpenAI's shape)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCall:
    """One call of a tool the request offered, parsed from the model's output."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


@dataclass(frozen=True)
class Ranked:
    """One document of a rerank request: its place in the request's list, and its score."""

    index: int
    relevance_score: float


@dataclass(frozen=True)
class Done:
    """The end of a request: the whole text, why it ended, usage and timing; the tool
    calls parsed from the text when the request offered tools. An embedding request's
    ends with its `embeddings` (one per input, in order: floats, or base64 strings as
    it asked), a rerank request's with its `results` (best first); their `text` is empty."""

    id: str
    finish_reason: FinishReason
    text: str
    usage: Usage
    timing: Timing
    metadata: dict[str, Any] | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None  # a thinking model's whole reasoning (the deltas' joined)
    stop_reason: str | None = None  # the stop string that ended it (vLLM's name); None for a stop token
    embeddings: list[list[float] | str] | None = None
    results: list[Ranked] | None = None
    type: Literal["done"] = field(default="done", repr=False)

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens per second after the first one: (tokens - 1) / (total - TTFT)."""
        tokens, ttft, total = self.usage.completion_tokens, self.timing.ttft_ms, self.timing.total_ms
        if tokens < 2 or ttft is None or total <= ttft:
            return None
        return round((tokens - 1) / ((total - ttft) / 1000.0), 1)


@dataclass(frozen=True)
class Error:
    """The request failed: `code` is machine-readable (an `ErrorCode` value), `message`
    says what to do."""

    id: str
    code: str
    message: str
    type: Literal["error"] = field(default="error", repr=False)


Event = Delta | Done | Error
_EVENT_TYPES: dict[str, type[Delta] | type[Done] | type[Error]] = {"delta": Delta, "done": Done, "error": Error}


# Made once: json.dumps with options builds a new encoder on every call.
_to_json = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def _encode(body: dict[str, Any], encoding: Encoding) -> bytes:
    """UTF-8 JSON (strict: no NaN) or msgpack; raises ValueError (or TypeError) on what
    cannot travel, here rather than in the Redis client's send."""
    if encoding == "json":
        return _to_json(body).encode()
    return msgpack.packb(body, use_bin_type=True)


def encode_event(event: Event, encoding: Encoding) -> dict[str, bytes | str]:
    """The stream entry fields of an output event; raises ValueError or TypeError if it cannot be encoded."""
    if isinstance(event, Delta) and event.logprobs is None:  # nearly every event: no deep copy of flat fields
        body: dict[str, Any] = {"id": event.id, "seq": event.seq, "text": event.text, "tokens": event.tokens}
        if event.reasoning is not None:
            body["reasoning"] = event.reasoning
        return {"type": "delta", encoding: _encode(body, encoding)}
    body = asdict(event)
    kind = body.pop("type")
    # Now and then: absent, not null.
    for optional in ("logprobs", "tool_calls", "reasoning", "stop_reason", "embeddings", "results"):
        if optional in body and body[optional] is None:
            del body[optional]
    return {"type": kind, encoding: _encode(body, encoding)}


def decode_event(fields: dict[Any, Any]) -> Event:
    """Parse an output stream entry into a typed event."""
    fields = {as_text(k): v for k, v in fields.items()}
    kind = as_text(fields["type"])
    if "json" in fields:
        body = json.loads(fields["json"])
    else:
        body = msgpack.unpackb(fields["msgpack"], raw=False)
    if kind == "done":
        body["usage"] = _known(Usage, body["usage"])
        body["timing"] = _known(Timing, body["timing"])
        if body.get("tool_calls") is not None:
            body["tool_calls"] = [ToolCall(id=c["id"], function=FunctionCall(**c["function"]))
                                  for c in body["tool_calls"]]
        if body.get("results") is not None:
            body["results"] = [_known(Ranked, r) for r in body["results"]]
    elif kind == "delta" and body.get("logprobs") is not None:
        body["logprobs"] = [TokenLogprob(**{**entry, "top_logprobs": [TopLogprob(**t) for t in entry["top_logprobs"]]})
                            for entry in body["logprobs"]]
    if kind == "done":  # a newer worker may say more at the end than this reader knows
        return _known(Done, body)
    return _EVENT_TYPES[kind](**body)


def _known(kind: type[T], values: dict[str, Any]) -> T:
    """A dataclass from the fields it knows (a newer worker may send more)."""
    names = {f.name for f in fields_of(kind)}  # type: ignore[arg-type]
    return kind(**{k: v for k, v in values.items() if k in names})


def is_terminal(event: Event) -> bool:
    """Whether the event ends its request (`done` or `error`)."""
    return not isinstance(event, Delta)
