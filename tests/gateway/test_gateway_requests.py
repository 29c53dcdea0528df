"""The gateway's translation of OpenAI's requests and of mlxq's events (no server, no Redis)."""

from __future__ import annotations

import asyncio
import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from client.protocol import Delta, Done, FunctionCall, Timing, TokenLogprob, ToolCall, TopLogprob, Usage
from common.settings_layers import SettingsError
from gateway.errors import ApiError
from gateway.requests import read_call
from gateway.responses import Shaper, ToolCallSplitter
from gateway.settings import load_gateway_settings

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def refused(kind: str, raw: object) -> ApiError:
    with pytest.raises(ApiError) as failed:
        read_call(kind, raw)  # type: ignore[arg-type]
    assert failed.value.status == 400
    return failed.value


def test_openai_fields_map_onto_the_mlxq_body():
    call = read_call("chat", {**CHAT, "max_completion_tokens": 9, "max_tokens": 3, "stop": "END", "seed": 4,
                              "temperature": 0.5, "logprobs": True, "top_logprobs": 2, "user": "u1",
                              "response_format": {"type": "text"}, "top_k": 5, "stream": True,
                              "stream_options": {"include_usage": True},
                              "messages": [{"role": "developer", "content": "Be brief."},
                                           {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                        {"type": "text", "text": "b"}]}]})
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]  # passed through, as parts
    assert call.body == {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}],
                         "max_tokens": 9, "stop": ["END"], "seed": 4, "temperature": 0.5, "logprobs": True,
                         "top_logprobs": 2, "top_k": 5, "metadata": {"user": "u1"}}
    assert call.stream and call.include_usage and call.model == "m" and not call.offers_tools


def test_completion_prompts_and_logprobs():
    assert read_call("completion", {"model": "m", "prompt": [1, 2]}).body == {"prompt_tokens": [1, 2]}
    assert read_call("completion", {"model": "m", "prompt": ["one"]}).body == {"prompt": "one"}
    assert read_call("completion", {"model": "m", "prompt": "x", "logprobs": 3}).body == {
        "prompt": "x", "logprobs": True, "top_logprobs": 3}
    assert "2 prompts in one request" in refused("completion", {"model": "m", "prompt": ["a", "b"]}).message
    assert refused("completion", {"model": "m", "prompt": "x", "echo": True}).param == "echo"


def test_images_come_from_data_urls_only():
    png = b"\x89PNG fake"
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}}
    call = read_call("chat", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "What?"},
                                                                               part]}]})
    assert call.body["images"] == [png]
    assert call.body["messages"] == [{"role": "user", "content": [{"type": "text", "text": "What?"},
                                                                  {"type": "image", "index": 0}]}]
    remote = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    error = refused("chat", {**CHAT, "messages": [{"role": "user", "content": [remote]}]})
    assert "only data: URLs are accepted (nothing is fetched)" in error.message
    assert error.param == "messages.0.content.0.image_url"
    bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}
    assert "not valid base64" in refused("chat", {**CHAT, "messages": [{"role": "user", "content": [bad]}]}).message


