"""`[[models]]`: what each model's worker process is given, and what a model is counted for."""

from __future__ import annotations

import json

import pytest

from worker.host.models_config import child_settings, footprint_bytes
from worker.settings import ModelEntry, ModelsConfigError, load_settings


def test_a_models_worker_takes_the_shared_settings_and_its_own(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    host = load_settings(prefix="acme", max_num_seqs=8, drain_timeout_s=5,
                         models=[{"name": "a", "path": str(tmp_path), "max_num_seqs": 2}])
    child = child_settings(host, host.models[0], "h.a")
    assert (child.model, child.queue, child.consumer, child.prefix) == (str(tmp_path), "a", "h.a", "acme")
    assert child.max_num_seqs == 2 and child.drain_timeout_s == 5 and not child.models


def test_a_model_is_counted_for_its_weights_and_cache_or_what_it_says(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "model.safetensors").write_bytes(b"\0" * 5000)  # a draft's, say: not this model's
    host = load_settings(cache_memory_mb=1, models=[{"name": "a", "path": str(tmp_path)},
                                                    {"name": "b", "path": str(tmp_path), "memory_gb": 2}])
    a, b = (child_settings(host, e, f"h.{e.name}") for e in host.models)
    assert footprint_bytes(host.models[0], a) == 1200 + 1024 * 1024
    assert footprint_bytes(host.models[1], b) == 2 * 1024 ** 3


@pytest.mark.parametrize(("table", "message"), [
    ({"queue": "x"}, "'queue' is the whole worker's"),
    ({"memory_budget_gb": 1}, "'memory_budget_gb' is the whole worker's"),
    ({"no_such_setting": 1}, "'no_such_setting' is not a worker setting"),
    ({"kv_bits": 3}, "models: a: kv_bits"),
])
def test_a_models_table_holds_only_its_own_valid_settings(tmp_path, table, message):
    host = load_settings(models=[{"name": "a", "path": str(tmp_path), **table}])
    with pytest.raises(ModelsConfigError, match=message):
        child_settings(host, host.models[0], "h.a")


def test_names_are_queue_names():
    with pytest.raises(ValueError, match="name"):
        ModelEntry(name="a b", path="x")


def test_the_gateway_routes_to_a_model_a_worker_can_load():
    from client.heartbeat import Heartbeat, ModelState
    from client.hosts import HostedModel
    from gateway.models import _served

    loadable = [HostedModel("vl", "org/VL", "available", 1, host="h"),
                HostedModel("broken", "org/B", "available", 1, failed="exited 3 times", host="h"),
                HostedModel("chat", "org/Chat", "loaded", 1, pin=True, host="h")]
    chat = ModelState("chat", "chat", "org/Chat", tool_call=("<a>", "</a>"))
    live = [Heartbeat("h.chat", started_at=100.0, models=(chat,))]
    served = {(s.model, s.queue): s for s in _served(live, loadable)}
    assert set(served) == {("org/VL", "vl"), ("org/Chat", "chat")}  # not the one that failed
    assert served[("org/Chat", "chat")].since == 100 and served[("org/Chat", "chat")].tool_call == ("<a>", "</a>")
    assert served[("org/VL", "vl")].since == 0


@pytest.mark.parametrize("value", ["a \"quoted\" é\\ path\n", 3, 2.5, float("inf"), True, ["x", "y"], []])
def test_a_models_worker_reads_back_every_value_its_file_holds(value):
    import math

    import tomllib

    from worker.host.supervisor import _toml

    read = tomllib.loads(f"v = {_toml(value)}")["v"]
    assert read == value or (isinstance(value, float) and math.isinf(value) and math.isinf(read))


def test_a_host_record_reads_back_as_written_and_junk_reads_as_none():
    """The host key's one encoding: what a host writes is what readers get; a key another
    writer left (not JSON, not an object, models of the wrong shape) reads as None or
    loses only what is wrong."""
    from client.hosts import HostedModel, HostRecord

    models = (HostedModel("chat", "org/Chat", "loaded", 3 << 30, pin=True, consumer="h.chat", host="h"),
              HostedModel("vl", "org/VL", "available", None, failed="exited 3 times", consumer="h.vl", host="h"))
    record = HostRecord("h", "mac-1", 42, 16 << 30, 13 << 30, 7, models)
    assert HostRecord.from_wire(record.to_wire()) == record
    written = json.loads(record.to_wire())["models"][0]  # docs/protocol.md's fields
    assert written == {"name": "chat", "queue": "chat", "path": "org/Chat", "state": "loaded", "memory_bytes": 3 << 30,
                       "pin": True, "failed": None, "consumer": "h.chat"}
    assert [m.offered for m in record.models] == [False, False]
    assert HostedModel("x", "p", "available").offered
    for junk in (None, b"", b"not json", b"[1, 2]", b'{"no": "name"}'):
        assert HostRecord.from_wire(junk) is None, junk
    odd = HostRecord.from_wire(b'{"name": "h", "free_bytes": "lots", "models": [1, {"path": "p"}, '
                               b'{"name": "m", "state": "exploded", "pin": "yes"}]}')
    assert odd == HostRecord("h", models=(HostedModel("m", "?", "available", host="h"),))
