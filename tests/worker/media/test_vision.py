"""Images: a worker serving the tiny Qwen2-VL through mlx-vlm, end to end, plus its batch backend in process."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgpack
import pytest
import redis
from media import b64, png
from PIL import Image
from support import KEYS, ROOT, WorkerProcess, check_stream, wait_for_deltas, worker_fixture, xadd_json

from client import Client, Delta, Done, Error, decode_event
from worker.engine.scheduler import StepPlan

worker = worker_fixture("vision_model", redis="valkey", max_images=2, max_image_pixels=200_000)


def ask(r: redis.Redis, queue: str, request_id: str, prompt: str, images: list[bytes], **extra: object) -> None:
    xadd_json(r, queue, request_id, {"prompt": prompt, "images": [b64(i) for i in images], **extra})


def stats(r: redis.Redis, worker: WorkerProcess) -> dict:
    return json.loads(r.get(KEYS.worker(worker.consumer)))


def settled_stats(r: redis.Redis, worker: WorkerProcess) -> dict:
    """The heartbeat's stats once they stop changing (it is written every 0.5 s)."""
    last = stats(r, worker)
    while True:
        time.sleep(1.1)
        now = stats(r, worker)
        if now["vision_cache"] == last["vision_cache"] and now["running"] == 0:
            return now
        last = now


# The demo processor keeps images between 56x56 and 224x224 pixels, in multiples of 28
# (patch 14, merge 2): a 168x112 image stays as it is, (168 / 14) x (112 / 14) = 96
# patches, merged 2x2 into 24 image tokens.
IMAGE_168x112_TOKENS = 24


def test_image_request_in_json_and_in_msgpack(worker, r, outputs, new_id):
    """Base64 in JSON and raw bytes in msgpack give the same greedy text; the deltas join to
    it; the prompt's usage counts the image's tokens (and its two vision markers)."""
    image = png(168, 112)
    text_only, in_json, in_msgpack = new_id(), new_id(), new_id()
    # With images a plain prompt is sent as one user message: compare with that message alone.
    xadd_json(r, worker.queue, text_only, {"messages": [{"role": "user", "content": "What is in the picture?"}],
                                           "max_tokens": 24})
    ask(r, worker.queue, in_json, "What is in the picture?", [image], max_tokens=24)
    body = msgpack.packb({"prompt": "What is in the picture?", "images": [image], "max_tokens": 24})
    r.xadd(KEYS.queue(worker.queue), {"id": in_msgpack, "msgpack": body})
    plain = check_stream(outputs.of(text_only))
    from_json = check_stream(outputs.of(in_json))
    from_msgpack = check_stream(outputs.of(in_msgpack))
    assert all(b"msgpack" in fields for _, fields in r.xrange(KEYS.output(worker.queue, in_msgpack)))
    assert isinstance(from_json, Done) and isinstance(from_msgpack, Done)
    assert from_json.text == from_msgpack.text and from_json.usage == from_msgpack.usage
    assert from_json.text != plain.text, "the image changed what the model saw"
    assert from_json.usage.prompt_tokens == plain.usage.prompt_tokens + IMAGE_168x112_TOKENS + 2
    assert from_json.usage.completion_tokens == 24


def alone(r, outputs, queue: str, new_id, prompt: str, images: list[bytes], max_tokens: int) -> str:
    rid = new_id("alone")
    ask(r, queue, rid, prompt, images, max_tokens=max_tokens)
    return check_stream(outputs.of(rid)).text


def test_image_and_text_requests_batch_together_and_match_running_alone(worker, r, outputs, new_id):
    """Three images of different sizes and one text-only request: two join while two decode;
    every greedy output equals the same request run alone."""
    requests = [("Describe it", [png(168, 112, 1)], 150), ("Read the sign", [png(56, 56, 2)], 150),
                ("Caption this", [png(224, 196, 3)], 20), ("Just text, no picture", [], 20)]
    expected = [alone(r, outputs, worker.queue, new_id, p, i, n) for p, i, n in requests]
    shared = KEYS.reply(worker.queue, new_id())
    ids = [new_id(f"r{k}") for k in range(4)]
    submissions = list(zip(ids, requests, strict=True))
    for rid, (prompt, images, n) in submissions[:2]:
        ask(r, worker.queue, rid, prompt, images, max_tokens=n, reply_to=shared)
    wait_for_deltas(r, shared, ids[:2])
    for rid, (prompt, images, n) in submissions[2:]:
        ask(r, worker.queue, rid, prompt, images, max_tokens=n, reply_to=shared)
    texts = [check_stream(outputs.events(shared, rid)).text for rid in ids]
    assert texts == expected
    order = [(type(e).__name__, e.id) for e in outputs.all_on(shared)]
    first_done = min(order.index(("Done", rid)) for rid in ids[:2])
    assert all(order.index(("Delta", rid)) < first_done for rid in ids[2:]), "the late two joined mid-decode"


