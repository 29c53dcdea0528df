"""The heartbeat as one type: what a worker writes reads back the same, the flat keys of
the earlier shape stay for raw readers, and whatever else a key holds reads leniently."""

from __future__ import annotations

import json

from client.heartbeat import Heartbeat, ModelState

BEAT = Heartbeat(consumer="mac-0", instance="abc", state="draining", host="mac", pid=42, started_at=1.5,
                 version="0.1.0", blas="mkl",
                 models=(ModelState("chat", "chat", "mlx-community/Qwen3-0.6B-8bit", "loaded", ("urgent",),
                                    ("<tool_call>", "</tool_call>")),),
                 in_flight=3, max_num_seqs=16, tok_s=12.5, totals={"generation_tokens": 7},
                 last_error={"code": "internal", "message": "x", "request_id": "r", "at": 2.0},
                 stats={"running": 2, "waiting": 1, "memory": {"active": 10}, "prefix_cache": None})


def test_a_heartbeat_reads_back_as_written():
    assert Heartbeat.from_json(BEAT.to_json()) == BEAT


def test_the_written_shape_keeps_the_flat_keys_and_the_engine_figures_at_the_top():
    """docs/protocol.md's readers (redis-cli, other languages) find what they always found."""
    raw = json.loads(BEAT.to_json())
    assert (raw["queue"], raw["lanes"], raw["model"], raw["tool_call"]) == (
        "chat", ["urgent"], "mlx-community/Qwen3-0.6B-8bit", ["<tool_call>", "</tool_call>"])
    assert (raw["running"], raw["waiting"], raw["memory"]) == (2, 1, {"active": 10})
    assert raw["models"][0] == {"name": "chat", "queue": "chat", "path": "mlx-community/Qwen3-0.6B-8bit",
                                "state": "loaded", "lanes": ["urgent"], "tool_call": ["<tool_call>", "</tool_call>"],
                                "memory_bytes": None, "task": "generate"}


def test_a_heartbeat_of_the_earlier_shape_reads_its_one_model_from_the_flat_keys():
    beat = Heartbeat.from_json(json.dumps({"consumer": "old", "state": "ready", "queue": "q", "model": "/m",
                                           "lanes": ["a"], "tool_call": None, "pid": 7, "running": 1}))
    assert beat is not None and beat.models == (ModelState("q", "q", "/m", "loaded", ("a",)),)
    assert beat.serves("q") and not beat.serves("other") and beat.pid == 7 and beat.stats == {"running": 1}


def test_whatever_else_a_heartbeat_key_holds_reads_without_an_error():
    """Not JSON, not an object, fields of the wrong type: None, or the defaults."""
    assert Heartbeat.from_json(None) is None
    assert Heartbeat.from_json(b"not json") is None
    assert Heartbeat.from_json(b"[1, 2]") is None
    beat = Heartbeat.from_json(json.dumps({"state": "on fire", "pid": "7", "host": 3, "in_flight": True,
                                           "models": [{"queue": 1}, "x", {"queue": "q", "path": "p", "state": "?"}],
                                           "totals": {"a": "b", "c": 1}, "last_error": "oops"}))
    assert beat is not None
    assert (beat.state, beat.pid, beat.host, beat.in_flight, beat.totals, beat.last_error) == (
        "ready", None, "?", 0, {"c": 1}, None)
    assert beat.models == (ModelState("q", "q", "p", "available"),)
    odd = Heartbeat.from_json('{"started_at": Infinity, "tok_s": NaN, "pid": 1e400}')  # JSON as Python reads it
    assert odd is not None and (odd.started_at, odd.tok_s, odd.pid) == (0.0, None, None)
