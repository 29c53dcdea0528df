"""The Responses API's bodies read, and conversations mapped onto chat (no server): any
body is read or refused with a 400, never an exception of another kind."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import ApiError
from gateway.responses_api.request import chat_messages, read_request

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                max_size=4), max_leaves=12)
FIELDS = ["model", "input", "instructions", "tools", "tool_choice", "text", "reasoning", "max_output_tokens",
          "metadata", "store", "stream", "background", "previous_response_id", "parallel_tool_calls", "include"]
ITEM = st.fixed_dictionaries({"type": st.sampled_from(["message", "function_call", "function_call_output",
                                                       "reasoning", "web_search_call", "x"])},
                             optional={"role": st.sampled_from(["user", "assistant", "tool"]), "content": JSON,
                                       "call_id": JSON, "name": JSON, "arguments": JSON, "output": JSON})
BODY = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["m", ""]) | JSON, "input": st.text(max_size=8) | st.lists(ITEM, max_size=3) | JSON,
    **{name: JSON for name in FIELDS[2:]}})


@settings(max_examples=400, deadline=None)
@given(BODY)
def test_any_body_is_read_or_refused_with_a_400(body):
    try:
        request = read_request(body)
        request.to_call(request.input_items())
    except ApiError as e:
        assert e.status == 400 and e.message


def test_a_conversations_items_become_chat_messages():
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "reasoning", "summary": []},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]}]
    assert chat_messages(items) == [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]


def test_instructions_effort_and_format_map_onto_the_chat_call():
    request = read_request({"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 5,
                            "reasoning": {"effort": "minimal"}, "metadata": {"k": "v"},
                            "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}})
    body = request.to_call(request.input_items()).body
    assert body["messages"][0] == {"role": "system", "content": "Be brief."} and body["max_tokens"] == 5
    assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["metadata"] == {"k": "v"}
    assert body["response_format"]["json_schema"]["name"] == "n"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "tools": [{"type": "web_search_preview"}]}, "tools.0.type"),
    ({"input": [{"type": "computer_call_output"}]}, "input.0.type"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ({"input": "x", "stream": True, "background": True}, "stream"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(ApiError) as refused:
        request = read_request({"model": "m", **body})
        request.to_call(request.input_items())
    assert refused.value.status == 400 and refused.value.param == param
