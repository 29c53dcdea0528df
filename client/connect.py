"""Redis clients from a URL, the one place that knows the URL forms mlxq accepts:

    redis://[user:password@]host:port[/db]        rediss:// for TLS (ssl_* in the query)
    unix:///path/to.sock
    redis+sentinel://[user:password@]host:port,host:port,.../<primary name>[/db]
    redis+cluster://[user:password@]host:port[,host:port...]   rediss+cluster:// for TLS

A Sentinel URL asks the Sentinels which server is the primary now, and again after each
failover (redis-py's `Sentinel`); the user and password are the primary's. A cluster URL
names one or more nodes of a Redis Cluster; the client learns the rest and follows
slots as they move (redis-py's `RedisCluster`). Query arguments (`socket_timeout`,
`ssl_*`, ...) go to the connections as with redis-py's `from_url`; `sentinel_password`
to the Sentinels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import redis as redis_py
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster as cluster
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.sentinel import Sentinel

SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
NUMBER_OPTIONS = ("socket_timeout", "socket_connect_timeout")


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
    username, password, sentinels = _servers(parts.netloc, "Sentinel")
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError("write redis+sentinel://host:port,host:port/<primary name>[/db]")
    options: dict[str, Any] = dict(parse_qsl(parts.query))
    sentinel_password = options.pop("sentinel_password", None)
    _numbers(options)
    return SentinelTarget(sentinels, path[0], int(path[1]) if len(path) == 2 else 0, username, password,
                          sentinel_password, options)


@dataclass(frozen=True)
class ClusterTarget:
    """What a `redis+cluster://` URL names: some of the cluster's nodes, and the options."""

    nodes: list[tuple[str, int]]
    options: dict[str, Any]


def parse_cluster_url(url: str) -> ClusterTarget:
    """The nodes and options of a `redis+cluster://` URL; raises ValueError saying what is wrong."""
    parts = urlsplit(url)
    username, password, nodes = _servers(parts.netloc, "cluster node")
    if not nodes or parts.path.strip("/"):
        raise ValueError("write redis+cluster://host:port[,host:port...] (a cluster has no databases)")
    options: dict[str, Any] = dict(parse_qsl(parts.query))
    _numbers(options)
    given = {"username": username, "password": password, "ssl": parts.scheme == "rediss+cluster" or None}
    return ClusterTarget(nodes, {**{k: v for k, v in given.items() if v is not None}, **options})


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0] in CLUSTER_SCHEMES


def connect(url: str, **kwargs: Any) -> redis_py.Redis:
    """A blocking client for `url`."""
    if is_cluster_url(url):
        shape = parse_cluster_url(url)
        nodes = [cluster.ClusterNode(host, port) for host, port in shape.nodes]
        return cluster.RedisCluster(startup_nodes=nodes, **{**shape.options, **kwargs})  # type: ignore[return-value]
    if url.startswith(SENTINEL_SCHEME + "://"):
        target = parse_sentinel_url(url)
        sentinel = Sentinel(target.sentinels, sentinel_kwargs=target.sentinel_kwargs(**kwargs))
        return sentinel.master_for(target.primary, **target.connection_kwargs(**kwargs))
    return redis_py.Redis.from_url(url, **kwargs)


def connect_async(url: str, **kwargs: Any) -> aioredis.Redis:
    """An asyncio client for `url`."""
    if is_cluster_url(url):
        shape = parse_cluster_url(url)
        nodes = [aiocluster.ClusterNode(host, port) for host, port in shape.nodes]
        return _AsyncCluster(startup_nodes=nodes, **{**shape.options, **kwargs})  # type: ignore[return-value]
    if url.startswith(SENTINEL_SCHEME + "://"):
        target = parse_sentinel_url(url)
        sentinel = AsyncSentinel(target.sentinels, sentinel_kwargs=target.sentinel_kwargs(**kwargs))
        return sentinel.master_for(target.primary, **target.connection_kwargs(**kwargs))
    return aioredis.Redis.from_url(url, **kwargs)


async def close_async(redis: aioredis.Redis) -> None:
    """Close an asyncio client and, for one a Sentinel gave (`connect_async`), that
    Sentinel's own connections to the sentinels, which the client's close leaves open."""
    await redis.aclose()
    pool = getattr(redis, "connection_pool", None)  # a cluster client has none
    sentinels = getattr(pool, "sentinel_manager", None)
    if sentinels is not None:
        await sentinels.aclose()


class _AsyncCluster(aiocluster.RedisCluster):
    """redis-py's asyncio cluster client, made ready before its first command: left to
    itself, many coroutines making their first calls together break each other's
    connections ("'NoneType' object has no attribute 'writelines'", redis-py 8.1)."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize:
            await self.initialize()  # once: it holds a lock, and the first caller clears the flag
        return await super().execute_command(*args, **kwargs)


def is_cluster(redis: Any) -> bool:
    """Whether a client talks to a Redis Cluster (where no command may span two slots)."""
    return isinstance(redis, (cluster.RedisCluster, aiocluster.RedisCluster))


def _servers(netloc: str, kind: str) -> tuple[str | None, str | None, list[tuple[str, int]]]:
    """The user, the password and the host:port list of a URL's `user:password@h:p,h:p`."""
    userinfo, _, hosts = netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    servers = []
    for host in filter(None, hosts.split(",")):
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"{host!r}: give each {kind} as host:port")
        servers.append((name, int(port)))
    return unquote(username) or None, unquote(password) or None, servers


def _numbers(options: dict[str, Any]) -> None:
    for name in NUMBER_OPTIONS:
        if name in options:
            options[name] = float(options[name])
