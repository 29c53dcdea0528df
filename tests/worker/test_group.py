"""A worker group: one model sharded over two processes on localhost (`mlx.launch`, the
ring backend), fed from the queue by rank 0, against a single-process worker on the same
model: the same tokens, the same contract, and a rank's death stops the group without
losing or repeating a request."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import redis
from support import (
    HELD,
    KEYS,
    ROOT,
    build_demo_model,
    check_stream,
    free_port,
    output_stream,
    start_worker,
    tokens_of,
    wait_for,
    wait_for_deltas,
    xadd_json,
)

from client import Delta, Done

STALL_S = 5  # group_stall_s: how long a rank waits for another before the group stops
REQUESTS = [  # greedy, seeded, with a stop string, with logprobs, constrained; of different lengths
    {"prompt": "Tell me about queues.", "max_tokens": 24},
    {"prompt": "Write a poem", "max_tokens": 40, "temperature": 0.8, "seed": 5},
    {"prompt": "Name the planets", "max_tokens": 12, "temperature": 1.2, "seed": 11, "top_p": 0.9},
    {"prompt": "Count with me", "max_tokens": 30, "stop": [" g"]},
    {"prompt": "Once upon a time", "max_tokens": 16, "logprobs": True, "top_logprobs": 2},
    {"prompt_tokens": [5, 17, 200, 33, 9], "max_tokens": 36, "ignore_eos": True},
    {"prompt": "Pick one", "max_tokens": 10, "response_format": {"type": "choice", "choices": ["yes", "no", "maybe"]}},
]


@dataclass
class Group:
    """`mlx.launch` running `mlxq worker --distributed` on two ranks."""

    launcher: subprocess.Popen[bytes]
    queue: str
    consumer: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rank_pid(self, rank: int) -> int:
        """The `mlxq worker` process of `rank` (rank 0's is the worker, with the heartbeat)."""
        for process in psutil.Process(self.launcher.pid).children(recursive=True):
            try:
                if process.environ().get("MLX_RANK") == str(rank) and "worker" in process.cmdline():
                    return process.pid
            except psutil.Error:
                continue
        raise AssertionError(f"no rank {rank} under the launcher")

    def stop(self) -> None:
        if self.launcher.poll() is None:
            try:
                os.kill(self.rank_pid(0), signal.SIGTERM)  # its drain closes the group's batch: all exit 0
                self.launcher.wait(60)
            except (AssertionError, subprocess.TimeoutExpired, ProcessLookupError):
                os.killpg(self.launcher.pid, signal.SIGKILL)
                self.launcher.wait(10)
        if self.launcher.stdin is not None:
            self.launcher.stdin.close()


def start_group(redis_url: str, model: Path, queue: str, mode: str, logs_dir: Path,
                rank1_model: Path | None = None, *settings: str) -> Group:
    consumer = f"group-{queue}"
    log_path = logs_dir / f"group-{queue}.log"
    worker = [sys.executable, "-m", "mlxq", "worker", "--redis-url", redis_url, "--model", str(model), "--queue",
              queue, "--consumer", consumer, "--heartbeat-s", "0.5", "--log-format", "json", "--distributed", mode,
              "--group-port", str(free_port()), "--group-stall-s", str(STALL_S), *settings]
    if rank1_model is not None:  # rank 1 given another model directory than rank 0's
        swap = (f'a=(); for w in "$@"; do [ "$MLX_RANK" = 1 ] && [ "$w" = "{model}" ] && w="{rank1_model}"; '
                'a+=("$w"); done; exec "${a[@]}"')
        worker = ["bash", "-c", swap, "-", *worker]
    launch = [str(Path(sys.executable).parent / "mlx.launch"), "--hosts", "127.0.0.1", "-n", "2", "--backend", "ring",
              "--", *worker]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "MLXQ_TEST_SLOW_ON_TOKEN": str(HELD[
        "prompt_tokens"][0])}
    with open(log_path, "ab") as log_file:
        launcher = subprocess.Popen(launch, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                    stdin=subprocess.PIPE, start_new_session=True)  # closed, it spins harder
    group = Group(launcher, queue, consumer, log_path)
    r = redis.Redis.from_url(redis_url)
    try:
        wait_for(lambda: r.exists(KEYS.worker(consumer)) or launcher.poll() is not None, timeout=90,
                 what="the group's heartbeat")
    finally:
        r.close()
    if launcher.poll() is not None:
        group.stop()
        raise RuntimeError(f"the group did not start:\n{group.log()}")
    return group


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("llama") / "llama", "--text-family", "llama")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    return build_demo_model(tmp_path_factory.mktemp("qwen2") / "qwen2", "--text-family", "qwen2")


@pytest.fixture(scope="module")
def single(valkey, llama, qwen2, logs_dir):
    """One ordinary worker per model: the reference."""
    workers = {name: start_worker(valkey, model, f"single-{name}", logs_dir, max_num_seqs=8)
               for name, model in (("llama", llama), ("qwen2", qwen2))}
    yield workers
    for worker in workers.values():
        worker.stop()


