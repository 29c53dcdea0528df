"""Hostile request entries against a real worker process (property-based).

Each example is a batch of entries, hostile ones of many shapes interleaved with valid
requests, in both encodings: nesting far past any limit, lone surrogates and invalid
UTF-8 in every string field, extreme numbers, huge and empty values, wrong types,
unknown and duplicated fields, hostile `reply_to` values. Whatever they carry: every
entry with a readable id gets exactly one terminal event on its own output stream (the
autouse `never_told_twice` fixture checks "exactly"), entries without one go to the
dead-letter stream, the valid ones complete with the text they give alone, the worker
stays up and its memory stays bounded.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from support import KEYS, Outputs, check_stream, rss_mb, worker_fixture

from client import Done

QUEUE = f"qfuzz{uuid.uuid4().hex[:8]}"
worker = worker_fixture(queue=QUEUE, max_tokens_limit=64, max_metadata_bytes=256, max_num_seqs=8)
FIELDS = ["prompt", "messages", "prompt_tokens", "max_tokens", "temperature", "top_p", "top_k", "min_p",
          "repetition_penalty", "seed", "stop", "stream_interval", "priority", "deadline_ms", "encoding",
          "images", "metadata", "reply_to"]
STRING_FIELDS = ["prompt", "messages.0.content", "messages.0.role", "stop.0", "reply_to", "encoding", "images.0",
                 "metadata.note", "metadata.<key>"]
VALID_PROMPTS = ["Hello there", "A queue of jobs", "Once upon a time", "Tell me about Redis", "Numbers: 1 2 3"]
WRONG_TYPE_REPLY = KEYS.reply(QUEUE, "fuzz-a-string-key")  # a string key: Redis refuses XADD to it
SHAPES: Counter[str] = Counter()
REPORT = {"entries": 0, "rss_before_mb": 0.0, "rss_after_mb": 0.0}


@dataclass(frozen=True)
class Entry:
    shape: str
    fields: dict[str, Any]
    request_id: str | None  # None: no readable id, so it is dead-lettered
    valid_prompt: str | None = None  # a valid request: its expected text is that prompt's


def _json(body: Any) -> bytes:
    return json.dumps(body, default=repr).encode()


def _pack(body: Any) -> bytes:
    try:
        return msgpack.packb(body, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):  # ints beyond 64 bits have no msgpack form
        return b"\xc1"


def _with_value(path: str, value: Any) -> dict[str, Any]:
    """A request body with `value` at `path` (a STRING_FIELDS entry)."""
    body: dict[str, Any] = {"prompt": "hi", "max_tokens": 2}
    if path.startswith("messages"):
        message = {"role": "user", "content": "hi"}
        message[path.rsplit(".", 1)[1]] = value
        body = {"messages": [message], "max_tokens": 2}
    elif path == "stop.0":
        body["stop"] = [value]
    elif path == "images.0":
        body["images"] = [value]
    elif path == "metadata.note":
        body["metadata"] = {"note": value}
    elif path == "metadata.<key>":
        body["metadata"] = {value: 1}
    else:
        body[path] = value
    return body


scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63, max_value=2**200)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30) | st.binary(max_size=30))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _nesting(draw: st.DrawFn, rid: str, encoding: str) -> Entry:
    depth = draw(st.sampled_from([33, 100, 1000, 20_000]))
    field = draw(st.sampled_from(["metadata", "prompt", "stop", "messages"]))
    if encoding == "json":
        raw = b'{"prompt":"hi","' + field.encode() + b'":' + b"[" * depth + b"]" * depth + b"}"
    else:  # msgpack's packer stops at 512 levels: write the bytes by hand
        raw = b"\x82\xa6prompt\xa2hi" + msgpack.packb(field) + b"\x91" * depth + b"\x90"
    return Entry(f"nesting {encoding}", {"id": rid, encoding: raw}, rid)


def _surrogate(draw: st.DrawFn, rid: str, encoding: str) -> Entry:
    path = draw(st.sampled_from(STRING_FIELDS))
    body = _with_value(path, "x\ud800y" if draw(st.booleans()) else "\udfff")
    return Entry(f"surrogate in {path}", {"id": rid, "json": json.dumps(body).encode()}, rid)  # escaped: \ud800


def _bad_utf8(draw: st.DrawFn, rid: str, encoding: str) -> Entry:
    path = draw(st.sampled_from(STRING_FIELDS))
    if encoding == "json":
        raw = json.dumps(_with_value(path, "MARK")).encode().replace(b"MARK", b"\xff\xfe\xc0")
    else:  # a msgpack str whose bytes are not UTF-8
        raw = _pack(_with_value(path, "MARK")).replace(b"\xa4MARK", b"\xa4\xff\xfe\xc0\x80")
    return Entry(f"bad-utf-8 in {path} {encoding}", {"id": rid, encoding: raw}, rid)


def _number(draw: st.DrawFn, rid: str, encoding: str) -> Entry:
    field = draw(st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "seed", "priority",
                                  "deadline_ms", "stream_interval", "prompt_tokens"]))
    number = draw(st.sampled_from(["1e999", "-1e999", "NaN", "Infinity", "1" * 5000, "-0.0", "1e-400", "1e-300",
                                   "18446744073709551616", "-9223372036854775809", "1" * 300, "1" * 400,
                                   "-" + "9" * 400, "1000000"]))
    value = f"[{number}]" if field == "prompt_tokens" else number
    head = '{"prompt_tokens":[1,2]' if field != "prompt_tokens" else '{"max_tokens":2'
    return Entry(f"number {field}", {"id": rid, "json": f'{head},"{field}":{value}}}'.encode()}, rid)


def _huge(draw: st.DrawFn, rid: str, encoding: str) -> Entry:
    what = draw(st.sampled_from(["prompt", "stop", "prompt_tokens", "metadata", "body"]))
    body = {"prompt": {"prompt": "x" * 3_000_000}, "stop": {"prompt": "hi", "stop": ["s"] * 10_000},
            "prompt_tokens": {"prompt_tokens": [7] * 200_000},
            "metadata": {"prompt": "hi", "metadata": {"k": "v" * 100_000}},
            "body": {"prompt": "hi", "pad": "p" * 9_000_000}}[what]
    return Entry(f"huge {what}", {"id": rid, encoding: _json(body) if encoding == "json" else _pack(body)}, rid)


def _empty(draw: st.DrawFn, rid: str, encoding: str) -> Entry:
    body = draw(st.sampled_from([{}, {"prompt": ""}, {"messages": []}, {"prompt_tokens": []},
                                 {"prompt": "hi", "stop": [""]}, {"prompt": "hi", "metadata": {}},
                                 {"messages": [{"role": "", "content": ""}]}]))
    raw = draw(st.sampled_from([b"", _json(body), _pack(body)]))
    return Entry("empty", {"id": rid, encoding: raw}, rid)


def _wrong_type(draw: st.DrawFn, rid: str, encoding: str) -> Entry:
    field = draw(st.sampled_from(FIELDS))
    body = {"prompt": "hi", field: draw(values)}
    return Entry(f"wrong-type {field}", {"id": rid, encoding: _json(body) if encoding == "json" else _pack(body)},
                 rid)


def _unknown_field(draw: st.DrawFn, rid: str, encoding: str) -> Entry:
    body = {"prompt": "hi", draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in FIELDS)): 1}
    return Entry("unknown-field", {"id": rid, "json": _json(body)}, rid)


def _duplicate_key(draw: st.DrawFn, rid: str, encoding: str) -> Entry:
    field = draw(st.sampled_from(["prompt", "max_tokens", "reply_to", "encoding"]))
    raw = f'{{"prompt":"a","max_tokens":2,"{field}":"x","{field}":"y"}}'.encode()
    return Entry(f"duplicate-key {field}", {"id": rid, "json": raw}, rid)


def _entry_fields(draw: st.DrawFn, rid: str, encoding: str) -> Entry:
    extra = draw(st.sampled_from([{"msgpack": _pack({"prompt": "hi"})}, {"extra": b"1"}, {b"\xff": b"1"},
                                  {"ID": b"other"}]))
    return Entry("entry-fields", {"id": rid, "json": _json({"prompt": "hi"}), **extra}, rid)


def _reply_to(draw: st.DrawFn, rid: str, encoding: str) -> Entry:
    reply_to = draw(st.sampled_from([
        "orders:events", KEYS.output(QUEUE, f"fz-{uuid.uuid4().hex}"), "mlxq:q:default", "mlxq:cancel",
        "mlxq:workers:x",
        KEYS.reply("another-queue", "x"), "mlxq:reply:x", KEYS.reply(QUEUE, ""), KEYS.reply(QUEUE, "a b"),
        KEYS.reply(QUEUE, "n" * 500), WRONG_TYPE_REPLY, KEYS.reply(QUEUE, "\u00e9"), ""]))
    body = {"prompt": "hi", "max_tokens": 2, "reply_to": reply_to}
    return Entry(f"reply_to {reply_to[:24]}", {"id": rid, encoding: _json(body) if encoding == "json"
                                               else _pack(body)}, rid)


def _no_id(draw: st.DrawFn, rid: str, encoding: str) -> Entry:
    fields = draw(st.sampled_from([{}, {"id": ""}, {"id": "x" * 129}, {"id": b"\xff\xfe"}, {"id": "a b"},
                                   {"id": "\u00e9t\u00e9"}]))
    return Entry("no-id", {**fields, "json": _json({"prompt": "hi"})}, None)


def _random_body(draw: st.DrawFn, rid: str, encoding: str) -> Entry:
    body = draw(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), values, max_size=6) | values)
    if draw(st.integers(0, 9)) == 0:
        raw = draw(st.binary(max_size=40))
    elif encoding == "msgpack":
        raw = _pack(body)
    else:
        raw = _json(body) if _jsonable(body) else b"{"
    return Entry(f"random-body {encoding}", {"id": rid, encoding: raw}, rid)


SHAPE_BUILDERS = [_nesting, _surrogate, _bad_utf8, _number, _huge, _empty, _wrong_type, _unknown_field,
                  _duplicate_key, _entry_fields, _reply_to, _no_id, _random_body]
SHAPE_BUILDERS += [_number] * 2  # its field x value pairs are many; one that passes validation can reach the engine


@st.composite
def hostile(draw: st.DrawFn) -> Entry:
    """One hostile entry of a drawn shape, in a drawn encoding."""
    build = draw(st.sampled_from(SHAPE_BUILDERS))
    return build(draw, f"fz-{uuid.uuid4().hex}", draw(st.sampled_from(["json", "msgpack"])))


def _jsonable(body: Any) -> bool:
    try:
        json.dumps(body)
        return True
    except (TypeError, ValueError):
        return False


@st.composite
def valid(draw: st.DrawFn) -> Entry:
    rid = f"fz-{uuid.uuid4().hex}"
    prompt = draw(st.sampled_from(VALID_PROMPTS))
    body = {"prompt": prompt, "max_tokens": 6, "metadata": {"n": draw(st.integers(-(2**63), 2**63 - 1))}}
    encoding = draw(st.sampled_from(["json", "msgpack"]))
    return Entry("valid", {"id": rid, encoding: _json(body) if encoding == "json" else _pack(body)}, rid, prompt)


@pytest.fixture(scope="module")
def expected(worker: Any, valkey: str) -> dict[str, str]:
    """Each valid prompt's text, from the worker with nothing else running."""
    r = redis.Redis.from_url(valkey)
    r.set(WRONG_TYPE_REPLY, "not a stream")
    texts = {}
    for prompt in VALID_PROMPTS:
        rid = f"alone-{uuid.uuid4().hex}"
        r.xadd(KEYS.queue(worker.queue), {"id": rid, "json": _json({"prompt": prompt, "max_tokens": 6})})
        done = check_stream(Outputs(r).of(rid, timeout=30))
        assert isinstance(done, Done)
        texts[prompt] = done.text
    REPORT["rss_before_mb"] = rss_mb(worker.process.pid)
    r.close()
    return texts


