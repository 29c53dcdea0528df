"""Property-based fuzzing of request entries against a real worker process.

Random fields, types, sizes, encodings, broken UTF-8 and huge numbers, interleaved with
valid requests: the worker stays up, every entry with a readable id gets exactly one
terminal event (the autouse `never_told_twice` fixture checks "exactly"), entries
without one go to the dead-letter stream, and every valid request completes.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from support import Outputs, check_stream, worker_fixture

from client import Done

worker = worker_fixture(max_tokens_limit=64, max_body_bytes=4096, max_metadata_bytes=256)
FIELDS = ["prompt", "messages", "prompt_tokens", "max_tokens", "temperature", "top_p", "top_k", "min_p",
          "repetition_penalty", "seed", "stop", "stream_interval", "priority", "deadline_ms", "encoding",
          "images", "metadata"]  # not reply_to: the output must stay on the stream this test reads
CASES = {"entries": 0}


@dataclass(frozen=True)
class Entry:
    fields: dict[str, Any]
    request_id: str | None  # None: no readable id, so it is dead-lettered
    valid: bool


scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**63, max_value=2**200)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30) | st.binary(max_size=30))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
invalid_ids = (st.just("") | st.just("x" * 129) | st.binary(max_size=20).map(lambda b: b"\xff" + b)
               | st.text(max_size=20).map(lambda t: t + " /"))
random_bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), values, max_size=6)
valid_bodies = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=40).filter(str.strip), "max_tokens": st.integers(1, 3)},
    optional={"temperature": st.floats(0, 2), "top_k": st.integers(0, 50), "seed": st.integers(0, 2**32),
              "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3), "priority": st.integers(-5, 5),
              "metadata": st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=10),
                                          max_size=3)})


def _encode(body: Any, encoding: str) -> bytes:
    if encoding == "json":
        return json.dumps(body, default=repr).encode()
    try:
        return msgpack.packb(body, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):  # ints beyond 64 bits have no msgpack form
        return b"\xc1"


@st.composite
def entries(draw: st.DrawFn) -> Entry:
    request_id = f"fz-{uuid.uuid4().hex}"
    valid = draw(st.booleans())
    body = draw(valid_bodies if valid else random_bodies | values)
    encoding = draw(st.sampled_from(["json", "msgpack"]))
    raw: bytes = draw(st.binary(max_size=40)) if not valid and draw(st.integers(0, 9)) == 0 else _encode(body, encoding)
    fields: dict[str, Any] = {encoding: raw}
    readable = True
    shape = 0 if valid else draw(st.integers(0, 12))
    if shape == 1:
        fields["id"] = draw(invalid_ids)
        readable = False
    elif shape == 2:
        readable = False  # no id at all
    else:
        fields["id"] = request_id
    if shape == 3:
        fields[draw(st.sampled_from(["json", "msgpack", "extra", "ID"]))] = draw(st.binary(max_size=10))
    return Entry(fields, request_id if readable else None, valid)


@settings(max_examples=200, deadline=None, phases=[Phase.explicit, Phase.generate],  # no shrinking: a live worker
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batch=st.lists(entries(), min_size=1, max_size=12))
def test_any_entry_gets_one_answer_and_the_worker_stays_up(worker, r, batch):
    dead_before = r.xlen(f"mlxq:q:{worker.queue}:dead")
    for entry in batch:
        r.xadd(f"mlxq:q:{worker.queue}", entry.fields)
    outputs = Outputs(r)
    for entry in batch:
        if entry.request_id is None:
            continue
        terminal = check_stream(outputs.of(entry.request_id, timeout=20))
        if entry.valid:
            assert isinstance(terminal, Done), (entry, terminal)
    unreadable = sum(entry.request_id is None for entry in batch)
    deadline = time.monotonic() + 30
    while r.xlen(f"mlxq:q:{worker.queue}:dead") - dead_before < unreadable:
        assert time.monotonic() < deadline, "an entry without a readable id was not dead-lettered"
        time.sleep(0.01)
    assert r.xlen(f"mlxq:q:{worker.queue}:dead") - dead_before == unreadable
    assert worker.process.poll() is None
    CASES["entries"] += len(batch)


@pytest.fixture(scope="module", autouse=True)
def report_cases() -> Any:
    yield
    print(f"\nfuzzed {CASES['entries']} request entries")