def run_all(r: redis.Redis, outputs, queue: str, requests: list[dict], wave: int = 3) -> list[list]:
    """Send the requests in two waves (the second joins while the first may run); each one's events."""
    ids = [f"g-{uuid.uuid4().hex[:10]}" for _ in requests]
    for request_id, body in zip(ids[:wave], requests[:wave], strict=True):
        xadd_json(r, queue, request_id, body)
    wait_for_deltas(r, wait_for(lambda: output_stream(r, ids[0]), what="the first output"), ids[:1])
    for request_id, body in zip(ids[wave:], requests[wave:], strict=True):
        xadd_json(r, queue, request_id, body)
    return [outputs.of(request_id, timeout=90) for request_id in ids]


def text_of(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, Delta))


@pytest.mark.parametrize(("family", "mode"), [("llama", "tensor"), ("qwen2", "pipeline")])
def test_a_group_serves_as_one_process_does(valkey, single, r, outputs, logs_dir, family, mode, request):
    """Greedy, seeded and sampled rows, stop strings and logprobs, joining and leaving at
    different steps, prompts reusing cached prefixes, a cancel: the group's tokens and
    logprobs are the single worker's."""
    group = start_group(valkey, request.getfixturevalue(family), f"grp{uuid.uuid4().hex[:6]}", mode, logs_dir)
    try:
        grouped = run_all(r, outputs, group.queue, REQUESTS)
        alone = run_all(r, outputs, single[family].queue, REQUESTS)
        assert [tokens_of(e) for e in grouped] == [tokens_of(e) for e in alone]
        assert [text_of(e) for e in grouped] == [text_of(e) for e in alone]
        assert [check_stream(e).finish_reason for e in grouped] == [check_stream(e).finish_reason for e in alone]
        # The shards add up in another order than one process: the same tokens, logprobs to rounding.
        logprobs = [[lp.logprob for d in e[4] if isinstance(d, Delta) for lp in d.logprobs or []]
                    for e in (grouped, alone)]
        assert logprobs[0] and logprobs[0] == pytest.approx(logprobs[1], abs=1e-3)
        assert_prefixes_reused_as_one_process_does(r, outputs, group.queue, single[family].queue, grouped)
        assert_a_cancel_stops_a_row(r, outputs, group.queue)
        beat = json.loads(r.get(KEYS.worker(group.consumer)))
        assert beat["model"].endswith(family)
        assert beat["group"] == {"mode": mode, "ranks": 2, "hosts": ["127.0.0.1", "127.0.0.1"]}
        wait_for(lambda: json.loads(r.get(KEYS.worker(group.consumer)))["prefix_cache"]["hits"] >= 2,
                 what="the heartbeat counting the group's prefix cache hits")
    finally:
        group.stop()
    assert group.launcher.returncode == 0, group.log()


def assert_prefixes_reused_as_one_process_does(r, outputs, queue: str, reference: str, earlier: list[list]) -> None:
    """Rank 0's prefix cache decides for every rank: a prompt repeated (all but its last
    token reused) and one that extends part of a finished sequence (its cache cut) are
    prefilled from each rank's own shard of the entry."""
    extended = REQUESTS[5]["prompt_tokens"] + tokens_of(earlier[5])[:20] + [7, 8]
    again = [REQUESTS[0], {"prompt_tokens": extended, "max_tokens": 16, "ignore_eos": True}]
    grouped, alone = ([outputs.of(i, timeout=90) for i in _sent(r, q, again)] for q in (queue, reference))
    assert [tokens_of(e) for e in grouped] == [tokens_of(e) for e in alone]
    cached = [check_stream(e).usage.cached_tokens for e in grouped]
    assert cached[0] > 0 and cached[1] == len(REQUESTS[5]["prompt_tokens"]) + 20, cached


def assert_a_cancel_stops_a_row(r, outputs, queue: str) -> None:
    held = f"held-{uuid.uuid4().hex[:8]}"
    xadd_json(r, queue, held, HELD)
    wait_for_deltas(r, wait_for(lambda: output_stream(r, held), what="the held output"), [held])
    r.set(KEYS.cancel_flag(queue, held), 1, ex=60)
    r.publish(KEYS.cancel_channel(queue), held)
    assert check_stream(outputs.of(held)).finish_reason == "cancelled"
    after = f"after-{uuid.uuid4().hex[:8]}"
    xadd_json(r, queue, after, REQUESTS[0])
    assert isinstance(check_stream(outputs.of(after)), Done)


