"""Scheduling with the real model: chunked prefill, the engine thread, an idle engine."""

from __future__ import annotations

import queue
import threading
import time
import uuid

from support import HELD, KEYS, ON_BOTH, settled, worker_fixture, xadd_json

from client import Delta, Done
from worker.engine.backends.mlx_lm import load_text_model
from worker.engine.scheduler import SchedulingPolicy
from worker.engine.thread import Engine
from worker.messages import EngineRequest, Queueing, RequestRef, SamplingParams, StepOutput, Stopping
from worker.settings import WorkerSettings

worker = worker_fixture(prefill_step_size=128)


def test_a_long_prefill_does_not_freeze_running_streams(worker, r, outputs):
    """While a 2,000-token prompt is prefilled in chunks of 128, a running request keeps
    getting deltas: count them between the long request's admission and its first token."""
    running, long = f"run-{uuid.uuid4().hex[:8]}", f"long-{uuid.uuid4().hex[:8]}"
    xadd_json(r, worker.queue, running, {"prompt": "Keep streaming", "max_tokens": 1500})
    while r.xlen(KEYS.output(worker.queue, running)) < 5:
        time.sleep(0.005)
    entry_id = xadd_json(r, worker.queue, long, {"prompt_tokens": [5 + i % 900 for i in range(2000)],
                                                 "max_tokens": 2})
    (*_, done) = outputs.of(long)
    assert isinstance(done, Done)
    arrived_ms = int(entry_id.split("-")[0])
    window = (arrived_ms + done.timing.queued_ms, arrived_ms + done.timing.ttft_ms)
    during = [e for e, f in r.xrange(KEYS.output(worker.queue, running))
              if f[b"type"] == b"delta" and window[0] <= int(e.decode().split("-")[0]) <= window[1]]
    assert len(during) >= 5, f"{len(during)} deltas of the running request during a {window[1] - window[0]} ms prefill"
    outputs.of(running)


def _request(rid: str, tokens: list[int], max_tokens: int = 8) -> EngineRequest:
    return EngineRequest(ref=RequestRef(rid, "1-0"), prompt_tokens=tokens, sampling=SamplingParams(),
                         stopping=Stopping(max_tokens), queueing=Queueing(0, time.time()))


def _until_done(outputs: queue.Queue[StepOutput], request_id: str) -> tuple[float, Done]:
    """Wait for the request's `done`; returns when its first delta came, and the `done`."""
    first = None
    while True:
        for item in outputs.get(timeout=30).outgoing:
            if item.event.id == request_id and isinstance(item.event, Delta) and first is None:
                first = time.monotonic()
            if item.event.id == request_id and isinstance(item.event, Done):
                return first or time.monotonic(), item.event


class CountingQueue(queue.Queue):
    """The engine's command queue, counting the engine's waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = 0

    def get(self, block: bool = True, timeout: float | None = None):  # noqa: ANN201
        self.gets += 1
        return super().get(block, timeout)


def test_mlx_runs_on_the_engine_thread_only_and_an_idle_engine_blocks(demo_model):
    """Every call into the model, the batch and the prefix cache happens on the engine
    thread; an idle engine waits on its command queue (one wait, no polling) and the
    next submit wakes it."""
    threads: set[int] = set()
    settings = WorkerSettings(model=str(demo_model))

    def load():
        loaded = load_text_model(settings)
        make_backend = loaded.make_backend

        def recording_backend():
            backend = make_backend()
            for name in ("insert", "step", "remove", "close"):
                method = getattr(backend, name)
                setattr(backend, name, lambda *a, _m=method, **k: (threads.add(threading.get_ident()), _m(*a, **k))[1])
            return backend

        cache = loaded.prefix_cache
        for name in ("fetch", "store"):
            method = getattr(cache, name)
            setattr(cache, name, lambda *a, _m=method, **k: (threads.add(threading.get_ident()), _m(*a, **k))[1])
        threads.add(threading.get_ident())
        loaded.make_backend = recording_backend
        return loaded

    outputs: queue.Queue[StepOutput] = queue.Queue()
    engine = Engine(load, SchedulingPolicy(4), on_output=outputs.put, on_fatal=lambda e: None)
    commands = engine._commands = CountingQueue()
    engine.start()
    engine.wait_ready(60)
    engine.submit(_request("a", list(range(50, 90))))
    _until_done(outputs, "a")
    time.sleep(0.2)  # the engine settles into its wait
    waits = commands.gets
    time.sleep(1.0)
    assert commands.gets == waits, "an idle engine blocks in one wait; it does not poll"
    engine.submit(_request("b", list(range(50, 90))))
    _, done = _until_done(outputs, "b")
    assert done.usage.cached_tokens == 39
    assert commands.gets > waits
    engine.shutdown(1)
    assert engine.join(10)
    assert threads == {engine._thread.ident}


lanes_worker = worker_fixture(lanes="urgent", max_num_seqs=1, prefetch=0)


@ON_BOTH
def test_a_lane_request_skips_the_backlog_in_redis(lanes_worker, r, outputs):
    """With the worker full and a backlog waiting in the queue stream, a request on the
    `urgent` lane is read (and finished) before every entry of the backlog."""
    queue = lanes_worker.queue
    running = f"run-{uuid.uuid4().hex[:8]}"
    xadd_json(r, queue, running, HELD)  # occupies the only slot until cancelled
    while not r.exists(KEYS.output(queue, running)):
        time.sleep(0.005)
    backlog = [f"backlog{i}-{uuid.uuid4().hex[:6]}" for i in range(4)]
    for request_id in backlog:
        xadd_json(r, queue, request_id, {"prompt": "Wait your turn", "max_tokens": 2})
    urgent = f"urgent-{uuid.uuid4().hex[:8]}"
    r.xadd(KEYS.lane(queue, "urgent"), {"id": urgent, "json": '{"prompt": "Me first", "max_tokens": 2}'})
    r.set(KEYS.cancel_flag(queue, running), 1, ex=60)  # the slot frees only now, with all of them waiting
    r.publish(KEYS.cancel_channel(queue), running)
    finished_at = {}
    for request_id in [running, urgent, *backlog]:
        (*_, done) = outputs.of(request_id)
        assert isinstance(done, Done)
        finished_at[request_id] = int(r.xrevrange(KEYS.output(queue, request_id), count=1)[0][0].split(b"-")[0])
    assert all(finished_at[urgent] <= finished_at[b] for b in backlog)
    assert settled(r, KEYS.lane(queue, "urgent")) and settled(r, KEYS.queue(queue))
