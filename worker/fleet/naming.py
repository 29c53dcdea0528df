"""Consumer names: never two live workers under one name.

A worker's name is its consumer in the group and the key of its heartbeat; its pending
entries are filed under it. Two live workers sharing one would keep each other's
heartbeat alive, so a dead one's entries would never be taken over. A name is taken by
writing its heartbeat only where no live worker's heartbeat is (`scripts.CLAIM_NAME`).
A heartbeat left by a process of this host that no longer runs is a dead worker's, so
its name is free at once: a restarted worker gets its old name back and resumes its own
pending entries. (Host names must be unique per pid namespace: containers that share
one hostname would take each other for this host's processes.) A name asked for that
another host's heartbeat holds is waited for until that heartbeat would have expired:
a container recreated under a new hostname gets its name back once the old one's
heartbeat lapses, while a live holder keeps renewing it and the newcomer is refused.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Iterable
from functools import partial

import structlog

from client.heartbeat import Heartbeat
from worker.fleet.membership import Membership
from worker.queue.retrying import retrying
from worker.settings import WorkerSettings

log = structlog.get_logger("mlxq.worker")

MAX_INDEX = 1024  # workers on one host, when names are picked
MAX_LAPSE_WAIT_S = 120.0  # longest wait for a held name's heartbeat to lapse


class NameTaken(RuntimeError):
    """The consumer name asked for is held by a live worker."""


async def claim_consumer_name(membership: Membership, settings: WorkerSettings,
                              heartbeat: Callable[[str], str], ttl_s: float) -> str:
    """Take `settings.consumer`, or `<host>-<worker_index>`, or, with neither given, the
    lowest free `<host>-<n>`; `heartbeat(name)` is the value written under the name.
    Raises `NameTaken` if a name asked for is held by a live worker."""
    host = socket.gethostname()
    explicit = settings.consumer or (None if settings.worker_index is None else f"{host}-{settings.worker_index}")
    names: Iterable[str] = [explicit] if explicit else (f"{host}-{i}" for i in range(MAX_INDEX))
    for name in names:
        held = await _claim(membership, name, heartbeat(name), ttl_s, host)
        if held is not None and explicit and _host_of(held) != host:  # alive or not: unknowable
            lapses_in_s = await retrying(partial(membership.heartbeat_ttl_s, name), "reading a heartbeat's TTL")
            log.info("the consumer name is held; waiting for its heartbeat to lapse", name=name, holder=_describe(held),
                     wait_s=round(lapses_in_s, 1))
            held = await _claim_when_lapsed(membership, name, heartbeat(name), ttl_s, host, lapses_in_s)
        if held is None:
            return name
        if explicit:
            raise NameTaken(f"the consumer name {name!r} is held by a live worker ({_describe(held)}); "
                            f"give this one another --consumer or --worker-index, or none to pick a free one")
    raise NameTaken(f"no free consumer name on {host}: {MAX_INDEX} workers are alive here")


async def _claim(membership: Membership, name: str, heartbeat: str, ttl_s: float, host: str) -> bytes | None:
    """Take `name` if free or left by a dead process of this host; else the holder's heartbeat."""
    claim = partial(membership.claim_name, name, heartbeat, ttl_s)
    held = await retrying(claim, "claiming a consumer name")
    if held is not None and _left_by_dead_process(held, host):
        held = await retrying(partial(claim, replacing=held), "claiming a consumer name")
    return held


async def _claim_when_lapsed(membership: Membership, name: str, heartbeat: str, ttl_s: float,
                             host: str, lapses_in_s: float) -> bytes | None:
    """Try again until the holder's heartbeat would have lapsed (a live holder renews it);
    None once taken."""
    deadline = time.monotonic() + min(lapses_in_s, MAX_LAPSE_WAIT_S) + 1.0
    while True:
        await asyncio.sleep(0.25)
        held = await _claim(membership, name, heartbeat, ttl_s, host)
        if held is None or time.monotonic() > deadline:
            return held


def _host_of(held: bytes) -> str | None:
    beat = Heartbeat.from_json(held)
    return None if beat is None else beat.host


def _left_by_dead_process(held: bytes, host: str) -> bool:
    """Whether the heartbeat is of a process on this host that is gone."""
    beat = Heartbeat.from_json(held)
    if beat is None or beat.host != host or beat.pid is None:
        return False
    pid = beat.pid
    if pid == os.getpid():  # our own pid, and we have not written yet: an earlier run (a restarted container)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _describe(held: bytes) -> str:
    beat = Heartbeat.from_json(held) or Heartbeat("?")
    queue = beat.model.queue if beat.model else "?"
    return f"host {beat.host}, pid {beat.pid if beat.pid is not None else '?'}, queue {queue}"
