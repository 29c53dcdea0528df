"""A worker group's rank 1, 2, ...: its shard of the model, in step with rank 0.

Started as `mlxq worker` under `mlx.launch` (like rank 0, with the same settings), it
opens no Redis connection: it says hello to rank 0's engine process (`group_port`),
joins the group, loads its shard and replays each step's plan (`worker.process.group`). It
exits 0 when rank 0 closes after a drain, 1 when rank 0 is gone or silent for
`group_stall_s` (mlx.launch then stops the other ranks).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import mlx.core as mx
import structlog
from mlx_lm.sample_utils import Sampler

from worker.engine.backends.mlx_lm import plain_backend
from worker.process.group import GREEDY, Replica, receive_frame, send_frame, shard, tokens_from_rank0
from worker.process.group_place import GroupPlace
from worker.settings import WorkerSettings

log = structlog.get_logger("mlxq.group")

CONNECT_RETRY_S = 0.2
RANK0_START_S = 120.0  # rank 0 listens once its worker and engine process are up: seconds, not this


def follow(settings: WorkerSettings, place: GroupPlace) -> int:
    """Serve rank 0's plans until it closes; the exit status."""
    assert settings.model is not None and settings.distributed is not None
    sock = _connect(place, settings)  # rank 0 joins the group once every rank has said hello
    group = mx.distributed.init(strict=True)
    try:
        model = shard(settings.model, settings.distributed, group)[0]
    except Exception as e:  # noqa: BLE001 - rank 0 says why the group cannot start
        log.critical("could not load this rank's shard", rank=place.rank, error=repr(e))
        send_frame(sock, ["failed", f"{type(e).__name__}: {e}"[:2000]])
        return 1
    send_frame(sock, ["loaded"])
    log.info("following rank 0", rank=place.rank, ranks=place.size, mode=settings.distributed)
    replica = Replica(lambda: plain_backend(model, settings), _samplers(tokens_from_rank0(group), group))
    reader = sock.makefile("rb")
    while True:
        try:
            ops = receive_frame(reader)
        except (EOFError, OSError) as e:
            closed = replica.idle
            (log.info if closed else log.critical)("rank 0 is gone", rank=place.rank, after_close=closed,
                                                   reason=repr(e))
            return 0 if closed else 1
        replica.apply(ops)


def _samplers(shared: Sampler, group: object) -> Callable[[str], Sampler]:
    """Each row's sampler as rank 0 keys it: one object for every greedy row (so the batch
    samples them in one call, as rank 0's does), a new one for any other row."""
    def sampler_for(key: str) -> Sampler:
        return shared if key == GREEDY else tokens_from_rank0(group)
    return sampler_for


def _connect(place: GroupPlace, settings: WorkerSettings) -> socket.socket:
    """Say hello to rank 0's engine process, which listens once it has started (and
    then waits group_stall_s for every rank's hello)."""
    deadline = time.monotonic() + RANK0_START_S + settings.group_stall_s
    while True:
        try:
            sock = socket.create_connection((place.leader, settings.group_port), timeout=settings.group_stall_s)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0 ({place.leader}:{settings.group_port}) did not answer within "
                                   f"{RANK0_START_S + settings.group_stall_s:g} s") from None
            time.sleep(CONNECT_RETRY_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    send_frame(sock, place.rank)
    sock.settimeout(settings.group_stall_s)  # rank 0 sends at least every group_stall_s / 4
    return sock
