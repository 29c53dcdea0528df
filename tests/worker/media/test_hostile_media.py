"""Hostile videos beside valid requests: each is an error for its own request, checked
from the container's header where it can be, decoded in a child process that may crash
or hang without the worker; the worker stays up, answers the others, and its RSS stays
bounded."""

from __future__ import annotations

import base64
import contextlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
from media import png, video, wav
from support import (
    KEYS,
    WorkerProcess,
    check_stream,
    output_stream,
    start_worker,
    wait_for,
    worker_fixture,
    worker_url,
)

from client import Done, Error

CRASH, HANG = b"MLXQ-CRASH-THE-DECODER", b"MLXQ-HANG-THE-DECODER"
MAX_PIXELS = 200_000  # the test worker's max_image_pixels: frames above it are refused from the header


worker = worker_fixture("vision_model", env={"MLXQ_TEST_DECODER_CRASH_ON": CRASH.decode(),
                                             "MLXQ_TEST_DECODER_HANG_ON": HANG.decode()},
                        max_image_pixels=MAX_PIXELS, max_video_seconds=60, media_decode_timeout_s=10, max_crashes=2)


# A decode that hangs here ends only when the test kills its decoder (a time limit
# nothing in a test reaches), and its request is dead-lettered at its first decoder death.
hung_worker = worker_fixture("vision_model", env={"MLXQ_TEST_DECODER_HANG_ON": HANG.decode()},
                             media_decode_timeout_s=3600, max_crashes=1)


