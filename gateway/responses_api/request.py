"""A Responses API body (`POST /v1/responses`), read strictly, and the conversation it
continues turned into the OpenAI chat body the gateway already serves: one mapping onto
mlxq's request for the chat, Messages and Responses APIs alike.

Input items are kept as OpenAI writes them (with ids), since a stored response keeps its
conversation as items; only the chat body is built from them. Everything the Responses
API defines is mapped, or refused with a 400 that names the field: built-in tools the
gateway cannot run, item types it cannot read, fields it has no meaning for.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ApiError
from ..requests import Call, describe, read_call

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use", "computer_use_preview",
                  "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImage(_Strict):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


Part = Annotated[InputText | OutputText | InputImage | Refusal, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=128)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[Part]
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Strict):
    """An earlier turn's reasoning, sent back by agents: not shown to the model again."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


Item = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                 Field(discriminator="type")]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the only one a model without the notion gives


class Reasoning(_Strict):
    """Effort maps onto thinking on or off (the chat template's `enable_thinking`), which
    is what a local thinking model has; the reasoning comes back as a reasoning item."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Strict):
    """`POST /v1/responses`."""

    model: str = Field(min_length=1, max_length=512)
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    parallel_tool_calls: bool | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    previous_response_id: str | None = Field(None, max_length=128)
    user: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["disabled"] | None = None
    include: list[Literal["reasoning.encrypted_content", "message.output_text.logprobs"]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # as vLLM's extra (e.g. enable_thinking)

    def input_items(self) -> list[dict[str, Any]]:
        """This request's input as items, each with an id (as OpenAI lists them back)."""
        if isinstance(self.input, str):
            items: list[dict[str, Any]] = [{"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": self.input}]}]
        else:
            items = [item.model_dump(by_alias=True, exclude_none=True) for item in self.input]
        for i, item in enumerate(items):
            item.setdefault("id", f"{_ID_PREFIXES[item['type']]}_{uuid.uuid4().hex}")
            content = item.get("content")
            for j, part in enumerate(content if isinstance(content, list) else []):
                if part["type"] == "input_image" and not str(part.get("image_url", "")).startswith("data:"):
                    where = f"input.{i}.content.{j}.image_url"
                    raise ApiError.invalid(f"{where}: mlxq takes an image as a data: URL (nothing is fetched, no "
                                           "file_id is read)", param=where)
        return items

    def to_call(self, conversation: list[dict[str, Any]]) -> Call:
        """The chat call that asks for the next turn of `conversation` (the earlier turns'
        items, then this request's); raises `ApiError` (400)."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + \
            chat_messages(conversation)
        template = dict(self.chat_template_kwargs or {})
        if self.reasoning is not None and self.reasoning.effort is not None:
            template["enable_thinking"] = self.reasoning.effort not in ("none", "minimal")
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
                                "stream": self.stream, "temperature": self.temperature, "top_p": self.top_p,
                                "metadata": self.metadata or None, "user": self.user or self.safety_identifier,
                                "chat_template_kwargs": template or None,
                                "parallel_tool_calls": self.parallel_tool_calls,
                                "response_format": self._response_format()}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description or "",
                "parameters": t.parameters or {"type": "object", "properties": {}}}} for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else \
                {"type": "function", "function": {"name": self.tool_choice.name}}
        return read_call("chat", {k: v for k, v in body.items() if v is not None})

    def _response_format(self) -> dict[str, Any] | None:
        format_ = self.text.format if self.text else None
        if format_ is None or format_.type == "text":
            return None
        if format_.type == "json_object":
            return {"type": "json_object"}
        if format_.schema_ is None or not format_.name:
            raise ApiError.invalid("text.format: a json_schema format needs its name and schema", param="text.format")
        schema = {"name": format_.name, "schema": format_.schema_, "strict": format_.strict,
                  "description": format_.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def read_request(raw: Any) -> ResponsesRequest:
    """Validate a Responses body; raises `ApiError` (400) naming the field."""
    if not isinstance(raw, dict):
        raise ApiError.invalid("the request body must be a JSON object")
    _refuse_what_cannot_run(raw)
    try:
        request = ResponsesRequest.model_validate({**raw, "input": _typed(raw.get("input"))})
    except ValidationError as e:
        raise ApiError.invalid(*describe(e)) from e
    if request.background and not request.store:
        raise ApiError.invalid("background: a background response is kept to be polled; it needs store: true",
                               param="background")
    if request.background and request.stream:
        raise ApiError.invalid("stream: a background response is polled (GET /v1/responses/{id}), not streamed",
                               param="stream")
    return request


def _refuse_what_cannot_run(raw: dict[str, Any]) -> None:
    """Built-in tools and item types the gateway has nothing for, named before validation."""
    tools = raw.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            shown = kind[:40]
            why = "a built-in tool the gateway cannot run" if kind in BUILT_IN_TOOLS else "not a tool type it knows"
            raise ApiError.invalid(f"tools.{i}.type: {shown!r} is {why}; give function tools (type 'function') "
                                   "and run them yourself", param=f"tools.{i}.type")
    items = raw.get("input")
    for i, item in enumerate(items if isinstance(items, list) else []):
        kind = item.get("type") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind not in ITEM_TYPES:
            raise ApiError.invalid(f"input.{i}.type: {kind[:40]!r} items are not supported; mlxq reads "
                                   f"{', '.join(ITEM_TYPES)} items", param=f"input.{i}.type")


def _typed(items: Any) -> Any:
    """Messages given without a type (OpenAI's easy input messages) are message items."""
    if not isinstance(items, list):
        return items
    return [{"type": "message", **item} if isinstance(item, dict) and "type" not in item and "role" in item
            else item for item in items]


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation's items as chat messages: an assistant turn's function calls as its
    `tool_calls`, each output as a `tool` message; reasoning items are not sent back."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type")
        if kind == "message":
            messages.append(_message(i, item))
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item["output"]
            text = output if isinstance(output, str) else "".join(_part_text(f"input.{i}.output", p) for p in output)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    return messages


def _message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    role, content = item["role"], item["content"]
    if isinstance(content, str):
        return {"role": role, "content": content}
    where = f"input.{i}.content"
    if role == "assistant":
        return {"role": role, "content": "".join(_part_text(f"{where}.{j}", p) for j, p in enumerate(content))}
    parts = []
    for j, part in enumerate(content):
        if part["type"] == "input_image":  # a data: URL, checked as the item came in
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            parts.append({"type": "text", "text": _part_text(f"{where}.{j}", part)})
    return {"role": role, "content": parts}


def _part_text(where: str, part: dict[str, Any]) -> str:
    if part["type"] == "input_image":
        raise ApiError.invalid(f"{where}: an image can only be in a user, system or developer message", param=where)
    return str(part.get("text", part.get("refusal", "")))


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
