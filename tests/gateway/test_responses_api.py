"""OpenAI's Responses API through the official SDK, against real gateways, a real worker
and Valkey: the same answer as the chat API, a stream's events in order, function calls
continued with `previous_response_id` on another gateway and after every gateway
restarted (the state is in Redis), structured output, background responses and their
cancel, and every refusal in OpenAI's shape."""

from __future__ import annotations

import json
import signal

import httpx
import jsonschema
import openai
import pytest
from support import (
    HELD,
    KEYS,
    MLXQ,
    ROOT,
    own_valkey_fixture,
    start_gateway,
    start_worker,
    wait_for,
    worker_fixture,
)

from client import Client, JobCancelled

ADMIN_KEY = "sk-responses-admin"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
    "additionalProperties": False}}]
ASK = "What is the weather in Paris?"


own_valkey = own_valkey_fixture("responses")


# One request at a time and nothing read ahead: a request held in its slot keeps the next one waiting.
worker = worker_fixture(queue="resp", redis="own_valkey", max_num_seqs=1, prefetch=0)


class Gateways:
    """Two gateways on one Redis, which a test may restart."""

    def __init__(self, redis_url: str, logs_dir) -> None:
        self.redis_url, self.logs_dir = redis_url, logs_dir
        self.started = [self._start() for _ in range(2)]
        self.clients: list[openai.OpenAI] = []  # closed with the gateways: no socket left to the collector

    def _start(self):
        return start_gateway(self.redis_url, self.logs_dir, "--api-keys", ADMIN_KEY)

    def restart(self) -> None:
        self.close_clients()
        for gateway in self.started:
            assert gateway.stop() in (0, -signal.SIGTERM), gateway.log()
        self.started = [self._start() for _ in range(2)]

    def sdk(self, index: int = 0, key: str = ADMIN_KEY) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.started[index].url}/v1", api_key=key, max_retries=0, timeout=120)
        self.clients.append(client)
        return client

    def close_clients(self) -> None:
        for client in self.clients:
            client.close()
        self.clients.clear()


@pytest.fixture(scope="module")
def gateways(own_valkey, worker, logs_dir):
    made = Gateways(own_valkey, logs_dir)
    yield made
    made.close_clients()
    for gateway in made.started:
        gateway.stop()


def test_a_response_is_the_chat_apis_answer_to_the_same_conversation(gateways):
    sdk = gateways.sdk()
    response = sdk.responses.create(model="resp", input=ASK, instructions="Answer briefly.", temperature=0,
                                    max_output_tokens=12)
    chat = sdk.chat.completions.create(model="resp", temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}])
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.id.startswith("resp_") and response.status == "incomplete"  # 12 tokens: cut at the limit
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == chat.usage.prompt_tokens and response.usage.output_tokens == 12
    assert response.usage.input_tokens_details.cached_tokens >= 0
    assert sdk.responses.retrieve(response.id).output_text == response.output_text  # stored by default


