"""Bad requests get a precise error (or a dead letter) and the worker keeps serving."""

from __future__ import annotations

import json

import msgpack
import pytest
from support import KEYS, check_stream, settled, worker_fixture, xadd_json

from client import Done, Error

worker = worker_fixture(max_tokens_limit=500, max_body_bytes=20_000, max_prompt_tokens=3000, max_stop_strings=4,
                        max_stop_length=10, max_metadata_bytes=100)

BAD_BODIES = [
    ("wrong type", {"prompt": "hi", "max_tokens": "ten"}, "invalid_request",
     "max_tokens: Input should be a valid integer"),
    ("wrong type in list", {"prompt": "hi", "stop": [1]}, "invalid_request", "stop.0: Input should be a valid string"),
    ("unknown field", {"prompt": "hi", "max_token": 5}, "invalid_request", "max_token: Extra inputs are not permitted"),
    ("two prompt kinds", {"prompt": "hi", "prompt_tokens": [1, 2]}, "invalid_request",
     "exactly one of prompt, messages, prompt_tokens is required (got prompt, prompt_tokens)"),
    ("no prompt", {"max_tokens": 5}, "invalid_request",
     "exactly one of prompt, messages, prompt_tokens is required (got none)"),
    ("empty prompt", {"prompt": ""}, "invalid_request", "prompt: String should have at least 1 character"),
    ("empty messages", {"messages": []}, "invalid_request", "messages: List should have at least 1 item"),
    ("message without role", {"messages": [{"content": "hi"}]}, "invalid_request", "messages.0.role: Field required"),
    ("max_tokens zero", {"prompt": "hi", "max_tokens": 0}, "invalid_request",
     "max_tokens: Input should be greater than or equal to 1"),
    ("max_tokens above the limit", {"prompt": "hi", "max_tokens": 501}, "too_large",
     "max_tokens: 501 is above this worker's max_tokens_limit (500)"),
    ("priority past 32 bits", {"prompt": "hi", "priority": 10**400}, "invalid_request",
     "priority: Input should be less than 2147483648"),
    ("temperature past a float", {"prompt": "hi", "temperature": 1e999}, "invalid_request",
     "body is not valid JSON: Infinity is not a JSON value"),
    ("negative temperature", {"prompt": "hi", "temperature": -1}, "invalid_request",
     "temperature: Input should be greater than or equal to 0"),
    ("token outside the vocabulary", {"prompt_tokens": [1, 99999]}, "invalid_request",
     "prompt_tokens: ids [99999] are outside the vocabulary"),
    ("prompt longer than the context", {"prompt_tokens": [5] * 2100}, "too_large",
     "the prompt has 2100 tokens; this model's context is 2048 tokens"),
    ("body above max_body_bytes", {"prompt": "x" * 25_000}, "too_large",
     "body: 25014 bytes is above this worker's max_body_bytes (20000)"),
    ("prompt above max_prompt_tokens", {"prompt_tokens": [5] * 3001}, "too_large",
     "the prompt has 3001 tokens; this worker's max_prompt_tokens is 3000"),
    ("too many stop strings", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "too_large",
     "stop: 5 strings is above this worker's max_stop_strings (4)"),
    ("stop string too long", {"prompt": "hi", "stop": ["x" * 11]}, "too_large",
     "stop: a string of 11 characters is above this worker's max_stop_length (10)"),
    ("metadata too large", {"prompt": "hi", "metadata": {"note": "y" * 200}}, "too_large",
     "metadata: 211 bytes encoded is above this worker's max_metadata_bytes (100)"),
    ("images on a text queue", {"prompt": "hi", "images": ["aGk="]}, "invalid_request",
     "images: this queue serves a text-only model"),
    ("reply_to into a queue", {"prompt": "hi", "reply_to": "mlxq:q:default"}, "invalid_request",
     "reply_to: 'mlxq:q:default' is not a shared reply stream of queue"),
    ("reply_to into another request's output", {"prompt": "hi", "reply_to": "mlxq:out:{other}"}, "invalid_request",
     "reply_to: 'mlxq:out:{other}' is not a shared reply stream"),
    ("reply_to another queue's reply stream", {"prompt": "hi", "reply_to": "mlxq:reply:elsewhere:x"},
     "invalid_request", "reply_to: 'mlxq:reply:elsewhere:x' is not a shared reply stream of queue"),
    ("reply_to another application's key", {"prompt": "hi", "reply_to": "orders:events"}, "invalid_request",
     "reply_to: 'orders:events' is not a shared reply stream"),
    ("bad encoding", {"prompt": "hi", "encoding": "xml"}, "invalid_request",
     "encoding: Input should be 'json' or 'msgpack'"),
]


@pytest.mark.parametrize(("case", "body", "code", "message"), BAD_BODIES, ids=[c[0] for c in BAD_BODIES])
def test_bad_body_gets_a_precise_error(worker, r, outputs, new_id, case, body, code, message):
    """Each kind of bad body is answered with its code and a message naming the field and reason."""
    rid = new_id()
    xadd_json(r, worker.queue, rid, body)
    (event,) = outputs.of(rid)
    assert isinstance(event, Error)
    assert event.code == code
    assert message in event.message


