"""Anthropic's Messages API onto the same queues: `POST /v1/messages` (streaming or not)
and `POST /v1/messages/count_tokens`.

A Messages body is read strictly and turned into the OpenAI chat body the gateway already
serves (system, text and base64 image blocks, `tool_use` / `tool_result` blocks, tools
and `tool_choice`: `any` and a named tool are forced by grammar as on the OpenAI side),
so both APIs share one mapping onto mlxq's request. Answers and errors are in
Anthropic's shapes; a stream is its event sequence (`message_start`, `content_block_*`,
`message_delta`, `message_stop`, `ping`, `error`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse

from client.protocol import Delta, Done, Error, Event

from .errors import ApiError
from .requests import Call, read_call
from .responses import ToolCallSplitter

# ApiError's OpenAI type -> Anthropic's error type, by HTTP status
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "api_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(BaseModel):
    type: str  # accepted and not acted on: the worker caches prompt prefixes by itself


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ImageSource(_Strict):
    type: Literal["base64", "url", "file"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None
    file_id: str | None = None


class ImageBlock(_Strict):
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Strict):
    """An earlier turn's reasoning, sent back by agents: not shown to the model again (as
    OpenAI's `reasoning_content`)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                  Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Strict):
    user_id: str | None = None


class Thinking(_Strict):
    """Whether a thinking model reasons first (its chat template's `enable_thinking`);
    `budget_tokens` is not enforced apart: `max_tokens` bounds reasoning and answer together."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class MessagesRequest(_Strict):
    """`POST /v1/messages` (and, without `max_tokens`, `count_tokens`)."""

    model: str = Field(min_length=1, max_length=512)
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    thinking: Thinking | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # as vLLM's extra (e.g. enable_thinking)

    def to_chat(self) -> dict[str, Any]:
        """The OpenAI chat body that asks for the same."""
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "\n\n".join(b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        for i, message in enumerate(self.messages):
            messages += _chat_messages(i, message)
        template = dict(self.chat_template_kwargs or {})
        if self.thinking is not None:
            template["enable_thinking"] = self.thinking.type != "disabled"
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                                "stream": self.stream, "temperature": self.temperature, "top_p": self.top_p,
                                "top_k": self.top_k, "stop": self.stop_sequences,
                                "chat_template_kwargs": template or None,
                                "user": self.metadata.user_id if self.metadata else None}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                               "parameters": t.input_schema}} for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = _tool_choice(self.tool_choice)
        return {k: v for k, v in body.items() if v is not None}


def _tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if choice.disable_parallel_tool_use and choice.type in ("auto", "any"):
        raise ApiError.invalid("tool_choice.disable_parallel_tool_use: cannot be enforced with 'auto' or 'any' "
                               "(a named tool forces exactly one call)", param="tool_choice")
    if choice.type == "tool":
        if not choice.name:
            raise ApiError.invalid("tool_choice.name: required with type 'tool'", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _chat_messages(i: int, message: Message) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI chat messages: a user turn's tool results first, as
    `tool` messages; an assistant turn's `tool_use` blocks as its `tool_calls`."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        where = f"messages.{i}.content.{j}"
        wrong = {ToolUseBlock: "user", ToolResultBlock: "assistant", ImageBlock: "assistant",
                 ThinkingBlock: "user"}.get(type(block))
        if wrong == message.role:
            raise ApiError.invalid(f"{where}: a {block.type} block cannot be in a {message.role} message", param=where)
        if isinstance(block, ThinkingBlock):
            continue
        if isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input)}})
        elif isinstance(block, ToolResultBlock):
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _result_text(where, block)})
        else:
            parts.append(_image_part(where, block) if isinstance(block, ImageBlock)
                         else {"type": "text", "text": block.text})
    if message.role == "assistant":
        text = "".join(p["text"] for p in parts)
        content = text or (None if calls else "")  # a turn of thinking alone is an empty answer
        return [{"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": parts}] if parts else [])


def _image_part(where: str, block: ImageBlock) -> dict[str, Any]:
    source = block.source
    if source.type != "base64" or not source.data or not source.media_type:
        raise ApiError.invalid(f"{where}.source: mlxq takes base64 images (type 'base64', media_type, data); it "
                               "never fetches a URL or a file", param=f"{where}.source")
    return {"type": "image_url", "image_url": {"url": f"data:{source.media_type};base64,{source.data}"}}


def _result_text(where: str, block: ToolResultBlock) -> str:
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    elif all(isinstance(b, TextBlock) for b in block.content):
        text = "".join(b.text for b in block.content if isinstance(b, TextBlock))
    else:
        raise ApiError.invalid(f"{where}.content: mlxq takes a tool result's text, not images", param=where)
    return f"Error: {text}" if block.is_error else text


def read_messages(raw: Any, counting: bool = False) -> tuple[MessagesRequest, Call]:
    """Validate a Messages body; raises `ApiError` (400). `counting`: a `count_tokens` body,
    which has no `max_tokens`."""
    if not isinstance(raw, dict):
        raise ApiError.invalid("the request body must be a JSON object")
    if counting:
        extra = sorted(set(raw) - {"model", "messages", "system", "tools", "tool_choice", "chat_template_kwargs"})
        if extra:
            raise ApiError.invalid(f"{extra[0]}: Extra inputs are not permitted", param=extra[0])
        raw = {**raw, "max_tokens": 1}
    try:
        request = MessagesRequest.model_validate(raw)
    except ValidationError as e:
        problem = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in problem["loc"])
        raise ApiError.invalid(f"{where}: {problem['msg']}", param=where) from e
    return request, read_call("chat", request.to_chat())


def message(done: Done, model: str, message_id: str, tool_call: tuple[str, str] | None) -> dict[str, Any]:
    """The whole answer as an Anthropic `message`."""
    content: list[dict[str, Any]] = []
    if done.reasoning:
        content.append({"type": "thinking", "thinking": done.reasoning, "signature": ""})
    text = done.text.split(tool_call[0], 1)[0].strip() if done.tool_calls and tool_call else done.text
    if text:
        content.append({"type": "text", "text": text})
    content += [_tool_use(call) for call in done.tool_calls or []]
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            **_stop(done), "usage": _usage(done)}


def _tool_use(call: Any) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = {"arguments": call.function.arguments}
    return {"type": "tool_use", "id": call.id, "name": call.function.name,
            "input": arguments if isinstance(arguments, dict) else {"value": arguments}}


def _stop(done: Done) -> dict[str, Any]:
    matched = done.stop_reason if isinstance(done.stop_reason, str) else None
    reason = "stop_sequence" if matched is not None else STOP_REASONS.get(done.finish_reason, "end_turn")
    return {"stop_reason": reason, "stop_sequence": matched}


def _usage(done: Done) -> dict[str, Any]:
    u = done.usage
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def sse(kind: str, body: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **body}, ensure_ascii=False,
                                                          separators=(",", ":")).encode() + b"\n\n"


PING = sse("ping", {})


def error_body(error: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


def anthropic_error(error: ApiError) -> JSONResponse:
    """An error as Anthropic's API answers it."""
    return JSONResponse(error_body(error), status_code=error.status, headers=error.headers)