def test_sampling_is_per_request_on_the_vision_path(worker, r, outputs, new_id):
    """A greedy image request reads the same beside a temperature-1.5 one; a seed repeats
    its draws whatever runs beside it."""
    image = png(112, 112, 4)
    greedy_alone = alone(r, outputs, worker.queue, new_id, "Look", [image], 30)
    hot = {"max_tokens": 30, "temperature": 1.5, "seed": 11}
    greedy, hot_first, hot_second, other = new_id("greedy"), new_id("hot"), new_id("hot"), new_id("other")
    ask(r, worker.queue, hot_first, "Look", [image], **hot)
    ask(r, worker.queue, greedy, "Look", [image], max_tokens=30)
    first = check_stream(outputs.of(hot_first)).text
    assert check_stream(outputs.of(greedy)).text == greedy_alone
    assert first != greedy_alone, "the hot request really sampled"
    ask(r, worker.queue, other, "Look", [image], **{**hot, "seed": 12})
    ask(r, worker.queue, hot_second, "Look", [image], **hot)
    assert check_stream(outputs.of(hot_second)).text == first
    assert check_stream(outputs.of(other)).text != first


def test_eos_min_tokens_and_ignore_eos_on_image_requests(worker, r, outputs, new_id, vision_model):
    """The engine, not mlx-vlm's batch, ends a sequence at eos, so that image requests get
    min_tokens and ignore_eos as text requests do: with eos pushed to the top, a request
    ends at once, runs to max_tokens with ignore_eos, and holds eos back for min_tokens."""
    eos = json.loads((vision_model / "config.json").read_text())["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    image, forced = png(112, 112, 4), {"logit_bias": {str(eos): 100}, "max_tokens": 6}
    cases = {"plain": {}, "ignore_eos": {"ignore_eos": True}, "min_tokens": {"min_tokens": 4}}
    ids = {name: new_id(name) for name in cases}
    for name, extra in cases.items():
        ask(r, worker.queue, ids[name], "Look", [image], **forced, **extra)
    ended = {name: check_stream(outputs.of(rid)) for name, rid in ids.items()}
    assert ended["plain"].usage.completion_tokens == 0 and ended["plain"].finish_reason == "stop"
    assert ended["ignore_eos"].usage.completion_tokens == 6 and ended["ignore_eos"].finish_reason == "length"
    assert ended["min_tokens"].usage.completion_tokens == 4 and ended["min_tokens"].finish_reason == "stop"


def test_logprobs_on_an_image_request(worker, r, outputs, new_id):
    """Each token of a greedy image request comes with its logprob and sorted top
    alternatives, the chosen token first; a request beside it that did not ask gets none."""
    asked, plain = new_id("logprobs"), new_id("plain")
    ask(r, worker.queue, asked, "Look", [png(112, 112, 4)], max_tokens=8, logprobs=True, top_logprobs=3)
    ask(r, worker.queue, plain, "Look", [png(112, 112, 4)], max_tokens=8)
    deltas = [e for e in outputs.of(asked) if isinstance(e, Delta)]
    entries = [entry for d in deltas for entry in d.logprobs]
    assert [e.token_id for e in entries] == [t for d in deltas for t in d.tokens] and len(entries) == 8
    for entry in entries:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token_id == entry.token_id and entry.logprob == values[0] <= 0
    assert all(d.logprobs is None for d in outputs.of(plain) if isinstance(d, Delta))


def test_tools_with_an_image_in_the_conversation(worker, r, outputs, new_id, vision_model):
    """An image request with tools: the tools reach the chat template beside the image
    (its prompt is longer than without them by their rendering), and a named function is
    called with arguments that fit it."""
    add = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a", "b"], "additionalProperties": False}}}
    messages = [{"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "Add these"}]}]
    image = b64(png(112, 112, 4))
    plain, called = new_id("plain"), new_id("called")
    xadd_json(r, worker.queue, plain, {"messages": messages, "images": [image], "max_tokens": 2})
    xadd_json(r, worker.queue, called, {"messages": messages, "images": [image], "max_tokens": 80, "tools": [add],
                                        "tool_choice": {"type": "function", "function": {"name": "add"}}})
    without, done = check_stream(outputs.of(plain)), check_stream(outputs.of(called))
    assert done.usage.prompt_tokens > without.usage.prompt_tokens + 20, "the tools were rendered into the prompt"
    (call,) = done.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "add" and set(arguments) == {"a", "b"}
    assert all(0 <= v <= 9 for v in arguments.values())


def test_constrained_image_requests_give_valid_output(worker, r, outputs, new_id):
    """response_format on the vision path: a schema, a regex and a choice, greedy and
    sampled, with images and beside a free image request, each valid and ended by itself."""
    import re

    import jsonschema

    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["color", "count"], "additionalProperties": False}
    formats = [{"type": "json_schema", "json_schema": {"name": "seen", "schema": schema}},
               {"type": "regex", "pattern": "[a-z]{2,6}-[0-9]{2}"},
               {"type": "choice", "choices": ["cat", "dog", "neither"]}]
    image = png(112, 112, 5)
    ids = {}
    for i, response_format in enumerate(formats):
        for sampling in ({}, {"temperature": 1.0, "seed": 3}):
            ids[new_id(f"vc{i}")] = response_format
            ask(r, worker.queue, list(ids)[-1], "What is it?", [image], max_tokens=60,
                response_format=response_format, **sampling)
    free = new_id("free")
    ask(r, worker.queue, free, "Look", [image], max_tokens=20)
    for request_id, response_format in ids.items():
        done = check_stream(outputs.of(request_id))
        assert isinstance(done, Done) and done.finish_reason == "stop", done
        if response_format["type"] == "json_schema":
            jsonschema.validate(json.loads(done.text), schema)
        elif response_format["type"] == "regex":
            assert re.fullmatch(response_format["pattern"], done.text), done.text
        else:
            assert done.text in response_format["choices"]
    assert check_stream(outputs.of(free)).text == alone(r, outputs, worker.queue, new_id, "Look", [image], 20)


def test_a_repeated_image_skips_the_vision_tower(worker, r, outputs, new_id):
    """The second request with the same image bytes is a vision-cache hit and reads the same."""
    image = png(140, 84, 5)
    before = settled_stats(r, worker)["vision_cache"]
    first = alone(r, outputs, worker.queue, new_id, "Again", [image], 16)
    second = alone(r, outputs, worker.queue, new_id, "Again", [image], 16)
    assert second == first
    deadline = time.monotonic() + 10
    while (after := stats(r, worker)["vision_cache"])["misses"] < before["misses"] + 1 or \
            after["hits"] < before["hits"] + 1:
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.1)
    assert after["hits"] == before["hits"] + 1 and after["misses"] == before["misses"] + 1
    assert after["entries"] >= 1 and after["bytes"] > 0


def test_text_only_requests_on_a_vision_model_reuse_cached_prefixes(worker, r, outputs, new_id):
    """mlx-vlm's prefix cache (16-token blocks) serves a repeated text prompt: usage says how
    many prompt tokens came from it, and the greedy text is the same."""
    body = {"prompt_tokens": list(range(300, 380)), "max_tokens": 12}
    first, second = new_id(), new_id()
    xadd_json(r, worker.queue, first, body)
    cold = check_stream(outputs.of(first))
    xadd_json(r, worker.queue, second, body)
    warm = check_stream(outputs.of(second))
    assert cold.usage.cached_tokens == 0 and warm.text == cold.text
    assert warm.usage.cached_tokens >= 48 and warm.usage.cached_tokens % 16 == 0, warm.usage
    assert settled_stats(r, worker)["prefix_cache"]["hits"] >= 1


def truncated_png() -> bytes:
    data = png(112, 112, 6)
    return data[: len(data) // 2]


def solid_png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


BAD_IMAGES = [
    ("not an image", {"images": [b64(b"this is plain text, not a picture")]}, "invalid_request",
     "images.0: not an image"),
    ("truncated", {"images": [b64(png(112, 112)), b64(truncated_png())]}, "invalid_request",
     "images.1: a PNG image that cannot be decoded, truncated or corrupt"),
    ("too many pixels", {"images": [b64(solid_png(600, 400))]}, "too_large",
     "images.0: 600x400 is 240000 pixels; this worker's max_image_pixels is 200000"),
    ("too many images", {"images": [b64(png(56, 56))] * 3}, "too_large",
     "images: 3 images; this worker's max_images is 2"),
    ("not base64", {"images": ["@@@"]}, "invalid_request", "images.0: not valid base64"),
    ("mlx-vlm's own template argument", {"prompt": None, "messages": [{"role": "user", "content": "Look"}],
                                         "images": [b64(png(56, 56))], "chat_template_kwargs": {"fps": 2}},
     "invalid_request", "chat_template_kwargs: fps cannot be set by a request"),
    ("with prompt_tokens", {"prompt": None, "prompt_tokens": [5, 6], "images": [b64(png(56, 56))]}, "invalid_request",
     "images: send them with prompt or messages"),
]


@pytest.mark.parametrize(("case", "body", "code", "message"), BAD_IMAGES, ids=[c[0] for c in BAD_IMAGES])
def test_bad_images_get_a_precise_error_and_the_worker_serves_on(worker, r, outputs, new_id, case, body, code,
                                                                  message):
    rid = new_id("bad")
    request = {k: v for k, v in {"prompt": "Look", "max_tokens": 5, **body}.items() if v is not None}
    xadd_json(r, worker.queue, rid, request)
    (error,) = outputs.of(rid)
    assert isinstance(error, Error), error
    assert error.code == code and error.message.startswith(message), error.message
    ok = new_id("ok")
    ask(r, worker.queue, ok, "Look", [png(56, 56)], max_tokens=3)
    assert check_stream(outputs.of(ok)).finish_reason == "length"


def test_chat_messages_with_images_and_the_python_client(worker, new_id):
    """`client.submit(messages=..., images=[bytes])`, in JSON (base64 on the wire) and msgpack."""
    image = png(84, 84, 7)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is this?"}]
    with Client(worker.redis_url, queue=worker.queue) as client:
        as_json = client.submit(messages=messages, images=[image], max_tokens=12).result(timeout=60)
        as_msgpack = client.submit(messages=messages, images=[image], max_tokens=12,
                                   encoding="msgpack").result(timeout=60)
        text_only = client.submit(messages=messages, max_tokens=12).result(timeout=60)
    assert as_json.text == as_msgpack.text
    assert as_json.usage.prompt_tokens == text_only.usage.prompt_tokens + 9 + 2  # 84x84: 6x6 patches -> 9


def test_submit_an_image_from_the_command_line(worker, r, tmp_path):
    """`mlxq submit --image FILE` prints the text of the image request (sent as msgpack bytes)."""
    photo = tmp_path / "photo.png"
    photo.write_bytes(png(168, 112, 10))
    rid = f"cli-image-{uuid.uuid4().hex[:8]}"
    result = subprocess.run([sys.executable, "-m", "mlxq", "submit", "--redis-url", worker.redis_url,
                             "--queue", worker.queue, "--image", str(photo), "--max-tokens", "8", "--id", rid,
                             "What is in the picture?"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    done = decode_event(r.xrange(KEYS.output(worker.queue, rid))[-1][1])
    assert isinstance(done, Done) and result.stdout == done.text + "\n"
    assert done.usage.prompt_tokens > IMAGE_168x112_TOKENS
    assert f"{done.usage.prompt_tokens} prompt + 8 completion tokens" in result.stderr
    missing = subprocess.run([sys.executable, "-m", "mlxq", "submit", "--redis-url", worker.redis_url,
                              "--image", str(tmp_path / "nope.png"), "x"], cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 1 and "cannot read the image" in missing.stderr


def test_cancel_a_decoding_image_request(worker, r, outputs, new_id):
    rid = new_id("cancel")
    ask(r, worker.queue, rid, "A long look", [png(168, 168, 8)], max_tokens=2000)
    wait_for_deltas(r, KEYS.output(worker.queue, rid), [rid])
    with Client(worker.redis_url, queue=worker.queue) as client:
        client.cancel(rid)
    done = check_stream(outputs.of(rid))
    assert done.finish_reason == "cancelled" and 0 < done.usage.completion_tokens < 2000
    after = new_id()
    ask(r, worker.queue, after, "Next", [png(56, 56)], max_tokens=3)
    assert check_stream(outputs.of(after)).finish_reason == "length"


# ---- the batch backend in process -------------------------------------------------


@pytest.fixture(scope="module")
def backend_parts(vision_model: Path):
    from worker.engine.backends.mlx_vlm import load_vision_model
    from worker.settings import WorkerSettings

    settings = WorkerSettings(model=str(vision_model), prefill_step_size=8)
    return load_vision_model(settings), settings


PLAN = StepPlan(prefill_chunk=8, prefill_prompts=8)  # what the vision backend is given (it keeps its own sizes)


def test_cancel_during_prefill_drops_the_request_and_keeps_its_neighbour(backend_parts):
    """Removed while its prompt is still being prefilled (8 tokens a step), a request never
    yields a token; the request decoding beside it goes on to its end."""
    from client.protocol import RequestBody
    from worker.engine.sampling import build_logits_processors, build_sampler
    from worker.messages import SamplingParams

    loaded, _ = backend_parts
    ids, media = loaded.info.vision.prepare(RequestBody(prompt="Picture " * 40, images=[png(224, 224, 9)]))
    greedy = SamplingParams()
    backend = loaded.make_backend()
    decoding = backend.insert([5, 6, 7], 30, build_sampler(greedy), build_logits_processors(greedy))
    produced: list[int] = []
    while not produced:
        produced += [out.uid for out in backend.step(PLAN)]
    prefilling = backend.insert(ids, 30, build_sampler(greedy), build_logits_processors(greedy), media=media)
    for _ in range(3):  # a decode step and one prefill chunk each
        produced += [out.uid for out in backend.step(PLAN)]
    assert prefilling not in produced, "still prefilling"
    backend.remove([prefilling])
    for _ in range(100):
        produced += [out.uid for out in backend.step(PLAN)]
    assert prefilling not in produced
    assert produced.count(decoding) == 30, "the neighbour ran to its max_tokens"
    backend.close()


def test_an_image_part_keeps_its_place_in_a_multi_turn_chat(backend_parts):
    """`{"type": "image", "index": i}` parts put each image in its own turn, in the order
    the parts come (not the order of `images`); an image no part points to goes first in
    the last user message. Each image's tokens follow its patches, so the images' order
    in the prompt is the order the tower gets them."""
    from client.protocol import RequestBody

    loaded, _ = backend_parts
    prompts = loaded.info.vision
    tokenizer = prompts.processor.tokenizer
    pad, turn = (tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|im_start|>"))
    first, second, loose = png(56, 56, 1), png(112, 112, 2), png(56, 112, 3)  # 4, 16 and 8 image tokens
    body = RequestBody(images=[b64(second), b64(first), b64(loose)], messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image", "index": 1}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "picture."}]},
        {"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "And this?"}]}])
    ids, media = prompts.prepare(body)
    turns: list[list[int]] = []
    for token in ids:
        if token == turn:
            turns.append([])
        elif turns:
            turns[-1].append(token)
    assert [t.count(pad) for t in turns] == [4, 0, 8 + 16, 0]  # the last: the assistant's opening
    runs = [len(run) for run in "".join("p" if t == pad else " " for t in turns[2]).split()]
    assert runs == [8, 16], "the loose image first, then the one its part points to"
    assert media.counts == {"image": 3} and media.key.count("image:") == 3
    text = tokenizer.decode(turns[0])
    assert text.index("What is this?") < text.index("<|image_pad|>")
    assert "A\npicture." in tokenizer.decode(turns[1])  # text parts joined, as on a text model


def test_media_parts_that_point_nowhere_are_refused_before_any_work():
    """A part whose index is past the request's images, one that points where another
    does, one outside a user message, and ones past the videos or the audio are each an
    `invalid_request` naming the part."""
    from client.protocol import RequestRejected, validate_body

    image = b64(png(56, 56))

    def refused(messages: list[dict], images: list[str]) -> str:
        with pytest.raises(RequestRejected) as e:
            validate_body({"messages": messages, "images": images})
        return str(e.value)

    part = {"type": "image", "index": 1}
    assert "the image part with index 1: the request has 1 images" in refused(
        [{"role": "user", "content": [part]}], [image])
    assert "points to an item another part points to" in refused(
        [{"role": "user", "content": [part, part]}], [image, image])
    assert "media parts go in user messages, not 'system' ones" in refused(
        [{"role": "system", "content": [part]}, {"role": "user", "content": "x"}], [image, image])
    assert "the video part with index 0: the request has 0 videos" in refused(
        [{"role": "user", "content": [{"type": "video", "index": 0}]}], [])
    assert "the audio part with index 0: the request has 0 audio" in refused(
        [{"role": "user", "content": [{"type": "audio", "index": 0}]}], [])
    assert "an empty list of parts" in refused([{"role": "user", "content": []}], [])
