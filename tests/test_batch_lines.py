"""Batch input files read into lines, and the pieces of a batch's state, without Redis."""

from __future__ import annotations

import json

import pytest

from client.batches import MAX_LINES, BatchLine, completion_window_s, line_index, line_request_id
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
    rid = line_request_id("batch_abc", 17)
    assert line_index("batch_abc", rid) == 17
    assert line_index("batch_other", rid) is None and line_index("batch_abc", "batch_abc-x") is None
    stored = BatchLine("c", {"prompt": "x"}, None, {"model": "m"})
    assert BatchLine.from_json(stored.to_json()) == stored
