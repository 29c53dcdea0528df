"""Structured output (response_format) inside the shared batch, on the random demo models
(a text and a vision one), where the constraint is the whole story: every constrained
output is valid, and the free requests beside them read exactly as they do alone."""

from __future__ import annotations

import json
import re
import signal
import time
import uuid

import jsonschema
import pytest
from support import KEYS, Outputs, check_stream, on_text_and_vision, start_worker, xadd_json

from client import Client, Done, JobFailed, RequestRejected

served, worker, reference = on_text_and_vision(max_num_seqs=16)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                     "ok": {"type": "boolean"}},
                    "required": ["zip", "ok"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
REGEX = {"type": "regex", "pattern": "[a-z]{3}-[0-9]{2,4}"}
CHOICE = {"type": "choice", "choices": ["yes", "no", "maybe not"]}
GRAMMAR = {"type": "grammar", "lark": 'start: "A" | "B" "C" | "D"+ "E"'}


def valid(response_format: dict, text: str) -> bool:
    kind = response_format["type"]
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), response_format["json_schema"]["schema"])
        return True
    if kind == "regex":
        return re.fullmatch(response_format["pattern"], text) is not None
    if kind == "choice":
        return text in response_format["choices"]
    return re.fullmatch(r"A|BC|D+E", text) is not None


def test_a_mixed_burst_gives_valid_outputs_and_free_requests_as_alone(worker):
    """Schema, regex, choice and grammar requests, greedy and sampled, in one burst with
    free requests: every constrained output is valid and ends by itself (`stop`); the free
    requests and the greedy constrained ones read as they do alone."""
    constrained = [(f, sampling) for f in (JSON_SCHEMA, REGEX, CHOICE, GRAMMAR)
                   for sampling in ({}, {"temperature": 1.0, "seed": 7}, {"temperature": 1.5, "seed": 99})]
    free = [f"Free request number {i}" for i in range(4)]
    with Client(worker.redis_url, queue=worker.queue) as client:
        jobs = [client.submit(f"Constrained {i}", max_tokens=200, response_format=f, **s)
                for i, (f, s) in enumerate(constrained)]
        free_jobs = [client.submit(p, max_tokens=24) for p in free]
        results = [job.result(timeout=120) for job in jobs]
        free_results = [job.result(timeout=120) for job in free_jobs]
        for (response_format, _), done in zip(constrained, results, strict=True):
            assert done.finish_reason == "stop", (response_format["type"], done.text)
            assert valid(response_format, done.text), (response_format["type"], done.text)
        for prompt, done in zip(free, free_results, strict=True):
            assert client.generate(prompt, max_tokens=24, timeout=60).text == done.text
        for i, ((response_format, sampling), done) in enumerate(zip(constrained, results, strict=True)):
            if not sampling:
                alone = client.generate(f"Constrained {i}", max_tokens=200, response_format=response_format,
                                        timeout=60)
                assert alone.text == done.text
        # The masks of the batch's constrained rows were filled together, step by step.
        deadline = time.monotonic() + 30
        while not (fills := _heartbeat(client, worker.consumer)["constraints"]["mask_fills"]):
            assert time.monotonic() < deadline, "no batch fill of the masks"
            time.sleep(0.2)
        assert fills > 10


def _heartbeat(client: Client, consumer: str) -> dict:
    return json.loads(client.redis.get(KEYS.worker(consumer)))


def test_json_object_tokens_are_all_accepted_by_the_grammar(worker, served):
    """json_object on the random model rarely closes the object, but every token it was
    allowed is one a fresh matcher of the same grammar accepts, starting with '{'."""
    from llguidance import LLMatcher
    from mlx_lm.utils import load_tokenizer

    from worker.engine.constraints import JSON_OPTIONS, Grammars

    with Client(worker.redis_url, queue=worker.queue) as client:
        job = client.submit("An object", max_tokens=40, response_format={"type": "json_object"})
        tokens = [t for delta in job.stream(timeout=60) for t in delta.tokens]
    tokenizer = load_tokenizer(served[1])
    grammars = Grammars(tokenizer, 1024)
    matcher = LLMatcher(grammars.tokenizer, LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                             defaults=JSON_OPTIONS))
    assert tokenizer.decode(tokens).startswith("{")
    assert matcher.consume_tokens(tokens), matcher.get_error()


HUGE = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(20_000)},
        "required": [f"k{i}" for i in range(20_000)]}


@pytest.mark.parametrize(("response_format", "extra", "code", "message"), [
    ({"type": "regex", "pattern": "a(b"}, {}, "invalid_request", 'response_format: at 1(8): invalid regex "a(b"'),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}, {}, "invalid_request",
     "response_format: Invalid type: objectx"),
    ({"type": "grammar", "lark": "start: ???"}, {}, "invalid_request", "response_format: 1(8): Expected value"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": HUGE}}, {}, "too_large",
     "response_format: schema too large"),
    (REGEX, {"ignore_eos": True}, "invalid_request", "ignore_eos cannot be combined with response_format"),
    (REGEX, {"min_tokens": 2}, "invalid_request", "min_tokens cannot be combined with response_format"),
], ids=["regex", "schema", "lark", "too large", "ignore_eos", "min_tokens"])
def test_a_format_that_cannot_compile_is_refused_with_llguidances_reason(worker, response_format, extra, code,
                                                                          message):
    with Client(worker.redis_url, queue=worker.queue) as client:
        with pytest.raises(JobFailed) as failed:
            client.generate("x", max_tokens=5, response_format=response_format, timeout=60, **extra)
        assert failed.value.code == code
        assert failed.value.message.startswith(message), failed.value.message
        assert client.generate("x", max_tokens=3, response_format=CHOICE, timeout=60).text in CHOICE["choices"]


def test_a_malformed_format_is_refused_before_sending(worker):
    with Client(worker.redis_url, queue=worker.queue) as client:
        with pytest.raises(RequestRejected, match="does not match any of the expected tags"):
            client.submit("x", response_format={"type": "xml"})
        with pytest.raises(RequestRejected, match=r"choices.*at least 1 item"):
            client.submit("x", response_format={"type": "choice", "choices": []})


def test_a_constrained_request_resumed_after_a_takeover_stays_valid(valkey, demo_model, logs_dir, r):
    """A long constrained output whose worker is frozen and killed mid-way completes on the
    other worker, whose matcher is advanced over the tokens already streamed: the joined
    output is valid JSON for the schema."""
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"enum": ["alpha", "beta"]},
                                                         "minItems": 60, "maxItems": 60}},
              "required": ["items"], "additionalProperties": False}
    queue = f"resume-{uuid.uuid4().hex[:6]}"
    victim = start_worker(valkey, demo_model, queue, logs_dir, consumer=f"{queue}-victim")
    request_id = f"long-json-{uuid.uuid4().hex[:8]}"
    xadd_json(r, queue, request_id, {"prompt": "List", "max_tokens": 600, "response_format": {
        "type": "json_schema", "json_schema": {"name": "items", "schema": schema}}})
    deadline = time.monotonic() + 60
    while r.xlen(KEYS.output(queue, request_id)) < 15:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    victim.signal(signal.SIGSTOP)
    survivor = start_worker(valkey, demo_model, queue, logs_dir, consumer=f"{queue}-survivor",
                            reclaim_interval_s=0.2)
    try:
        victim.process.kill()
        victim.wait()
        done = check_stream(Outputs(r).of(request_id, timeout=90))
        assert isinstance(done, Done) and done.finish_reason == "stop"
        jsonschema.validate(json.loads(done.text), schema)
        assert "resuming a request" in survivor.log()
    finally:
        survivor.stop()
