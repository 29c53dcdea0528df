"""Per-key limits, kept in Redis so that every gateway counts against the same numbers.

    rpm               requests a minute      a moving window (the `limits` library)
    tpm               tokens a minute        a sliding window counter (a moving window would
                                             keep an entry per token), counted when each
                                             request ends; a request is admitted while the
                                             window holds fewer
    max_concurrency   requests in flight     leases in a sorted set, each ending by itself
                                             if its gateway dies
    max_priority      the best priority      a request asking for better gets this one

A refusal is a 429 in OpenAI's shape with `Retry-After` and OpenAI's `x-ratelimit-*`
headers.
"""

from __future__ import annotations

import math
import time

import redis.asyncio as aioredis
from limits import RateLimitItem, RateLimitItemPerSecond
from limits.aio.storage import RedisClusterStorage, RedisStorage, Storage
from limits.aio.strategies import MovingWindowRateLimiter, SlidingWindowCounterRateLimiter

from client.connect import is_cluster_url, parse_cluster_url
from client.keys import Keys

from .errors import ApiError
from .tenants import Caller, KeyRecord

# KEYS: a key's in-flight set. ARGV: now (ms), the lease's end (ms), the request, the most at once.
# Returns 1 if the request got a lease, 0 if the key has as many in flight as it may.
ACQUIRE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
redis.call('PEXPIREAT', KEYS[1], ARGV[2])
return 1
"""


def rate_limit_storage(redis_url: str, redis: aioredis.Redis, keys: Keys) -> Storage:
    """The `limits` storage on the gateway's own Redis: its connection pool where it has
    one (a server, a Sentinel's primary), the cluster's nodes for a Redis Cluster."""
    if is_cluster_url(redis_url):
        target = parse_cluster_url(redis_url)
        nodes = ",".join(f"{host}:{port}" for host, port in target.nodes)
        return RedisClusterStorage(f"async+redis+cluster://{nodes}", implementation="redispy",
                                   key_prefix=keys.rate_limits, **target.options)
    return RedisStorage("async+redis://", implementation="redispy", key_prefix=keys.rate_limits,
                        connection_pool=redis.connection_pool)  # type: ignore[arg-type]


class Admission:
    """One request admitted under its key's limits; `close` once it ends."""

    def __init__(self, quotas: Quotas | None, record: KeyRecord | None, request_id: str) -> None:
        self._quotas = quotas
        self._record = record
        self._request_id = request_id
        self._closed = False

    async def close(self, tokens: int) -> None:
        """Count the request's tokens against the key and give back its lease (once)."""
        if self._closed or self._quotas is None or self._record is None:
            return
        self._closed = True
        await self._quotas.finished(self._record, self._request_id, tokens)


OPEN = Admission(None, None, "")


class Quotas:
    """Admits requests under their keys' limits."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, storage: Storage, *, lease_s: float,
                 window_s: int = 60) -> None:
        self.redis = redis
        self.keys = keys
        self.requests = MovingWindowRateLimiter(storage)
        self.tokens = SlidingWindowCounterRateLimiter(storage)
        self.lease_s = lease_s
        self.window_s = window_s  # a minute (rpm, tpm); shorter only where a test waits one out
        self._acquire = redis.register_script(ACQUIRE)

    async def admit(self, caller: Caller, request_id: str) -> Admission:
        """An admission for one request of `caller`; raises a 429 `ApiError` past a limit."""
        record = caller.record
        if record is None:
            return OPEN
        if record.tpm is not None and not await self.tokens.test(self._window(record.tpm), record.id, "tokens"):
            raise await self._refusal(record, "tokens", f"{record.tpm} tokens per {self._per}")
        if record.rpm is not None and not await self.requests.hit(self._window(record.rpm), record.id, "requests"):
            raise await self._refusal(record, "requests", f"{record.rpm} requests per {self._per}")
        if record.max_concurrency is not None:
            now_ms = int(time.time() * 1000)
            leased = await self._acquire(keys=[self.keys.in_flight(record.id)], args=[
                now_ms, now_ms + int(self.lease_s * 1000), request_id, record.max_concurrency])
            if not int(leased):
                raise ApiError(429, f"this key has {record.max_concurrency} requests in flight, its "
                               "max_concurrency: wait for one to end", "rate_limit_error", "rate_limit_exceeded",
                               headers={"Retry-After": "1"})
        return Admission(self, record, request_id)

    async def finished(self, record: KeyRecord, request_id: str, tokens: int) -> None:
        if record.max_concurrency is not None:
            await self.redis.zrem(self.keys.in_flight(record.id), request_id)
        if record.tpm is not None and tokens > 0:
            item = self._window(record.tpm)
            if not await self.tokens.hit(item, record.id, "tokens", cost=min(tokens, record.tpm)):
                # more than the window has left: fill it, so that the next request waits for it to move
                stats = await self.tokens.get_window_stats(item, record.id, "tokens")
                if stats.remaining > 0:
                    await self.tokens.hit(item, record.id, "tokens", cost=stats.remaining)

    def _window(self, amount: int) -> RateLimitItem:
        return RateLimitItemPerSecond(amount, self.window_s)

    @property
    def _per(self) -> str:
        return "minute" if self.window_s == 60 else f"{self.window_s} seconds"

    async def _refusal(self, record: KeyRecord, kind: str, limit: str) -> ApiError:
        amount = record.tpm if kind == "tokens" else record.rpm
        assert amount is not None
        limiter = self.tokens if kind == "tokens" else self.requests
        stats = await limiter.get_window_stats(self._window(amount), record.id, kind)
        wait_s = max(1, math.ceil(stats.reset_time - time.time()))
        headers = {"Retry-After": str(wait_s), f"x-ratelimit-limit-{kind}": str(amount),
                   f"x-ratelimit-remaining-{kind}": str(stats.remaining), f"x-ratelimit-reset-{kind}": f"{wait_s}s"}
        return ApiError(429, f"Rate limit reached for this key on {kind}: {limit}. Try again in {wait_s}s.",
                        "rate_limit_error", "rate_limit_exceeded", headers=headers)
