"""How many lines one batch may have in flight: its share of its queue's slots.

A queue's batch lane is first come, first served: a batch that fed 512 lines stands in
front of every line fed after it. So each batch keeps in flight only its share of the
slots live workers give the queue (twice that, so that no slot idles between its
driver's passes): the slots split evenly between the tenants whose batches run on the
queue, and a tenant's share between its batches. A tenant's 10-line batch then waits
behind a few lines of another tenant's 50,000-line one, not all of them; alone, a batch
keeps every slot busy. A batch made with the client (no tenant) counts as its own tenant.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from .fleet import read_workers_async
from .keys import Keys
from .replies import as_text

SLACK = 2  # lines in flight per slot of the share: one running, one waiting to take its place
REFRESH_S = 2.0  # the fleet and the active batches are read at most this often


@dataclass(frozen=True)
class QueueLoad:
    """What a queue's batches share: its slots and who runs batches on it."""

    slots: int  # max_num_seqs of its live workers, together (0: none seen)
    batches: dict[str, str]  # each active batch on it -> its tenant (or its own id when it has none)

    def share(self, batch_id: str) -> int | None:
        """The lines `batch_id` may have in flight; None when no live worker says its slots."""
        if not self.slots:
            return None
        tenant = self.batches.get(batch_id, batch_id)
        tenants = set(self.batches.values()) | {tenant}
        own = sum(1 for t in self.batches.values() if t == tenant) or 1
        return max(1, math.ceil(SLACK * self.slots / (len(tenants) * own)))


class BatchShares:
    """Reads each queue's load (at most once a `REFRESH_S`) for the drivers of one process."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._read: dict[str, tuple[float, QueueLoad]] = {}

    async def share(self, queue: str, batch_id: str) -> int | None:
        now = time.monotonic()
        read = self._read.get(queue)
        if read is None or now - read[0] >= REFRESH_S:
            read = self._read[queue] = (now, await self._load(queue))
        return read[1].share(batch_id)

    async def _load(self, queue: str) -> QueueLoad:
        workers = await read_workers_async(self.redis, self.keys)
        slots = sum(w.heartbeat.max_num_seqs or 0 for w in workers
                    if w.state == "ready" and any(m.queue == queue and m.state == "loaded" for m in w.heartbeat.models))
        active = [as_text(b) for b in await self.redis.smembers(self.keys.active_batches)]
        async with self.redis.pipeline(transaction=False) as pipe:  # one round trip (a batch per slot on a cluster)
            for batch_id in active:
                pipe.hmget(self.keys.batch(batch_id), ["queue", "tenant"])
            found = await pipe.execute()
        batches = {batch_id: as_text(tenant) if tenant else batch_id
                   for batch_id, (on, tenant) in zip(active, found, strict=True)
                   if on is not None and as_text(on) == queue}
        return QueueLoad(slots, batches)
