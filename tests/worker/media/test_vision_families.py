"""Every demo vision family through a worker: text only, one image, two images in two
turns, all batched together, each equal to mlx-vlm's own greedy generation of the same
prompt run alone; a video, natively where the family's processor takes video and as
frames where not; and the vision-embedding cache where the family's features are cached."""

from __future__ import annotations

import base64
import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from media import png, wav
from media import video as mp4
from PIL import Image
from support import KEYS, WorkerProcess, build_demo_model, check_stream, start_worker, tokens_of, worker_url

from client import Done, Error
from mlxq.demo_vision import FAMILIES

MAX_TOKENS = 24
AUDIO_FAMILIES = ("gemma4",)


IMAGES = [png(60, 44, 1), png(90, 120, 2)]
VIDEO_FPS = 2.0

# (name, images sent, messages): the conversations every family is asked, in mlx-vlm's
# part format, which is ours without the indexes.
CONVERSATIONS = [
    ("text only", [], [{"role": "user", "content": "Say something about nothing"}]),
    ("one image", [0], [{"role": "user", "content": [{"type": "image", "index": 0},
                                                      {"type": "text", "text": "What is in it?"}]}]),
    ("two images in two turns", [0, 1], [
        {"role": "user", "content": [{"type": "text", "text": "Look at this"}, {"type": "image", "index": 0}]},
        {"role": "assistant", "content": "I see it."},
        {"role": "user", "content": [{"type": "image", "index": 1}, {"type": "text", "text": "And now this one?"}]}]),
]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    family = request.param
    path = build_demo_model(tmp_path_factory.mktemp("model") / family, "--vision", "--family", family)
    assert json.loads((path / "config.json").read_text())["model_type"] == family
    return family, path


@pytest.fixture(scope="module")
def family_worker(family_model: tuple[str, Path], redis_url: str, logs_dir: Path) -> Iterator[WorkerProcess]:
    family, path = family_model
    process = start_worker(worker_url(redis_url), path, f"{family}{uuid.uuid4().hex[:6]}", logs_dir, max_images=2,
                           max_num_seqs=8, prefill_batch_size=8)
    yield process
    process.stop()
    assert process.process.returncode == 0, f"worker exited {process.process.returncode}:\n{process.log()}"


@pytest.fixture(scope="module")
def mlx_vlm_alone(family_model: tuple[str, Path]) -> Any:
    """mlx-vlm's own greedy generation of one conversation, in this process."""
    from mlx_vlm import generate, load
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(str(family_model[1]))

    def run(images: list[int], messages: list[dict]) -> list[int]:
        plain = [{**m, "content": [{k: v for k, v in part.items() if k != "index"} for part in m["content"]]}
                 if isinstance(m["content"], list) else m for m in messages]
        prompt = apply_chat_template(processor, model.config, plain, num_images=len(images))
        pictures = [Image.open(io.BytesIO(IMAGES[i])).convert("RGB") for i in images]
        result = generate(model, processor, prompt, image=pictures or None, max_tokens=MAX_TOKENS, temperature=0.0,
                          verbose=False)
        return result.token_ids

    def run_video(path: Path, question: str) -> list[int]:
        """mlx-vlm's own answer: the video itself where its processor takes video, else
        the frames mlx-vlm's loader samples, as images."""
        from mlx_vlm.generate.video import processor_handles_video
        from mlx_vlm.utils import VideoSampling, load_video

        if processor_handles_video(processor):
            prompt = processor.tokenizer.apply_chat_template([{"role": "user", "content": [
                {"type": "video"}, {"type": "text", "text": question}]}], tokenize=False, add_generation_prompt=True)
            return generate(model, processor, prompt, video=[str(path)], fps=VIDEO_FPS, max_tokens=MAX_TOKENS,
                            temperature=0.0, verbose=False).token_ids
        frames, _ = load_video(str(path), VideoSampling(fps=VIDEO_FPS))
        stills = [Image.fromarray(np.transpose(frame, (1, 2, 0))) for frame in frames]
        prompt = apply_chat_template(processor, model.config, [{"role": "user", "content": [
            *({"type": "image"} for _ in stills), {"type": "text", "text": question}]}], num_images=len(stills))
        return generate(model, processor, prompt, image=stills, max_tokens=MAX_TOKENS, temperature=0.0,
                        verbose=False).token_ids

    def run_audio(path: Path, question: str) -> list[int]:
        """mlx-vlm's own answer to the clip, read by its own loader at the model's rate."""
        from mlx_vlm.utils import load_audio

        clip = load_audio(str(path), sr=processor.feature_extractor.sampling_rate)
        prompt = processor.tokenizer.apply_chat_template([{"role": "user", "content": [
            {"type": "audio"}, {"type": "text", "text": question}]}], tokenize=False, add_generation_prompt=True)
        return generate(model, processor, prompt, audio=[clip], max_tokens=MAX_TOKENS, temperature=0.0,
                        verbose=False).token_ids

    run.video = run_video  # type: ignore[attr-defined]
    run.audio = run_audio  # type: ignore[attr-defined]
    return run


