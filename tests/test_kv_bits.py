"""`kv_bits`: a text model's sequences keep their keys and values quantized, in mlx-vlm's
batch (mlx-lm's has no quantized cache), decoded in the shared batch exactly as mlx-vlm's
own batch decodes them, and resumed after a kill to the same text; refused at start
where it cannot be served."""

from __future__ import annotations

import random
import signal
import time
import uuid

import pytest
from support import (
    KEYS,
    build_demo_model,
    check_stream,
    start_worker,
    tokens_of,
    wait_for_deltas,
    worker_url,
    xadd_json,
)

from client import Done

BITS = 8
NEW_TOKENS = 40
# The bench size: its heads are 64 wide, which mx.quantize can group (the demo model's 16 cannot).
PROMPTS = [random.Random(n).choices(range(10, 1000), k=n) for n in (20, 31, 44)]


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    return build_demo_model(tmp_path_factory.mktemp("model") / "bench", "--size", "bench")


@pytest.fixture(scope="module")
def worker(redis_url, bench_model, logs_dir):
    process = start_worker(worker_url(redis_url), bench_model, f"kv{uuid.uuid4().hex[:8]}", logs_dir,
                           kv_bits=BITS, kv_group_size=64, max_num_seqs=8)
    yield process
    process.stop()
    assert process.process.returncode == 0, process.log()


@pytest.fixture(scope="module")
def reference(bench_model):
    """mlx-vlm's own batch, greedy, the prompts inserted together, quantized or not."""
    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.generate.ar import BatchGenerator

    model, processor = load(str(bench_model))
    processor.stopping_criteria.reset([])  # no eos: the requests say ignore_eos

    def generate(bits: int | None) -> list[list[int]]:
        quantized = {} if bits is None else {"kv_bits": bits, "kv_group_size": 64}
        batch = BatchGenerator(model.language_model, processor, compute_logprobs=False, **quantized)
        embeddings = [{k: v for k, v in model.get_input_embeddings(mx.array([p])).to_dict().items() if v is not None}
                      for p in PROMPTS]
        uids = batch.insert(PROMPTS, [NEW_TOKENS] * len(PROMPTS), prompt_kwargs=embeddings)
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        while any(len(made) < NEW_TOKENS for made in tokens.values()):
            for response in batch.next()[1]:
                tokens[response.uid].append(response.token)
        batch.close()
        return [tokens[uid] for uid in uids]

    return generate


def test_batched_sequences_decode_as_mlx_vlm_does_with_the_same_quantization(worker, r, outputs, new_id,
                                                                              reference):
    quantized = reference(BITS)
    assert reference(None) != quantized, "quantizing must change the output, or this test could not tell"
    ids = [new_id("kv") for _ in PROMPTS]
    for rid, prompt in zip(ids, PROMPTS, strict=True):
        xadd_json(r, worker.queue, rid, {"prompt_tokens": prompt, "max_tokens": NEW_TOKENS, "ignore_eos": True})
    assert [tokens_of(outputs.of(rid)) for rid in ids] == quantized


def test_a_group_that_does_not_divide_the_heads_is_refused(demo_model):
    from worker.backends import load_model
    from worker.settings import load_settings

    with pytest.raises(ValueError, match="kv_group_size 32 does not divide the model's head dimension 16"):
        load_model(load_settings(model=str(demo_model), kv_bits=4, kv_group_size=32))


def test_a_window_with_quantization_is_refused(demo_model):
    from worker.backends import load_model
    from worker.settings import load_settings

    with pytest.raises(ValueError, match="max_kv_size is served through mlx-lm's batch only"):
        load_model(load_settings(model=str(demo_model), kv_bits=8, max_kv_size=64))


@pytest.mark.parametrize(("setting", "value"), [("kv_bits", 3), ("kv_bits", 16), ("kv_group_size", 48)])
def test_hostile_settings_are_refused(setting, value):
    from pydantic import ValidationError

    from worker.settings import load_settings

    with pytest.raises(ValidationError, match=setting):
        load_settings(**{setting: value})


STORIES = [f"Story number {i}:" for i in range(3)]
LONG = 120


def submit(r, queue: str, tag: str) -> list[str]:
    ids = [f"{tag}{i}-{uuid.uuid4().hex[:8]}" for i in range(len(STORIES))]
    for rid, prompt in zip(ids, STORIES, strict=True):
        xadd_json(r, queue, rid, {"prompt": prompt, "max_tokens": LONG, "ignore_eos": True})
    return ids


