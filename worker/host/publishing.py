"""What a host of several models writes for the fleet, and reads of the other hosts: its
host key (`client.hosts.HostRecord`, claimed at start, rewritten each look), its place in
the hosts' index, and the load leases (`mlxq:loading:<queue>`) it holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

import redis as redis_py
import structlog
from redis.exceptions import RedisError

from client.hosts import HostRecord
from client.keys import Keys
from client.replies import as_text
from worker.queue.retrying import describe

Claim = Literal["claimed", "taken", "stopped"]
log = structlog.get_logger("mlxq.host")


class HostKey:
    """The host's key and leases in Redis."""

    def __init__(self, redis: redis_py.Redis, keys: Keys, name: str, heartbeat_s: float) -> None:
        self.redis, self.keys, self.name = redis, keys, name
        self.ttl_s = max(3.0, 3 * heartbeat_s)  # the key outlives a few missed looks
        self.lease_ms = int(max(10.0, 4 * heartbeat_s) * 1000)  # a load's: ends soon after a host that died mid-load

    def claim(self, record: HostRecord, stopping: Callable[[], bool], retry_s: float) -> Claim:
        """Take the host key, waiting out one left by a host that died (it expires): `taken`
        if another live host holds the name, `stopped` if told to stop first."""
        deadline = time.monotonic() + self.ttl_s + 1
        while not stopping():
            try:
                if self.redis.set(self.keys.host(self.name), record.to_wire(), nx=True, px=int(self.ttl_s * 1000)):
                    return "claimed"
            except RedisError as e:  # not up yet: wait for it, as a worker does
                log.warning("redis does not answer yet; trying again", error=describe(e))
                deadline = time.monotonic() + self.ttl_s + 1
                time.sleep(1.0)
                continue
            if time.monotonic() > deadline:
                return "taken"
            time.sleep(retry_s)
        return "stopped"

    def publish(self, record: HostRecord, loading: list[str]) -> None:
        """This look's record, and the leases of the loads still under way renewed."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.host(self.name), record.to_wire(), px=int(self.ttl_s * 1000))
            pipe.zadd(self.keys.hosts, {self.name: time.time()})
            for queue in loading:
                pipe.pexpire(self.keys.loading(queue), self.lease_ms)
            pipe.execute()

    def take_load(self, queue: str) -> bool:
        """The lease on loading `queue`'s model: one loader per demand in the fleet."""
        return bool(self.redis.set(self.keys.loading(queue), self.name, nx=True, px=self.lease_ms))

    def end_load(self, queue: str) -> None:
        self.redis.delete(self.keys.loading(queue))

    def loaders_elsewhere(self, queues: list[str]) -> frozenset[str]:
        """Those of `queues` whose load lease another host holds."""
        with self.redis.pipeline(transaction=False) as pipe:
            for queue in queues:
                pipe.get(self.keys.loading(queue))
            loaders = pipe.execute() if queues else []
        return frozenset(q for q, loader in zip(queues, loaders, strict=True)
                         if loader is not None and as_text(loader) != self.name)

    def other_hosts(self) -> list[HostRecord]:
        """The records of the other live hosts; what does not read as one is left out."""
        seen: list[bytes] = self.redis.zrangebyscore(self.keys.hosts, time.time() - self.ttl_s,  # type: ignore[assignment]
                                                     "+inf")
        others = [name for name in map(as_text, seen) if name != self.name]
        with self.redis.pipeline(transaction=False) as pipe:  # GETs, not one MGET: the keys may sit on other slots
            for name in others:
                pipe.get(self.keys.host(name))
            raws = pipe.execute()
        return [record for raw in raws if (record := HostRecord.from_wire(raw)) is not None]

    def release(self, loading: list[str]) -> None:
        """At the host's end: its key and its leases go (else they expire)."""
        self.redis.delete(self.keys.host(self.name), *(self.keys.loading(q) for q in loading))