def cases(tmp: Path) -> dict[str, tuple[bytes, str, str]]:
    """Each hostile video: its bytes, the error code and a part of the message it gets."""
    good = video(tmp / "good.mp4")
    return {
        "random bytes": (np.random.RandomState(1).bytes(5000), "invalid_request", "not a video OpenCV can open"),
        "truncated": (good[: len(good) // 2], "invalid_request", "videos.0"),
        "claims hours": (video(tmp / "slow.mp4", frames=4, fps=0.01), "too_large", "max_video_seconds"),
        "frames too large": (video(tmp / "wide.mp4", frames=2, size=(640, 480)), "too_large", "max_image_pixels"),
        "a png": (png(), "invalid_request", "videos.0"),
        "decoder crashes": (good + CRASH, "poisoned", "killed by SIGSEGV"),
        "decoder hangs": (good + HANG, "poisoned", "media_decode_timeout_s"),
    }


def test_each_hostile_video_costs_its_own_request_only(worker, r, outputs, new_id, tmp_path):
    pid = worker.process.pid
    good = base64.b64encode(video(tmp_path / "valid.mp4", seed=5)).decode()
    rss_before = psutil.Process(pid).memory_info().rss
    for name, (data, code, says) in cases(tmp_path).items():
        bad, fine = new_id("bad"), new_id("fine")
        for rid, payload in ((bad, base64.b64encode(data).decode()), (fine, good)):
            body = {"prompt": "What is it?", "videos": [payload], "max_tokens": 4}
            r.xadd(KEYS.queue(worker.queue), {"id": rid, "json": json.dumps(body)})
        error = check_stream(outputs.of(bad, timeout=120))
        assert isinstance(error, Error) and error.code == code and says in error.message, (name, error)
        assert isinstance(check_stream(outputs.of(fine, timeout=120)), Done), name
        assert worker.process.poll() is None, f"{name}: the worker died"
    grown = psutil.Process(pid).memory_info().rss - rss_before
    assert grown < 200 << 20, f"the worker's RSS grew by {grown >> 20} MB"


def test_a_decoder_crash_counts_toward_max_crashes(worker, r, outputs, new_id, tmp_path):
    """The crashing video above was decoded max_crashes (2) times, then dead-lettered;
    its dead letter says why."""
    rid = new_id("crash")
    data = base64.b64encode(video(tmp_path / "c.mp4") + CRASH).decode()
    r.xadd(KEYS.queue(worker.queue), {"id": rid, "json": json.dumps({"prompt": "x", "videos": [data]})})
    error = check_stream(outputs.of(rid, timeout=120))
    assert isinstance(error, Error) and error.code == "poisoned"
    assert "crashed 2 time(s)" in error.message
    dead = [fields for _, fields in r.xrange(KEYS.dead(worker.queue)) if fields.get(b"field:id") == rid.encode()]
    assert len(dead) == 1 and b"SIGSEGV" in dead[0][b"reason"], "dead-lettered, with the reason"


@pytest.fixture(scope="module")
def audio_worker(tmp_path_factory: pytest.TempPathFactory, redis_url: str, logs_dir: Path) -> Iterator[WorkerProcess]:
    from support import build_demo_model

    model = build_demo_model(tmp_path_factory.mktemp("model") / "gemma4", "--vision", "--family", "gemma4")
    env = {"MLXQ_TEST_DECODER_CRASH_ON": CRASH.decode()}
    process = start_worker(worker_url(redis_url), model, f"hostilea{uuid.uuid4().hex[:6]}", logs_dir, env=env,
                           max_audio_seconds=2, max_crashes=1)
    yield process
    process.stop()
    assert process.process.returncode == 0, f"worker exited {process.process.returncode}:\n{process.log()}"


def test_each_hostile_audio_clip_costs_its_own_request_only(audio_worker, r, outputs, new_id):
    """Random bytes, a truncated WAV, a clip longer than max_audio_seconds (2 s here) by
    its header, a PNG as audio, and a clip that crashes its decoder, each beside a valid
    clip; max_crashes 1 dead-letters the crashing one at once."""
    worker, good = audio_worker, base64.b64encode(wav(1.0)).decode()
    clip = wav(1.0)
    hostile = {
        "random bytes": (np.random.RandomState(1).bytes(5000), "invalid_request", "not audio in a format served"),
        "truncated": (clip[: len(clip) // 2], "invalid_request", "a truncated WAV"),
        "too long": (wav(3.0), "too_large", "max_audio_seconds is 2"),
        "a png": (png(), "invalid_request", "not audio in a format served"),
        "decoder crashes": (clip + CRASH, "poisoned", "killed by SIGSEGV"),
    }
    rss_before = psutil.Process(worker.process.pid).memory_info().rss
    for name, (data, code, says) in hostile.items():
        bad, fine = new_id("bad"), new_id("fine")
        for rid, payload in ((bad, base64.b64encode(data).decode()), (fine, good)):
            body = {"messages": [{"role": "user", "content": [{"type": "audio", "index": 0}]}],
                    "audio": [payload], "max_tokens": 4}
            r.xadd(KEYS.queue(worker.queue), {"id": rid, "json": json.dumps(body)})
        error = check_stream(outputs.of(bad, timeout=120))
        assert isinstance(error, Error) and error.code == code and says in error.message, (name, error)
        assert error.message.startswith("audio.0: ") or code == "poisoned", error.message
        assert isinstance(check_stream(outputs.of(fine, timeout=120)), Done), name
        assert worker.process.poll() is None, f"{name}: the worker died"
    grown = psutil.Process(worker.process.pid).memory_info().rss - rss_before
    assert grown < 200 << 20, f"the worker's RSS grew by {grown >> 20} MB"


def test_a_video_slow_to_decode_holds_back_no_request_read_after_it(hung_worker, r, outputs, new_id, tmp_path):
    """Preparation runs beside the batch, and a request whose media take long to decode
    holds its own slot only: a text request read after it is served meanwhile; the video
    is answered when its decoding ends (here: its decoder killed)."""
    video_id, text_id = new_id("video"), new_id("text")
    payload = base64.b64encode(video(tmp_path / "hangs.mp4") + HANG).decode()
    r.xadd(KEYS.queue(hung_worker.queue),
           {"id": video_id, "json": json.dumps({"prompt": "What is it?", "videos": [payload], "max_tokens": 4})})
    wait_for(lambda: r.exists(KEYS.crashes(hung_worker.queue, video_id)), what="the video's attempt opened")
    r.xadd(KEYS.queue(hung_worker.queue), {"id": text_id, "json": json.dumps({"prompt": "Hi", "max_tokens": 4})})
    assert isinstance(check_stream(outputs.of(text_id, timeout=120)), Done)
    assert output_stream(r, video_id) is None, "nothing of the video yet: its decode hangs"
    for decoder in _decoders(hung_worker):
        decoder.kill()
    error = check_stream(outputs.of(video_id, timeout=120))
    assert isinstance(error, Error) and error.code == "poisoned", error
    assert hung_worker.process.poll() is None


def _decoders(worker: WorkerProcess) -> list[psutil.Process]:
    """The worker's media decoder processes (spawned by its engine process)."""
    decoders = []
    for child in psutil.Process(worker.process.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile (a decoder retired)
            if "spawn_main" in " ".join(child.cmdline()):
                decoders.append(child)
    return decoders
