"""OpenAI Batch API files: input lines read into mlxq lines, results written as output
and error lines in OpenAI's shape. No HTTP here: `mlxq batch` uses it too."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from client.batches import MAX_LINES, Batch, BatchLine, BatchStore, LineResult
from client.protocol import Done, TokenLogprob, encode_event

from .errors import ApiError
from .pooling import embeddings_response, read_pooling_call
from .requests import Call, read_call
from .responses import Shaper

ENDPOINTS: dict[str, Literal["chat", "completion", "embeddings"]] = {
    "/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/embeddings": "embeddings"}
MAX_CUSTOM_ID = 512


@dataclass
class ReadFile:
    """An input file, read: its lines, the one model they name, and what fails the whole
    batch (OpenAI's validation errors: `{code, message, line}`)."""

    lines: list[BatchLine]
    model: str | None
    errors: list[dict[str, Any]]


def read_input(content: bytes, endpoint: str) -> ReadFile:
    """Each line of a JSONL input file as an mlxq line, or the reason it cannot run (a
    malformed line, another endpoint, a body the gateway would refuse: that line's error).
    Custom ids used twice and more than `MAX_LINES` lines fail the whole batch."""
    if endpoint not in ENDPOINTS:
        raise ApiError.invalid(f"endpoint {endpoint!r}: batches take {', '.join(ENDPOINTS)}", param="endpoint")
    try:
        text = content.decode()
    except UnicodeDecodeError as e:
        return ReadFile([], None, [_problem("invalid_file", f"the file is not UTF-8 text ({e})", None)])
    raw_lines = [line for line in text.splitlines() if line.strip()]
    if not raw_lines:
        return ReadFile([], None, [_problem("empty_file", "the file has no lines", None)])
    if len(raw_lines) > MAX_LINES:
        return ReadFile([], None, [_problem("too_many_requests", f"the file has {len(raw_lines)} lines; a batch "
                                            f"holds at most {MAX_LINES}", None)])
    read = ReadFile([], None, [])
    seen: dict[str, int] = {}
    for number, raw in enumerate(raw_lines, 1):
        line = _read_line(raw, endpoint)
        read.lines.append(line)
        if line.custom_id is not None and line.custom_id in seen:
            read.errors.append(_problem("duplicate_custom_id", f"custom_id {line.custom_id!r} is also on line "
                                        f"{seen[line.custom_id]}; each line needs its own", number))
        seen.setdefault(line.custom_id or "", number)
        model = line.meta.get("model")
        if model is not None and read.model is None:
            read.model = model
    read.lines = [_one_model(line, read.model) for line in read.lines]  # one model per batch, as OpenAI's
    return read


def _one_model(line: BatchLine, model: str | None) -> BatchLine:
    if line.body is None or line.meta["model"] == model:
        return line
    return replace(line, body=None, error={"code": "invalid_request", "message": f"body.model {line.meta['model']!r}: "
                                            f"every line of a batch names one model (the first names {model!r})"})


def _problem(code: str, message: str, line: int | None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None, "line": line}


def _read_line(raw: str, endpoint: str) -> BatchLine:
    try:
        line = json.loads(raw)
    except ValueError as e:
        return BatchLine(None, error={"code": "invalid_json_line", "message": f"not a JSON object: {e}"})
    if not isinstance(line, dict):
        return BatchLine(None, error={"code": "invalid_json_line", "message": "not a JSON object"})
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        return BatchLine(None, error={"code": "invalid_request", "message": f"custom_id: a string of 1-{MAX_CUSTOM_ID} "
                                      "characters is required"})
    unknown = sorted(set(line) - {"custom_id", "method", "url", "body"})
    why = (f"unknown field(s) {', '.join(unknown)}" if unknown
           else f"method {line.get('method')!r}: batches take POST" if line.get("method") != "POST"
           else f"url {line.get('url')!r}: this batch's endpoint is {endpoint}" if line.get("url") != endpoint
           else None)
    if why is not None:
        return BatchLine(custom_id, error={"code": "invalid_request", "message": why})
    kind = ENDPOINTS[endpoint]
    try:
        call = read_pooling_call(kind, line.get("body")) if kind == "embeddings" else read_call(kind, line.get("body"))
    except ApiError as e:
        return BatchLine(custom_id, error={"code": e.code or "invalid_request", "message": e.message})
    return BatchLine(custom_id, body=call.body, meta={"model": call.model, "created": call.created,
                                                      "offers_tools": call.offers_tools})


ToolMarkers = Callable[[str], Awaitable[tuple[str, str] | None]]


async def output_line(result: LineResult, line: BatchLine, endpoint: str, tool_call: ToolMarkers) -> dict[str, Any]:
    """The output or error file's line for one result."""
    line_id = f"batch_req_{uuid.uuid5(uuid.NAMESPACE_URL, result.request_id).hex}"
    event = result.event
    if isinstance(event, Done) and endpoint not in ENDPOINTS:  # a client's batch: mlxq's own `done`
        body = json.loads(encode_event(event, "json")["json"])
        return {"id": line_id, "custom_id": result.custom_id,
                "response": {"status_code": 200, "request_id": result.request_id, "body": body}, "error": None}
    if isinstance(event, Done):
        call = Call(ENDPOINTS[endpoint], line.meta["model"], line.body or {}, False, False, line.meta["created"],
                    line.meta["offers_tools"])
        if call.kind == "embeddings":
            body = embeddings_response(call, event)
        else:
            markers = await tool_call(call.model) if call.offers_tools else None
            logprobs: list[TokenLogprob] | None = None
            if call.body.get("logprobs"):
                logprobs = [entry for delta in result.deltas for entry in delta.logprobs or []]
            body = Shaper(call, result.request_id, markers).whole(event, logprobs)
        return {"id": line_id, "custom_id": result.custom_id,
                "response": {"status_code": 200, "request_id": result.request_id, "body": body}, "error": None}
    error = {"code": event.code, "message": event.message}
    if line.body is None or event.code in ("batch_expired", "cancelled"):  # never ran as a request
        return {"id": line_id, "custom_id": result.custom_id, "response": None, "error": error}
    failed = ApiError.from_code(event.code, event.message)
    return {"id": line_id, "custom_id": result.custom_id, "error": error,
            "response": {"status_code": failed.status, "request_id": result.request_id, "body": failed.body()}}


async def result_file(store: BatchStore, batch: Batch, part: Literal["output", "errors"],
                      tool_call: ToolMarkers) -> bytes:
    """A batch's output or error file: a line per result of that kind, in line order."""
    results = [r for r in await store.results(batch.id) if (part == "output") == isinstance(r.event, Done)]
    lines = await store.lines(batch.id, 0, batch.total) if results else []
    return jsonl([await output_line(r, lines[r.index], batch.endpoint, tool_call) for r in results])


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode() + b"\n" for line in lines)
