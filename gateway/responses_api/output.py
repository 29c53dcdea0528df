"""mlxq's events as the Responses API's objects: the `response` and its output items, and
a stream's events (`response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta` ... `response.completed`).

Item ids come from the request's id, so that the items a stream announced are the items
of the response it ends with (and of the one stored)."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from client.protocol import Delta, Done, Error, Event, TokenLogprob

from ..errors import ApiError
from ..requests import Call
from ..responses import ToolCallSplitter
from .request import ResponsesRequest

STATUS = {"length": "incomplete", "cancelled": "cancelled"}  # finish reason -> status; else completed
KEEPALIVE = b": keep-alive\n\n"


class Skeleton:
    """What a response says of its request, whatever becomes of it."""

    def __init__(self, request: ResponsesRequest, response_id: str, model: str) -> None:
        self.id = response_id
        self.created_at = int(time.time())
        self.fields: dict[str, Any] = {
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens, "model": model,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": request.reasoning.effort if request.reasoning else None, "summary": None},
            "store": request.store, "background": request.background,
            "temperature": request.temperature, "top_p": request.top_p,
            "text": {"format": (request.text.format.model_dump(by_alias=True, exclude_none=True)
                                if request.text and request.text.format else {"type": "text"})},
            "tool_choice": (request.tool_choice if isinstance(request.tool_choice, str) or request.tool_choice is None
                            else request.tool_choice.model_dump()) or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in request.tools or []],
            "truncation": "disabled", "user": request.user, "metadata": request.metadata or {}}

    def response(self, status: str, output: list[dict[str, Any]] | None = None, usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None, incomplete: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
                **self.fields, "output": output or [], "usage": usage}

    def finished(self, done: Done, request_id: str, tool_start: str | None) -> dict[str, Any]:
        """The response a `done` ends."""
        status = STATUS.get(done.finish_reason, "completed")
        return self.response(status, output_items(done, request_id, tool_start), usage(done),
                             incomplete="max_output_tokens" if status == "incomplete" else None)

    def failed(self, error: ApiError) -> dict[str, Any]:
        return self.response("failed", error={"code": error.code or "server_error", "message": error.message})

    @staticmethod
    def from_stored(response: dict[str, Any]) -> Skeleton:
        """The skeleton of a stored response (to finish a background one)."""
        skeleton = Skeleton.__new__(Skeleton)
        skeleton.id, skeleton.created_at = response["id"], response["created_at"]
        skeleton.fields = {k: v for k, v in response.items() if k not in (
            "id", "object", "created_at", "status", "error", "incomplete_details", "output", "usage")}
        return skeleton


def output_items(done: Done, request_id: str, tool_start: str | None) -> list[dict[str, Any]]:
    """A done's reasoning, text and function calls as output items."""
    items: list[dict[str, Any]] = []
    if done.reasoning:
        items.append(reasoning_item(request_id, done.reasoning))
    text = done.text.split(tool_start, 1)[0].strip() if done.tool_calls and tool_start else done.text
    if text or not done.tool_calls:
        items.append(message_item(request_id, text))
    items += [function_call_item(request_id, i, call.id, call.function.name, call.function.arguments)
              for i, call in enumerate(done.tool_calls or [])]
    return items