def texts(outputs, ids: list[str]) -> list[str]:
    done = [check_stream(outputs.of(rid, timeout=120)) for rid in ids]
    assert all(isinstance(d, Done) and d.usage.completion_tokens == LONG for d in done), done
    return [d.text for d in done]


def test_kill_9_mid_generation_resumes_to_the_same_text(redis_url, bench_model, logs_dir, r, outputs):
    queue = f"kvrec{uuid.uuid4().hex[:8]}"
    url = worker_url(redis_url)
    victim = start_worker(url, bench_model, queue, logs_dir, consumer="kv-victim", kv_bits=BITS, kv_group_size=64)
    ids = submit(r, queue, "kv")
    for rid in ids:
        wait_for_deltas(r, KEYS.output(rid), [rid], 10)
    victim.signal(signal.SIGSTOP)
    time.sleep(0.2)  # a write already sent lands
    written = {rid: r.xlen(KEYS.output(rid)) for rid in ids}
    survivor = start_worker(url, bench_model, queue, logs_dir, consumer="kv-survivor", reclaim_interval_s=0.2,
                            kv_bits=BITS, kv_group_size=64)
    try:
        victim.process.kill()
        victim.wait()
        resumed = texts(outputs, ids)
        assert all(written[rid] < LONG for rid in ids), "the kill came after a request had finished"
        assert "took over the requests of a silent worker" in survivor.log()
        assert resumed == texts(outputs, submit(r, queue, "reference"))
    finally:
        survivor.stop()


IMAGE_MESSAGES = [{"role": "user", "content": [{"type": "image", "index": 0},
                                               {"type": "text", "text": "What is in it?"}]}]


@pytest.fixture(scope="module")
def mistral3_model(tmp_path_factory):
    """The demo family whose heads (32 wide) mx.quantize can group."""
    return build_demo_model(tmp_path_factory.mktemp("model") / "mistral3", "--vision", "--family", "mistral3")


def test_an_image_conversation_decodes_as_mlx_vlm_does_with_the_same_quantization(mistral3_model, redis_url, logs_dir,
                                                                                  r, outputs, new_id):
    import base64
    import io

    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.generate.ar import BatchGenerator
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs
    from PIL import Image
    from test_vision import png

    image = png(60, 44, 1)
    model, processor = load(str(mistral3_model))
    processor.tokenizer.stopping_criteria.reset([])
    plain = [{**m, "content": [{k: v for k, v in part.items() if k != "index"} for part in m["content"]]}
             for m in IMAGE_MESSAGES]
    prompt = apply_chat_template(processor, model.config, plain, num_images=1)

    def mlx_vlm_batch(bits: int | None) -> list[int]:
        """mlx-vlm's own batch on the processor's inputs, embedded by the model."""
        inputs = prepare_inputs(processor, images=[Image.open(io.BytesIO(image)).convert("RGB")], prompts=prompt)
        ids, pixels, mask = inputs.pop("input_ids"), inputs.pop("pixel_values"), inputs.pop("attention_mask")
        embedded = model.get_input_embeddings(ids, pixels, mask=mask, **inputs).to_dict()
        quantized = {} if bits is None else {"kv_bits": bits, "kv_group_size": 32}
        batch = BatchGenerator(model.language_model, processor, compute_logprobs=False, **quantized)
        batch.insert([ids[0].tolist()], [NEW_TOKENS],
                     prompt_kwargs=[{k: v for k, v in embedded.items() if isinstance(v, mx.array)}])
        tokens: list[int] = []
        while len(tokens) < NEW_TOKENS:
            tokens += [response.token for response in batch.next()[1]]
        return tokens

    expected = mlx_vlm_batch(BITS)
    assert mlx_vlm_batch(None) != expected, "quantizing must change the output, or this test could not tell"
    worker = start_worker(worker_url(redis_url), mistral3_model, f"kvv{uuid.uuid4().hex[:6]}", logs_dir,
                          kv_bits=BITS, kv_group_size=32)
    try:
        rid = new_id("kvv")
        xadd_json(r, worker.queue, rid, {"messages": IMAGE_MESSAGES, "images": [base64.b64encode(image).decode()],
                                         "max_tokens": NEW_TOKENS, "ignore_eos": True})
        assert tokens_of(outputs.of(rid)) == expected
    finally:
        worker.stop()

