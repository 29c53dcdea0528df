"""The adapters a worker serves: its settings' and those loaded at runtime for its queue.

`mlxq adapters load|unload` writes the queue's hash (`Keys.adapters`: name -> path, an
empty path unloading one the settings name); every worker of the queue reads it each
heartbeat and has its engine serve the result, so a worker started later serves the
same, and a missed read is made good by the next one. What each worker made of it
(loaded, or refused and why) is in its heartbeat's `adapters`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any

import structlog
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from client.keys import Keys
from worker.queue.retrying import describe, is_permission_error, retrying
from worker.settings import AdapterEntry, WorkerSettings

log = structlog.get_logger("mlxq.worker")
Adapters = tuple[tuple[str, str], ...]  # (name, path), by name


def wanted_adapters(settings: WorkerSettings, runtime: dict[Any, Any]) -> Adapters:
    """The settings' adapters, overridden by the queue's runtime ones."""
    wanted = {entry.name: entry.path for entry in settings.adapters}
    for raw_name, raw_path in runtime.items():
        name, path = _text(raw_name), _text(raw_path)
        if path and not _valid(name, path):
            continue
        wanted[name] = path
    return tuple(sorted((name, path) for name, path in wanted.items() if path))


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _valid(name: str, path: str) -> bool:
    try:
        AdapterEntry(name=name, path=path)
    except ValidationError as e:
        log.warning("ignoring a runtime adapter", adapter=name[:200], error=str(e.errors()[0]["msg"]))
        return False
    return True


async def follow_adapters(redis: Redis, keys: Keys, settings: WorkerSettings,
                          serve: Callable[[Adapters], None]) -> None:
    """Have the engine serve the queue's adapters, as they change. Under an ACL that keeps
    the hash from this worker, it serves its settings' adapters alone (said once)."""
    served = wanted_adapters(settings, {})  # what the engine loaded at start
    refused = False
    while True:
        try:
            runtime = await retrying(partial(redis.hgetall, keys.adapters(settings.queue)),  # type: ignore[arg-type]
                                     "reading the queue's adapters")
        except RedisError as e:
            if not is_permission_error(e):
                raise
            if not refused:
                log.warning("redis refuses the queue's runtime adapters to this worker; it serves its settings' "
                            "alone", key=keys.adapters(settings.queue), reason=describe(e))
            refused, runtime = True, {}
        wanted = wanted_adapters(settings, runtime)
        if wanted != served:
            serve(wanted)
            served = wanted
        await asyncio.sleep(settings.heartbeat_s)
