"""The worker's edge, unit by unit, with no Valkey and no model: preparing a request
against the simulated model's limits, the counters that outlive restarts, and telling a
dead holder of a consumer name from a live one."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from client.heartbeat import Heartbeat, StatsRecord, counter_names
from client.protocol import Delta, Done, Error, RequestRejected, Timing, Usage, encode_request, read_envelope
from worker.engine.backends.sim import load_sim
from worker.fleet.naming import _left_by_dead_process
from worker.messages import RequestRef
from worker.prepare.generation import Preparer
from worker.queue.totals import Totals
from worker.settings import WorkerSettings

REF = RequestRef("r1", "1-0")


@pytest.fixture(scope="module")
def preparer() -> Preparer:
    return Preparer(load_sim("sim:step_ms=1").info, WorkerSettings(model="sim:", max_tokens_limit=50))


def prepare(preparer: Preparer, body: dict) -> object:
    return preparer.prepare(read_envelope(encode_request("r1", body)), REF, arrived_at=1.0, clock_offset_s=0.0)


def test_a_valid_request_becomes_an_engine_request(preparer):
    request = prepare(preparer, {"prompt": "abc", "max_tokens": 5, "stop": ["x"], "priority": 2})
    assert (request.ref, request.prompt_tokens, request.stopping.max_tokens, request.stopping.stop,
            request.queueing.priority) == (
        REF, [ord(c) % 26 for c in "abc"], 5, ["x"], 2)  # the simulated tokenizer's ids
    assert request.media is None and request.constraint is None and request.reporting.tools is None


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "a", "max_tokens": 51}, "max_tokens: 51 is above this worker's max_tokens_limit (50)"),
    ({"prompt": "a", "images": ["aGk="]}, "images: this queue serves a text-only model"),
    ({"messages": [{"role": "user", "content": "a"}]}, "messages: this model has no chat template"),
    ({"prompt": "a", "response_format": {"type": "json_object"}}, "cannot be constrained yet"),
    ({"prompt": "a", "reply_to": "other:key"}, "reply_to"),
    ({"prompt": "a", "logprobs": True}, "does not give them yet"),
])
def test_what_the_model_or_the_worker_cannot_honour_is_refused_by_name(preparer, body, message):
    with pytest.raises(RequestRejected, match=re.escape(message)):
        prepare(preparer, body)


def test_totals_count_published_events_and_restore_only_their_own_fields():
    totals = Totals()
    totals.observe(Delta(id="a", seq=0, text="x", tokens=[1, 2]))
    totals.observe(Done(id="a", finish_reason="length", text="x", usage=Usage(3, 2, 1),
                        timing=Timing(queued_ms=1.0, ttft_ms=2.0, total_ms=3.0)))
    totals.observe(Error(id="b", code="from_a_newer_worker", message="m"))
    fields = totals.as_fields()
    assert set(fields) == set(counter_names())  # a fixed set, whatever the events carried
    assert (fields["generation_tokens"], fields["prompt_tokens"], fields["cached_tokens"]) == (2, 3, 1)
    assert (fields["finished:length"], fields["errors:internal"]) == (1, 1)
    again = Totals()
    assert again.tok_s(now=100.0) == 0.0  # a heartbeat before the restore
    again.restore(StatsRecord.from_wire({b"generation_tokens": b"7", b"made_up": b"9", b"prompt_tokens": b"many",
                                         b"last_error": b"not json"}))
    assert again.tok_s(now=101.0) == 0.0  # the restored tokens were not made in that second
    assert again.as_fields()["generation_tokens"] == 7 and "made_up" not in again.as_fields()
    assert again.as_fields()["prompt_tokens"] == 0 and again.last_error is None


def test_a_stats_record_reads_back_as_written():
    """The stats hash's one encoding: the worker writes it, `mlxq status` and the worker's
    next run under the name read it (HGETALL, or the HGETs the gateway's ACL allows)."""
    beat = Heartbeat(consumer="mac-0", state="stopped", totals={"generation_tokens": 5})
    record = StatsRecord({"generation_tokens": 5, "errors:internal": 1}, beat, "stopped",
                         {"code": "internal", "message": "m"})
    wire = {k.encode(): str(v).encode() for k, v in {**record.to_wire(), "last_seen": 12.5}.items()}
    assert StatsRecord.from_wire(wire) == StatsRecord({**{name: 0 for name in counter_names()},
                                                       "generation_tokens": 5, "errors:internal": 1},
                                                      beat, "stopped", {"code": "internal", "message": "m"}, 12.5)
    assert StatsRecord.from_wire({b"heartbeat": b"[]", b"state": None, b"last_seen": b"soon"}) == StatsRecord()


def test_a_name_is_free_when_its_holder_on_this_host_is_gone():
    """A heartbeat of this host whose process exited frees its name; a live process's, or
    another host's (unknowable from here), does not."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()

    def beat(pid: int, on: str = host) -> bytes:
        return json.dumps({"consumer": "c", "host": on, "pid": pid}).encode()

    assert _left_by_dead_process(beat(gone.pid), host)
    assert not _left_by_dead_process(beat(os.getppid()), host)
    assert not _left_by_dead_process(beat(gone.pid, "elsewhere"), host)
    assert not _left_by_dead_process(b"garbage", host)
