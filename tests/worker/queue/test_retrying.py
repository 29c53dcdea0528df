"""`retrying` rides out an unreachable Redis but never swallows a cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from redis._parsers.base import BaseParser  # how redis-py turns an error reply into an exception
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from structlog.testing import capture_logs
from support import free_port

from worker.queue.retrying import describe, is_permission_error, is_transient, retrying


@contextlib.contextmanager
def fast_backoff() -> Iterator[None]:
    """Retries without pauses (the jitter factor is 0)."""
    with mock.patch("worker.queue.retrying.random.uniform", return_value=0.0):
        yield


@contextlib.contextmanager
def tls_server() -> Iterator[int]:
    """A TLS listener with a self-signed certificate (made by openssl): the handshake
    fails on the client's side, as with a Redis whose certificate is not trusted."""
    with tempfile.TemporaryDirectory() as tmp:
        key, cert = Path(tmp, "key.pem"), Path(tmp, "cert.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                        str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]

        def serve() -> None:
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = listener.accept()
                    with contextlib.suppress(OSError, ssl.SSLError), context.wrap_socket(conn, server_side=True):
                        pass

        threading.Thread(target=serve, daemon=True).start()
        try:
            yield port
        finally:
            listener.close()


async def test_transient_errors_are_retried_until_the_call_succeeds():
    calls = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise RedisConnectionError("refused")
        return "ok"

    assert await retrying(flaky, "a test") == "ok"
    assert len(calls) == 3


async def test_a_cancellation_that_comes_back_as_a_connection_error_still_cancels():
    """A Redis client that turns the cancellation of a blocked read into a connection
    error must not make the loop retry forever: that hung a worker's shutdown."""
    async def read() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RedisConnectionError("connection closed by cancellation") from None

    task = asyncio.create_task(retrying(read, "a test"))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=2)


# ---- which failures pass, and what the log says -------------------------------------

@pytest.mark.parametrize(("reply", "transient"), [
    ("BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.", True),
    ("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.", True),
    ("TRYAGAIN Multiple keys request during rehashing of slot", True),
    ("CLUSTERDOWN The cluster is down", True),
    ("WRONGTYPE Operation against a key holding the wrong kind of value", False),
    ("ERR unknown command 'FOO'", False),
])
def test_error_replies_are_told_apart_by_their_code(reply, transient):
    """The replies Redis gives while busy or changing role pass; answers about a key or a command do not."""
    error = BaseParser.parse_error(reply)
    assert is_transient(error) is transient


def test_redis_py_classes_for_oom_loading_readonly_and_noperm():
    """redis-py strips the codes it knows into classes: OOM, LOADING and READONLY still
    pass, NOPERM is a permission error and does not."""
    for reply in ("OOM command not allowed when used memory > 'maxmemory'.", "LOADING Redis is loading",
                  "READONLY You can't write against a read only replica."):
        assert is_transient(BaseParser.parse_error(reply)), reply
    denied = BaseParser.parse_error("NOPERM this user has no permissions to run the 'xadd' command")
    assert not is_transient(denied) and is_permission_error(denied)
    assert describe(denied).startswith("NOPERM this user has no permissions")


async def test_connection_failures_say_why():
    """Refused, unknown host and a certificate Redis's TLS port would not accept are each
    described by their cause, not by redis-py's bare class name."""
    import redis.asyncio as aioredis

    async def failure(url: str, **kwargs: object) -> str:
        client = aioredis.Redis.from_url(url, socket_timeout=2, **kwargs)
        try:
            await client.ping()
        except RedisError as e:
            return describe(e)
        finally:
            await client.aclose()
        raise AssertionError("connected")

    assert (await failure(f"redis://127.0.0.1:{free_port()}")).startswith("connection refused")
    assert (await failure("redis://no-such-host.invalid:6379")).startswith("host name not resolved")
    with tls_server() as port:
        assert (await failure(f"rediss://127.0.0.1:{port}")).startswith("TLS certificate rejected: self-signed")


async def test_an_outage_is_logged_when_it_starts_changes_and_ends_not_per_retry():
    """Ten failed attempts with one cause, then another cause, then success: three log lines."""
    attempts = []

    async def flaky() -> str:
        attempts.append(1)
        if len(attempts) <= 10:
            raise RedisConnectionError("Connection refused")
        if len(attempts) <= 12:
            raise BaseParser.parse_error("LOADING Redis is loading the dataset in memory")
        return "ok"

    with capture_logs() as logs, fast_backoff():
        assert await retrying(flaky, "a test") == "ok"
    events = [entry["event"] for entry in logs]
    assert events == ["redis unavailable; retrying until it answers"] * 2 + ["redis answers again"]
    assert "LOADING" in logs[1]["reason"]
