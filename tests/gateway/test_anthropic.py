"""`/v1/messages` through the official `anthropic` SDK against a real gateway, Valkey and
worker on the demo model: a message, a stream, a tool call round trip, `count_tokens`,
stop sequences, errors in Anthropic's shape."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import jsonschema
import openai
import pytest
from support import start_gateway, start_worker, worker_fixture

ASK = [{"role": "user", "content": "Tell me about queues."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
GREEDY = {"temperature": 0}  # anthropic 2.x takes temperature only through extra_body


worker = worker_fixture()


@pytest.fixture(scope="module")
def gateway(redis_url, worker, logs_dir):
    process = start_gateway(redis_url, logs_dir, "--api-keys", "sk-ant-test")
    yield process
    process.stop()


@pytest.fixture
def claude(gateway):
    with anthropic.Anthropic(base_url=gateway.url, api_key="sk-ant-test", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture
def sdk(gateway):
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-ant-test", max_retries=0, timeout=60) as client:
        yield client


def test_a_message_says_what_the_chat_api_says(claude, sdk, worker):
    reply = claude.messages.create(model=worker.queue, max_tokens=12, messages=ASK, system="Be brief.",
                                   extra_body=GREEDY)
    chat = sdk.chat.completions.create(model=worker.queue, max_tokens=12, temperature=0,
                                       messages=[{"role": "system", "content": "Be brief."}, *ASK])
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    assert [b.type for b in reply.content] == ["text"]
    assert reply.content[0].text == chat.choices[0].message.content
    assert reply.stop_reason == "max_tokens" and reply.stop_sequence is None
    assert reply.usage.output_tokens == 12
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == chat.usage.prompt_tokens


def test_a_stream_is_anthropic_s_event_sequence_with_the_same_text(claude, worker):
    whole = claude.messages.create(model=worker.queue, max_tokens=16, messages=ASK, extra_body=GREEDY)
    with claude.messages.stream(model=worker.queue, max_tokens=16, messages=ASK, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert final.usage.output_tokens == 16


def test_a_stop_sequence_ends_the_message_and_is_named(claude, worker):
    free = claude.messages.create(model=worker.queue, max_tokens=24, messages=ASK, extra_body=GREEDY)
    text = free.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = claude.messages.create(model=worker.queue, max_tokens=24, messages=ASK, stop_sequences=[stop],
                                 extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


def test_a_tool_call_round_trip(claude, worker):
    """A forced tool call comes back as a `tool_use` block whose input fits the schema; its
    result sent back in a `tool_result` block gets an answer."""
    asked = claude.messages.create(model=worker.queue, max_tokens=300, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    (use,) = [b for b in asked.content if b.type == "tool_use"]
    assert asked.stop_reason == "tool_use" and use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    answered = claude.messages.create(
        model=worker.queue, max_tokens=8, tools=[WEATHER], extra_body=GREEDY,
        messages=[*ASK, {"role": "assistant", "content": asked.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                "content": "Sunny, 21"}]}])
    assert answered.stop_reason in ("max_tokens", "end_turn", "tool_use") and answered.usage.output_tokens > 0
    prompt = answered.usage.input_tokens + answered.usage.cache_read_input_tokens  # the prefix cache may hold some
    assert prompt > asked.usage.input_tokens + asked.usage.cache_read_input_tokens  # the call and its result
    with claude.messages.stream(model=worker.queue, max_tokens=300, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use" and "<tool_call>" not in "".join(
        b.text for b in streamed.content if b.type == "text")


def test_count_tokens_counts_what_a_message_is_charged(claude, worker):
    counted = claude.messages.count_tokens(model=worker.queue, messages=ASK, system="Be brief.", tools=[WEATHER])
    reply = claude.messages.create(model=worker.queue, max_tokens=1, messages=ASK, system="Be brief.",
                                   tools=[WEATHER], extra_body=GREEDY)
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 0


def test_errors_come_in_anthropic_s_shape(claude, gateway, worker):
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=worker.queue, max_tokens=4, messages=[{"role": "robot", "content": "x"}])
    assert "messages.0.role" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="never fetches"):
        claude.messages.create(model=worker.queue, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://example.com/a.png"}}]}])
    with pytest.raises(anthropic.APIStatusError, match="max_tokens") as too_large:
        claude.messages.create(model=worker.queue, max_tokens=10**6, messages=ASK)
    assert too_large.value.status_code == 413 and too_large.value.body["error"]["type"] == "request_too_large"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=gateway.url, api_key="wrong", max_retries=0).messages.create(
            model=worker.queue, max_tokens=4, messages=ASK)
    wrong = httpx.post(f"{gateway.url}/v1/messages", headers={"x-api-key": "wrong"}, json={})
    assert wrong.status_code == 401 and "send 'x-api-key: <key>'" in wrong.json()["error"]["message"]  # as it came
    raw = httpx.post(f"{gateway.url}/v1/messages", headers={"x-api-key": "sk-ant-test"}, content=b"{not json")
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    assert json.loads(raw.text)["type"] == "error"


def test_count_only_prepares_a_request_and_generates_nothing(worker, loaded_demo_model):
    """The protocol underneath count_tokens: `count_only` answers `done` with the prompt's
    tokens (as the worker templates and tokenizes it) and no deltas."""
    from client import Client

    _, tokenizer = loaded_demo_model
    with Client(worker.redis_url, queue=worker.queue) as client:
        job = client.submit("Tell me about queues.", count_only=True, max_tokens=50)
        events = list(job.stream(timeout=60))
        done = job.result(timeout=60)
    assert events == [] and done.finish_reason == "length" and done.text == ""
    assert done.usage.prompt_tokens == len(tokenizer.encode("Tell me about queues."))
    assert done.usage.completion_tokens == 0


def test_a_thinking_model_s_reasoning_comes_as_a_thinking_block(valkey, thinking_model, logs_dir, gateway):
    """Reasoning goes to a `thinking` block before the text, whole and streamed, as the
    client's `done.reasoning` and `done.text` say; `thinking: disabled` turns it off; an
    agent's earlier thinking blocks are accepted and not shown to the model again."""
    from client import Client

    thinking = start_worker(valkey, thinking_model, f"at{uuid.uuid4().hex[:6]}", logs_dir)
    try:
        ask = [{"role": "user", "content": "Think first."}]
        with Client(valkey, queue=thinking.queue) as client:
            done = client.generate(messages=ask, max_tokens=12, timeout=60)
        claude = anthropic.Anthropic(base_url=gateway.url, api_key="sk-ant-test", max_retries=0)
        reply = claude.messages.create(model=thinking.queue, max_tokens=12, messages=ask, extra_body=GREEDY,
                                       thinking={"type": "enabled", "budget_tokens": 1024})
        with claude.messages.stream(model=thinking.queue, max_tokens=12, messages=ask, extra_body=GREEDY) as stream:
            streamed = stream.get_final_message()
        off = claude.messages.create(model=thinking.queue, max_tokens=12, messages=[
            *ask, {"role": "assistant", "content": reply.content}, {"role": "user", "content": "Again."}],
            thinking={"type": "disabled"}, extra_body=GREEDY)
    finally:
        thinking.stop()
    assert done.reasoning
    for message in (reply, streamed):
        assert message.content[0].type == "thinking" and message.content[0].thinking == done.reasoning
        assert "".join(b.text for b in message.content if b.type == "text") == done.text
    assert all(b.type != "thinking" for b in off.content)
