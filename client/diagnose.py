"""Why a Redis call failed, in words a person can act on (the worker, the CLI and the client share it)."""

from __future__ import annotations

import socket
import ssl
from urllib.parse import urlsplit

from redis.exceptions import AuthenticationError, ResponseError

SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "redis+cluster", "rediss+cluster")


def redis_url_problem(url: str) -> str | None:
    """What is wrong with a Redis URL, or None: redis-py's own error for a missing scheme
    is a traceback away from the user."""
    scheme = urlsplit(url).scheme if "://" in url else ""
    if scheme not in SCHEMES:
        example = url.split("://")[-1] or "host:6379"
        return (f"{url!r} is not a Redis URL: write redis://{example} (rediss:// for TLS, "
                "unix:///path/to.sock for a socket, redis+sentinel://host:port,host:port/<primary> for Sentinel, "
                "redis+cluster://host:port,host:port for a Redis Cluster)")
    from .connect import parse_cluster_url, parse_sentinel_url

    parse = {"redis+sentinel": parse_sentinel_url, "redis+cluster": parse_cluster_url,
             "rediss+cluster": parse_cluster_url}.get(scheme)
    try:
        if parse is not None:
            parse(url)
    except ValueError as e:
        return f"{redacted(url)}: {e}"
    return None


def redacted(url: str) -> str:
    """The URL as it may be logged or printed: its password replaced by `***`."""
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    user, colon, password = userinfo.partition(":")
    if not password:
        return url
    return parts._replace(netloc=f"{user}:***@{hosts}").geturl()


def reply_code(error: BaseException) -> str | None:
    """The code of a Redis error reply (`NOPERM`, `BUSY`, ...), or None for other errors."""
    code = getattr(error, "status_code", None)  # redis-py strips the codes it knows from the message
    if code:
        return str(code)
    if not isinstance(error, ResponseError):
        return None
    first = str(error).split(" ", 1)[0]
    return first if first.isupper() else "ERR"


def describe(error: BaseException) -> str:
    """Why a Redis call failed, in words a person can act on: the cause's own message
    (certificate, DNS, refused, auth) rather than redis-py's bare class name."""
    for cause in _chain(error):
        if isinstance(cause, ssl.SSLCertVerificationError):
            return f"TLS certificate rejected: {cause.verify_message or cause}"
        if isinstance(cause, ssl.SSLError):
            return f"TLS failed: {cause}"
        if isinstance(cause, socket.gaierror):
            return f"host name not resolved: {cause}"
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused: is Redis running on that host and port?"
    if isinstance(error, AuthenticationError):
        return f"authentication failed: {error} (check the user and password in the URL)"
    code = reply_code(error)
    if code is not None:
        text = str(error)
        return text if text.startswith(code) else f"{code} {text}"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _chain(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    seen: BaseException | None = error
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    return chain
