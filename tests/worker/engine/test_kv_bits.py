"""`kv_bits`: a text model's sequences keep their keys and values quantized, in mlx-vlm's
batch (mlx-lm's has no quantized cache), decoded in the shared batch exactly as mlx-vlm's
own batch decodes them, and resumed after a kill to the same text; refused at start
where it cannot be served. `quantized_kv_start`: dense until the batch is that long, then
quantized as a sequence decoded alone and switched at that length is, rows joining after
quantized as they join."""

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
    worker_fixture,
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


worker = worker_fixture("bench_model", kv_bits=BITS, kv_group_size=64, max_num_seqs=8)


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
    from worker.engine.backends import load_model
    from worker.settings import load_settings

    with pytest.raises(ValueError, match="kv_group_size 32 does not divide the model's head dimension 16"):
        load_model(load_settings(model=str(demo_model), kv_bits=4, kv_group_size=32))


def test_a_window_with_quantization_is_refused(demo_model):
    from worker.engine.backends import load_model
    from worker.settings import load_settings

    with pytest.raises(ValueError, match="max_kv_size is served through mlx-lm's batch only"):
        load_model(load_settings(model=str(demo_model), kv_bits=8, max_kv_size=64))


@pytest.mark.parametrize(("setting", "value"), [("kv_bits", 3), ("kv_bits", 16), ("kv_group_size", 48),
                                              ("quantized_kv_start", -1)])
def test_hostile_settings_are_refused(setting, value):
    from pydantic import ValidationError

    from worker.settings import load_settings

    with pytest.raises(ValidationError, match=setting):
        load_settings(**{setting: value})


def test_a_start_without_bits_is_refused():
    from pydantic import ValidationError

    from worker.settings import load_settings

    with pytest.raises(ValidationError, match="quantized_kv_start is where KV quantization starts: set kv_bits"):
        load_settings(quantized_kv_start=100)


START = 40  # past the first prompt (20 tokens), reached while it decodes
STARTED_BITS = 4  # parts from the unquantized output within a few tokens: a test can tell


@pytest.fixture(scope="module")
def alone():
    """The oracle: one sequence decoded greedily by mlx-vlm's language model with a cache
    per layer, whose quantizable layers switch (`KVCache.to_quantized`) before the first
    step that finds `start` positions in them: mlx-lm's single-sequence rule."""
    import functools

    import mlx.core as mx
    from mlx_vlm import load
    from mlx_vlm.models.cache import KVCache, make_prompt_cache, should_quantize_kv_layer

    @functools.cache
    def language_model(path):
        return load(str(path))[0].language_model

    def decode(model, prompt: list[int], tokens: int, start: int, group: int = 64) -> list[int]:
        language = language_model(model)
        caches = make_prompt_cache(language)
        out = []
        logits = language(mx.array([prompt]), cache=caches).logits[:, -1]
        while len(out) < tokens:
            out.append(int(mx.argmax(logits, axis=-1).item()))
            for index, layer in enumerate(caches):
                if type(layer) is KVCache and should_quantize_kv_layer(index, len(caches)) and layer.offset >= start:
                    caches[index] = layer.to_quantized(group_size=group, bits=STARTED_BITS)
            logits = language(mx.array([out[-1:]]), cache=caches).logits[:, -1]
        return out

    return decode


class GreedyBackend:
    """The worker's backend for `model` in process (`settings` as a worker's), greedy."""

    def __init__(self, model, **settings) -> None:
        from worker.engine.backends import load_model
        from worker.messages import SamplingParams
        from worker.settings import WorkerSettings

        self.backend = load_model(WorkerSettings(model=str(model), **settings)).make_backend()
        self.greedy = SamplingParams()
        self.made: dict[int, list] = {}  # each inserted sequence's TokenOuts

    def insert(self, prompt: list[int], tokens: int) -> int:
        from worker.engine.sampling import build_logits_processors, build_sampler

        uid = self.backend.insert(prompt, tokens, build_sampler(self.greedy), build_logits_processors(self.greedy))
        self.made[uid] = []
        return uid

    def step_until(self, done) -> None:
        from worker.engine.scheduler import StepPlan

        while not done():
            for out in self.backend.step(StepPlan(prefill_chunk=512, prefill_prompts=8)):
                self.made[out.uid].append(out)

    def tokens(self, uid: int) -> list[int]:
        return [out.token for out in self.made[uid]]

    def layer_types(self) -> set[str]:
        """The running batch's cache classes."""
        return {type(c).__name__ for c in self.backend._generator._generation_batch.prompt_cache}

    def close(self) -> None:
        self.backend.close()


