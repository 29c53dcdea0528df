"""`mlxq gateway` through the official OpenAI SDK, httpx and curl, against a real gateway
process, real Valkey and real workers on the demo models."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import redis
from media import png
from support import HELD, KEYS, ON_BOTH, ROOT, start_gateway, start_worker, wait_for, worker_fixture

from client import Client, JobCancelled

KEY = "sk-mlxq-test"
ASK = [{"role": "user", "content": "Tell me about queues."}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["a", "b"], "additionalProperties": False}}},
]


worker = worker_fixture()


# Runs one request at a time and reads nothing ahead; its queue holds 2 waiting.
one_slot = worker_fixture(max_num_seqs=1, prefetch=0, max_queue_len=2)


@pytest.fixture(scope="module")
def gateway(redis_url, worker, logs_dir):
    """The gateway most tests use: API keys on, `small` named for the worker's queue, a
    `ghost` model whose queue no worker serves, keep-alives every second."""
    process = start_gateway(redis_url, logs_dir, "--api-keys", KEY, "--models", f"small={worker.queue}",
                            "ghost=nowhere", "--keepalive-s", "1")
    yield process
    assert process.stop() in (0, -signal.SIGTERM), process.log()


@pytest.fixture(scope="module")
def open_gateway(redis_url, worker, logs_dir):
    """A second gateway beside the first, with no API keys."""
    process = start_gateway(redis_url, logs_dir)
    yield process
    assert process.stop() in (0, -signal.SIGTERM), process.log()


@pytest.fixture
def sdk(gateway):
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture
def mlxq(worker):
    with Client(worker.redis_url, queue=worker.queue) as client:
        yield client


@ON_BOTH
def test_chat_reads_as_the_queue_does(sdk, mlxq):
    response = sdk.chat.completions.create(model="small", messages=ASK, max_tokens=12)
    done = mlxq.generate(messages=ASK, max_tokens=12, timeout=60)
    (choice,) = response.choices
    assert choice.message.content == done.text and choice.message.role == "assistant"
    assert choice.finish_reason == done.finish_reason == "length"
    assert response.model == "small" and response.id.startswith("chatcmpl-")
    assert response.usage.prompt_tokens == done.usage.prompt_tokens
    assert response.usage.completion_tokens == 12 and response.usage.total_tokens == done.usage.prompt_tokens + 12


@ON_BOTH
def test_a_chat_stream_joins_to_the_same_text_and_ends_with_the_usage(sdk):
    whole = sdk.chat.completions.create(model="small", messages=ASK, max_tokens=12).choices[0].message.content
    chunks = list(sdk.chat.completions.create(model="small", messages=ASK, max_tokens=12, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1


def test_completions_stream_and_not(sdk, mlxq, worker):
    """A queue's name is a model name too."""
    done = mlxq.generate("Once upon a time", max_tokens=10, timeout=60)
    whole = sdk.completions.create(model=worker.queue, prompt="Once upon a time", max_tokens=10)
    assert whole.choices[0].text == done.text and whole.object == "text_completion"
    chunks = list(sdk.completions.create(model=worker.queue, prompt="Once upon a time", max_tokens=10, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == done.text
    assert chunks[-1].choices[0].finish_reason == "length"
    from_ids = sdk.completions.create(model=worker.queue, prompt=[5, 6, 7], max_tokens=3)
    assert from_ids.usage.prompt_tokens == 3 and from_ids.usage.completion_tokens == 3


def test_stop_ends_the_text_before_the_stop_string(sdk, worker):
    full = sdk.completions.create(model=worker.queue, prompt="The queue", max_tokens=24).choices[0].text
    start = next(i for i in range(6, len(full) - 3) if full[i:i + 3].isprintable() and "\ufffd" not in full[i:i + 3])
    stop = full[start:start + 3]
    stopped = sdk.completions.create(model=worker.queue, prompt="The queue", max_tokens=24, stop=[stop]).choices[0]
    assert stopped.text == full[:full.find(stop)] and stopped.finish_reason == "stop"


def test_a_seed_repeats_a_sampled_output(sdk, worker):
    def sample(seed: int) -> str:
        return sdk.completions.create(model=worker.queue, prompt="Once", max_tokens=16, temperature=1.0,
                                      seed=seed).choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert {sample(seed) for seed in (8, 9, 10)} != {first}


def test_a_json_schema_response_format_validates(sdk):
    schema = {"type": "object", "additionalProperties": False, "required": ["label", "score", "tags"],
              "properties": {"label": {"enum": ["spam", "ham"]}, "score": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9},
                             "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}}
    response = sdk.chat.completions.create(model="small", messages=ASK, max_tokens=200, temperature=0.8, seed=3,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "verdict", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)
    assert response.choices[0].finish_reason == "stop"


def parameters(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_forced_tool_calls_come_back_as_tool_calls(sdk):
    response = sdk.chat.completions.create(model="small", messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=1500)
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), parameters(call.function.name))
    named = sdk.chat.completions.create(model="small", messages=ASK, tools=TOOLS, max_tokens=200,
                                        tool_choice={"type": "function", "function": {"name": "add"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "add"


def test_a_streamed_tool_call_arrives_as_a_tool_call_not_as_markup(sdk):
    chunks = list(sdk.chat.completions.create(model="small", messages=ASK, tools=TOOLS, tool_choice="required",
                                              max_tokens=1500, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert "<tool_call>" not in content and calls
    assert [call.index for call in calls] == list(range(len(calls)))
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), parameters(call.function.name))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_logprobs_rank_the_alternatives_and_greedy_takes_the_top(sdk):
    response = sdk.chat.completions.create(model="small", messages=ASK, max_tokens=6, logprobs=True, top_logprobs=3)
    entries = response.choices[0].logprobs.content
    assert len(entries) == 6
    for entry in entries:
        values = [alt.logprob for alt in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == pytest.approx(values[0])
        assert entry.bytes == list(entry.token.encode())


def status_of(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as failed:
        call()
    return failed.value.status_code, failed.value.body


def test_errors_have_openai_shape_and_status(sdk, gateway):
    def chat(**fields):
        return lambda: sdk.chat.completions.create(**{"model": "small", "messages": ASK, "max_tokens": 4, **fields})

    assert status_of(chat(n=2)) == (400, {"message": "n: 2 choices asked for; mlxq generates one choice per request "
                                          "(send n requests)", "type": "invalid_request_error", "param": "n",
                                          "code": "invalid_request"})
    status, body = status_of(chat(extra_body={"frobnicate": 1}))
    assert status == 400 and body["message"] == "Unrecognized request argument supplied: frobnicate"
    status, body = status_of(chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]}]))
    assert status == 400 and "only data: URLs are accepted (nothing is fetched)" in body["message"]
    status, body = status_of(chat(model="nope"))
    assert status == 404 and body["code"] == "model_not_found" and body["message"].startswith("The model `nope`")
    status, body = status_of(chat(max_tokens=100000))
    assert status == 413 and body["message"] == "max_tokens: 100000 is above this worker's max_tokens_limit (4096)"
    status, body = status_of(chat(model="ghost"))
    assert status == 503 and body["code"] == "no_worker"
    status, body = status_of(chat(stream=True, response_format={"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "nope"}}}))  # found by the worker, before the stream starts
    assert status == 400 and body["message"].startswith("response_format:")
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
    assert httpx.post(f"{gateway.url}/v1/completions", json={"model": "small", "prompt": "x"}).status_code == 401
    assert sdk.chat.completions.create(model="small", messages=ASK, max_tokens=2).choices[0].finish_reason


def test_a_timeout_is_504_and_a_full_queue_429(gateway, one_slot, valkey, logs_dir, r):
    """With one request running on the one-slot worker, a request through a gateway with a
    1 s timeout waits, is cancelled and answered 504; with two waiting (the queue's bound),
    the next is 429."""
    before = totals_when(r, one_slot.consumer)
    with Client(valkey, queue=one_slot.queue) as mlxq:
        blocker = mlxq.submit(**HELD)  # runs until cancelled
        assert wait_for(lambda: in_flight(r, one_slot.consumer) == 1)
        impatient = start_gateway(valkey, logs_dir, "--request-timeout-s", "1")
        try:
            with openai.OpenAI(base_url=f"{impatient.url}/v1", api_key="none", max_retries=0) as sdk:
                status, body = status_of(lambda: sdk.completions.create(model=one_slot.queue, prompt="x",
                                                                        max_tokens=2))
        finally:
            assert impatient.stop() in (0, -signal.SIGTERM)
        assert status == 504 and body["code"] == "timeout" and "did not finish within 1 s" in body["message"]
        waiting = mlxq.submit("wait", max_tokens=2)  # two waiting now, with the timed-out one
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0) as sdk:
            with pytest.raises(openai.RateLimitError, match="is full: 2 requests waiting"):
                sdk.completions.create(model=one_slot.queue, prompt="x", max_tokens=2)
        waiting.cancel()
        blocker.cancel()
        with pytest.raises(JobCancelled) as cancelled:
            blocker.result(timeout=30)
    # the timed-out request and the waiting one ended without a token (cancelled, or past their deadline)
    ended = ("finished:cancelled", "errors:deadline_exceeded")
    after = totals_when(r, one_slot.consumer, lambda now: changed(before, now, *ended) >= 3)
    assert changed(before, after, *ended) == 3
    assert changed(before, after, "generation_tokens") == cancelled.value.done.usage.completion_tokens


def totals_when(r: redis.Redis, consumer: str, ready: Callable[[dict[str, int]], bool] = lambda _: True
                ) -> dict[str, int]:
    """A worker's counters as of a heartbeat that says it holds nothing, once `ready(counters)`.
    A worker counts a request's events before it lets the request go, so such a
    heartbeat's counters include every request it has let go."""
    def idle() -> dict[str, int] | None:
        beat = json.loads(r.get(KEYS.worker(consumer)))
        return beat["totals"] if beat["in_flight"] == 0 and ready(beat["totals"]) else None

    return wait_for(idle, 60, f"{consumer}'s counters")


def changed(before: dict[str, int], after: dict[str, int], *names: str) -> int:
    return sum(after.get(n, 0) - before.get(n, 0) for n in names)


def in_flight(r: redis.Redis, consumer: str) -> int:
    return json.loads(r.get(KEYS.worker(consumer)))["in_flight"]


def test_a_disconnect_mid_stream_cancels_the_request(gateway, worker, r):
    before = totals_when(r, worker.consumer)
    body = {"model": "small", "prompt": HELD["prompt_tokens"], "max_tokens": HELD["max_tokens"], "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = response.iter_lines()
        assert [next(lines) for _ in range(6)][0].startswith("data: ")  # some output, then the client leaves
    after = totals_when(r, worker.consumer, lambda now: changed(before, now, "finished:cancelled") >= 1)
    assert changed(before, after, "finished:cancelled") == 1
    assert 0 < changed(before, after, "generation_tokens") < 1000  # stopped long before its 2000 tokens


def raw_post(url: str, path: str, body: dict) -> socket.socket:
    """A POST whose connection the test closes when it likes (a client going away)."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


@pytest.mark.parametrize("leaves", ["at once", "after a keep-alive"])
def test_a_disconnect_while_queued_cancels_before_it_runs(gateway, one_slot, r, leaves):
    """The client goes away while its request waits behind another: as soon as the request
    is queued (before the stream has started), and after a keep-alive comment came."""
    before = totals_when(r, one_slot.consumer)
    with Client(one_slot.redis_url, queue=one_slot.queue) as mlxq:
        blocker = mlxq.submit(**HELD)  # runs until cancelled
        assert wait_for(lambda: in_flight(r, one_slot.consumer) == 1)
        sock = raw_post(gateway.url, "/v1/chat/completions", {"model": one_slot.queue, "messages": ASK,
                                                               "stream": True, "max_tokens": 8})
        wait_for(lambda: r.xlen(KEYS.queue(one_slot.queue)) == 2, 30, "the gateway's request queued")
        if leaves == "after a keep-alive":
            received = b""
            sock.settimeout(30)
            while b": keep-alive\n\n" not in received:
                chunk = sock.recv(65536)
                assert chunk, f"the gateway closed the stream: {received!r}"
                received += chunk
        sock.close()
        queued = _queued_id(r, one_slot.queue)
        wait_for(lambda: r.exists(KEYS.cancel_flag(one_slot.queue, queued)), 30, "the gateway's cancel")
        blocker.cancel()
        with pytest.raises(JobCancelled) as cancelled:
            blocker.result(timeout=30)
    after = totals_when(r, one_slot.consumer, lambda now: changed(before, now, "finished:cancelled") >= 2)
    assert changed(before, after, "finished:cancelled") == 2
    assert changed(before, after, "generation_tokens") == cancelled.value.done.usage.completion_tokens


def _queued_id(r: redis.Redis, queue: str) -> str:
    """The id of the newest request on `queue`."""
    [(_, fields)] = r.xrevrange(KEYS.queue(queue), count=1)
    return fields[b"id"].decode()


def test_curl_sees_exact_sse_bytes(gateway):
    body = json.dumps({"model": "small", "messages": ASK, "max_tokens": 3, "stream": True})
    out = subprocess.run(["curl", "-sN", f"{gateway.url}/v1/chat/completions", "-H", f"Authorization: Bearer {KEY}",
                          "-H", "Content-Type: application/json", "-d", body], capture_output=True, timeout=60,
                         check=True).stdout
    assert out.endswith(b"data: [DONE]\n\n")
    events = out.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert sum(1 for c in chunks if c["choices"][0]["delta"].get("content")) >= 1


def test_models_lists_the_models_of_live_workers_on_two_queues(sdk, worker, valkey, demo_model, tmp_path, logs_dir, r):
    other_model = Path(shutil.copytree(demo_model, tmp_path / "other-model"))
    other = start_worker(valkey, other_model, f"two{uuid.uuid4().hex[:6]}", logs_dir)
    try:
        deadline = time.monotonic() + 10
        while str(other_model) not in (ids := {m.id for m in sdk.models.list()}):
            assert time.monotonic() < deadline, ids
            time.sleep(0.2)
        assert {str(demo_model), "small"} <= ids and "ghost" not in ids
        assert sdk.completions.create(model=str(other_model), prompt="x", max_tokens=2).usage.completion_tokens == 2
        deadline = time.monotonic() + 5
        while r.hget(KEYS.stats(other.consumer), "finished:length") != b"1":
            assert time.monotonic() < deadline, "the request did not go to the other model's queue"
            time.sleep(0.2)
        assert sdk.models.retrieve("small").id == "small"
    finally:
        other.stop()
    deadline = time.monotonic() + 10
    while str(other_model) in {m.id for m in sdk.models.list()}:
        assert time.monotonic() < deadline, "a stopped worker's model is still listed"
        time.sleep(0.2)
    with pytest.raises(openai.InternalServerError, match="no live worker serves model"):
        sdk.completions.create(model=str(other_model), prompt="x", max_tokens=2)


def test_64_concurrent_streams_through_one_gateway_and_more_beside_it(gateway, open_gateway, worker, mlxq, r):
    """64 streams at once through one gateway, and 16 more through a second one beside it:
    every text is what the queue gives for its prompt, and both reply streams end empty."""
    prompts = ["Alpha", "Beta queue", "Gamma stream", "Delta worker"]
    expected = {p: mlxq.generate(p, max_tokens=16, timeout=60).text for p in prompts}

    async def run() -> list[tuple[str, str]]:
        first, second = (openai.AsyncOpenAI(base_url=f"{g.url}/v1", api_key=KEY, max_retries=0, timeout=120)
                         for g in (gateway, open_gateway))

        async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
            prompt = prompts[i % len(prompts)]
            stream = await client.completions.create(model=worker.queue, prompt=prompt, max_tokens=16, stream=True)
            return prompt, "".join([c.choices[0].text async for c in stream])

        try:
            return await asyncio.gather(*(one(first, i) for i in range(64)), *(one(second, i) for i in range(16)))
        finally:
            await first.close()
            await second.close()

    results = asyncio.run(run())
    assert len(results) == 80 and all(text == expected[prompt] for prompt, text in results)
    admin = {"authorization": f"Bearer {KEY}"}
    replies = [key for g in (gateway, open_gateway)
               for key in httpx.get(f"{g.url}/health", headers=admin).json()["reply_streams"]]
    assert replies and all(key.startswith("mlxq:reply:") for key in replies)
    assert wait_for(lambda: all(r.xlen(key) == 0 for key in replies)), "what was read is trimmed away"


def test_the_open_gateway_said_so_and_serves_metrics(open_gateway, gateway, sdk):
    assert "no api_keys are configured: anyone who can connect may use the queue" in open_gateway.log()
    sdk.chat.completions.create(model="small", messages=ASK, max_tokens=2)
    metrics = httpx.get(f"{gateway.url}/metrics").text
    assert re.search(r'mlxq_gateway_requests_total\{route="chat",status="200"\} [1-9]', metrics)
    assert "mlxq_gateway_open_streams 0.0" in metrics
    assert re.search(r'mlxq_gateway_time_to_first_byte_seconds_count\{route="chat"\} [1-9]', metrics)
    assert httpx.get(f"{gateway.url}/health").json() == {"status": "ok"}  # nothing more without a key
    assert httpx.get(f"{gateway.url}/health", headers={"authorization": "Bearer wrong"}).status_code == 401


def readme_examples() -> tuple[str, str]:
    """The Python and curl examples of the README's "Use it from any OpenAI SDK" section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use it from any OpenAI SDK"):]
    section = section[:section.index("\n## ", 1)]
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    curl = re.search(r"```sh\n(curl .*?)```", section, re.S).group(1)
    return python, curl


def test_the_readme_examples_run(open_gateway, worker):
    python, curl = readme_examples()
    here = {"http://127.0.0.1:8000": open_gateway.url, '"default"': f'"{worker.queue}"'}
    for old, new in here.items():
        python, curl = python.replace(old, new), curl.replace(old, new)
    printed = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True, timeout=60, check=True)
    assert printed.stdout.strip()
    streamed = subprocess.run(["bash", "-c", curl], capture_output=True, timeout=60, check=True).stdout
    assert streamed.endswith(b"data: [DONE]\n\n")


def test_an_image_request_on_a_vision_worker(gateway, valkey, vision_model, logs_dir):
    vision = start_worker(valkey, vision_model, f"gv{uuid.uuid4().hex[:6]}", logs_dir)
    try:
        image = png(168, 112, seed=3)
        with Client(valkey, queue=vision.queue) as mlxq:
            done = mlxq.generate(messages=[{"role": "user", "content": "Describe it."}], images=[image],
                                 max_tokens=8, encoding="msgpack", timeout=60)
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0) as sdk:
            response = sdk.chat.completions.create(model=vision.queue, max_tokens=8, messages=[{
                "role": "user", "content": [
                    {"type": "text", "text": "Describe it."},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image)
                                                        .decode()}}]}])
        assert response.choices[0].message.content == done.text
        assert response.usage.prompt_tokens == done.usage.prompt_tokens > 24  # the image's tokens are in it
        _image_in_an_earlier_turn(gateway, valkey, vision.queue, image)
    finally:
        vision.stop()


def test_a_video_part_through_the_gateway(gateway, valkey, vision_model, logs_dir, tmp_path):
    """A `video_url` part (vLLM's extension, data: URLs only) reads as the same video sent
    by a raw producer in its place: here in the first of two user turns."""
    import cv2

    writer = cv2.VideoWriter(str(tmp_path / "v.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 8.0, (64, 48))
    for i in range(16):
        writer.write((np.random.RandomState(i).rand(48, 64, 3) * 255).astype(np.uint8))
    writer.release()
    video = (tmp_path / "v.mp4").read_bytes()
    url = "data:video/mp4;base64," + base64.b64encode(video).decode()
    vision = start_worker(valkey, vision_model, f"gv{uuid.uuid4().hex[:6]}", logs_dir)
    try:
        _a_part_reads_as_the_raw_request(gateway, valkey, vision.queue, "video", video, {
            "type": "video_url", "video_url": {"url": url}}, ({
                "type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
                "only data: URLs are accepted"))
    finally:
        vision.stop()


def test_an_input_audio_part_through_the_gateway(gateway, valkey, logs_dir, tmp_path):
    """OpenAI's `input_audio` part ({data, format}) on a model that takes audio (the demo
    Gemma 4) reads as the raw request with the clip in its place; a format that is not
    what the data is, is a 400 naming the part."""
    import wave

    from support import build_demo_model

    model = build_demo_model(tmp_path / "gemma4", "--vision", "--family", "gemma4")
    clip = io.BytesIO()
    with wave.open(clip, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes((np.random.RandomState(4).randn(16000) * 3000).astype("<i2").tobytes())
    data = base64.b64encode(clip.getvalue()).decode()
    worker = start_worker(valkey, model, f"ga{uuid.uuid4().hex[:6]}", logs_dir)
    try:
        _a_part_reads_as_the_raw_request(gateway, valkey, worker.queue, "audio", clip.getvalue(), {
            "type": "input_audio", "input_audio": {"data": data, "format": "wav"}}, ({
                "type": "input_audio", "input_audio": {"data": data, "format": "mp3"}},
                "the format says mp3, the data is wav"))
    finally:
        worker.stop()


def _a_part_reads_as_the_raw_request(gateway, valkey, queue: str, kind: str, data: bytes, part: dict,
                                     refused: tuple[dict, str]) -> None:
    """An OpenAI media `part` in the first of two user turns gives what the raw request
    with mlxq's part there gives; the `refused` part is a 400 saying what it says."""
    def chat(media: dict) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, media]},
                {"role": "assistant", "content": "Noise."}, {"role": "user", "content": "Sure?"}]

    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0) as sdk:
        response = sdk.chat.completions.create(model=queue, max_tokens=8, messages=chat(part))
        with pytest.raises(openai.BadRequestError, match=refused[1]):
            sdk.chat.completions.create(model=queue, max_tokens=8, messages=chat(refused[0]))
    with Client(valkey, queue=queue) as mlxq:
        field = {"video": "videos", "audio": "audio"}[kind]
        raw = mlxq.generate(messages=chat({"type": kind, "index": 0}), max_tokens=8, **{field: [data]})
    assert response.choices[0].message.content == raw.text
    assert response.usage.prompt_tokens == raw.usage.prompt_tokens > 25  # the media's tokens are in it


def _image_in_an_earlier_turn(gateway, valkey, queue: str, image: bytes) -> None:
    """The image in the first user turn, through the gateway: it stays there, as the same
    request with an image part sent by a raw producer; with the image in the last turn
    (where a request without parts puts it) the output differs."""
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    turns = [[{"type": "text", "text": "Describe it."}, "IMAGE"], "A cat.", [{"type": "text", "text": "Sure?"}]]

    def chat(image_part: object, image_turn: int) -> list[dict]:
        return [{"role": ("user", "assistant")[i % 2], "content": (
            [*(p for p in turn if p != "IMAGE"), *([image_part] if i == image_turn else [])]
            if isinstance(turn, list) else turn)} for i, turn in enumerate(turns)]

    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0) as sdk:
        through_gateway = sdk.chat.completions.create(model=queue, max_tokens=8, messages=chat(
            {"type": "image_url", "image_url": {"url": url}}, 0))
    with Client(valkey, queue=queue) as mlxq:
        raw = mlxq.generate(messages=chat({"type": "image", "index": 0}, 0), images=[image], max_tokens=8)
        in_the_last_turn = mlxq.generate(messages=chat({"type": "image", "index": 0}, 2), images=[image],
                                         max_tokens=8)
    assert in_the_last_turn.text != raw.text, "where the image is changes the output"
    assert through_gateway.choices[0].message.content == raw.text
    assert through_gateway.usage.prompt_tokens == raw.usage.prompt_tokens


