"""A worker's membership of the fleet in Redis: its consumer name, its heartbeat and
its entries' leases, and the totals it leaves under its name."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from client.heartbeat import StatsRecord
from client.keys import GROUP, Keys
from client.replies import as_text
from worker.queue import scripts


class Membership:
    """The Redis side of `naming` and `leases`, for the workers of one queue's streams."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, request_streams: list[str]) -> None:
        self.redis = redis
        self.keys = keys
        self.request_streams = request_streams
        self._scripts = scripts.ScriptRunner(redis)

    async def claim_name(self, name: str, heartbeat: str, ttl_s: float, replacing: bytes | None = None) -> bytes | None:
        """Take the consumer name `name` by writing its heartbeat, unless a worker holds it
        (or, with `replacing`, unless it holds anything else). Returns None when taken,
        else the holder's heartbeat."""
        held = await self._scripts.run(scripts.CLAIM_NAME, [self.keys.worker(name)],
                                       [heartbeat, max(1, int(ttl_s * 1000)), replacing or ""])
        return None if held == 1 else held  # type: ignore[no-any-return]

    async def heartbeat_ttl_s(self, name: str) -> float:
        """Seconds until the heartbeat of consumer `name` expires (0 if it has none or no TTL)."""
        return max(0, await self.redis.pttl(self.keys.worker(name))) / 1000

    async def keep_mine(self, consumer: str, entries: dict[str, list[str]], heartbeat: str, ttl_s: float, instance: str,
                        idle_ms: int = 0) -> list[str]:
        """Refresh (or, with `heartbeat` empty, delete) this worker's heartbeat and set the
        idle time of its entries (ids by stream); returns the ids another worker took over.
        Raises `ResponseError` (NAMETAKEN) if another worker holds our consumer name now."""
        await self._scripts.run(scripts.HEARTBEAT, [self.keys.worker(consumer)],
                                [heartbeat, max(1, int(ttl_s * 1000)), instance])
        lost = []
        for stream in dict.fromkeys([*self.request_streams, *entries]):  # placement lanes' entries too
            args = [GROUP, consumer, idle_ms, *entries.get(stream, [])]
            lost += [as_text(i) for i in await self._scripts.run(scripts.KEEP_MINE, [stream], args)]
        return lost

    async def drain_asked(self, consumer: str) -> str | None:
        """The process instance someone asked to drain under our consumer name, if any."""
        asked = await self.redis.get(self.keys.drain(consumer))
        return None if asked is None else as_text(asked)

    async def read_stats(self, consumer: str) -> StatsRecord:
        """The stats record an earlier run under our consumer name left (empty if none)."""
        stored: dict[bytes, bytes] = await self.redis.hgetall(self.keys.stats(consumer))  # type: ignore[assignment]
        return StatsRecord.from_wire(stored)

    async def record_stats(self, consumer: str, record: StatsRecord, keep_s: int) -> None:
        """Write this worker's totals and last heartbeat where `mlxq status` finds them, for
        `keep_s` after its last write; workers not seen for that long leave the fleet set."""
        now = time.time()
        stats = self.keys.stats(consumer)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(stats, mapping={**record.to_wire(), "last_seen": round(now, 3)})  # type: ignore[dict-item]
            pipe.expire(stats, keep_s)
            pipe.zadd(self.keys.fleet, {consumer: now})
            pipe.zremrangebyscore(self.keys.fleet, "-inf", now - keep_s)
            await pipe.execute()