@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_killed_stops_the_group_and_its_requests_finish_elsewhere(valkey, llama, single, r, outputs,
                                                                          logs_dir, rank):
    """kill -9 of a rank mid-generation: every rank of the group is gone within its bound,
    and an ordinary worker on the same queue finishes each request, resuming after what
    was written (no text twice: the single worker's own tokens from the first to the last)."""
    group = start_group(valkey, llama, f"grp{uuid.uuid4().hex[:6]}", "tensor", logs_dir)
    ranks = [group.rank_pid(0), group.rank_pid(1)]
    # Greedy: a resumed greedy request reads token for token as an uninterrupted one.
    long = [dict(REQUESTS[i], max_tokens=60, ignore_eos=True) for i in (0, 3, 5)]
    ids = [f"k-{uuid.uuid4().hex[:10]}" for _ in long]
    held = f"held-{uuid.uuid4().hex[:8]}"
    try:
        xadd_json(r, group.queue, held, HELD)  # slows every step while it runs: the others are mid-way at the kill
        for request_id, body in zip(ids, long, strict=True):
            xadd_json(r, group.queue, request_id, body)
        for request_id in ids:
            wait_for_deltas(r, wait_for(lambda rid=request_id: output_stream(r, rid), what="an output"), [request_id])
        os.kill(ranks[rank], signal.SIGKILL)
        started = time.monotonic()
        wait_for(lambda: group.launcher.poll() is not None or not any(psutil.pid_exists(p) and
                 psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in ranks), timeout=STALL_S * 4,
                 what="every rank of the group gone")
        assert time.monotonic() - started < STALL_S * 4
    finally:
        group.stop()
    takeover = start_worker(valkey, llama, group.queue, logs_dir, consumer=f"takeover-{group.queue}")
    try:
        r.set(KEYS.cancel_flag(group.queue, held), 1, ex=60)
        r.publish(KEYS.cancel_channel(group.queue), held)
        finished = [outputs.of(request_id, timeout=90) for request_id in ids]
        reference = [outputs.of(request_id, timeout=90) for request_id in _sent(r, single["llama"].queue, long)]
        assert [tokens_of(e) for e in finished] == [tokens_of(e) for e in reference]
        assert check_stream(outputs.of(held, timeout=90)).finish_reason == "cancelled"
    finally:
        takeover.stop()


def _sent(r: redis.Redis, queue: str, bodies: list[dict]) -> list[str]:
    ids = [f"ref-{uuid.uuid4().hex[:10]}" for _ in bodies]
    for request_id, body in zip(ids, bodies, strict=True):
        xadd_json(r, queue, request_id, body)
    return ids


def test_a_group_and_an_ordinary_worker_share_a_queue(valkey, llama, r, outputs, logs_dir):
    """Twelve requests at once into two workers of two slots each (no read-ahead): the
    group can hold two until one ends, 40 steps on, so the other worker reads some of
    them whatever the machine's speed, and each is answered once, whole."""
    group = start_group(valkey, llama, f"grp{uuid.uuid4().hex[:6]}", "tensor", logs_dir, None,
                        "--max-num-seqs", "2", "--prefetch", "0")
    worker = start_worker(valkey, llama, group.queue, logs_dir, consumer=f"beside-{group.queue}", max_num_seqs=2,
                          prefetch=0)
    try:
        ids = _sent(r, group.queue, [dict(REQUESTS[5], max_tokens=40)] * 12)
        assert all(isinstance(check_stream(outputs.of(request_id, timeout=90)), Done) for request_id in ids)
        def served() -> dict[str, int]:
            return {name: json.loads(r.get(KEYS.worker(name)))["totals"].get("finished:length", 0)
                    for name in (group.consumer, worker.consumer)}

        wait_for(lambda: sum(served().values()) == 12, what="both heartbeats counting what they served")
        assert all(served().values()), served()
    finally:
        worker.stop()
        group.stop()


def test_a_rank_that_cannot_load_its_shard_stops_the_group_with_the_reason(valkey, llama, tmp_path, logs_dir):
    broken = tmp_path / "broken"
    shutil.copytree(llama, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RuntimeError, match="the group did not start") as refused:
        start_group(valkey, llama, f"grp{uuid.uuid4().hex[:6]}", "tensor", logs_dir, rank1_model=broken)
    assert "rank 1 could not load its shard" in str(refused.value)


def test_a_rank_that_never_starts_stops_rank_0_with_the_reason(valkey, llama, tmp_path):
    """Joining the group would wait for rank 1 forever: rank 0 waits group_stall_s for its
    hello, then its worker exits saying which ranks are missing."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    worker = subprocess.run([sys.executable, "-m", "mlxq", "worker", "--redis-url", valkey, "--model", str(llama),
                             "--queue", f"grp{uuid.uuid4().hex[:6]}", "--distributed", "tensor",
                             "--group-port", str(free_port()), "--group-stall-s", "1"],
                            cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", "MLX_RANK": "0",
                                           "MLX_HOSTFILE": str(hostfile)},
                            capture_output=True, text=True, timeout=120)
    assert worker.returncode != 0
    assert "ranks [1] did not join the group within group_stall_s (1 s)" in worker.stdout + worker.stderr


def test_what_a_group_cannot_run_is_refused_at_start():
    from pydantic import ValidationError

    from worker.settings import load_settings

    with pytest.raises(ValidationError, match="distributed with prompt_lookup_max: a worker group runs mlx-lm"):
        load_settings(distributed="tensor", prompt_lookup_max=2)
    with pytest.raises(ValidationError, match="distributed with kv_bits"):
        load_settings(distributed="pipeline", kv_bits=8)
