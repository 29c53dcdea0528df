"""Placement by prefix: a request goes to the worker whose prefix cache holds its prompt's
start, without giving up what the shared queue gives.

Each worker publishes its digest (`common.prefix_chain`: the hashes of the prompt prefixes
its prefix cache holds, and of those of the requests it serves now, whose prefill the
engine shares as soon as it ends) under `mlxq:digest:<queue>:<consumer>`, its version in
its heartbeat, and keeps a copy of every live peer's. A worker that reads a fresh request
from the shared queue looks up the request's chain: if a live peer holds a longer part
of it than this worker does (at least `MIN_BLOCKS`), and that peer has room, the entry
moves to the peer's placement lane (`mlxq:q:<queue>:at:<peer>`), which the peer reads
before anything else. The queue's guarantees stay: a lane's entry that waits longer than
`affinity_wait_ms` (its worker full or slow), or whose worker is gone or draining, is
taken by any worker with a free slot; a dead worker's pending lane entries are taken over
as any others are (`recovery`); and load wins over affinity: a peer that holds a whole
batch more than this worker is passed over and the request served here.

Placements are counted by reason in the worker's totals: `placed:affine` (served where
its prefix is cached: here, or read from this worker's own lane), `placed:forwarded`
(moved to a peer's lane), `placed:balanced` (a peer held it but load kept it here),
`placed:stolen` (taken from another worker's lane).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from client.heartbeat import Heartbeat
from client.keys import GROUP, Keys
from client.replies import as_text, keyed_stream_entries
from common.prefix_chain import MIN_BLOCKS, Chain, matched_blocks
from worker.queue.retrying import retrying
from worker.queue.streams import RequestStreams
from worker.queue.totals import Totals

log = structlog.get_logger("mlxq.placement")

REFRESH_S = 1.0  # at most this long between looks at the peers' heartbeats and digests


@dataclass(frozen=True)
class Peer:
    """Another live worker of the queue, as its last heartbeat and digest say."""

    name: str
    held: frozenset[int]
    version: str  # of its digest
    load: int  # requests it holds
    slots: int  # max_num_seqs


@dataclass(frozen=True)
class Choice:
    """Where a request goes: `peer` (None: here) and why."""

    peer: str | None
    reason: str  # "affine" | "forwarded" | "balanced" | "" (no prefix cached anywhere)


class Affinity:
    """This worker's side of placement by prefix: its digest out, its peers' in, the
    choice for each fresh request, the moves between lanes."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, streams: RequestStreams, totals: Totals, *,
                 enabled: bool, wait_ms: int, ttl_s: float, refresh_s: float, clock_offset_s: float,
                 in_flight: Callable[[], Iterable[Chain]] = tuple) -> None:
        self.redis = redis
        self.keys = keys
        self.streams = streams
        self.totals = totals
        self.enabled = enabled
        self.wait_ms = wait_ms
        self.ttl_s = ttl_s
        self.refresh_s = min(refresh_s, REFRESH_S)
        self.clock_offset_s = clock_offset_s  # the server's clock minus ours: lane entry ids are its time
        self.queue = streams.queue
        self.consumer = streams.consumer
        self.own: frozenset[int] = frozenset()  # the prefix cache's digest
        self.in_flight = in_flight  # the chains of the requests this worker serves now
        self._own_wire = b""  # the digest as published
        self.version = ""  # of the digest as published: peers fetch it again when it changes
        self._published = 0.0
        self.peers: dict[str, Peer] = {}
        self._fetched: dict[str, tuple[str, frozenset[int]]] = {}  # peer -> (version, held)
        self._next_steal_look = 0.0

    def describe(self) -> dict[str, Any]:
        """What the heartbeat says of placement here."""
        return {"enabled": self.enabled, "digest": len(self.held()), "version": self.version,
                "peers": {p.name: {"digest": len(p.held), "version": p.version, "load": p.load}
                          for p in self.peers.values()}}

    def held(self) -> frozenset[int]:
        """What this worker can serve from a cache: its prefix cache's digest, and the
        prompts it is computing."""
        return self.own.union(*self.in_flight())

    def set_own(self, digest: tuple[int, ...]) -> None:
        """The engine's latest digest of its prefix cache (published at the next refresh)."""
        if self.enabled:
            self.own = frozenset(digest)

    async def run(self) -> None:
        """Keep the own digest published and the peers' read, until cancelled."""
        while True:
            await retrying(self.refresh, "publishing and reading prefix digests")
            await asyncio.sleep(self.refresh_s)

    async def refresh(self) -> None:
        if not self.enabled:
            return
        await self._publish()
        beats = {name: beat for name, beat in (await self._live_heartbeats()).items()
                 if name != self.consumer and beat.serves(self.queue)}
        peers = {}
        for name, beat in beats.items():
            version, held = await self._held(name, beat)
            if beat.state == "ready" and held:
                peers[name] = Peer(name, held, version, beat.in_flight, beat.max_num_seqs or 1)
        self.peers = peers

    async def _live_heartbeats(self) -> dict[str, Heartbeat]:
        """The heartbeats of the workers seen lately (only those: this runs every second)."""
        recent = time.time() - 2 * self.ttl_s
        members: Any = await self.redis.zrangebyscore(self.keys.fleet, recent, "+inf")
        names = [as_text(n) for n in members]
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.get(self.keys.worker(name))
            raws = await pipe.execute()
        return {name: beat for name, raw in zip(names, raws, strict=True)
                if raw and (beat := Heartbeat.from_json(raw)) is not None}

    async def _publish(self) -> None:
        wire = msgpack.packb(sorted(self.held()))
        if wire == self._own_wire and time.monotonic() - self._published < self.ttl_s / 3:
            return
        await self.redis.set(self.keys.digest(self.queue, self.consumer), wire, ex=max(1, int(self.ttl_s)))
        self._own_wire, self._published = wire, time.monotonic()
        self.version = hashlib.blake2b(wire, digest_size=6).hexdigest()

    async def _held(self, name: str, beat: Heartbeat) -> tuple[str, frozenset[int]]:
        """A peer's digest and its version, fetched again only when its heartbeat names
        another version."""
        placement = beat.placement or {}
        version = placement.get("version")
        if not isinstance(version, str) or not version:
            return "", frozenset()
        known = self._fetched.get(name)
        if known is not None and known[0] == version:
            return known
        raw = await self.redis.get(self.keys.digest(self.queue, name))
        try:
            hashes = msgpack.unpackb(raw) if raw else []
            held = frozenset(h for h in hashes if isinstance(h, int))
        except (ValueError, TypeError, msgpack.UnpackException):
            held = frozenset()
        self._fetched[name] = (version, held)
        return version, held

    async def choose(self, chain: Chain, own_load: int) -> Choice:
        """Where a fresh request of prefix `chain` goes, this worker holding `own_load`
        requests (it has room: it read it). Affinity wins until the peer holds a whole
        batch (its `max_num_seqs`) more than this worker: SGLang's router balances past a
        gap of 32 requests, a worker's batch is the gap here. Below it the request waits
        for a slot there, which a cached prefix repays (and `affinity_wait_ms` bounds);
        past it, this worker would idle while that one queues. The peer's load is read
        now (its heartbeat's may be seconds old): what it holds of the queue, and its lane."""
        if not self.enabled or not chain:
            return Choice(None, "")
        here = matched_blocks(chain, self.held())
        best, peer = max(((matched_blocks(chain, p.held), p) for p in self.peers.values()),
                         key=lambda m: (m[0], -m[1].load), default=(0, None))
        if peer is None or best < MIN_BLOCKS or best <= here:
            return Choice(None, "affine" if here >= MIN_BLOCKS else "")
        if await self._load(peer.name) - own_load >= peer.slots:
            return Choice(None, "balanced")
        return Choice(peer.name, "forwarded")

    async def _load(self, peer: str) -> int:
        """What a peer holds of the queue's stream (delivered, not settled) and what its
        lane holds (waiting or running: settled entries are deleted)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xinfo_consumers(self.streams.queue_stream, GROUP)
            pipe.xlen(self.keys.affinity_lane(self.queue, peer))
            consumers, lane = await pipe.execute(raise_on_error=False)
        held = 0 if isinstance(consumers, Exception) else \
            next((int(c["pending"]) for c in consumers if as_text(c["name"]) == peer), 0)
        return held + (0 if isinstance(lane, Exception) else int(lane))

    async def forward(self, stream: str, entry_id: str, fields: dict[Any, Any], peer: str) -> None:
        """Move an entry to a peer's placement lane: added there, then settled here (a
        worker that dies between the two leaves two entries of one id, which the fence
        serves once)."""
        await self.streams.add_to_lane(peer, fields)
        await self.streams.settle(stream, [entry_id])

    async def steal(self, room: int) -> list[tuple[str, str, dict[Any, Any] | None]]:
        """Entries of other workers' lanes that waited past `affinity_wait_ms`, or whose
        worker is gone or draining: up to `room` of them, oldest lane first. Looked at
        every `affinity_wait_ms / 2` at most; an empty lane of a gone worker is removed."""
        now = time.monotonic()
        if room <= 0 or now < self._next_steal_look:
            return []
        self._next_steal_look = now + self.wait_ms / 2000
        taken: list[tuple[str, str, dict[Any, Any] | None]] = []
        for peer in await self.streams.other_lanes():
            lane = self.keys.affinity_lane(self.queue, peer)
            gone = peer not in self.peers and not await self._ready(peer)
            due = await self._waiting_past_bound(lane, gone)
            if due:
                wanted = min(due, room - len(taken))
                reply = await self.redis.xreadgroup(GROUP, self.consumer, {lane: ">"}, count=wanted)
                taken += keyed_stream_entries(reply)
            elif gone:
                await self.streams.drop_lane(peer)
            if len(taken) >= room:
                break
        if taken:
            self.totals.count("placed:stolen", len(taken))
        return taken

    async def _ready(self, peer: str) -> bool:
        raw = await self.redis.get(self.keys.worker(peer))
        beat = Heartbeat.from_json(raw) if raw else None
        return beat is not None and beat.state == "ready"

    async def _waiting_past_bound(self, lane: str, gone: bool) -> int:
        """How many of the lane's undelivered entries may be taken now (all of a gone
        worker's; else those older than the bound)."""
        try:
            groups: Any = await self.redis.xinfo_groups(lane)
        except ResponseError:
            return 0  # no lane (yet, or any more)
        group = next((g for g in groups if as_text(g["name"]) == GROUP), None)
        if group is None:
            return 0
        if group.get("lag") == 0:  # (servers before Redis 7 give no lag: then looked at)
            return 0
        last = as_text(group["last-delivered-id"])
        waiting: Any = await self.redis.xrange(lane, min=f"({last}", max="+", count=64)
        if gone:
            return len(waiting)
        bound_ms = int((time.time() + self.clock_offset_s) * 1000) - self.wait_ms
        return sum(1 for entry_id, _ in waiting if int(as_text(entry_id).split("-", 1)[0]) <= bound_ms)