class MessageShape:
    """One call's answer as Anthropic writes it (`relay.Shape`): a whole `message`, or a
    stream of events: a text block while text comes (tool-call markup held back), then a
    `tool_use` block per parsed call, then the stop."""

    route = "messages"
    keepalive = PING

    def __init__(self, call: Call, request_id: str, tool_call: tuple[str, str] | None) -> None:
        self.call = call
        self.id = f"msg_{request_id}"
        self.tool_call = tool_call
        self.splitter = ToolCallSplitter(tool_call[0]) if call.offers_tools and tool_call else None
        self.blocks = 0  # blocks opened so far
        self.open: str | None = None  # the kind of the block open now: "thinking" or "text"

    async def settle(self) -> None:
        pass

    def whole(self, done: Done, logprobs: Any = None) -> dict[str, Any]:
        return message(done, self.call.model, self.id, self.tool_call if self.call.offers_tools else None)

    def failure(self, error: ApiError) -> list[bytes]:
        return [sse("error", error_body(error))]

    def opening(self) -> list[bytes]:
        start: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.call.model,
                                 "content": [], "stop_reason": None, "stop_sequence": None,
                                 "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [sse("message_start", {"message": start}), PING]

    def lines(self, event: Event) -> list[bytes]:
        if isinstance(event, Delta):
            text = self.splitter.feed(event.text) if self.splitter else event.text
            return self._block("thinking", event.reasoning or "") + self._block("text", text)
        if isinstance(event, Error):
            return self.failure(ApiError.from_code(event.code, event.message))
        return self._ending(event)

    def _block(self, kind: str, text: str) -> list[bytes]:
        """`text` for a block of `kind`: the open block's, or a new one (the open one closed)."""
        if not text:
            return []
        lines = []
        if self.open != kind:
            lines += self._close()
            start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text",
                                                                                                      "text": ""}
            lines.append(sse("content_block_start", {"index": self.blocks, "content_block": start}))
            self.open = kind
            self.blocks += 1
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                         "text": text}
        lines.append(sse("content_block_delta", {"index": self.blocks - 1, "delta": delta}))
        return lines

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        lines = []
        if self.open == "thinking":
            lines.append(sse("content_block_delta", {"index": self.blocks - 1, "delta": {"type": "signature_delta",
                                                                                        "signature": ""}}))
        self.open = None
        return [*lines, sse("content_block_stop", {"index": self.blocks - 1})]

    def _ending(self, done: Done) -> list[bytes]:
        held = self.splitter.flush() if self.splitter else ""
        lines = [*([] if done.tool_calls else self._block("text", held)), *self._close()]
        for call in done.tool_calls or []:
            use = _tool_use(call)
            lines += [sse("content_block_start", {"index": self.blocks, "content_block": {**use, "input": {}}}),
                      sse("content_block_delta", {"index": self.blocks, "delta": {
                          "type": "input_json_delta", "partial_json": json.dumps(use["input"])}}),
                      sse("content_block_stop", {"index": self.blocks})]
            self.blocks += 1
        usage = _usage(done)
        lines += [sse("message_delta", {"delta": _stop(done), "usage": {"output_tokens": usage["output_tokens"]}}),
                  sse("message_stop", {})]
        return lines