RAW_ENTRIES = [
    ("not JSON", {"json": "{not json"}, "body is not valid JSON"),
    ("not msgpack", {"msgpack": b"\xc1"}, "body is not valid msgpack"),
    ("JSON but not an object", {"json": "[1, 2]"}, "body must be a JSON object, not list"),
    ("msgpack but not a map", {"msgpack": msgpack.packb("hi")}, "body must be a msgpack map, not str"),
    ("no body", {}, "exactly one of 'json' or 'msgpack'"),
    ("two bodies", {"json": "{}", "msgpack": msgpack.packb({})}, "exactly one of 'json' or 'msgpack'"),
]


@pytest.mark.parametrize(("case", "fields", "message"), RAW_ENTRIES, ids=[c[0] for c in RAW_ENTRIES])
def test_unreadable_body_gets_an_error(worker, r, outputs, new_id, case, fields, message):
    """An entry whose body cannot be decoded is answered on the id's output stream."""
    rid = new_id()
    r.xadd(KEYS.queue(worker.queue), {"id": rid, **fields})
    (event,) = outputs.of(rid)
    assert isinstance(event, Error) and event.code == "invalid_request"
    assert message in event.message


def test_an_error_honours_reply_to_and_encoding(worker, r, outputs, new_id):
    """Even an invalid request's error goes where it asked, in the format it asked for."""
    rid, reply_to = new_id(), KEYS.reply(worker.queue, new_id())
    xadd_json(r, worker.queue, rid, {"prompt": "", "reply_to": reply_to, "encoding": "msgpack"})
    (event,) = outputs.events(reply_to, rid)
    assert isinstance(event, Error)
    assert [f.keys() for _, f in r.xrange(reply_to)] == [{b"type", b"msgpack"}]


@pytest.mark.parametrize("fields", [{"json": "{}"}, {"id": "bad id!", "json": "{}"}, {"id": "x" * 129, "json": "{}"}],
                         ids=["no id", "bad characters", "too long"])
def test_entry_without_a_readable_id_goes_to_the_dead_letter_stream(worker, r, fields):
    """An entry without a usable id is moved to `<queue>:dead` with the reason, and acknowledged."""
    entry_id = r.xadd(KEYS.queue(worker.queue), fields).decode()
    dead = KEYS.dead(worker.queue)
    for _ in range(100):
        letters = {f[b"entry_id"].decode(): f for _, f in r.xrange(dead)}
        if entry_id in letters:
            break
        r.xread({dead: "$"}, block=100)
    letter = letters[entry_id]
    assert b"id" in letter[b"reason"]
    assert letter[b"field:json"] == b"{}"


def test_the_worker_keeps_serving_after_bad_input(worker, r, outputs, new_id):
    """After every kind of bad input above, a valid request still completes."""
    for _, body, _, _ in BAD_BODIES:
        xadd_json(r, worker.queue, new_id(), body)
    r.xadd(KEYS.queue(worker.queue), {"json": json.dumps({"prompt": "no id"})})
    rid = new_id()
    xadd_json(r, worker.queue, rid, {"prompt": "Still there?", "max_tokens": 5})
    done = check_stream(outputs.of(rid))
    assert isinstance(done, Done) and done.finish_reason == "length"
    assert settled(r, KEYS.queue(worker.queue))


def test_metadata_that_cannot_be_echoed_is_refused(worker, r, outputs, new_id):
    """Bytes in metadata cannot come back as JSON: the request is refused up front, not lost later."""
    rid = new_id()
    body = {"prompt": "hi", "encoding": "json", "metadata": {"blob": b"\x00"}}
    r.xadd(KEYS.queue(worker.queue), {"id": rid, "msgpack": msgpack.packb(body, use_bin_type=True)})
    (event,) = outputs.of(rid)
    assert isinstance(event, Error) and event.code == "invalid_request"
    assert event.message.startswith("metadata: cannot be sent back as json")


def test_a_reply_to_redis_refuses_is_answered_on_the_requests_own_stream(worker, r, outputs, new_id):
    """Output to a reply stream that is a key of another type fails that request alone: its
    error goes to its own output stream, its entry is settled, and the next request runs."""
    refused, wrong = new_id(), KEYS.reply(worker.queue, new_id())
    r.set(wrong, "a string")
    xadd_json(r, worker.queue, refused, {"prompt": "hi", "max_tokens": 3, "reply_to": wrong})
    (event,) = outputs.of(refused)
    assert isinstance(event, Error) and event.code == "invalid_request"
    assert event.message.startswith(f"reply_to: Redis refused writing to {wrong} (WRONGTYPE")
    rid = new_id()
    xadd_json(r, worker.queue, rid, {"prompt": "and me", "max_tokens": 3})
    assert isinstance(check_stream(outputs.of(rid)), Done)
    assert r.get(wrong) == b"a string"
    assert settled(r, KEYS.queue(worker.queue))
