"""What a tenant may keep in Redis: bytes (its uploaded files and its batches' stored
lines, under one budget) and batches running at once. Each check and its reservation are
one script, so two gateways taking the last bytes at the same moment cannot both get them.

A reservation names what holds it (`file-…`, `batch_…`) and when it lapses (the file's
or batch's own expiry), so bytes come back when the thing they were for is deleted or
expires, whichever gateway is running then.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from client.keys import Keys

from .errors import ApiError

# KEYS: the tenant's `bytes` hash (holder -> "<bytes>:<lapses at, unix s>"). ARGV: now, the
# budget, the holder, its bytes, when it lapses. Returns {1 if reserved, the bytes held before}.
RESERVE = """
local held = 0
local entries = redis.call('HGETALL', KEYS[1])
for i = 1, #entries, 2 do
  local size, lapses = string.match(entries[i + 1], '^(%d+):(%d+)$')
  if not size or tonumber(lapses) <= tonumber(ARGV[1]) then
    redis.call('HDEL', KEYS[1], entries[i])
  else
    held = held + tonumber(size)
  end
end
if held + tonumber(ARGV[4]) > tonumber(ARGV[2]) then return {0, held} end
redis.call('HSET', KEYS[1], ARGV[3], ARGV[4] .. ':' .. ARGV[5])
return {1, held}
"""

# KEYS: the tenant's `active` batches (id -> when it expires). ARGV: now, the most at once,
# the batch, when it expires. Returns 1 if it may start, 0 if the tenant runs as many.
START = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
return 1
"""


class TenantBudget:
    """Reserves a tenant's bytes and batch slots."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._reserve = redis.register_script(RESERVE)
        self._start = redis.register_script(START)

    async def reserve(self, tenant: str, holder: str, size: int, lapses_at: int, budget: int) -> None:
        """Hold `size` bytes for `holder` until `lapses_at`; raises 413 past the budget."""
        reserved, held = await self._reserve(keys=[self.keys.tenant(tenant, "bytes")],
                                             args=[int(time.time()), budget, holder, size, lapses_at])
        if not int(reserved):
            raise ApiError(413, f"your files and batches hold {int(held)} bytes; this one ({size}) would pass "
                           f"your files budget ({budget} bytes): delete files first", "invalid_request_error",
                           "too_large")

    async def release(self, tenant: str, holder: str) -> None:
        await self.redis.hdel(self.keys.tenant(tenant, "bytes"), holder)

    async def start_batch(self, tenant: str, batch_id: str, expires_at: int, most: int) -> None:
        """Count a new batch against the tenant's active batches; raises 429 past `most`."""
        started = await self._start(keys=[self.keys.tenant(tenant, "active")],
                                    args=[int(time.time()), most, batch_id, expires_at])
        if not int(started):
            raise ApiError(429, f"you have {most} batches in progress, as many as you may: wait for one to end "
                           "or cancel one", "rate_limit_error", "batch_limit_reached",
                           headers={"Retry-After": "60"})