def test_a_batch_shorter_than_the_start_decodes_unquantized(bench_model, reference):
    batch = GreedyBackend(bench_model, cache_memory_mb=0, kv_bits=STARTED_BITS, quantized_kv_start=200)
    uids = [batch.insert(prompt, NEW_TOKENS) for prompt in PROMPTS]
    batch.step_until(lambda: all(len(batch.made[uid]) == NEW_TOKENS for uid in uids))
    batch.close()
    assert [batch.tokens(uid) for uid in uids] == reference(None)


def test_a_sequence_is_quantized_from_the_start_on(redis_url, bench_model, logs_dir, r, outputs, new_id, alone):
    prompt, tokens = PROMPTS[0], 60
    expected, unquantized = alone(bench_model, prompt, tokens, START), alone(bench_model, prompt, tokens, 10**9)
    first_quantized = START - len(prompt)  # the first token drawn after a quantized step
    assert expected[:first_quantized] == unquantized[:first_quantized]
    assert expected != unquantized, "quantizing must change the output, or this test could not tell"
    worker = start_worker(worker_url(redis_url), bench_model, f"kvs{uuid.uuid4().hex[:6]}", logs_dir,
                          kv_bits=STARTED_BITS, quantized_kv_start=START)
    try:
        rid = new_id("kvs")
        xadd_json(r, worker.queue, rid, {"prompt_tokens": prompt, "max_tokens": tokens, "ignore_eos": True})
        assert tokens_of(outputs.of(rid)) == expected
    finally:
        worker.stop()


@pytest.mark.parametrize(("model_fixture", "group", "layer_types"), [
    ("bench_model", 64, {"JoiningQuantizedKVCache", "BatchKVCache"}),  # six layers: the last stays dense
    ("mistral3_model", 32, {"JoiningQuantizedKVCache"}),  # two; its lone row runs on KVCaches until another joins
])
def test_a_row_joining_a_quantized_batch_is_quantized_as_it_joins(request, alone, model_fixture, group, layer_types):
    """The batch is past the start when the second prompt joins: its rows are quantized from
    its prefill on (decoded alone: switched at its prompt's length); the first row goes on
    as if alone."""
    model = request.getfixturevalue(model_fixture)
    first, joining = [min(t, 150) for t in PROMPTS[0]], [min(t, 150) for t in PROMPTS[1]]  # in both vocabularies
    batch = GreedyBackend(model, cache_memory_mb=0, kv_bits=STARTED_BITS, kv_group_size=group,
                          quantized_kv_start=START)
    running = batch.insert(first, 60)
    batch.step_until(lambda: len(batch.made[running]) == 30)  # 20 + 30 positions: switched
    assert batch.layer_types() == layer_types
    joined = batch.insert(joining, 60)
    batch.step_until(lambda: len(batch.made[joined]) == 60)
    batch.close()
    assert [batch.tokens(running), batch.tokens(joined)] == [alone(model, first, 60, START, group),
                                                             alone(model, joining, 60, len(joining), group)]
    assert batch.tokens(joined) != alone(model, joining, 60, 10**9, group)


def test_a_prefix_cache_hit_joins_a_quantized_batch(bench_model, alone):
    """A prompt whose start the prefix cache holds (dense blocks) joins a batch already
    switched: its warm rows are quantized as they join, and it decodes as alone."""
    batch = GreedyBackend(bench_model, cache_memory_mb=64, kv_bits=STARTED_BITS, quantized_kv_start=START)
    shared = random.Random(1).choices(range(10, 1000), k=64)
    first = batch.insert([*shared, 5, 6, 7], 4)
    batch.step_until(lambda: len(batch.made[first]) == 4)
    running = batch.insert(PROMPTS[0], 80)
    batch.step_until(lambda: len(batch.made[running]) == 30)  # 20 + 30 positions: switched
    assert "JoiningQuantizedKVCache" in batch.layer_types()
    warm = batch.insert([*shared, 11, 12, 13], 20)
    batch.step_until(lambda: len(batch.made[warm]) == 20)
    batch.close()
    assert batch.made[warm][0].cached_tokens == 64
    assert batch.tokens(warm) == alone(bench_model, [*shared, 11, 12, 13], 20, 67)


