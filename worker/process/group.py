"""A worker group: one model sharded over several processes (`mx.distributed`, tensor or
pipeline parallel), on one Mac or several, fed from the queue by rank 0.

Every rank runs `mlxq worker` under `mlx.launch`. Rank 0 is an ordinary worker (the only
Redis client); its engine process holds shard 0 and drives the batch. The other ranks
(`worker.process.follower`) hold their shards and replay rank 0's batch: each step, rank
0 sends them what changed (sequences inserted and removed, the step's prefill plan) over
a TCP connection of their own, and every rank then runs the same step, the shards
meeting in the model's collectives. Only rank 0 samples: its sampler's tokens are summed
with the followers' zeros (`all_sum`), so every rank feeds the same next tokens, and
logits processors, seeds, stop checks and detokenizing stay rank 0's alone.

The plan connection is also the group's watchdog: collectives never time out, so a rank
that sees its peer's connection drop, or hears nothing for `group_stall_s`, exits at
once; the worker on rank 0 then hands its requests back to the queue.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
import msgpack
import structlog
from mlx_lm.sample_utils import LogitsProcessor, Sampler, greedy_sampler

from worker.engine.backends import Coverage, Loaded, TokenOut, is_vision_model, task_of
from worker.engine.backends.mlx_lm import MlxBatchBackend, load_text_model
from worker.engine.scheduler import StepPlan
from worker.messages import PreparedMedia
from worker.process.group_place import GroupPlace
from worker.settings import WorkerSettings

log = structlog.get_logger("mlxq.group")

HEADER = struct.Struct("!I")
MAX_FRAME = 64 << 20  # a step's plan: prompts' token ids, far below this
GREEDY = "greedy"  # the sampler key rows share: the batch samples them in one call, on every rank


# ---- the plan's frames: msgpack, never pickle (they cross the network) ----------------

def send_frame(sock: socket.socket, value: Any) -> None:
    data = msgpack.packb(value)
    sock.sendall(HEADER.pack(len(data)) + data)


def receive_frame(reader: Any) -> Any:
    """The next frame's value; raises EOFError once the peer is gone."""
    header = reader.read(HEADER.size)
    if len(header) < HEADER.size:
        raise EOFError
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"a plan frame of {size} bytes")
    data = reader.read(size)
    if len(data) < size:
        raise EOFError
    return msgpack.unpackb(data)


# ---- sampling on rank 0 alone ---------------------------------------------------------

def tokens_for_all(sample: Sampler, group: Any) -> Sampler:
    """Rank 0's sampler, its tokens handed to every rank."""
    def sampled(logprobs: mx.array) -> mx.array:
        return mx.distributed.all_sum(sample(logprobs).astype(mx.uint32), group=group)
    return sampled


def tokens_from_rank0(group: Any) -> Sampler:
    """A follower's sampler: rank 0's tokens (its own share is zeros)."""
    def sampled(logprobs: mx.array) -> mx.array:
        return mx.distributed.all_sum(mx.zeros(logprobs.shape[:1], dtype=mx.uint32), group=group)
    return sampled


def shard(path: str, mode: str, group: Any) -> tuple[Any, Any, dict[str, Any]]:
    """This rank's shard of the model at `path`: mlx-lm's `sharded_load`."""
    from mlx_lm.utils import sharded_load

    groups = {"tensor_group": group} if mode == "tensor" else {"pipeline_group": group}
    return sharded_load(path, return_config=True, **groups)  # type: ignore[no-any-return]


# ---- rank 0 ---------------------------------------------------------------------------

class Followers:
    """Rank 0's connections to the other ranks: the plan goes out on them, and any of them
    failing to load, dropping, or failing to take a frame ends this process (the group
    cannot go on; a rank that failed to load would leave rank 0's own load waiting in its
    last collective forever)."""

    def __init__(self, place: GroupPlace, port: int, stall_s: float) -> None:
        self._stall_s = stall_s
        self._lock = threading.Lock()
        self._sent_at = time.monotonic()
        joined = _accept(place, port, stall_s)
        self._socks = {rank: sock for rank, (sock, _) in joined.items()}
        for rank, (_, reader) in joined.items():
            threading.Thread(target=self._watch, args=(rank, reader), name=f"mlxq-rank{rank}", daemon=True).start()

    def start(self) -> None:
        """Every rank has loaded: from now on, an empty plan whenever the batch is idle."""
        threading.Thread(target=self._keep_alive, name="mlxq-group-keepalive", daemon=True).start()

    def send(self, ops: list[Any]) -> None:
        with self._lock:
            for rank, sock in self._socks.items():
                try:
                    send_frame(sock, ops)
                except OSError as e:
                    _leave(f"rank {rank} did not take the step's plan ({e})")
            self._sent_at = time.monotonic()

    def _keep_alive(self) -> None:
        """While the batch is idle, an empty plan now and then: the followers' sign of life."""
        while True:
            time.sleep(self._stall_s / 4)
            if time.monotonic() - self._sent_at > self._stall_s / 4:
                self.send([])

    def _watch(self, rank: int, reader: Any) -> None:
        """A follower says once whether its shard loaded, then nothing: any read after
        that returning is its end."""
        try:
            loaded = receive_frame(reader)
            if loaded != ["loaded"]:
                _leave(f"rank {rank} could not load its shard: {loaded[1] if isinstance(loaded, list) else loaded}")
            receive_frame(reader)
        except (EOFError, OSError, ValueError):
            pass
        _leave(f"rank {rank} left the group")


