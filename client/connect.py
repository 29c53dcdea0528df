"""Redis clients from a URL, the one place that knows the URL forms mlxq accepts:

    redis://[user:password@]host:port[/db]        rediss:// for TLS (ssl_* in the query)
    unix:///path/to.sock
    redis+sentinel://[user:password@]host:port,host:port,.../<primary name>[/db]

The last asks the Sentinels which server is the primary now, and again after each
failover (redis-py's `Sentinel`); the user and password are the primary's. Query
arguments (`socket_timeout`, `ssl_*`, ...) go to the connections as with redis-py's
`from_url`; `sentinel_password` to the Sentinels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis as redis_py
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.sentinel import Sentinel

SENTINEL_SCHEME = "redis+sentinel"


@dataclass(frozen=True)
class SentinelTarget:
    """What a `redis+sentinel://` URL names."""

    sentinels: list[tuple[str, int]]
    primary: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def connection_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        given = {"db": self.db, "username": self.username, "password": self.password, **self.options, **kwargs}
        return {k: v for k, v in given.items() if v is not None}

    def sentinel_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        """For the connections to the Sentinels: their password, and the primary's socket timeout."""
        given = {"password": self.sentinel_password, "socket_timeout": kwargs.get("socket_timeout")}
        return {k: v for k, v in given.items() if v is not None}


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The Sentinels, the primary's name and the options of a `redis+sentinel://` URL;
    raises ValueError saying what is wrong."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    sentinels = []
    for host in filter(None, hosts.split(",")):
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"{host!r}: give each Sentinel as host:port")
        sentinels.append((name, int(port)))
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError("write redis+sentinel://host:port,host:port/<primary name>[/db]")
    options: dict[str, Any] = dict(parse_qsl(parts.query))
    sentinel_password = options.pop("sentinel_password", None)
    for name in ("socket_timeout", "socket_connect_timeout"):
        if name in options:
            options[name] = float(options[name])
    return SentinelTarget(sentinels, path[0], int(path[1]) if len(path) == 2 else 0, unquote(username) or None,
                          unquote(password) or None, sentinel_password, options)


def connect(url: str, **kwargs: Any) -> redis_py.Redis:
    """A blocking client for `url`."""
    if url.startswith(SENTINEL_SCHEME + "://"):
        target = parse_sentinel_url(url)
        sentinel = Sentinel(target.sentinels, sentinel_kwargs=target.sentinel_kwargs(**kwargs))
        return sentinel.master_for(target.primary, **target.connection_kwargs(**kwargs))
    return redis_py.Redis.from_url(url, **kwargs)


def connect_async(url: str, **kwargs: Any) -> aioredis.Redis:
    """An asyncio client for `url`."""
    if url.startswith(SENTINEL_SCHEME + "://"):
        target = parse_sentinel_url(url)
        sentinel = AsyncSentinel(target.sentinels, sentinel_kwargs=target.sentinel_kwargs(**kwargs))
        return sentinel.master_for(target.primary, **target.connection_kwargs(**kwargs))
    return aioredis.Redis.from_url(url, **kwargs)

