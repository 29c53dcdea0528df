"""`mlxq status`: the fleet on one screen, from Redis alone (base install)."""

from __future__ import annotations

import json
import time
from typing import Any

import redis as redis_py

from client.engine_stats import CacheStats
from client.fleet import Fleet, StreamView, WorkerView, read_fleet
from client.heartbeat import PLACEMENTS
from client.hosts import HostedModel
from client.keys import Keys


def run(redis: redis_py.Redis, keys: Keys, queues: list[str], as_json: bool, watch_s: float | None) -> int:
    """Print the fleet once, or every `watch_s` until interrupted."""
    while True:
        fleet = read_fleet(redis, keys, queues)
        if queues:  # those queues alone (each shown even where no worker serves it)
            fleet = fleet.only(queues)
        if as_json:
            print(json.dumps(fleet.as_json()), flush=True)
        else:
            if watch_s is not None:
                print("\033[H\033[J", end="")  # clear the terminal, as `watch` does
            print(render(fleet), flush=True)
        if watch_s is None:
            return 0
        time.sleep(watch_s)


def render(fleet: Fleet) -> str:
    """The fleet as two tables, streams then workers, and the workers' last errors."""
    states = [w.state for w in fleet.workers]
    summary = ", ".join(f"{states.count(s)} {s}" for s in ("ready", "draining", "stopped", "gone") if s in states)
    lines = [f"mlxq status at {time.strftime('%Y-%m-%d %H:%M:%S')}: {summary or 'no workers seen in the last hour'}",
             ""]
    lines += _table(["QUEUE", "LANE", "LENGTH", "WAITING", "OLDEST", "IN FLIGHT", "DEAD", "BOUND"],
                    [_stream_row(s) for s in fleet.streams]) or ["(no queues)"]
    lines.append("")
    lines += _table(["WORKER", "STATE", "HOST", "QUEUE", "MODEL", "RUN/WAIT", "TOK/S", "REQUESTS", "TOKENS",
                     "ERRORS", "PREFIX HIT", "DIGEST", "PLACED", "VISION HIT", "MLX MEM", "VERSION", "BLAS", "SEEN"],
                    [_worker_row(w) for w in fleet.workers]) or ["(no workers)"]
    if fleet.models:
        lines.append("")
        lines += _table(["WORKER OF MODELS", "MODEL", "STATE", "PIN", "GB", "PATH"],
                        [_hosted_row(m) for m in fleet.models])
    if fleet.batches:
        lines.append("")
        lines += _table(["BATCH", "STATUS", "QUEUE", "COMPLETED", "FAILED", "TOTAL", "TOKENS", "AGE"],
                        [[b.id, b.status, b.queue, str(b.completed), str(b.failed), str(b.total), str(b.tokens),
                          _ago(time.time() - b.created_at)] for b in fleet.batches])
    errors = [f"  {w.name}: {e.get('code')} {e.get('message', '')[:120]!r} ({_ago(time.time() - e['at'])} ago)"
              for w in fleet.workers if (e := w.heartbeat.last_error) and "at" in e]
    if errors:
        lines += ["", "last errors:", *errors]
    return "\n".join(lines)


def _hosted_row(m: HostedModel) -> list[str]:
    gb = "-" if m.memory_bytes is None else f"{m.memory_bytes / 1024 ** 3:.2f}"
    return [m.host, m.name, m.state if m.failed is None else f"failed: {m.failed}", "yes" if m.pin else "-", gb, m.path]


def _stream_row(s: StreamView) -> list[str]:
    return [s.queue, s.lane or "-", str(s.length), str(s.waiting), _ago(s.oldest_waiting_s), str(s.pending),
            str(s.dead), "-" if not s.max_len else str(s.max_len)]


def _worker_row(w: WorkerView) -> list[str]:
    beat, totals = w.heartbeat, w.totals
    requests = sum(n for name, n in totals.items() if name.startswith(("finished:", "errors:")))
    errors = " ".join(f"{name.removeprefix('errors:')}={n}" for name, n in sorted(totals.items())
                      if name.startswith("errors:") and n) or "-"
    stats, model = beat.stats, beat.model
    running = f"{stats.running}/{stats.waiting}" if w.alive and stats else "-"
    served = _model(model.path if model else None) + (f" ({model.task})" if model and model.task != "generate" else "")
    return [w.name, w.state, beat.host, model.queue if model else "?", served,
            running, str(beat.tok_s if beat.tok_s is not None else "-") if w.alive else "-", str(requests),
            str(totals.get("generation_tokens", 0)), errors, _rate(stats.prefix_cache if stats else None),
            _digest(beat.placement), _placed(totals), _rate(stats.vision_cache if stats else None),
            _bytes(stats.memory.get("active") if stats else None),
            beat.version, beat.blas, _ago(w.last_seen_s) + " ago"]


def _digest(placement: dict[str, Any] | None) -> str:
    """The hashes its prefix cache's digest lists (placement by prefix), or off."""
    if not placement or not placement.get("enabled"):
        return "off"
    return str(placement.get("digest", 0))


def _placed(totals: dict[str, int]) -> str:
    """Its requests placed by prefix, by reason (`worker.queue.affinity`)."""
    return " ".join(f"{reason}={totals[f'placed:{reason}']}" for reason in PLACEMENTS
                    if totals.get(f"placed:{reason}")) or "-"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in [header, *rows]]


def _model(name: Any) -> str:
    text = str(name or "?")
    return text if len(text) <= 32 else "..." + text[-29:]


def _rate(cache: CacheStats | None) -> str:
    rate = None if cache is None else cache.hit_rate
    return "-" if rate is None else f"{100 * rate:.0f}%"


def _bytes(n: Any) -> str:
    if not isinstance(n, int):
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return "-"


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"