def _accept(place: GroupPlace, port: int, stall_s: float) -> dict[int, tuple[socket.socket, Any]]:
    """Each other rank's connection and its reader, told apart by its hello (its rank)."""
    server = socket.create_server(("0.0.0.0", port), reuse_port=False)
    server.settimeout(stall_s)
    joined: dict[int, tuple[socket.socket, Any]] = {}
    try:
        while len(joined) < place.size - 1:
            try:
                sock, _ = server.accept()
            except TimeoutError:
                missing = sorted(set(range(1, place.size)) - joined.keys())
                raise RuntimeError(f"ranks {missing} did not join the group within group_stall_s "
                                   f"({stall_s:g} s)") from None
            sock.settimeout(stall_s)
            reader = sock.makefile("rb")  # the one reader: a second would miss what this one buffered
            try:
                rank = receive_frame(reader)
            except (EOFError, ValueError, OSError, msgpack.UnpackException):
                rank = None  # not one of ours
            if not isinstance(rank, int) or not 0 < rank < place.size or rank in joined:
                sock.close()
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            joined[rank] = (sock, reader)
    finally:
        server.close()
    return joined


def _leave(why: str) -> None:
    try:  # a log whose reader is gone (mlx.launch killed) raises: the exit must not depend on it
        log.critical("the worker group cannot go on; this rank exits", reason=why)
    finally:
        os._exit(1)


class GroupBackend:
    """`BatchBackend` on rank 0: its own batch, with each change and step told to the
    other ranks before the step runs there and here."""

    def __init__(self, plain: MlxBatchBackend, followers: Followers, group: Any) -> None:
        self._plain = plain
        self._followers = followers
        self._group = group
        self._greedy = tokens_for_all(greedy_sampler, group)
        self._ops: list[Any] = []

    def insert(self, prompt: list[int], max_tokens: int, sampler: Sampler,
               logits_processors: list[LogitsProcessor], cached: Coverage | None = None,
               media: PreparedMedia | None = None, logprobs: bool = False, speculative: bool = True,
               cache_salt: str = "", adapter: int = 0) -> int:
        assert cached is None and media is None and not adapter, "a group keeps no caches, media or adapters"
        shared = sampler is greedy_sampler  # the same object for every greedy row, as on the other ranks
        uid = self._plain.insert(prompt, max_tokens, self._greedy if shared else tokens_for_all(sampler, self._group),
                                 logits_processors, logprobs=logprobs)
        self._ops.append(["insert", prompt, max_tokens, GREEDY if shared else f"row{uid}"])
        return uid

    def remove(self, uids: Iterable[int], keep_caches: bool = False) -> dict[int, Coverage]:
        uids = list(uids)
        self._ops.append(["remove", uids])
        self._plain.remove(uids)
        return {}

    def step(self, plan: StepPlan) -> list[TokenOut]:
        self._ops.append(["step", plan.prefill_chunk, plan.prefill_prompts])
        self._followers.send(self._ops)
        self._ops = []
        return self._plain.step(plan)

    def upcoming_tokens(self) -> dict[int, int]:
        return self._plain.upcoming_tokens()

    def close(self) -> None:
        self._followers.send([["close"]])
        self._plain.close()


class LeaderShard:
    """`Sharded` for rank 0's engine process: joins the group, loads shard 0, waits for
    the other ranks to connect."""

    def __init__(self, settings: WorkerSettings, place: GroupPlace) -> None:
        self.settings = settings
        self.place = place
        self.group: Any = None
        self.followers: Followers | None = None

    def load(self, path: str) -> tuple[Any, Any, dict[str, Any]]:
        self.group = mx.distributed.init(strict=True)
        assert self.settings.distributed is not None
        self.followers = Followers(self.place, self.settings.group_port, self.settings.group_stall_s)
        loaded = shard(path, self.settings.distributed, self.group)  # ends in a collective: every rank loaded
        self.followers.start()
        log.info("worker group joined", ranks=self.place.size, mode=self.settings.distributed)
        return loaded

    def backend(self, plain: MlxBatchBackend) -> GroupBackend:
        assert self.followers is not None, "loaded first"
        return GroupBackend(plain, self.followers, self.group)


def replay(ops: list[Any], backend: MlxBatchBackend | None, new_backend: Callable[[], MlxBatchBackend],
           sampler_for: Callable[[str], Sampler]) -> MlxBatchBackend | None:
    """Apply one plan from rank 0 to a follower's batch (made anew after a `close`)."""
    for op in ops:
        kind = op[0]
        if kind == "close":
            if backend is not None:
                backend.close()
            backend = None
            continue
        backend = backend or new_backend()
        if kind == "insert":
            _, prompt, max_tokens, key = op
            backend.insert(prompt, max_tokens, sampler_for(key), [])
        elif kind == "remove":
            backend.remove(op[1])
        elif kind == "step":
            backend.step(StepPlan(op[1], op[2]))
        else:
            raise ValueError(f"unknown plan step {kind!r}")
    return backend


def load_leader(settings: WorkerSettings) -> Loaded:
    """Rank 0's model: its shard, the batch told to the other ranks. A vision model or a
    pooling one is refused: mlx-lm's sharding is for text generation."""
    place = GroupPlace.from_environment()
    if place is None:
        raise RuntimeError("distributed: run the worker under mlx.launch, which tells each rank its place "
                           "(MLX_RANK and MLX_HOSTFILE are not set)")
    assert settings.model is not None
    if is_vision_model(settings.model) or task_of(settings) != "generate":
        raise RuntimeError(f"distributed: {settings.model} is not a text generation model; a worker group shards "
                           "text models through mlx-lm")
    # Each rank would need the same prefix cache entries of its own shard: not yet.
    return load_text_model(settings.model_copy(update={"cache_memory_mb": 0}), LeaderShard(settings, place))
