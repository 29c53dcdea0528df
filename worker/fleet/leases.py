"""The worker's name, heartbeat and leases: what tells the fleet it is alive.

Every `heartbeat_s` one script refreshes the heartbeat (TTL 3x) and the idle time of
every entry held, so that a long generation is never taken from a live worker; entries
another worker took are dropped at once. At exit the heartbeat goes and what is still
held is handed back (marked long idle), so another worker resumes it at its next scan.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import socket
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import structlog
from redis.exceptions import RedisError

from client.engine_stats import EngineStats
from client.heartbeat import LONGEST, Heartbeat, ModelState, RunningRequest, StatsRecord, WorkerState
from client.protocol import Task
from worker.fleet.membership import Membership
from worker.fleet.naming import claim_consumer_name
from worker.queue.requests import RequestStatus, RequestTable
from worker.queue.retrying import describe, is_permission_error, retrying
from worker.queue.totals import Totals
from worker.settings import WorkerSettings

log = structlog.get_logger("mlxq.worker")

HAND_BACK_IDLE_MS = 10**9  # entries handed back look long abandoned, so others take them at once
STATS_KEEP_S = 7 * 86400  # a worker's totals outlive restarts under its name for this long


def _version() -> str:
    try:
        return importlib.metadata.version("mlxq")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class Leases:
    """Claims a consumer name, then keeps it, the heartbeat and the entries' leases alive."""

    def __init__(self, settings: WorkerSettings, membership: Membership, requests: RequestTable,
                 model_name: str, totals: Totals, blas: str, tool_call: tuple[str, str] | None = None,
                 task: Task = "generate", engine_stats: Callable[[], EngineStats | None] = lambda: None,
                 engine_pid: Callable[[], int | None] = lambda: None, group: dict[str, Any] | None = None,
                 placement: Callable[[], dict[str, Any] | None] = lambda: None,
                 on_drain_asked: Callable[[], None] = lambda: None) -> None:
        self.settings = settings
        self.membership = membership
        self.consumer = ""  # set once, by `claim_name`
        self.requests = requests
        self.model_name = model_name
        self.tool_call = tool_call  # the model's tool-call markers, for readers that split calls from text
        self.task = task
        self.totals = totals
        self.blas = blas
        self.engine_pid = engine_pid  # the engine process's, as it is now (a new one after a crash)
        self.state: WorkerState = "ready"  # then "draining", then "stopped"
        self.version = _version()
        self.instance = uuid.uuid4().hex  # this process, in its heartbeat: tells it from a later holder of its name
        self.started_at = time.time()
        self.engine_stats = engine_stats  # the engine's latest (the worker keeps them)
        self.ttl_s = 3 * settings.heartbeat_s
        self.group = group  # a worker group's mode, ranks and hosts (rank 0 is this process)
        self.placement = placement  # placement by prefix, as it stands (set once the name is claimed)
        self.on_drain_asked = on_drain_asked  # someone asked, through Redis, that this process drain
        self.drain_refused = False

    async def claim_name(self) -> str:
        """Take a consumer name no live worker holds (see `naming`); raises `NameTaken`."""
        self.consumer = await claim_consumer_name(self.membership, self.settings, self._heartbeat, self.ttl_s)
        stored = await retrying(partial(self.membership.read_stats, self.consumer), "reading this worker's totals")
        earlier = stored.heartbeat.model if stored.heartbeat else None
        if earlier is None or (earlier.queue, earlier.path) == (self.settings.queue, self.model_name):
            self.totals.restore(stored)
        else:  # the name served another queue or model before: its counts are not this worker's
            log.info("starting the totals from zero: this name served another queue or model before",
                     before={"queue": earlier.queue, "model": earlier.path})
        await retrying(self._keep_alive, "writing the first heartbeat")  # with the totals restored
        return self.consumer

    async def run(self) -> None:
        """Renew every `heartbeat_s` until cancelled; a refusal of our own keys is raised."""
        while True:
            await asyncio.sleep(self.settings.heartbeat_s)
            await retrying(self._keep_alive, "renewing the heartbeat and leases")

    async def draining(self) -> None:
        """Say at once that this worker drains (takes nothing new); a failure waits for the
        next heartbeat."""
        self.state = "draining"
        try:
            await self._keep_alive()
        except (RedisError, OSError) as e:
            log.warning("could not announce the drain", reason=describe(e))

    async def _keep_alive(self) -> None:
        """Refresh the heartbeat and our entries' idle times; drop what another worker took."""
        beat = self._beat(self.consumer)
        lost = await self.membership.keep_mine(self.consumer, self.requests.by_stream(), beat.to_json(),
                                                ttl_s=self.ttl_s, instance=self.instance)
        await self._record(beat)
        if self.state == "ready" and await self._drain_asked():
            log.info("drain asked through Redis", key=self.membership.keys.drain(self.consumer))
            self.on_drain_asked()
        for entry_id in lost:
            held = self.requests.by_entry(entry_id)
            if held is not None:
                log.warning("another worker took this request over; dropping it here", request_id=held.route.id)
                self.requests.end(held.route.id, RequestStatus.LOST)

    async def _drain_asked(self) -> bool:
        """Whether someone asked this process to drain (the dashboard). Under an ACL that keeps
        the drain key from this worker, it is drained by signals alone (said once)."""
        if self.drain_refused:
            return False
        try:
            return await self.membership.drain_asked(self.consumer) == self.instance
        except RedisError as e:
            if not is_permission_error(e):
                raise
            log.warning("redis refuses this worker its drain key; it drains on SIGTERM alone",
                        key=self.membership.keys.drain(self.consumer), reason=describe(e))
            self.drain_refused = True
            return False

    async def hand_back(self) -> None:
        """Remove our heartbeat and mark what we still hold as long idle, so that another
        worker takes it over (and resumes it) at its next scan, not after a timeout."""
        left = list(self.requests)
        try:
            await self.membership.keep_mine(self.consumer, self.requests.by_stream(), heartbeat="", ttl_s=0,
                                             instance=self.instance, idle_ms=HAND_BACK_IDLE_MS)
            self.state = "stopped"
            await self._record(self._beat(self.consumer))
        except (RedisError, OSError) as e:
            log.warning("could not hand back; others take over when the heartbeat expires", reason=describe(e))
        for held in left:
            self.requests.end(held.route.id, RequestStatus.HANDED_BACK)
        log.info("worker stopped", handed_back=len(left))

    async def _record(self, beat: Heartbeat) -> None:
        """Our totals and this heartbeat, kept in Redis past our heartbeat's expiry."""
        record = StatsRecord(self.totals.as_fields(), beat, self.state, self.totals.last_error)
        await self.membership.record_stats(self.consumer, record, STATS_KEEP_S)

    def _heartbeat(self, consumer: str) -> str:
        return self._beat(consumer).to_json()

    def _beat(self, consumer: str) -> Heartbeat:
        """What this worker tells the fleet about itself, under the name `consumer`
        (`mlxq:workers:<consumer>`)."""
        model = ModelState(self.settings.queue, self.settings.queue, self.model_name, "loaded",
                           tuple(self.settings.lanes), self.tool_call, task=self.task)
        return Heartbeat(
            consumer=consumer, instance=self.instance, state=self.state, host=socket.gethostname(),
            pid=os.getpid(), engine_pid=self.engine_pid(), started_at=self.started_at, version=self.version,
            blas=self.blas, models=(model,),
            in_flight=len(self.requests), max_num_seqs=self.settings.max_num_seqs, tok_s=self.totals.tok_s(),
            totals=self.totals.as_fields(), last_error=self.totals.last_error,
            stats=self.engine_stats(), group=self.group, placement=self.placement(),
            longest=tuple(RunningRequest(held.route.id, held.route.stream, held.read_at, held.tokens)
                          for held in self.requests.longest(LONGEST)))
