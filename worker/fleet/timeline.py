"""This worker's samples on the fleet's timeline (`client/timeline.py`): what it served
since its last sample, written every `timeline_s`, for the dashboard's charts."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from client.keys import Keys
from client.protocol import Delta, Done, Error, Event
from client.timeline import TIMELINE_KEEP_S, Sample, ttft_bucket
from worker.queue.retrying import describe, is_permission_error

log = structlog.get_logger("mlxq.worker")


class Timeline:
    """Counts what is published (on the event loop) and writes it as one sample a stretch."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, queue: str, streams: list[str], every_s: float) -> None:
        self.redis = redis
        self.keys = keys
        self.queue = queue
        self.streams = streams  # the queue's request streams: their length is its depth
        self.every_s = every_s
        self.consumer = ""  # set once the name is claimed
        self._sample = Sample("", queue)

    def observe(self, event: Event) -> None:
        """Count one published event."""
        if isinstance(event, Delta):
            self._sample.tokens += len(event.tokens)
        elif isinstance(event, Done):
            self._sample.finished += 1
            if event.timing.ttft_ms is not None:
                self._sample.ttft[ttft_bucket(event.timing.ttft_ms)] += 1
        elif isinstance(event, Error):
            self._sample.errors += 1

    async def run(self, consumer: str) -> None:
        """Write a sample every `every_s` until cancelled; a failed write is retried with the next one's counts."""
        self.consumer = consumer
        refused = False
        while True:
            await asyncio.sleep(self.every_s)
            if refused:
                continue
            try:
                await self.write()
            except (RedisError, OSError) as e:
                refused = is_permission_error(e)  # an ACL without the key: the charts lack this worker
                log.warning("redis refuses this worker the fleet's timeline; it writes none" if refused else
                            "could not write a timeline sample; its counts go into the next",
                            key=self.keys.timeline, reason=describe(e))

    async def write(self) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in self.streams:
                pipe.xinfo_stream(stream)
            infos = [i for i in await pipe.execute(raise_on_error=False) if isinstance(i, dict)]
        sample, self._sample = self._sample, Sample(self.consumer, self.queue)
        sample.consumer = self.consumer
        sample.depth = sum(int(i.get("length", 0)) for i in infos)
        sample.added = sum(int(i.get("entries-added", 0)) for i in infos)  # Redis 7 and Valkey
        try:
            keep_from_ms = int((time.time() - TIMELINE_KEEP_S) * 1000)
            await self.redis.xadd(self.keys.timeline, sample.to_wire(), minid=keep_from_ms,  # type: ignore[arg-type]
                                  approximate=True)
        except BaseException:
            self._merge(sample)
            raise

    def _merge(self, unwritten: Sample) -> None:
        """Put an unwritten sample's counts back, so the next one carries them."""
        self._sample.tokens += unwritten.tokens
        self._sample.finished += unwritten.finished
        self._sample.errors += unwritten.errors
        self._sample.ttft = [a + b for a, b in zip(self._sample.ttft, unwritten.ttft, strict=True)]
