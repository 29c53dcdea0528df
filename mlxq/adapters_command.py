"""`mlxq adapters`: load, unload and list the LoRA adapters of a queue's workers at runtime.

`load` and `unload` write the queue's adapters hash (`mlxq:adapters:<queue>`); each
worker of the queue reads it within a heartbeat and serves the change without a restart
(running requests go on), and workers started later serve the same. The command then
waits for every live worker to say what it made of it in its heartbeat.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from client.fleet import WorkerView, read_workers
from client.keys import Keys

from .client_commands import connect
from .errors import CommandError

POLL_S = 0.2


def run(args: argparse.Namespace) -> int:
    redis, keys = connect(args), Keys(args.prefix)
    if args.action == "list":
        print(render(_serving(redis, keys, args.queue), args.queue))
        return 0
    if not args.name:
        raise CommandError(f"mlxq adapters {args.action}: name the adapter", status=2)
    path = ""
    if args.action == "load":
        if not args.path:
            raise CommandError("mlxq adapters load: give the adapter's directory after its name", status=2)
        path = str(Path(args.path).expanduser().absolute())  # as each worker's host sees it
    redis.hset(keys.adapters(args.queue), args.name, path)
    return _wait(redis, keys, args.queue, args.name, path, args.wait)


def _serving(redis: Any, keys: Keys, queue: str) -> list[WorkerView]:
    return [w for w in read_workers(redis, keys) if w.alive and w.heartbeat.serves(queue)]


def _outcome(worker: WorkerView, name: str, path: str) -> str | None:
    """What `worker` made of the change, once its heartbeat shows it; None before."""
    stats = worker.heartbeat.stats
    if stats is None:
        return None
    if stats.adapters is None:
        return "serves no adapters (a vision model, speculative decoding or kv_bits)"
    entry = next((a for a in stats.adapters if a.get("name") == name), None)
    if not path:
        return "unloaded" if entry is None else None
    if entry is None or entry.get("path") != path:
        return None
    return f"refused: {entry['error']}" if "error" in entry else f"loaded (rank {entry.get('rank', '?')})"


def _wait(redis: Any, keys: Keys, queue: str, name: str, path: str, wait_s: float) -> int:
    deadline = time.monotonic() + wait_s
    while True:
        workers = _serving(redis, keys, queue)
        outcomes = {w.name: _outcome(w, name, path) for w in workers}
        if all(outcomes.values()) or time.monotonic() > deadline:
            break
        time.sleep(POLL_S)
    if not workers:
        print(f"no live worker serves {queue}; workers of it serve {name!r} as they start")
        return 0
    for worker, outcome in sorted(outcomes.items()):
        print(f"{worker}: {outcome or f'no answer within {wait_s:g} s'}")
    ok = ("loaded", "unloaded")
    return 0 if all(o is not None and o.startswith(ok) for o in outcomes.values()) else 1


def render(workers: list[WorkerView], queue: str) -> str:
    if not workers:
        return f"no live worker serves {queue}"
    lines = []
    for worker in workers:
        adapters = None if worker.heartbeat.stats is None else worker.heartbeat.stats.adapters
        if adapters is None:
            lines.append(f"{worker.name}: no adapters served")
            continue
        lines.append(f"{worker.name}: {len(adapters)} adapter(s)")
        for a in adapters:
            state = f"refused: {a['error']}" if "error" in a else \
                f"rank {a.get('rank', '?')}, {a.get('running', 0)} running, {a.get('requests', 0)} started" \
                if a.get("loaded") else f"on disk, {a.get('requests', 0)} started"
            lines.append(f"  {a.get('name')}  {a.get('path')}  ({state})")
    return "\n".join(lines)