def submit_together(r: Any, queue: str, stream: str, requests: list[tuple[str, list[int], list[dict]]]) -> None:
    """XADD them in one transaction: the worker's next read takes them all at once."""
    with r.pipeline(transaction=True) as pipe:
        for rid, images, messages in requests:
            body = {"messages": messages, "images": [base64.b64encode(IMAGES[i]).decode() for i in images],
                    "max_tokens": MAX_TOKENS, "reply_to": stream}
            if not images:
                del body["images"]
            pipe.xadd(KEYS.queue(queue), {"id": rid, "json": json.dumps(body)})
        pipe.execute()


def test_each_conversation_batched_equals_mlx_vlm_alone(family_worker, mlx_vlm_alone, r, outputs, new_id):
    stream = KEYS.reply(family_worker.queue, new_id())
    ids = [new_id(name.replace(" ", "-")) for name, _, _ in CONVERSATIONS]
    submit_together(r, family_worker.queue, stream, [(rid, images, messages)
                                                     for rid, (_, images, messages) in zip(ids, CONVERSATIONS,
                                                                                           strict=True)])
    events = {rid: outputs.events(stream, rid) for rid in ids}
    for rid, (name, images, messages) in zip(ids, CONVERSATIONS, strict=True):
        done = check_stream(events[rid])
        assert isinstance(done, Done), (name, done)
        assert tokens_of(events[rid]) == mlx_vlm_alone(images, messages), name
    texts = [check_stream(events[rid]).text for rid in ids]
    assert len(set(texts)) == len(texts), "each conversation reads differently"
    order = [(type(e).__name__, e.id) for e in outputs.all_on(stream)]
    first_done = min(order.index(("Done", rid)) for rid in ids)
    assert all(order.index(("Delta", rid)) < first_done for rid in ids), "all three ran in one batch"


def test_the_same_images_again_read_the_same(family_worker, family_model, r, outputs, new_id):
    """A repeated conversation with images gives the same text; in a family whose
    features are cached, from the cache."""
    from worker.engine.backends.vision_features import ENCODERS

    _, images, messages = CONVERSATIONS[2]
    before = json.loads(r.get(KEYS.worker(family_worker.consumer)))["vision_cache"]
    texts = []
    for _ in range(2):
        stream = KEYS.reply(family_worker.queue, new_id())
        rid = new_id()
        submit_together(r, family_worker.queue, stream, [(rid, images, messages)])
        texts.append(check_stream(outputs.events(stream, rid)).text)
    assert texts[0] == texts[1]
    if family_model[0] not in ENCODERS:
        return  # its features are not cached
    wait_for_stats(r, family_worker, lambda s: s["hits"] >= before["hits"] + 1)


