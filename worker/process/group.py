"""A worker group: one model sharded over several processes (`mx.distributed`, tensor or
pipeline parallel), on one Mac or several, fed from the queue by rank 0.

Every rank runs `mlxq worker` under `mlx.launch`. Rank 0 is an ordinary worker (the only
Redis client); its engine process holds shard 0 and drives the batch. The other ranks
(`worker.process.follower`) hold their shards and replay rank 0's batch: each step, rank
0 sends them what changed (sequences inserted and removed, the step's prefill plan, the
prefix cache entries kept, reused and dropped) over a TCP connection of their own, and
every rank then runs the same step, the shards meeting in the model's collectives.
Each rank keeps its own shard of every prefix cache entry; rank 0's cache decides. Only
rank 0 samples: its sampler's tokens are summed with the followers' zeros (`all_sum`),
so every rank feeds the same next tokens, and logits processors, seeds, stop checks and
detokenizing stay rank 0's alone.

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
from typing import Any, NoReturn

import mlx.core as mx
import msgpack
import structlog
from mlx_lm.sample_utils import LogitsProcessor, Sampler, greedy_sampler

from worker.engine.backends import Coverage, Loaded, TokenOut, is_vision_model, task_of
from worker.engine.backends.mlx_lm import MlxBatchBackend, load_text_model
from worker.engine.prefix_cache import detached_cache, prefix_copy
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
        self._heard = {rank: threading.Event() for rank in joined}  # whether it said how its load went
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

    def hear_loads(self) -> None:
        """Wait (at most `group_stall_s`) until every rank has said how its load went: one
        that failed ends this process with its reason, which rank 0's own load, broken
        by that rank's exit, would otherwise hide (a lost connection)."""
        deadline = time.monotonic() + self._stall_s
        for heard in self._heard.values():
            heard.wait(max(0.0, deadline - time.monotonic()))

    def _watch(self, rank: int, reader: Any) -> None:
        """A follower says once whether its shard loaded, then nothing: any read after
        that returning is its end."""
        try:
            loaded = receive_frame(reader)
            if loaded != ["loaded"]:
                _leave(f"rank {rank} could not load its shard: {loaded[1] if isinstance(loaded, list) else loaded}")
            self._heard[rank].set()
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


def _leave(why: str) -> NoReturn:
    try:  # a log whose reader is gone (mlx.launch killed) raises: the exit must not depend on it
        log.critical("the worker group cannot go on; this rank exits", reason=why)
    finally:
        os._exit(1)


class GroupBackend:
    """`BatchBackend` on rank 0: its own batch, with each change and step told to the
    other ranks before the step runs there and here."""

    def __init__(self, plain: MlxBatchBackend, shard: LeaderShard) -> None:
        self._plain = plain
        self._shard = shard
        self._greedy = tokens_for_all(greedy_sampler, shard.group)

    def insert(self, prompt: list[int], max_tokens: int, sampler: Sampler,
               logits_processors: list[LogitsProcessor], cached: Coverage | None = None,
               media: PreparedMedia | None = None, logprobs: bool = False, speculative: bool = True,
               cache_salt: str = "", adapter: int = 0) -> int:
        assert media is None and not adapter, "a group serves no media or adapters"
        assert cached is None or cached.entry is not None, "a reused cache comes from the prefix cache"
        shared = sampler is greedy_sampler  # the same object for every greedy row, as on the other ranks
        uid = self._plain.insert(prompt, max_tokens,
                                 self._greedy if shared else tokens_for_all(sampler, self._shard.group),
                                 logits_processors, cached, logprobs=logprobs)
        reused = None if cached is None else [cached.entry, len(cached.tokens)]
        self._shard.ops.append(["insert", prompt, max_tokens, GREEDY if shared else f"row{uid}", reused])
        return uid

    def remove(self, uids: Iterable[int], keep_caches: bool = False) -> dict[int, Coverage]:
        uids = list(uids)
        self._shard.ops.append(["remove", uids, keep_caches])
        return self._plain.remove(uids, keep_caches)

    def step(self, plan: StepPlan) -> list[TokenOut]:
        self._shard.ops.append(["step", plan.prefill_chunk, plan.prefill_prompts])
        self._shard.send_ops()
        try:
            return self._plain.step(plan)
        except Exception as e:  # noqa: BLE001 - the other ranks wait in this step's collectives
            _leave(f"a step failed on rank 0 ({e!r}); the other ranks cannot leave it")

    def upcoming_tokens(self) -> dict[int, int]:
        return self._plain.upcoming_tokens()

    def running_cache(self, uid: int) -> Coverage | None:
        return None  # the other ranks keep their shards of an entry only from a finished row

    def close(self) -> None:
        self._shard.ops.append(["close"])
        self._shard.send_ops()
        self._plain.close()


