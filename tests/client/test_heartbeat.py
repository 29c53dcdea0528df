"""The heartbeat as one type: what a worker writes reads back the same, the flat keys of
the earlier shape stay for raw readers, and whatever else a key holds reads leniently."""

from __future__ import annotations

import json

from client.engine_stats import CacheStats, EngineStats, EngineTime
from client.heartbeat import LONGEST, Heartbeat, ModelState, RunningRequest

BEAT = Heartbeat(consumer="mac-0", instance="abc", state="draining", host="mac", pid=42, started_at=1.5,
                 version="0.1.0", blas="mkl",
                 models=(ModelState("chat", "chat", "mlx-community/Qwen3-0.6B-8bit", "loaded", ("urgent",),
                                    ("<tool_call>", "</tool_call>")),),
                 in_flight=3, max_num_seqs=16, tok_s=12.5, totals={"generation_tokens": 7},
                 last_error={"code": "internal", "message": "x", "request_id": "r", "at": 2.0},
                 stats=EngineStats(2, 1, {"active": 10, "cache": 5}, prefix_cache=CacheStats(3, 4, 1, 1024, None, 1),
                                   ssd_cache=CacheStats(0, 0, 0), speculation={"method": "ngram", "accepted": 3},
                                   mask_fills=2, mask_fill_ms=1.5,
                                   time=EngineTime(steps=9, model_s=0.5, other_s=0.25, handoff_s=0.125, idle_s=2.0)),
                 longest=(RunningRequest("r1", "mlxq:q:chat", 100.5, 12), RunningRequest("r2", "mlxq:q:chat", 101.0)))


def test_a_heartbeat_reads_back_as_written():
    assert Heartbeat.from_json(BEAT.to_json()) == BEAT


def test_the_written_shape_keeps_the_flat_keys_and_the_engine_figures_at_the_top():
    """docs/protocol.md's readers (redis-cli, other languages) find what they always found."""
    raw = json.loads(BEAT.to_json())
    assert (raw["queue"], raw["lanes"], raw["model"], raw["tool_call"]) == (
        "chat", ["urgent"], "mlx-community/Qwen3-0.6B-8bit", ["<tool_call>", "</tool_call>"])
    assert (raw["running"], raw["waiting"], raw["memory"]) == (2, 1, {"active": 10, "cache": 5})
    assert raw["prefix_cache"]["hit_rate"] == 0.8 and raw["constraints"] == {"mask_fills": 2, "mask_fill_ms": 1.5}
    assert raw["engine"] == {"steps": 9, "model_s": 0.5, "other_s": 0.25, "handoff_s": 0.125, "idle_s": 2.0}
    assert raw["models"][0] == {"name": "chat", "queue": "chat", "path": "mlx-community/Qwen3-0.6B-8bit",
                                "state": "loaded", "lanes": ["urgent"], "tool_call": ["<tool_call>", "</tool_call>"],
                                "memory_bytes": None, "task": "generate"}


def test_a_heartbeat_of_the_earlier_shape_reads_its_one_model_from_the_flat_keys():
    beat = Heartbeat.from_json(json.dumps({"consumer": "old", "state": "ready", "queue": "q", "model": "/m",
                                           "lanes": ["a"], "tool_call": None, "pid": 7, "running": 1,
                                           "waiting": 0}))
    assert beat is not None and beat.models == (ModelState("q", "q", "/m", "loaded", ("a",)),)
    assert beat.serves("q") and not beat.serves("other") and beat.pid == 7
    assert beat.stats == EngineStats(1, 0, {})


def test_whatever_else_a_heartbeat_key_holds_reads_without_an_error():
    """Not JSON, not an object, fields of the wrong type: None, or the defaults."""
    assert Heartbeat.from_json(None) is None
    assert Heartbeat.from_json(b"not json") is None
    assert Heartbeat.from_json(b"[1, 2]") is None
    beat = Heartbeat.from_json(json.dumps({"state": "on fire", "pid": "7", "host": 3, "in_flight": True,
                                           "models": [{"queue": 1}, "x", {"queue": "q", "path": "p", "state": "?"}],
                                           "totals": {"a": "b", "c": 1}, "last_error": "oops",
                                           "longest": [{"id": 5}, "x", {"id": "ok", "tokens": "many"}] * 9}))
    assert beat is not None
    assert (beat.state, beat.pid, beat.host, beat.in_flight, beat.totals, beat.last_error) == (
        "ready", None, "?", 0, {"c": 1}, None)
    assert beat.models == (ModelState("q", "q", "p", "available"),)
    assert beat.longest[0] == RunningRequest("ok", "?", 0.0, 0) and len(beat.longest) <= LONGEST
    odd = Heartbeat.from_json('{"started_at": Infinity, "tok_s": NaN, "pid": 1e400}')  # JSON as Python reads it
    assert odd is not None and (odd.started_at, odd.tok_s, odd.pid) == (0.0, None, None)


def test_engine_figures_of_the_wrong_shape_read_as_none_or_their_defaults():
    """A worker still loading has no figures; junk in one of them costs only that one."""
    assert EngineStats.from_wire({}) is None
    assert EngineStats.from_wire({"running": "2", "waiting": 1}) is None
    odd = EngineStats.from_wire({"running": 2, "waiting": 1, "memory": {"active": "lots", "cache": 7},
                                 "prefix_cache": {"entries": 1}, "constraints": "none", "engine": {"steps": "x"},
                                 "speculation": [1]})
    assert odd == EngineStats(2, 1, {"cache": 7}, time=EngineTime())
    assert odd.memory_held == 7