def wait_for_stats(r: Any, worker: WorkerProcess, settled: Any, timeout: float = 15.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not settled(stats := json.loads(r.get(KEYS.worker(worker.consumer)))["vision_cache"]):
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def in_json_and_msgpack(r: Any, queue: str, new_id: Any, body: dict, field: str, data: bytes) -> tuple[str, str]:
    """`body` with `data` in `field` submitted twice, as a producer in any language would:
    base64 in JSON, raw bytes in msgpack."""
    in_json, in_msgpack = new_id("json"), new_id("msgpack")
    r.xadd(KEYS.queue(queue), {"id": in_json, "json": json.dumps({**body, field: [base64.b64encode(data).decode()]})})
    r.xadd(KEYS.queue(queue), {"id": in_msgpack, "msgpack": msgpack.packb({**body, field: [data]})})
    return in_json, in_msgpack


def each_reads(outputs: Any, ids: tuple[str, ...], expected: list[int], more_prompt_than: int) -> None:
    """Each request's tokens are `expected`, its prompt longer than the text alone."""
    for rid in ids:
        events = outputs.of(rid)
        done = check_stream(events)
        assert isinstance(done, Done), done
        assert tokens_of(events) == expected
        assert done.usage.prompt_tokens > more_prompt_than, "the media's tokens are in the prompt"


def test_a_video_from_json_and_msgpack_equals_mlx_vlm_alone(family_worker, family_model, mlx_vlm_alone, r, outputs,
                                                             new_id, tmp_path):
    """A video part in JSON (base64) and in msgpack (raw bytes) reads as mlx-vlm reads
    the same video: natively, or as its frames (Gemma 3, Idefics3)."""
    video = mp4(tmp_path / "clip.mp4", frames=16, fps=8.0)
    messages = [{"role": "user", "content": [{"type": "video", "index": 0}, {"type": "text", "text": "What moves?"}]}]
    ids = in_json_and_msgpack(r, family_worker.queue, new_id, {"messages": messages, "max_tokens": MAX_TOKENS,
                                                                 "video_fps": VIDEO_FPS}, "videos", video)
    each_reads(outputs, ids, mlx_vlm_alone.video(tmp_path / "clip.mp4", "What moves?"), more_prompt_than=20)


def test_audio_from_json_and_msgpack_equals_mlx_vlm_alone(family_worker, family_model, mlx_vlm_alone, r, outputs,
                                                          new_id, tmp_path):
    """An audio part reads as mlx-vlm reads the clip, on a family that takes audio; on
    the others it is an invalid_request that says so."""
    clip = wav()
    (tmp_path / "clip.wav").write_bytes(clip)  # what mlx-vlm alone reads
    messages = [{"role": "user", "content": [{"type": "audio", "index": 0}, {"type": "text", "text": "What is it?"}]}]
    ids = in_json_and_msgpack(r, family_worker.queue, new_id, {"messages": messages, "max_tokens": MAX_TOKENS},
                              "audio", clip)
    if family_model[0] not in AUDIO_FAMILIES:
        for rid in ids:
            error = check_stream(outputs.of(rid))
            assert isinstance(error, Error) and error.code == "invalid_request" and "takes no audio" in error.message
        return
    # the clip's 25 tokens (40 ms each) are in the prompt
    each_reads(outputs, ids, mlx_vlm_alone.audio(tmp_path / "clip.wav", "What is it?"), more_prompt_than=25)


def test_a_repeated_video_is_a_vision_cache_hit(family_worker, family_model, r, outputs, new_id, tmp_path):
    from worker.engine.backends.vision_features import CACHES_VIDEOS

    if family_model[0] not in CACHES_VIDEOS:
        pytest.skip(f"{family_model[0]}: its video features are not cached")
    video = base64.b64encode(mp4(tmp_path / "again.mp4", frames=16, fps=8.0, seed=7)).decode()
    before = json.loads(r.get(KEYS.worker(family_worker.consumer)))["vision_cache"]
    texts = []
    for _ in range(2):
        rid = new_id()
        xadd = {"prompt": "Again", "videos": [video], "max_tokens": MAX_TOKENS}
        r.xadd(KEYS.queue(family_worker.queue), {"id": rid, "json": json.dumps(xadd)})
        texts.append(check_stream(outputs.of(rid)).text)
    assert texts[0] == texts[1]
    wait_for_stats(r, family_worker, lambda s: s["hits"] >= before["hits"] + 1 and
                   s["misses"] >= before["misses"] + 1)


def test_prefilled_in_one_batch_each_reads_as_alone(family_model):
    """In process, the three conversations inserted at once (one prompt batch where the
    family allows it) and one at a time give the same tokens: what another row holds
    never changes an answer (mlx-vlm misplaces Qwen 3's deepstack features beside other
    rows, so that family prefills media prompts alone)."""
    from client.protocol import RequestBody
    from worker.engine.backends.mlx_vlm import load_vision_model
    from worker.engine.sampling import build_logits_processors, build_sampler
    from worker.engine.scheduler import StepPlan
    from worker.messages import SamplingParams
    from worker.settings import WorkerSettings

    loaded = load_vision_model(WorkerSettings(model=str(family_model[1])))
    prompts = []
    for _, images, messages in CONVERSATIONS:
        if images:
            body = RequestBody(messages=messages, images=[base64.b64encode(IMAGES[i]).decode() for i in images])
            prompts.append(loaded.info.vision.prepare(body))
        else:
            prompts.append((list(loaded.info.tokenizer.apply_chat_template(messages, add_generation_prompt=True)),
                            None))

    def run(which: list[int]) -> list[list[int]]:
        backend, greedy = loaded.make_backend(), SamplingParams()
        uids = [backend.insert(prompts[k][0], MAX_TOKENS, build_sampler(greedy), build_logits_processors(greedy),
                               media=prompts[k][1]) for k in which]
        out: dict[int, list[int]] = {uid: [] for uid in uids}
        while any(len(tokens) < MAX_TOKENS for tokens in out.values()):
            for token in backend.step(StepPlan(prefill_chunk=512, prefill_prompts=8)):
                out[token.uid].append(token.token)
        backend.close()
        return [out[uid] for uid in uids]

    assert run([0, 1, 2]) == [run([k])[0] for k in range(3)]


def test_a_model_mlx_vlm_cannot_batch_is_refused_at_start_with_the_reason(tmp_path):
    """A vision model whose mlx-vlm class has no language model over input embeddings
    (which mlx-vlm's batch runs on) never starts serving: the worker says why."""
    from types import SimpleNamespace

    from worker.engine.backends.mlx_vlm import unbatchable

    assert "no language model taking input embeddings" in unbatchable(SimpleNamespace(config=SimpleNamespace(
        model_type="an_encoder")))


def test_every_demo_family_is_batchable(family_model):
    from mlx_vlm import load

    from worker.engine.backends.mlx_vlm import unbatchable

    assert unbatchable(load(str(family_model[1]))[0]) is None
