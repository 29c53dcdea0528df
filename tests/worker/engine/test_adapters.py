"""LoRA adapters in the shared batch: rows of several adapters and of none run together,
each exactly as mlx-lm's own `load(base, adapter_path=...)` generates it alone."""

from __future__ import annotations

import io
import json
import random
import subprocess
from pathlib import Path

import pytest
from support import (
    HELD,
    KEYS,
    MLXQ,
    check_stream,
    free_port,
    mlxq,
    output_stream,
    scrape_metrics,
    start_worker,
    tokens_of,
    wait_for,
    wait_for_deltas,
    worker_url,
    xadd_json,
)

from client import Delta, Done, Error

RANKS = {"tone": 4, "format": 8, "lang": 16}  # three adapters of different ranks: padded to the largest in the batch
PROMPTS = [random.Random(n).choices(range(10, 1000), k=n) for n in (12, 19, 27, 33, 8, 41, 16, 24)]
ADAPTER_OF = ["tone", None, "format", "lang", "tone", None, "lang", "format"]  # rows of each, and of none
NEW_TOKENS = [24, 40, 32, 18, 40, 26, 30, 36]  # they leave the batch at different steps


def write_adapter(base: Path, out: Path, rank: int, seed: int) -> Path:
    from support import ROOT

    made = subprocess.run([*MLXQ, "demo-model", "--adapter", str(out), "--base", str(base), "--rank", str(rank),
                           "--seed", str(seed)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    return out


@pytest.fixture(scope="module")
def adapters(demo_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(demo_model, root / name, rank, seed)
            for seed, (name, rank) in enumerate(RANKS.items())}


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def worker(redis_url, demo_model, adapters, logs_dir, tmp_path_factory, metrics_port):
    missing = tmp_path_factory.mktemp("nothing") / "gone"
    flags = [f"{name}={path}" for name, path in adapters.items()] + [f"broken={missing}"]
    process = start_worker(worker_url(redis_url), demo_model, "adapters", logs_dir, adapter=flags, max_num_seqs=8,
                           metrics_port=metrics_port)
    yield process
    process.stop()
    assert process.process.returncode == 0, process.log()


def alone(model_path: Path, adapter: Path | None, prompt: list[int], new_tokens: int) -> list[int]:
    """mlx-lm's own greedy tokens for one prompt, the adapter loaded its way."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model = load(str(model_path), adapter_path=None if adapter is None else str(adapter))[0]
    batch = BatchGenerator(model, stop_tokens=[])
    batch.insert([prompt], max_tokens=[new_tokens])
    tokens: list[int] = []
    while len(tokens) < new_tokens:
        tokens.extend(response.token for response in batch.next_generated())
    batch.close()
    return tokens


def submit(r, rid: str, prompt: list[int], new_tokens: int, adapter: str | None) -> None:
    body = {"prompt_tokens": prompt, "max_tokens": new_tokens, "ignore_eos": True}
    xadd_json(r, "adapters", rid, body | ({"adapter": adapter} if adapter else {}))


def test_rows_of_three_adapters_and_of_none_decode_each_as_mlx_lm_alone(worker, r, outputs, new_id, demo_model,
                                                                        adapters, metrics_port):
    wanted = [alone(demo_model, adapters.get(name or ""), prompt, n)
              for name, prompt, n in zip(ADAPTER_OF, PROMPTS, NEW_TOKENS, strict=True)]
    base = [alone(demo_model, None, prompt, n) for prompt, n in zip(PROMPTS, NEW_TOKENS, strict=True)]
    for name, want, plain in zip(ADAPTER_OF, wanted, base, strict=True):
        assert (want != plain) == (name is not None), "each adapter must change its text, or the test is blind"
    ids = [new_id("lora") for _ in PROMPTS]
    first = ids[:4]
    for i in range(4):  # the first half starts, the second joins while it may still run
        submit(r, ids[i], PROMPTS[i], NEW_TOKENS[i], ADAPTER_OF[i])
    wait_for_deltas(r, wait_for(lambda: output_stream(r, first[0]), what="the first output"), first[:1])
    for i in range(4, len(ids)):
        submit(r, ids[i], PROMPTS[i], NEW_TOKENS[i], ADAPTER_OF[i])
    got = [tokens_of(outputs.of(rid)) for rid in ids]
    assert got == wanted
    per_adapter = {(("adapter", "tone"),): 2, (("adapter", "format"),): 2, (("adapter", "lang"),): 2}
    wait_for(lambda: scrape_metrics(metrics_port).get("mlxq_lora_requests_total") == per_adapter,
             what="each adapter's requests counted in the worker's metrics")


def test_a_prompt_cached_under_one_adapter_never_serves_another(worker, r, outputs, new_id, demo_model, adapters):
    prompt, n = random.Random(99).choices(range(10, 1000), k=40), 12  # a prompt no other test sends
    order = ["tone", None, "format", "tone"]  # the same prompt, four times: the last is tone's own hit
    dones = []
    for name in order:
        rid = new_id("salted")
        submit(r, rid, prompt, n, name)
        events = outputs.of(rid)
        assert tokens_of(events) == alone(demo_model, adapters.get(name or ""), prompt, n), name
        dones.append(check_stream(events))
    assert [d.usage.cached_tokens > 0 for d in dones] == [False, False, False, True]


def test_an_unknown_adapter_is_refused_naming_it_and_those_served(worker, r, outputs, new_id):
    rid = new_id("unknown")
    submit(r, rid, PROMPTS[0], 4, "nope")
    end = check_stream(outputs.of(rid))
    assert isinstance(end, Error) and end.code == "invalid_request"
    assert "unknown adapter 'nope'" in end.message and "format, lang, tone" in end.message


def test_an_adapter_refused_at_start_leaves_the_worker_serving(worker, r, outputs, new_id):
    assert "adapter refused" in worker.log() and "broken" in worker.log()
    rid = new_id("broken")
    submit(r, rid, PROMPTS[0], 4, "broken")
    end = check_stream(outputs.of(rid))
    assert isinstance(end, Error) and "adapter 'broken' is not served: it was refused at load" in end.message
    assert "no adapter_config.json" in end.message
    rid = new_id("after")
    submit(r, rid, PROMPTS[0], 4, "tone")
    assert isinstance(check_stream(outputs.of(rid)), Done)


@pytest.fixture(scope="module")
def quantized_model(demo_model, tmp_path_factory) -> Path:
    """The demo model quantized to 8 bits by mlx-lm's own `convert` (groups of 32: its
    key and value projections are 32 wide)."""
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("quantized") / "q8"
    convert(str(demo_model), str(out), quantize=True, q_group_size=32, q_bits=8)
    return out


@pytest.fixture(scope="module")
def quantized_worker(redis_url, quantized_model, adapters, logs_dir):
    process = start_worker(worker_url(redis_url), quantized_model, "adapters-q8", logs_dir,
                           adapter=[f"lang={adapters['lang']}"], max_num_seqs=4)
    yield process
    process.stop()
    assert process.process.returncode == 0, process.log()


def test_on_a_quantized_base_adapter_rows_decode_as_mlx_lm_alone(quantized_worker, r, outputs, new_id,
                                                                quantized_model, adapters):
    rows = [("lang", PROMPTS[0]), (None, PROMPTS[1]), ("lang", PROMPTS[2])]
    wanted = [alone(quantized_model, adapters.get(name or ""), prompt, 20) for name, prompt in rows]
    assert wanted[0] != alone(quantized_model, None, PROMPTS[0], 20)
    ids = [new_id("q8") for _ in rows]
    for rid, (name, prompt) in zip(ids, rows, strict=True):
        body = {"prompt_tokens": prompt, "max_tokens": 20, "ignore_eos": True}
        xadd_json(r, "adapters-q8", rid, body | ({"adapter": name} if name else {}))
    assert [tokens_of(outputs.of(rid)) for rid in ids] == wanted


def adapters_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return mlxq("adapters", *args, timeout=90)


def heartbeat_adapters(r, worker) -> dict[str, dict]:
    beat = json.loads(r.get(KEYS.worker(worker.consumer)))
    return {a["name"]: a for a in beat["adapters"]}


def test_adapters_load_and_unload_at_runtime_while_requests_run(worker, r, outputs, new_id, demo_model, adapters,
                                                               tmp_path, redis_url):
    url = ["--queue", "adapters", "--redis-url", redis_url]
    held = new_id("held")
    xadd_json(r, "adapters", held, HELD | {"adapter": "tone"})  # runs until cancelled
    stream = wait_for(lambda: output_stream(r, held), what="the held request's output")
    wait_for_deltas(r, stream, [held])

    extra = write_adapter(demo_model, tmp_path / "extra", rank=4, seed=7)
    loaded = adapters_cli("load", "extra", str(extra), *url)
    assert loaded.returncode == 0, loaded.stderr
    assert f"{worker.consumer}: loaded (rank 4)" in loaded.stdout
    assert heartbeat_adapters(r, worker)["extra"]["path"] == str(extra)
    rid = new_id("extra")
    submit(r, rid, PROMPTS[3], 16, "extra")
    assert tokens_of(outputs.of(rid)) == alone(demo_model, extra, PROMPTS[3], 16)

    refused = adapters_cli("load", "bad", str(tmp_path / "nothing"), *url)
    assert refused.returncode == 1 and "refused: adapter 'bad': no adapter_config.json" in refused.stdout

    unloaded = adapters_cli("unload", "tone", *url)
    assert unloaded.returncode == 0 and f"{worker.consumer}: unloaded" in unloaded.stdout
    assert "tone" not in heartbeat_adapters(r, worker)
    rid = new_id("gone")
    submit(r, rid, PROMPTS[0], 4, "tone")
    assert "unknown adapter 'tone'" in check_stream(outputs.of(rid)).message
    before = len(r.xrange(stream))
    wait_for(lambda: len(r.xrange(stream)) > before, what="the running tone request going on after its unload")

    r.set(KEYS.cancel_flag("adapters", held), 1, ex=60)  # as mlxq cancel does: the flag, then the word
    r.publish(KEYS.cancel_channel("adapters"), held)
    assert check_stream(outputs.of(held)).finish_reason == "cancelled"
    listing = adapters_cli("list", *url)
    assert "extra" in listing.stdout and "tone" not in listing.stdout and "refused" in listing.stdout
    r.hdel(KEYS.adapters("adapters"), "tone", "extra", "bad")  # back to the settings' own, for the tests after


def test_the_gateway_lists_adapters_as_models_and_the_openai_sdk_names_one(worker, redis_url, logs_dir, r, outputs,
                                                                          new_id):
    import openai
    from support import start_gateway

    gateway = start_gateway(redis_url, logs_dir)
    try:
        with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0, timeout=60) as sdk:
            listed = {m.id for m in sdk.models.list().data}
            assert {"tone", "format", "lang"} <= listed and "broken" not in listed
            ask = {"prompt": "Tell me about queues.", "max_tokens": 16, "temperature": 0,
                   "extra_body": {"ignore_eos": True}}
            through_gateway = {name: sdk.completions.create(model=name, **ask).choices[0].text
                               for name in ("tone", "adapters")}  # the adapter, and its queue's own model
            line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "tone", "prompt": ask["prompt"], "max_tokens": 16, "temperature": 0,
                             "ignore_eos": True}}
            file_id = sdk.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch").id
            batch = sdk.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
            done = wait_for(lambda: (b := sdk.batches.retrieve(batch.id)).status == "completed" and b, timeout=60,
                            what="the batch naming the adapter")
            output = json.loads(sdk.files.content(done.output_file_id).content)
    finally:
        gateway.stop()
    rid = new_id("direct")
    submit_body = {"prompt": ask["prompt"], "max_tokens": 16, "ignore_eos": True, "adapter": "tone"}
    xadd_json(r, "adapters", rid, submit_body)
    direct = "".join(e.text for e in outputs.of(rid) if isinstance(e, Delta))
    assert through_gateway["tone"] == direct == output["response"]["body"]["choices"][0]["text"]
    assert through_gateway["tone"] != through_gateway["adapters"]


def test_structured_output_and_logprobs_run_with_an_adapter(worker, r, outputs, new_id):
    rid = new_id("shaped")
    xadd_json(r, "adapters", rid, {"prompt": "Pick one.", "adapter": "lang", "max_tokens": 20, "logprobs": True,
                                   "top_logprobs": 2,
                                   "response_format": {"type": "choice", "choices": ["yes", "no", "maybe not"]}})
    events = outputs.of(rid)
    end = check_stream(events)
    assert isinstance(end, Done) and end.finish_reason == "stop"
    assert "".join(e.text for e in events if isinstance(e, Delta)) in ("yes", "no", "maybe not")
    assert all(e.logprobs and len(e.logprobs[0].top_logprobs) == 2 for e in events if isinstance(e, Delta) and e.tokens)


def test_adapters_beside_speculation_or_kv_bits_are_refused_at_start():
    from pydantic import ValidationError

    from worker.settings import load_settings

    with pytest.raises(ValidationError, match="adapters and speculative decoding: adapters are batched on mlx-lm"):
        load_settings(adapters=["a=/x"], prompt_lookup_max=2)
    with pytest.raises(ValidationError, match="adapters and kv_bits"):
        load_settings(adapters=["a=/x"], kv_bits=8)
    with pytest.raises(ValidationError, match="give an adapter as NAME=PATH"):
        load_settings(adapters=["just-a-path"])
    with pytest.raises(ValidationError, match="tone given twice"):
        load_settings(adapters=["tone=/x", "tone=/y"])