@pytest.mark.parametrize(("model_fixture", "group", "start", "entries"), [
    ("bench_model", 64, 0, "uint32"), ("bench_model", 64, 1, "float32"),
    ("mistral3_model", 32, 0, "uint32"),  # a lone row on mlx-vlm's single-sequence quantized caches
])
def test_a_prefix_cache_hit_decodes_as_its_cold_run(request, model_fixture, group, start, entries):
    """From the first token the prefix cache keeps the batch's own codes (packed, one uint32
    array a block), which a hit puts back as they were; from a start it keeps the dense
    prefill's blocks, which the switch quantizes as the cold run's did. Either way a
    repeated prompt's hit, beside a cold neighbour, decodes exactly as its cold run (mlx-vlm
    keeps dequantized blocks and quantizes them again, which moves values by up to a step)."""
    batch = GreedyBackend(request.getfixturevalue(model_fixture), cache_memory_mb=64, kv_bits=STARTED_BITS,
                          kv_group_size=group, quantized_kv_start=start)
    prompt, other = ([min(t, 150) for t in tokens] for tokens in (random.Random(1).choices(range(10, 1000), k=99),
                                                                   PROMPTS[1]))  # in both vocabularies
    cold = batch.insert(prompt, NEW_TOKENS)
    batch.step_until(lambda: len(batch.made[cold]) == NEW_TOKENS)
    hit, neighbour = batch.insert(prompt, NEW_TOKENS), batch.insert(other, NEW_TOKENS)
    batch.step_until(lambda: len(batch.made[hit]) == len(batch.made[neighbour]) == NEW_TOKENS)
    blocks = [block for block in batch.backend._generator.apc_manager.pool if block.block_hash is not None]
    batch.close()
    assert [batch.made[uid][0].cached_tokens for uid in (cold, hit, neighbour)] == [0, 96, 0]
    assert batch.tokens(hit) == batch.tokens(cold)
    assert {str(block.keys[0].dtype) for block in blocks} == {f"mlx.core.{entries}"}  # a quantized layer's


@pytest.mark.parametrize(("start", "cached"), [(0, 96), (1, 0)])
def test_packed_entries_hold_more_prompts_in_the_same_budget(bench_model, start, cached):
    """1 MB holds five of the bench model's dense blocks (80 tokens: float32, 4 heads of 64,
    6 layers), seventeen packed at 4 bits (its last layer stays dense): two prompts of 99
    tokens both stay packed, while the second evicts the first's dense blocks."""
    batch = GreedyBackend(bench_model, cache_memory_mb=1, kv_bits=STARTED_BITS, quantized_kv_start=start)
    first, second = (random.Random(seed).choices(range(10, 1000), k=99) for seed in (1, 2))
    for prompt in (first, second, first):
        uid = batch.insert(prompt, 4)
        batch.step_until(lambda: len(batch.made[uid]) == 4)  # noqa: B023 (run before the loop moves on)
    held = sum(block.resident_bytes() for block in batch.backend._generator.apc_manager.pool)
    batch.close()
    assert batch.made[uid][0].cached_tokens == cached
    assert 0 < held <= 1 << 20


@pytest.mark.parametrize(("bits", "group", "dtype"), [(4, 64, "float32"), (8, 32, "bfloat16"), (8, 128, "float16")])
def test_packed_codes_unpack_to_what_was_packed(bits, group, dtype):
    import mlx.core as mx

    from worker.engine.backends.packed_prefix import pack, unpack

    keys = mx.random.normal((2, 4, 5, 128)).astype(getattr(mx, dtype))
    parts = mx.quantize(keys, group_size=group, bits=bits)
    packed = pack(parts)
    assert packed.dtype == mx.uint32 and packed.shape[:3] == (2, 4, 5)
    again = unpack(packed[:, :, 1:3], bits, group, getattr(mx, dtype))  # a slice of its tokens: of each part
    assert all(mx.array_equal(a, b[:, :, 1:3]).item() and a.dtype == b.dtype for a, b in zip(again, parts, strict=True))


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
        wait_for_deltas(r, KEYS.output(queue, rid), [rid], 10)
    victim.signal(signal.SIGSTOP)
    time.sleep(0.2)  # a write already sent lands
    written = {rid: r.xlen(KEYS.output(queue, rid)) for rid in ids}
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
    from media import png
    from mlx_vlm import load
    from mlx_vlm.generate.ar import BatchGenerator
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs
    from PIL import Image

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

