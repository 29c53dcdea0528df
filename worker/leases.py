"""The worker's name, heartbeat and leases: what tells the fleet it is alive.

Every `heartbeat_s` one script refreshes the heartbeat (TTL 3x) and the idle time of
every entry held, so that a long generation is never taken from a live worker; entries
another worker took are dropped at once. At exit the heartbeat goes and what is still
held is handed back (marked long idle), so another worker resumes it at its next scan.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import uuid

import structlog
from redis.exceptions import RedisError

from .messages import EngineStats
from .naming import claim_consumer_name
from .redis_queue import RedisQueue
from .requests import RequestStatus, RequestTable
from .retrying import describe, retrying
from .settings import WorkerSettings

log = structlog.get_logger("mlxq.worker")

HAND_BACK_IDLE_MS = 10**9  # entries handed back look long abandoned, so others take them at once


class Leases:
    """Claims a consumer name, then keeps it, the heartbeat and the entries' leases alive."""

    def __init__(self, settings: WorkerSettings, redis_queue: RedisQueue, requests: RequestTable,
                 model_name: str) -> None:
        self.settings = settings
        self.redis_queue = redis_queue
        self.requests = requests
        self.model_name = model_name
        self.instance = uuid.uuid4().hex  # this process, in its heartbeat: tells it from a later holder of its name
        self.started_at = time.time()
        self.stats: EngineStats | None = None  # the engine's latest
        self.ttl_s = 3 * settings.heartbeat_s

    @property
    def consumer(self) -> str:
        return self.redis_queue.consumer

    async def claim_name(self) -> str:
        """Take a consumer name no live worker holds (see `naming`); raises `NameTaken`."""
        def heartbeat(name: str) -> str:
            self.redis_queue.consumer = name
            return self._heartbeat()

        self.redis_queue.consumer = await claim_consumer_name(self.redis_queue, self.settings, heartbeat, self.ttl_s)
        return self.consumer

    def update(self, stats: EngineStats) -> None:
        """The engine's stats, for the next heartbeat."""
        self.stats = stats

    async def run(self) -> None:
        """Renew every `heartbeat_s` until cancelled; a refusal of our own keys is raised."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            await retrying(self._keep_alive, "renewing the heartbeat and leases")

    async def _keep_alive(self) -> None:
        """Refresh the heartbeat and our entries' idle times; drop what another worker took."""
        lost = await self.redis_queue.keep_mine(self.requests.by_stream(), self._heartbeat(), ttl_s=self.ttl_s,
                                                instance=self.instance)
        for entry_id in lost:
            held = self.requests.by_entry(entry_id)
            if held is not None:
                log.warning("another worker took this request over; dropping it here", request_id=held.route.id)
                self.requests.end(held.route.id, RequestStatus.LOST)

    async def hand_back(self) -> None:
        """Remove our heartbeat and mark what we still hold as long idle, so that another
        worker takes it over (and resumes it) at its next scan, not after a timeout."""
        left = list(self.requests)
        try:
            await self.redis_queue.keep_mine(self.requests.by_stream(), heartbeat="", ttl_s=0,
                                             instance=self.instance, idle_ms=HAND_BACK_IDLE_MS)
        except (RedisError, OSError) as e:
            log.warning("could not hand back; others take over when the heartbeat expires", reason=describe(e))
        for held in left:
            self.requests.end(held.route.id, RequestStatus.HANDED_BACK)
        log.info("worker stopped", handed_back=len(left))

    def _heartbeat(self) -> str:
        """What this worker tells the fleet about itself (`mlxq:workers:<consumer>`)."""
        return json.dumps({
            "consumer": self.consumer, "instance": self.instance, "queue": self.settings.queue,
            "model": self.model_name, "host": socket.gethostname(), "pid": os.getpid(), "started_at": self.started_at,
            "in_flight": len(self.requests), "max_num_seqs": self.settings.max_num_seqs,
            **(self.stats.as_json() if self.stats else {})})