class LeaderShard:
    """`Sharded` for rank 0's engine process: waits for the other ranks to say hello,
    joins the group with them, loads shard 0; then collects what the other ranks must
    replay (the batch's changes, the prefix cache's decisions: it is the cache's
    `Mirror`) and sends it before each step."""

    def __init__(self, settings: WorkerSettings, place: GroupPlace) -> None:
        self.settings = settings
        self.place = place
        self.group: Any = None
        self.followers: Followers | None = None
        self.ops: list[Any] = []  # what the other ranks replay before the next step

    def load(self, path: str) -> tuple[Any, Any, dict[str, Any]]:
        # Every rank says hello first (or the load fails within group_stall_s): joining
        # the group blocks this process, unbounded, until every rank joins.
        self.followers = Followers(self.place, self.settings.group_port, self.settings.group_stall_s)
        self.group = mx.distributed.init(strict=True)
        assert self.settings.distributed is not None
        try:
            loaded = shard(path, self.settings.distributed, self.group)  # ends in a collective: every rank loaded
        except Exception:
            self.followers.hear_loads()  # a rank that failed says why, and this process ends with it
            raise
        self.followers.start()
        log.info("worker group joined", ranks=self.place.size, mode=self.settings.distributed)
        return loaded

    def backend(self, plain: MlxBatchBackend) -> GroupBackend:
        assert self.followers is not None, "loaded first"
        return GroupBackend(plain, self)

    def keep(self, row: int, entry: int) -> None:
        self.ops.append(["keep", row, entry])

    def forget(self, entry: int) -> None:
        self.ops.append(["forget", entry])

    def send_ops(self) -> None:
        assert self.followers is not None, "loaded first"
        self.followers.send(self.ops)
        self.ops = []


class Replica:
    """A follower's batch and its shards of rank 0's prefix cache entries, changed only
    as rank 0's plans say. The batch is made anew after a `close`; the entries last."""

    def __init__(self, new_backend: Callable[[], MlxBatchBackend], sampler_for: Callable[[str], Sampler]) -> None:
        self._new_backend = new_backend
        self._sampler_for = sampler_for
        self._backend: MlxBatchBackend | None = None
        self._finished: dict[int, Coverage] = {}  # the last step's finished rows, until rank 0 says which to keep
        self._entries: dict[int, Coverage] = {}
        self._ops: dict[str, Callable[..., None]] = {
            "insert": self._insert, "remove": self._remove, "step": self._step, "close": self._close,
            "keep": self._keep, "forget": self._forget}

    @property
    def idle(self) -> bool:
        """Whether no batch is open (before the first plan, or after a `close`)."""
        return self._backend is None

    def apply(self, ops: list[Any]) -> None:
        """Apply one plan from rank 0."""
        for kind, *args in ops:
            if kind not in self._ops:
                raise ValueError(f"unknown plan step {kind!r}")
            self._ops[kind](*args)

    def _batch(self) -> MlxBatchBackend:
        self._backend = self._backend or self._new_backend()
        return self._backend

    def _insert(self, prompt: list[int], max_tokens: int, key: str, reused: list[int] | None) -> None:
        cached = None
        if reused is not None:
            entry, count = reused
            stored = self._entries[entry]  # rank 0 forgets no entry before this insert
            cache = prefix_copy(stored.cache, len(stored.tokens), count)
            assert cache is not None, "rank 0 cut the same cache"
            cached = Coverage(cache, stored.tokens[:count])
        self._batch().insert(prompt, max_tokens, self._sampler_for(key), [], cached)

    def _remove(self, uids: list[int], keep_caches: bool) -> None:
        self._finished.update(self._batch().remove(uids, keep_caches))

    def _step(self, prefill_chunk: int, prefill_prompts: int) -> None:
        tokens = self._batch().step(StepPlan(prefill_chunk, prefill_prompts))
        # Rank 0 has said which of the last step's to keep: this step's replace them.
        self._finished = {t.uid: t.coverage for t in tokens if t.coverage is not None}

    def _keep(self, row: int, entry: int) -> None:
        finished = self._finished.pop(row)
        self._entries[entry] = Coverage(detached_cache(finished.cache), finished.tokens)

    def _forget(self, entry: int) -> None:
        del self._entries[entry]

    def _close(self) -> None:
        if self._backend is not None:
            self._backend.close()
        self._backend = None
        self._finished = {}


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
    return load_text_model(settings, LeaderShard(settings, place))