def test_reasoning_comes_as_reasoning_content(gateway, valkey, thinking_model, logs_dir):
    thinking = start_worker(valkey, thinking_model, f"gt{uuid.uuid4().hex[:6]}", logs_dir)
    end_think = "4"  # the thinking demo model's </think>, barred: everything it writes is reasoning
    try:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0) as sdk:
            fields = {"model": thinking.queue, "messages": ASK, "max_tokens": 12, "logit_bias": {end_think: -100}}
            message = sdk.chat.completions.create(**fields).choices[0].message
            chunks = list(sdk.chat.completions.create(**fields, stream=True))
        assert message.content == "" and message.reasoning_content
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
        assert "".join(d.content or "" for d in deltas) == ""
    finally:
        thinking.stop()


def test_hostile_bodies_get_a_400_and_the_gateway_serves_on(gateway, sdk):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = f"{gateway.url}/v1/chat/completions"
    for body, says in ((b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
                       (b'{"model": "small", "messages": [', "could not parse the JSON body"),
                       (b"\xff\xfe", "could not parse the JSON body"),
                       (json.dumps({"model": "small", "messages": [{"role": "user", "content": "\ud800"}]}).encode(),
                        "lone surrogate"),
                       (json.dumps({"model": "m" * 10_000, "messages": ASK}).encode(),
                        "model: String should have at most")):
        response = httpx.post(url, content=body, headers=headers)
        assert response.status_code == 400 and says in response.json()["error"]["message"], response.text
    too_big = httpx.post(url, content=b" " * (17 * 1024 * 1024), headers=headers)
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "too_large"
    assert sdk.chat.completions.create(model="small", messages=ASK, max_tokens=2).choices[0].message.content