def reasoning_item(request_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{request_id}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(request_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [text_part(text)]
    return {"type": "message", "id": f"msg_{request_id}", "status": status, "role": "assistant", "content": content}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(request_id: str, index: int, call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{request_id}_{index}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def usage(done: Done) -> dict[str, Any]:
    u = done.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


class ResponseShape:
    """One call's answer as the Responses API writes it (`relay.Shape`): the whole
    response, or its events; `settle` hands the final response to `keep` (the store)."""

    route = "responses"
    keepalive = KEEPALIVE

    def __init__(self, call: Call, request_id: str, tool_call: tuple[str, str] | None, skeleton: Skeleton,
                 keep: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        self.request_id = request_id
        self.skeleton = skeleton
        self.keep = keep
        self.tool_start = tool_call[0] if call.offers_tools and tool_call else None
        self.splitter = ToolCallSplitter(self.tool_start) if self.tool_start else None
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # output items announced so far
        self.open: str | None = None  # "reasoning" or "message": the item whose text streams now
        self.text = ""  # the open item's text so far
        self.final: dict[str, Any] | None = None

    def whole(self, done: Done, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        self.final = self.skeleton.finished(done, self.request_id, self.tool_start)
        return self.final

    def opening(self) -> list[bytes]:
        started = self.skeleton.response("in_progress")
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def lines(self, event: Event) -> list[bytes]:
        if isinstance(event, Delta):
            text = self.splitter.feed(event.text) if self.splitter else event.text
            return self._stream("reasoning", event.reasoning or "") + self._stream("message", text)
        if isinstance(event, Error):
            return self.failure(ApiError.from_code(event.code, event.message))
        return self._ending(event)

    def failure(self, error: ApiError) -> list[bytes]:
        self.final = self.skeleton.failed(error)
        return [self._event("error", code=error.code, message=error.message, param=error.param),
                self._event("response.failed", response=self.final)]

    async def settle(self) -> None:
        if self.final is not None:
            await self.keep(self.final)

    # ---- the stream's items -----------------------------------------------------

    def _stream(self, kind: str, text: str) -> list[bytes]:
        """`text` for the item of `kind`: the open one's, or a new one (the open one closed)."""
        if not text:
            return []
        lines = self._open(kind) if self.open != kind else []
        self.text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        lines.append(self._event(name, item_id=self.items[-1]["id"], output_index=len(self.items) - 1,
                                 content_index=0, delta=text, **({} if kind == "reasoning" else {"logprobs": []})))
        return lines

    def _open(self, kind: str) -> list[bytes]:
        """Close the open item and announce a new one of `kind`, with its (empty) part."""
        lines = self._close()
        lines += self._add(reasoning_item(self.request_id, "", "in_progress") if kind == "reasoning"
                           else message_item(self.request_id, None, "in_progress"))
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else text_part("")
        lines.append(self._event("response.content_part.added", item_id=self.items[-1]["id"],
                                 output_index=len(self.items) - 1, content_index=0, part=part))
        self.open, self.text = kind, ""
        return lines

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        index, item = len(self.items) - 1, self.items[-1]
        if self.open == "reasoning":
            part: dict[str, Any] = {"type": "reasoning_text", "text": self.text}
            done = self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                               content_index=0, text=self.text)
            finished = reasoning_item(self.request_id, self.text)
        else:
            part = text_part(self.text)
            done = self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=self.text, logprobs=[])
            finished = message_item(self.request_id, self.text)
        self.items[-1], self.open = finished, None
        return [done, self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=finished)]

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self.items.append(item)
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)]

    def _ending(self, done: Done) -> list[bytes]:
        held = self.splitter.flush() if self.splitter else ""
        lines = [*([] if done.tool_calls else self._stream("message", held)), *self._close()]
        if not done.tool_calls and not any(item["type"] == "message" for item in self.items):
            lines += self._open("message") + self._close()  # nothing was said: an empty message, as the whole has
        for i, call in enumerate(done.tool_calls or []):
            item = function_call_item(self.request_id, i, call.id, call.function.name, "", "in_progress")
            lines += self._add(item)
            index, arguments = len(self.items) - 1, call.function.arguments
            finished = {**item, "arguments": arguments, "status": "completed"}
            lines += [self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=arguments),
                      self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  arguments=arguments),
                      self._event("response.output_item.done", output_index=index, item=finished)]
            self.items[-1] = finished
        self.final = self.skeleton.finished(done, self.request_id, self.tool_start)
        self.final["output"] = self.items  # what was streamed is what is kept
        # A response cancelled while it streamed ends as an incomplete one does (the API has no
        # event of its own for it); its status says cancelled.
        kind = "response.completed" if self.final["status"] == "completed" else "response.incomplete"
        return [*lines, self._event(kind, response=self.final)]

    def _event(self, kind: str, **body: Any) -> bytes:
        self.sequence += 1
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **body}, ensure_ascii=False,
                          separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()
