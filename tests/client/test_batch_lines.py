"""Batch input files read into lines, the pieces of a batch's state, and Anthropic bodies read,
without Redis."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.batch_share import QueueLoad
from client.batches import MAX_LINES, Batch, BatchLine, completion_window_s, line_index, line_request_id
from gateway.anthropic import read_messages
from gateway.batch_lines import read_input
from gateway.errors import ApiError


def line(custom_id: str, model: str = "m", url: str = "/v1/chat/completions", **body: object) -> bytes:
    request = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": request}).encode() + b"\n"


def test_each_line_becomes_an_mlxq_body_or_its_own_error():
    read = read_input(line("a") + b"\n" + b"[1, 2]\n" + line("b", url="/v1/completions") + line("c", n=2)
                      + line("d", model="other") + line("e", temperature=0.5), "/v1/chat/completions")
    assert read.errors == [] and read.model == "m"
    by_id = {(x.custom_id, x.error["code"] if x.error else None): x for x in read.lines}
    assert [x.custom_id for x in read.lines] == ["a", None, "b", "c", "d", "e"]
    assert read.lines[0].body == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert read.lines[5].body["temperature"] == 0.5
    assert (None, "invalid_json_line") in by_id
    assert "this batch's endpoint is /v1/chat/completions" in read.lines[2].error["message"]
    assert read.lines[3].error and "n" in read.lines[3].error["message"]
    assert "every line of a batch names one model" in read.lines[4].error["message"]


def test_what_fails_the_whole_file():
    assert read_input(line("a") + line("a"), "/v1/chat/completions").errors[0]["code"] == "duplicate_custom_id"
    assert read_input(b"\n \n", "/v1/chat/completions").errors[0]["code"] == "empty_file"
    assert read_input(b"\xff\xfe", "/v1/chat/completions").errors[0]["code"] == "invalid_file"
    many = b"".join(line(f"x{i}") for i in range(MAX_LINES + 1))
    assert read_input(many, "/v1/chat/completions").errors[0]["code"] == "too_many_requests"
    with pytest.raises(ApiError, match="batches take"):
        read_input(line("a"), "/v1/images/generations")


@pytest.mark.parametrize(("window", "seconds"), [("24h", 86400), ("30m", 1800), ("45s", 45), ("7d", 604800)])
def test_completion_windows(window, seconds):
    assert completion_window_s(window) == seconds


@pytest.mark.parametrize("window", ["", "0h", "8d", "1w", "24 h", "-1h", "24H"])
def test_completion_windows_refused(window):
    with pytest.raises(ValueError, match="completion_window"):
        completion_window_s(window)


def test_a_line_s_request_id_names_its_batch_and_number():
    batch = Batch("batch_abc", "in_progress", "q", "mlxq", "24h", 0, 1, 20, 0, secret="s3cret")
    rid = line_request_id(batch, 17)
    assert line_index(batch, rid) == 17
    other = Batch("batch_other", "in_progress", "q", "mlxq", "24h", 0, 1, 20, 0, secret="s3cret")
    assert line_index(other, rid) is None and line_index(batch, "batch_abc-x") is None
    assert line_index(batch, "batch_abc-17") is None, "without the line's token, no request is the line's"
    assert line_index(batch, rid[:-1] + ("0" if rid[-1] != "0" else "1")) is None
    legacy = Batch("batch_old", "in_progress", "q", "mlxq", "24h", 0, 1, 20, 0)  # stored before lines had secrets
    assert line_index(legacy, line_request_id(legacy, 3)) == 3 == int(line_request_id(legacy, 3).split("-")[-1])


def test_a_queue_s_slots_are_shared_evenly_between_the_tenants_running_batches_on_it():
    alone = QueueLoad(slots=16, batches={"b1": "alpha"})
    assert alone.share("b1") == 32, "alone, a batch keeps every slot busy (and as many lines waiting)"
    two = QueueLoad(slots=16, batches={"b1": "alpha", "b2": "beta", "b3": "beta"})
    assert two.share("b1") == 16 and two.share("b2") == two.share("b3") == 8
    assert QueueLoad(slots=16, batches={"b1": "alpha"}).share("new") == 16, "a batch not yet seen counts too"
    assert QueueLoad(slots=0, batches={}).share("b1") is None, "no live worker: the driver's own window"
    assert QueueLoad(slots=1, batches={f"b{i}": f"t{i}" for i in range(5)}).share("b0") == 1


def test_a_stored_line_keeps_raw_bytes_and_lines_stored_as_json_still_read():
    stored = BatchLine("c", {"prompt": "x", "images": [b"\x89PNG\x00"]}, None, {"model": "m"})
    assert BatchLine.decode(stored.encode()) == stored
    legacy = '{"custom_id": "c", "body": {"prompt": "x"}, "error": null, "meta": {"model": "m"}}'
    assert BatchLine.decode(legacy.encode()) == BatchLine("c", {"prompt": "x"}, None, {"model": "m"})


scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=20)
chat_bodies = st.fixed_dictionaries({"model": st.just("m"), "messages": json_values})
line_shapes = st.fixed_dictionaries({}, optional={"custom_id": json_values | st.text(min_size=1, max_size=8),
                                                  "method": st.sampled_from(["POST", "GET"]) | json_values,
                                                  "url": st.sampled_from(["/v1/chat/completions"]) | json_values,
                                                  "body": json_values | chat_bodies})


@settings(max_examples=300, deadline=None)
@given(st.lists(line_shapes | json_values, max_size=6), st.binary(max_size=40))
def test_no_input_file_breaks_the_reader(lines, junk):
    """Whatever a file holds, it is read into lines and reasons, never an exception."""
    content = b"\n".join(json.dumps(line).encode() for line in lines) + b"\n" + junk
    read = read_input(content, "/v1/chat/completions")
    assert all((line.body is None) != (line.error is None) for line in read.lines)


@settings(max_examples=300, deadline=None)
@given(json_values | st.fixed_dictionaries({"model": st.just("m"), "max_tokens": st.integers(),
                                            "messages": st.lists(st.fixed_dictionaries(
                                                {"role": st.sampled_from(["user", "assistant"]),
                                                 "content": json_values}), max_size=3)}))
def test_no_messages_body_breaks_the_anthropic_reader(body):
    """Whatever a /v1/messages body holds, it is read or refused with a 400."""
    try:
        read_messages(body)
    except ApiError as e:
        assert e.status == 400
