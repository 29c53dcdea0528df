"""Tool calls: tools rendered by the chat template, calls parsed by mlx-lm's parser into
`tool_calls`, and `required` / a named function enforced with a grammar, so that even the
random demo models (a text and a vision one) return a call that parses and matches the
tool's parameters."""

from __future__ import annotations

import json

import jsonschema
import pytest
from support import KEYS, on_text_and_vision

from client import JobFailed, RequestRejected
from worker.engine.tools import MAX_FORCED_CALLS

served, worker, reference = on_text_and_vision()

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                                         "maximum": 100},
                                                                   "b": {"type": "integer", "minimum": 0,
                                                                         "maximum": 100}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def parameters(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_gives_calls_that_match_their_tools(client, temperature):
    """`required` forces one call or more (OpenAI's parallel calls), each valid for its tool."""
    done = client.generate(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=600,
                           temperature=temperature, seed=5, timeout=60)
    assert done.finish_reason == "tool_calls"
    assert 1 <= len(done.tool_calls) <= MAX_FORCED_CALLS
    assert done.text.count("<tool_call>") == len(done.tool_calls)
    for call in done.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in ("get_weather", "add")
        jsonschema.validate(json.loads(call.function.arguments), parameters(call.function.name))
    assert len({call.id for call in done.tool_calls}) == len(done.tool_calls)


def test_a_named_function_is_the_one_called(client):
    done = client.generate(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                           max_tokens=120, timeout=60)
    (call,) = done.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), parameters("add"))


def test_auto_parses_a_call_the_model_writes_and_none_leaves_the_tools_out(client):
    """With `auto` the tools are in the prompt and a call in the output is parsed (the
    output is pinned to one here with a `choice` format); `none` renders no tools."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    done = client.generate(messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=80, timeout=60,
                           response_format={"type": "choice", "choices": [call]})
    assert done.text == call and done.finish_reason == "tool_calls"
    (parsed,) = done.tool_calls
    assert parsed.function.name == "add" and json.loads(parsed.function.arguments) == {"a": 2, "b": 3}
    plain = client.generate(messages=ASK, max_tokens=1, timeout=60)
    offered = client.generate(messages=ASK, tools=TOOLS, max_tokens=1, timeout=60)
    declined = client.generate(messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=1, timeout=60)
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens == declined.usage.prompt_tokens
    assert declined.tool_calls is None


def test_a_conversation_with_a_call_and_its_answer_renders(client):
    messages = [*ASK, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    done = client.generate(messages=messages, tools=TOOLS, max_tokens=4, timeout=60)
    assert done.usage.prompt_tokens > client.generate(messages=ASK, tools=TOOLS, max_tokens=1,
                                                      timeout=60).usage.prompt_tokens


def test_bad_tool_requests_are_refused_precisely(client, worker):
    with pytest.raises(RequestRejected, match="tool_choice: no tool named 'nope'"):
        client.submit(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(RequestRejected, match="tool_choice needs tools"):
        client.submit(messages=ASK, tool_choice="required")
    with pytest.raises(RequestRejected, match="tools and chat_template_kwargs go with messages"):
        client.submit("a prompt", tools=TOOLS)
    client.redis.xadd(KEYS.queue(worker.queue), {"id": "tools-not-a-list", "json": json.dumps(
        {"messages": ASK, "tools": {"name": "x"}})})
    from client import Job

    with pytest.raises(JobFailed) as failed:
        Job(client, "tools-not-a-list", KEYS.output(worker.queue, "tools-not-a-list"), worker.queue).result(
            timeout=60)
    assert failed.value.code == "invalid_request" and failed.value.message.startswith("tools: Input should be a")
    with pytest.raises(JobFailed, match="chat_template_kwargs: tokenize cannot be set by a request"):
        client.generate(messages=ASK, chat_template_kwargs={"tokenize": False}, timeout=60)
    assert client.generate(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=600,
                           timeout=60).finish_reason == "tool_calls"
