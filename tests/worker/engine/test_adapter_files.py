"""What an adapter must be to be served, checked when it loads: each refusal says why,
and the adapters already served keep serving. And what a slot is: a batch mixes at most
`max_loras` adapters, an adapter's slot is freed when its last sequence ends."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load

from mlxq.demo_adapter import write_adapter
from worker.engine.adapters import AdapterBank, AdapterRefused, UnknownAdapter

IN = 64  # the demo model's width


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from mlxq import demo_model

    return demo_model.build(tmp_path_factory.mktemp("base") / "demo")


@pytest.fixture
def bank(base) -> AdapterBank:
    return AdapterBank(load(str(base))[0], max_loras=2, max_rank=16, max_loaded=2)


def adapter(base: Path, where: Path, rank: int = 4, seed: int = 0, **config: object) -> Path:
    write_adapter(where, base, seed=seed, rank=rank)
    if config:
        file = where / "adapter_config.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), **config}))
    return where


def test_a_good_adapter_loads_and_is_listed(bank, base, tmp_path):
    bank.load("good", str(adapter(base, tmp_path / "good")))
    assert bank.listing() == [{"name": "good", "path": str(tmp_path / "good"), "loaded": True, "rank": 4,
                               "running": 0, "requests": 0}]


@pytest.mark.parametrize(("config", "reason"), [
    ({"fine_tune_type": "dora"}, "DoRA rescales each weight per adapter"),
    ({"fine_tune_type": "full"}, "a full fine-tune is a model of its own"),
    ({"lora_parameters": {"rank": 4}}, "lora_parameters.scale must be a number"),
    ({"lora_parameters": {"rank": 0, "scale": 1.0}}, "rank must be a positive integer"),
])
def test_what_is_not_a_batchable_lora_is_refused(bank, base, tmp_path, config, reason):
    with pytest.raises(AdapterRefused, match=reason):
        bank.load("odd", str(adapter(base, tmp_path / "odd", **config)))
    assert bank.names == []


def test_a_rank_above_max_lora_rank_is_refused(bank, base, tmp_path):
    with pytest.raises(AdapterRefused, match="its rank 32 is above this worker's max_lora_rank 16"):
        bank.load("wide", str(adapter(base, tmp_path / "wide", rank=32)))


def test_an_adapter_for_another_base_is_refused_by_its_shapes(bank, base, tmp_path):
    where = adapter(base, tmp_path / "other")
    weights = dict(mx.load(str(where / "adapters.safetensors")))
    name = next(k for k in weights if k.endswith("q_proj.lora_a"))
    weights[name] = mx.zeros((IN * 2, 4))  # a wider model's layer
    mx.save_safetensors(str(where / "adapters.safetensors"), weights)
    with pytest.raises(AdapterRefused, match=r"is 64 -> 64 in this model, but its lora_a is \(128, 4\)"):
        bank.load("other", str(where))


def test_weights_that_are_not_lora_or_not_on_a_linear_layer_are_refused(bank, base, tmp_path):
    where = adapter(base, tmp_path / "extra")
    weights = dict(mx.load(str(where / "adapters.safetensors")))
    mx.save_safetensors(str(where / "adapters.safetensors"),
                        weights | {"model.embed_tokens.lora_a": mx.zeros((IN, 4)),
                                   "model.embed_tokens.lora_b": mx.zeros((4, IN))})
    with pytest.raises(AdapterRefused, match="model.embed_tokens, which is not a linear layer"):
        bank.load("embed", str(where))
    magnitude = {"model.layers.0.self_attn.q_proj.m": mx.zeros((IN,))}  # DoRA's, under a LoRA config
    mx.save_safetensors(str(where / "adapters.safetensors"), weights | magnitude)
    with pytest.raises(AdapterRefused, match="q_proj.m is not a LoRA weight"):
        bank.load("magnitude", str(where))


def test_missing_files_are_refused(bank, tmp_path):
    with pytest.raises(AdapterRefused, match="no adapter_config.json"):
        bank.load("gone", str(tmp_path / "gone"))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterRefused, match="no lora_parameters|no adapters.safetensors"):
        bank.load("half", str(tmp_path / "half"))


def test_slots_are_held_by_running_sequences_and_freed_after(bank, base, tmp_path):
    for i, name in enumerate(("a", "b", "c")):
        bank.load(name, str(adapter(base, tmp_path / name, seed=i)))
    a, b = bank.acquire("a"), bank.acquire("b")
    assert {a, b} == {1, 2}
    assert bank.acquire("a") == a  # the same adapter shares its slot
    assert bank.acquire("c") is None  # max_loras 2: c waits for a slot
    bank.release(b)
    assert bank.acquire("c") == b  # b's sequences ended: its slot is c's now
    with pytest.raises(UnknownAdapter, match=r"unknown adapter 'd' \(this worker's adapters: a, b, c\)"):
        bank.acquire("d")


def test_an_adapter_dropped_from_memory_is_read_again(bank, base, tmp_path):
    for i, name in enumerate(("a", "b", "c")):  # max_loaded 2: a is dropped when c loads
        bank.load(name, str(adapter(base, tmp_path / name, seed=i)))
    assert [entry["loaded"] for entry in bank.listing()] == [False, True, True]
    assert bank.acquire("a") == 1
    assert [entry["loaded"] for entry in bank.listing()] == [True, False, True]


def test_an_unloaded_adapter_takes_no_new_requests_and_a_reload_is_a_new_identity(bank, base, tmp_path):
    bank.load("a", str(adapter(base, tmp_path / "a")))
    first = bank.identity("a")
    bank.unload("a")
    with pytest.raises(UnknownAdapter):
        bank.acquire("a")
    bank.load("a", str(tmp_path / "a"))
    assert bank.identity("a") != first  # the prefix cache never serves the old load's prefixes to the new
