"""Which Redis, when none is named: one answer for the client, every command, the worker
and the gateway.

    1. a URL given to it: `Client(url)`, `--redis-url`, a TOML's `redis_url`
    2. $MLXQ_REDIS_URL
    3. the embedded Valkey on 127.0.0.1, at $MLXQ_EMBEDDED_PORT (else 6390)

A worker with none of 1 and 2 starts that embedded server (or reuses it); the others
connect to it. (The worker's and gateway's TOML sits between 2 and 3, as their settings'
layers have it: flags > environment > file > defaults.)
"""

from __future__ import annotations

import os
from collections.abc import Mapping

EMBEDDED_PORT = 6390
DEFAULT_URL = f"redis://127.0.0.1:{EMBEDDED_PORT}"  # the embedded Valkey's, on its default port


def embedded_port(environ: Mapping[str, str] = os.environ) -> int:
    """The embedded Valkey's port: $MLXQ_EMBEDDED_PORT, else 6390."""
    given = environ.get("MLXQ_EMBEDDED_PORT", "")
    return int(given) if given.isdigit() and 0 < int(given) < 65536 else EMBEDDED_PORT


def embedded_url(port: int | None = None) -> str:
    return f"redis://127.0.0.1:{embedded_port() if port is None else port}"


def default_url(environ: Mapping[str, str] = os.environ) -> str:
    """The Redis to use when none is given: $MLXQ_REDIS_URL, else the embedded Valkey's."""
    return environ.get("MLXQ_REDIS_URL") or embedded_url(embedded_port(environ))