@pytest.mark.parametrize(("fields", "named"), [
    ({"n": 2}, "n"), ({"audio": {"voice": "x"}}, "audio"), ({"store": True}, "store"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"), ({"modalities": ["text", "audio"]}, "modalities"),
    ({"functions": [{"name": "f"}]}, "functions"), ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_what_mlxq_cannot_honour_is_refused_by_name(fields, named):
    error = refused("chat", {**CHAT, **fields})
    assert error.param == named and error.message.startswith(f"{named}:")


def test_unknown_fields_are_named_as_openai_does():
    assert refused("chat", {**CHAT, "temprature": 1}).message == "Unrecognized request argument supplied: temprature"
    assert refused("chat", [1, 2]).message == "the request body must be a JSON object"
    assert refused("chat", {"model": "m"}).param == "messages"


@given(st.text(alphabet="ab<tool_c>", max_size=40), st.lists(st.integers(0, 40), max_size=6))
def test_the_splitter_loses_nothing_and_never_emits_the_marker(text, cuts):
    """However the text arrives in pieces, content + held == text, and content stops before the marker."""
    splitter = ToolCallSplitter("<tool_call>")
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    content = "".join(splitter.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))
    held = splitter.flush()
    assert content + held == text
    at = text.find("<tool_call>")
    if at >= 0:
        assert content == text[:at]
    else:  # only what may still begin the marker is held back
        assert len(held) < len("<tool_call>") and "<tool_call>".startswith(held)


def done(**fields) -> Done:
    return Done(**{"id": "r1", "finish_reason": "stop", "text": "", "usage": Usage(5, 3, 2),
                   "timing": Timing(1.0, 2.0, 3.0), **fields})


def test_a_tool_call_ends_a_stream_as_tool_calls_and_its_markup_never_shows():
    call = read_call("chat", {**CHAT, "stream": True, "tools": [
        {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]})
    shaper = Shaper(call, "r1", ("<tool_call>", "</tool_call>"))
    pieces = ["Sure. <tool", '_call>\n{"name": "add"}', "\n</tool_call>"]
    chunks = [c for p in pieces for c in shaper.delta(Delta("r1", 0, p, [1]))]
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["Sure. "]
    calls = [ToolCall("call_1", FunctionCall("add", '{"a": 1}'))]
    ending = shaper.ending(done(finish_reason="tool_calls", text="".join(pieces), tool_calls=calls))
    assert ending[0]["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    assert ending[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = shaper.whole(done(finish_reason="tool_calls", text="".join(pieces), tool_calls=calls), None)
    assert whole["choices"][0]["message"]["content"] == "Sure."


def test_text_held_for_a_call_that_did_not_parse_is_sent_after_all():
    call = read_call("chat", {**CHAT, "stream": True, "tools": [
        {"type": "function", "function": {"name": "add"}}]})
    shaper = Shaper(call, "r1", ("<tool_call>", "</tool_call>"))
    assert shaper.delta(Delta("r1", 0, "<tool_call>oops", [1])) == []
    ending = shaper.ending(done(text="<tool_call>oops"))
    assert ending[0]["choices"][0]["delta"] == {"content": "<tool_call>oops"}


def test_completion_logprobs_carry_offsets_and_usage_counts_cached_tokens():
    call = read_call("completion", {"model": "m", "prompt": "x", "logprobs": 1})
    shaper = Shaper(call, "r1", None)
    entries = [TokenLogprob(7, "ab", -0.5, [TopLogprob(7, "ab", -0.5)]), TokenLogprob(8, "c", -1.0, [])]
    whole = shaper.whole(done(text="abc"), entries)
    assert whole["choices"][0]["logprobs"] == {"tokens": ["ab", "c"], "token_logprobs": [-0.5, -1.0],
                                               "top_logprobs": [{"ab": -0.5}, {}], "text_offset": [0, 2]}
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                              "prompt_tokens_details": {"cached_tokens": 2}}


def test_worker_error_codes_get_their_status():
    assert [ApiError.from_code(code, "m").status for code in
            ("invalid_request", "too_large", "deadline_exceeded", "timeout", "poisoned", "internal", "new")] == [
        400, 413, 504, 504, 500, 500, 500]


def test_gateway_settings_layers(tmp_path, monkeypatch):
    config = tmp_path / "gateway.toml"
    config.write_text('port = 9000\napi_keys = ["sk-secret-1"]\n[models]\nfast = "q1"\n')
    monkeypatch.setenv("MLXQ_GATEWAY_PORT", "9100")
    settings = load_gateway_settings(config, host="0.0.0.0")
    assert (settings.port, settings.host, settings.models) == (9100, "0.0.0.0", {"fast": "q1"})
    assert settings.api_keys[0].get_secret_value() == "sk-secret-1" and "sk-secret-1" not in repr(settings)
    monkeypatch.setenv("MLXQ_GATEWAY_APIKEYS", "x")
    with pytest.raises(SettingsError, match="MLXQ_GATEWAY_APIKEYS is not a gateway setting .did you mean "
                                            "MLXQ_GATEWAY_API_KEYS"):
        load_gateway_settings()


def test_the_gateway_socket_sends_small_writes_at_once():
    """Connections accepted on the gateway's socket have TCP_NODELAY: a stream's chunks are
    not held back behind its headers (Nagle's algorithm against delayed ACKs: ~40 ms each)."""
    import socket

    from mlxq.gateway_command import _listen

    with _listen("127.0.0.1", 0) as server, socket.create_connection(server.getsockname()[:2]):
        accepted, _ = server.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


async def test_a_gateway_stops_even_if_its_redis_connections_never_close(monkeypatch):
    """Closing redis-py's connections can hang (redis-py #3941), and so can a task
    cancelled inside a Redis call; the gateway's shutdown waits for them only so long, so
    that SIGTERM still stops it."""
    from gateway import app as gateway_app

    app = gateway_app.create_app(load_gateway_settings(redis_url="redis://127.0.0.1:1"))
    monkeypatch.setattr(gateway_app, "CLOSE_TIMEOUT_S", 0.1)
    app.state.gateway.close = asyncio.Event().wait  # never returns

    running = asyncio.Event()

    async def stubborn() -> None:  # the batch runner, cancelled inside a Redis call that hangs
        running.set()
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.shield(asyncio.Event().wait())

    app.state.gateway.runner.run = stubborn

    async def start_and_stop() -> None:
        async with app.router.lifespan_context(app):
            await running.wait()

    await asyncio.wait_for(start_and_stop(), 10)