@settings(max_examples=250, deadline=None, phases=[Phase.explicit, Phase.generate],  # no shrinking: a live worker
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(batch=st.lists(st.one_of(hostile(), hostile(), valid()), min_size=1, max_size=12))
def test_any_entry_gets_one_answer_and_the_worker_stays_up(worker, r, expected, batch):
    """Every readable id is answered once on its own stream, valid ones with their text;
    unreadable ones are dead-lettered; the worker is alive after each batch."""
    dead = KEYS.dead(worker.queue)
    dead_before = r.xlen(dead)
    for entry in batch:
        r.xadd(KEYS.queue(worker.queue), entry.fields)
        SHAPES[entry.shape.split(" ")[0]] += 1
    outputs = Outputs(r)
    for entry in batch:
        if entry.request_id is None:
            continue
        terminal = check_stream(outputs.of(entry.request_id, timeout=30))
        if entry.valid_prompt is not None:
            assert isinstance(terminal, Done), (entry.shape, terminal)
            assert terminal.text == expected[entry.valid_prompt]
    unreadable = sum(entry.request_id is None for entry in batch)
    deadline = time.monotonic() + 30
    while r.xlen(dead) - dead_before < unreadable:
        assert time.monotonic() < deadline, "an entry without a readable id was not dead-lettered"
        time.sleep(0.01)
    assert r.xlen(dead) - dead_before == unreadable
    assert worker.process.poll() is None
    REPORT["entries"] += len(batch)


def test_memory_stays_bounded_after_the_hostile_entries(worker, expected):
    """The worker's RSS after every hostile batch (megabyte prompts among them) is close
    to what it was before them: no body is tokenized or kept whole that should not be."""
    REPORT["rss_after_mb"] = rss_mb(worker.process.pid)
    assert REPORT["entries"] > 0
    assert REPORT["rss_after_mb"] < REPORT["rss_before_mb"] + 300


@pytest.fixture(scope="module", autouse=True)
def report_cases() -> Any:
    yield
    print(f"\nfuzzed {REPORT['entries']} request entries of {len(SHAPES)} kinds {dict(SHAPES)}; worker RSS "
          f"{REPORT['rss_before_mb']:.0f} MB before, {REPORT['rss_after_mb']:.0f} MB after")
