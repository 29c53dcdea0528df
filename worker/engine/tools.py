"""Tool calls: the model's own tool format (from its chat template, as mlx-lm's tokenizer
wrapper infers it), a grammar that forces a call (`tool_choice` `required` or a named
function), and the parse of calls out of the finished text with mlx-lm's parser.

Deltas stream the raw text, call markup included; the terminal event carries the parsed
`tool_calls` (and `finish_reason` `tool_calls`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from llguidance import LLMatcher

from client.protocol import FunctionCall, NamedToolChoice, Tool, ToolCall
from worker.messages import ToolFormat, ToolUse

MAX_FORCED_CALLS = 8  # `required` lets the model call several tools (OpenAI's parallel calls), up to this


def forced_call_grammar(fmt: ToolFormat, tools: list[Tool], choice: str | NamedToolChoice) -> str:
    """A Lark grammar for the calls `choice` forces, in the model's own markup, each call's
    arguments valid for its tool's parameters: one to MAX_FORCED_CALLS calls of any of
    `tools` for `required`, exactly one call for a named function."""
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name},
                             "arguments": t.function.parameters or {"type": "object"}}} for t in tools]
    schema = {"anyOf": calls, "x-guidance": {"whitespace_flexible": False}}
    opening, closing = json.dumps(fmt.start + "\n"), json.dumps("\n" + fmt.end)
    more = 0 if isinstance(choice, NamedToolChoice) else MAX_FORCED_CALLS - 1
    return LLMatcher.grammar_from_lark(f"start: block (\"\\n\" block)~0..{more}\n"
                                       f"block: {opening} call {closing}\n"
                                       f"call: %json {json.dumps(schema)}")


def _tool_call(call: dict[str, Any]) -> ToolCall:
    arguments = call.get("arguments", {})
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(
        name=call["name"], arguments=arguments if isinstance(arguments, str) else json.dumps(arguments)))


def parse_tool_calls(text: str, use: ToolUse) -> list[ToolCall]:
    """The calls in the finished text, in order; a call the parser cannot read is left
    out (its text stays in `text`)."""
    calls = []
    rest = text
    while (start := rest.find(use.format.start)) >= 0:
        end = rest.find(use.format.end, start + len(use.format.start))
        if end < 0:
            break
        body = rest[start + len(use.format.start):end]
        rest = rest[end + len(use.format.end):]
        try:
            parsed = use.format.parse(body, use.tools)
            calls += [_tool_call(call) for call in (parsed if isinstance(parsed, list) else [parsed])
                      if isinstance(call, dict) and isinstance(call.get("name"), str)]
        except Exception:  # noqa: BLE001 - a malformed call is text, not a crash
            continue
    return calls