def test_a_stream_sends_the_responses_events_in_order_and_its_text(gateways):
    sdk = gateways.sdk()
    events = list(sdk.responses.create(model="resp", input=ASK, temperature=0, max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == events[-4].text
    whole = sdk.responses.create(model="resp", input=ASK, temperature=0, max_output_tokens=12)
    assert whole.output_text == text
    assert sdk.responses.retrieve(final.id).output_text == text


def _forced_call(sdk: openai.OpenAI):
    first = sdk.responses.create(model="resp", input=ASK, tools=TOOLS, tool_choice="required", temperature=0,
                                 max_output_tokens=400)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] is not None
    assert first.status == "completed" and "<tool_call>" not in first.output_text
    return first, call


def _continued_as_chat(sdk: openai.OpenAI, call) -> str | None:
    """The chat API's answer to the whole conversation, given in one request."""
    return sdk.chat.completions.create(model="resp", temperature=0, max_tokens=16, tools=[
        {"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}], messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}]).choices[0].message.content


def test_a_function_call_round_trip_continues_on_another_gateway(gateways):
    first, call = _forced_call(gateways.sdk(0))
    second = gateways.sdk(1).responses.create(
        model="resp", previous_response_id=first.id, tools=TOOLS, temperature=0, max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert second.previous_response_id == first.id
    expected = _continued_as_chat(gateways.sdk(0), call)
    assert second.output_text == expected and expected  # the whole conversation was seen
    items = gateways.sdk(1).responses.input_items.list(second.id)
    assert [item.type for item in items.data] == ["function_call_output"]


def test_a_conversation_continues_after_every_gateway_restarted(gateways):
    first, call = _forced_call(gateways.sdk(0))
    gateways.restart()
    second = gateways.sdk(1).responses.create(
        model="resp", previous_response_id=first.id, tools=TOOLS, temperature=0, max_output_tokens=16,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert second.output_text == _continued_as_chat(gateways.sdk(0), call)


def test_a_json_schema_text_format_gives_valid_json(gateways):
    schema = {"type": "object", "additionalProperties": False, "required": ["label", "score"],
              "properties": {"label": {"enum": ["spam", "ham"]}, "score": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}}}
    response = gateways.sdk().responses.create(model="resp", input="Classify: buy now!", max_output_tokens=200,
                                               text={"format": {"type": "json_schema", "name": "verdict",
                                                                "schema": schema, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_a_background_response_is_polled_and_cancelled(gateways, worker):
    """The worker's one slot is held, so the background response waits in the queue until cancelled."""
    with Client(worker.redis_url, queue=worker.queue) as client:
        held = client.submit(**HELD)
        wait_for(lambda: client.redis.exists(KEYS.output(worker.queue, held.id)), what="the held request running")
        queued = gateways.sdk(0).responses.create(model="resp", input=ASK, background=True, max_output_tokens=8)
        assert queued.status == "queued" and queued.background
        assert gateways.sdk(1).responses.retrieve(queued.id).status == "queued"
        cancelled = gateways.sdk(1).responses.cancel(queued.id)
        assert cancelled.status == "cancelled"
        held.cancel()
        with pytest.raises(JobCancelled):
            held.result(timeout=60)
    done = gateways.sdk(0).responses.create(model="resp", input=ASK, background=True, max_output_tokens=8,
                                            temperature=0)
    finished = wait_for(lambda: (r := gateways.sdk(1).responses.retrieve(done.id)).status != "queued"
                        and r.status != "in_progress" and r, what="the background response to end")
    assert finished.status == "incomplete" and finished.output_text
    with pytest.raises(openai.BadRequestError, match="only a response that is queued or in progress"):
        gateways.sdk(0).responses.cancel(done.id)


def test_what_the_gateway_cannot_do_is_refused_naming_the_field(gateways):
    sdk = gateways.sdk()
    refusals = [
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        ({"input": ASK, "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": ASK, "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.0.type"),
        ({"input": ASK, "tools": [{"type": "computer_use_preview"}]}, "tools.0.type"),
        ({"input": ASK, "service_tier": "flex"}, "service_tier"),
        ({"input": ASK, "prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": ASK, "background": True, "store": False}, "background"),
        ({"input": ASK, "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
         "input.0.content.0.image_url"),
    ]
    for extra, param in refusals:
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.responses.create(model="resp", **extra)
        error = refused.value.body
        assert error["param"] == param and error["type"] == "invalid_request_error", (param, error)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve("resp_nonexistent")


def test_another_tenants_response_is_a_404(gateways, own_valkey):
    import subprocess

    keys = []
    for tenant in ("team-a", "team-b"):
        made = subprocess.run([*MLXQ, "keys", "create", "--redis-url", own_valkey, "--tenant", tenant, "--json"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert made.returncode == 0, made.stderr
        keys.append(json.loads(made.stdout)["key"])
    mine = gateways.sdk(0, keys[0]).responses.create(model="resp", input=ASK, max_output_tokens=4)
    theirs = gateways.sdk(1, keys[1])
    for attempt in (lambda: theirs.responses.retrieve(mine.id), lambda: theirs.responses.delete(mine.id),
                    lambda: theirs.responses.cancel(mine.id), lambda: theirs.responses.input_items.list(mine.id),
                    lambda: theirs.responses.create(model="resp", input="And?", previous_response_id=mine.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert gateways.sdk(1, keys[0]).responses.retrieve(mine.id).id == mine.id  # its own tenant, any gateway
    gateways.sdk(0, keys[0]).responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        gateways.sdk(0, keys[0]).responses.retrieve(mine.id)


def test_a_hostile_body_is_a_400_and_the_gateway_serves_on(gateways):
    url = f"{gateways.started[0].url}/v1/responses"
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    for body in (b"[]", b'{"model": "resp"}', b'{"model": "resp", "input": [{"type": "message"}]}',
                 json.dumps({"model": "resp", "input": [{"role": "user", "content": [{"type": "x"}]}]}).encode(),
                 json.dumps({"model": "resp", "input": "x", "metadata": {str(i): "v" for i in range(17)}}).encode(),
                 json.dumps({"model": "resp", "input": "a lone \ud800 surrogate"}).encode()):  # stored, then refused
        answer = httpx.post(url, content=body, headers=headers)
        assert answer.status_code == 400 and answer.json()["error"]["message"], answer.text
    assert gateways.sdk().responses.create(model="resp", input=ASK, max_output_tokens=2).output_text


def test_reasoning_effort_turns_thinking_on_and_off_and_comes_back_as_an_item(gateways, own_valkey, thinking_model,
                                                                               logs_dir):
    thinker = start_worker(own_valkey, thinking_model, "think", logs_dir)
    try:
        sdk = gateways.sdk()
        thought = sdk.responses.create(model="think", input="Why queues?", reasoning={"effort": "high"},
                                       max_output_tokens=24)
        assert thought.output[0].type == "reasoning" and thought.output[0].content[0].text
        assert "<think>" not in thought.output_text
        streamed = list(sdk.responses.create(model="think", input="Why queues?", reasoning={"effort": "high"},
                                             max_output_tokens=24, stream=True))
        reasoning = "".join(e.delta for e in streamed if e.type == "response.reasoning_text.delta")
        assert reasoning == thought.output[0].content[0].text
        plain = sdk.responses.create(model="think", input="Why queues?", reasoning={"effort": "none"},
                                     max_output_tokens=24)
        assert [item.type for item in plain.output] == ["message"]
    finally:
        thinker.stop()
