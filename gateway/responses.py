"""mlxq's output events as OpenAI's objects: stream chunks and whole responses.

A request that offers tools streams its text as content until the model's tool-call
marker begins; from there the text is held back, and the parsed calls go out as
`tool_calls` when the request ends (the held text is sent as content after all when
no call could be parsed, so nothing is lost).
"""

from __future__ import annotations

from typing import Any

from client.protocol import Delta, Done, TokenLogprob

from .requests import Call


class ToolCallSplitter:
    """Splits streamed text into content and the tool-call markup that starts at `start`."""

    def __init__(self, start: str) -> None:
        self.start = start
        self.held = ""
        self.inside = False

    def feed(self, text: str) -> str:
        """The part of `text` that is content for sure; the rest is held."""
        if self.inside:
            self.held += text
            return ""
        text = self.held + text
        at = text.find(self.start)
        if at >= 0:
            self.inside = True
            self.held = text[at:]
            return text[:at]
        keep = _partial_suffix(text, self.start)  # might be the marker's beginning
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def usage(done: Done) -> dict[str, Any]:
    u = done.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [{"token": e.text, "logprob": e.logprob, "bytes": list(e.text.encode()),
                         "top_logprobs": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode())}
                                          for t in e.top_logprobs]} for e in entries]}


class Shaper:
    """Builds the OpenAI objects of one call from its events."""

    def __init__(self, call: Call, request_id: str, tool_call: tuple[str, str] | None) -> None:
        self.call = call
        self.chat = call.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"
        self.splitter = ToolCallSplitter(tool_call[0]) if call.offers_tools and tool_call else None
        self.offset = 0  # characters streamed so far (completions' text_offset)

    def _object(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        body = {"id": self.id, "object": kind, "created": self.call.created, "model": self.call.model,
                "choices": choices}
        if chunk and self.call.include_usage:
            body["usage"] = None
        return body

    def opening(self) -> list[dict[str, Any]]:
        """The chunk that starts a chat stream (the assistant's role)."""
        if not self.chat:
            return []
        return [self._object([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}], chunk=True)]

    def delta(self, delta: Delta) -> list[dict[str, Any]]:
        """The chunk for one delta (none when it adds nothing a client would see)."""
        text = self.splitter.feed(delta.text) if self.splitter else delta.text
        if not (text or delta.reasoning or delta.logprobs):
            return []
        return [self._object([self._delta_choice(text, delta)], chunk=True)]

    def _delta_choice(self, text: str, delta: Delta) -> dict[str, Any]:
        if self.chat:
            content: dict[str, Any] = {"content": text} if text or not delta.reasoning else {}
            if delta.reasoning:
                content["reasoning_content"] = delta.reasoning
            logprobs = chat_logprobs(delta.logprobs) if delta.logprobs is not None else None
            return {"index": 0, "delta": content, "logprobs": logprobs, "finish_reason": None}
        return {"index": 0, "text": text, "logprobs": self._completion_logprobs(delta.logprobs),
                "finish_reason": None}

    def ending(self, done: Done) -> list[dict[str, Any]]:
        """The chunks that end a stream: held text or tool calls, the finish reason, the usage."""
        chunks = []
        held = self.splitter.flush() if self.splitter else ""
        if done.tool_calls and self.chat:
            calls = [{"index": i, **_tool_call(c)} for i, c in enumerate(done.tool_calls)]
            chunks.append(self._object([{"index": 0, "delta": {"tool_calls": calls}, "logprobs": None,
                                         "finish_reason": None}], chunk=True))
        elif held:
            key = "delta" if self.chat else "text"
            chunks.append(self._object([{"index": 0, key: {"content": held} if self.chat else held,
                                         "logprobs": None, "finish_reason": None}], chunk=True))
        last = {"index": 0, "delta": {}} if self.chat else {"index": 0, "text": ""}
        chunks.append(self._object([{**last, "logprobs": None, "finish_reason": done.finish_reason}], chunk=True))
        if self.call.include_usage:
            chunks.append({**self._object([], chunk=True), "usage": usage(done)})
        return chunks

    def whole(self, done: Done, logprobs: list[TokenLogprob] | None) -> dict[str, Any]:
        """The response of a call that does not stream."""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": self._content(done)}
            if done.reasoning is not None:
                message["reasoning_content"] = done.reasoning
            if done.tool_calls:
                message["tool_calls"] = [_tool_call(c) for c in done.tool_calls]
            choice = {"index": 0, "message": message,
                      "logprobs": chat_logprobs(logprobs) if logprobs is not None else None}
        else:
            choice = {"index": 0, "text": done.text, "logprobs": self._completion_logprobs(logprobs)}
        return {**self._object([{**choice, "finish_reason": done.finish_reason}], chunk=False),
                "usage": usage(done), "system_fingerprint": None}

    def _content(self, done: Done) -> str | None:
        """The message's text: without the tool-call markup when calls were parsed from it."""
        if not done.tool_calls or self.splitter is None:
            return done.text
        return done.text.split(self.splitter.start, 1)[0].strip() or None

    def _completion_logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e.text)
        return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{t.text: t.logprob for t in e.top_logprobs} for e in entries],
                "text_offset": offsets}


def _tool_call(call: Any) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments}}
