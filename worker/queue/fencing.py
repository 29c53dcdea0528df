"""The output fence: what makes one worker the one writer of a request's output.

A worker takes the fence (see `scripts.TAKE`) when it starts serving an entry, before
its first write: from then on a cut-off worker that served the entry before is refused,
and the fence says where the output stands. Two findings end the request here instead:
another entry with the same id serves it (the entry is settled as a repeat), or its
terminal event is already written (a worker died between writing it and settling the
entry: the settling is done now).

Publishing writes a step's events under the fences taken (see `scripts.PUBLISH`); each
request's status says what the write found.
"""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgpack
import redis.asyncio as aioredis
import structlog
from redis.crc import key_slot

from client.connect import is_cluster
from client.keys import Keys
from client.protocol import Delta, Encoding, Error, ErrorCode, Event, decode_event, encode_event
from client.replies import as_text
from worker.messages import Resume, Route
from worker.queue import scripts
from worker.queue.requests import HeldRequest, RequestStatus, RequestTable
from worker.queue.retrying import retrying
from worker.queue.streams import RequestStreams

log = structlog.get_logger("mlxq.worker")


class Fencing:
    """Takes fences and writes output under them, for one consumer."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, queue: str, consumer: str, result_ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.queue = queue
        self.consumer = consumer
        self.result_ttl_s = result_ttl_s
        self._scripts = scripts.ScriptRunner(redis)

    async def take(self, route: Route) -> Taken:
        """Take the fence of a request this worker starts serving (see `scripts.TAKE`):
        from now on only writes under the new token land, and another worker's, still
        running or cut off, are refused."""
        token = uuid.uuid4().hex
        status, written, finished = await self._scripts.run(
            scripts.TAKE, [self.keys.progress(self.queue, route.id, route.reply_to)],
            [route.entry_id, token, self.consumer, self.result_ttl_s])
        return Taken(as_text(status) == "taken", token, int(written), bool(finished))

    async def publish(self, writes: list[OutputWrite]) -> list[Published]:
        """Write one step's events, fenced (see `scripts.PUBLISH`): one script call for all
        on one server; on a cluster one per slot, in one pipeline (a round trip per node).
        Returns one status per write; `finish` then settles the requests that ended."""
        groups = self._by_slot(writes)
        calls = []
        for group in groups:
            keys: list[str] = []
            for write in group:
                keys += [write.route.reply_to, self.keys.progress(self.queue, write.route.id, write.route.reply_to)]
            packed = msgpack.packb([write.packed() for write in group], use_bin_type=False)  # Lua's cmsgpack: no bin
            calls.append((keys, [self.result_ttl_s, packed]))
        statuses = {}
        for group, reply in zip(groups, await self._scripts.run_many(scripts.PUBLISH, calls), strict=True):
            for write, status in zip(group, msgpack.unpackb(reply, raw=False), strict=True):
                statuses[id(write)] = Published.parse(status)
        return [statuses[id(write)] for write in writes]

    def _by_slot(self, writes: list[OutputWrite]) -> list[list[OutputWrite]]:
        if not is_cluster(self.redis):
            return [writes]
        groups: dict[int, list[OutputWrite]] = {}
        for write in writes:
            groups.setdefault(key_slot(write.route.reply_to.encode()), []).append(write)
        return list(groups.values())

    async def earlier_output(self, route: Route, written: int) -> EarlierOutput:
        """The deltas earlier deliveries of this entry published, `written` events in all."""
        deltas = []
        entries: Any = await self.redis.xrange(route.reply_to)
        for _, fields in entries:
            event = decode_event(fields)
            if isinstance(event, Delta) and event.id == route.id:
                deltas.append(event)
        return EarlierOutput(written, deltas)


async def take_fence(fencing: Fencing, streams: RequestStreams, requests: RequestTable,
                     held: HeldRequest) -> Taken | None:
    """Take the fence of a held request and hold it at the position the fence gives;
    None when the request ended here instead (see the module's doc)."""
    route = held.route
    taken = await retrying(partial(fencing.take, route), "taking a request's fence")
    if not taken.taken:
        log.warning("another entry with this id is served; dropping this one", request_id=route.id,
                    entry_id=route.entry_id)
        await retrying(partial(streams.settle, route.stream, [route.entry_id]), "settling a duplicate")
    elif taken.finished:
        log.info("this request's output was already complete; settling it", request_id=route.id)
        await retrying(partial(streams.finish, [route]), "settling a finished request")
    else:
        requests.fenced(route.id, taken.token, taken.written)
        return taken
    requests.end(route.id, RequestStatus.SETTLED)
    return None


@dataclass(frozen=True)
class OutputWrite:
    """One request's encoded events from one publish, and the position of the first."""

    route: Route
    first: int
    events: list[Event]
    entries: list[tuple[str, bytes]]  # each event's type and body, in the route's encoding

    @property
    def terminal(self) -> bool:
        """Whether the last event ends the request."""
        return not isinstance(self.events[-1], Delta)

    def packed(self) -> list[Any]:
        """This write as the publish script reads it (see `scripts.PUBLISH`)."""
        route = self.route
        return [route.entry_id, route.fence, self.first, self.terminal, route.encoding,
                [part for entry in self.entries for part in entry]]


class PublishStatus(enum.Enum):
    """What the publish script found for one request (see `scripts.PUBLISH`)."""

    APPLIED = "applied"
    LOST = "lost"
    DUPLICATE = "duplicate"
    EXPIRED = "expired"
    GAP = "gap"
    REFUSED = "refused"


@dataclass(frozen=True)
class Published:
    """One request's status from the publish script; `detail` is the count of events
    found (a gap) or Redis's reason (refused)."""

    status: PublishStatus
    detail: str = ""

    @classmethod
    def parse(cls, reply: str) -> Published:
        if reply == "applied":  # nearly every status of every write
            return _APPLIED
        status, _, detail = reply.partition(":")
        return cls(PublishStatus(status), detail)


_APPLIED = Published(PublishStatus.APPLIED)


@dataclass(frozen=True)
class Taken:
    """A request's fence as this worker took it: its token (`taken`; else another entry
    serves the id), how many events were written before, and whether the last was terminal."""

    taken: bool
    token: str
    written: int
    finished: bool


@dataclass(frozen=True)
class EarlierOutput:
    """An entry's output so far: how many events were written, and its deltas."""

    written: int
    deltas: list[Delta]

    @property
    def whole(self) -> bool:
        """Whether every event written is still there (else continuing would leave a gap)."""
        return len(self.deltas) == self.written

    def resume(self) -> Resume | None:
        """Where a new delivery continues: after these deltas; None if nothing was written."""
        if not self.written:
            return None
        return Resume(tokens=[t for d in self.deltas for t in d.tokens], text="".join(d.text for d in self.deltas),
                      deltas=self.written, reasoning="".join(d.reasoning or "" for d in self.deltas))


def encode_write(route: Route, first: int, events: list[Event]) -> OutputWrite:
    """A request's events, encoded. An event that cannot be encoded ends the request
    there with an `internal` error whose message is plain ASCII, so that it always can be."""
    entries: list[tuple[str, bytes]] = []
    for i, event in enumerate(events):
        try:
            entries.append(_entry(event, route.encoding))
        except (TypeError, ValueError, RecursionError) as e:
            reason = ascii(str(e)[:300])
            log.error("event could not be encoded", request_id=route.id, error=reason)
            error = Error(id=route.id, code=ErrorCode.INTERNAL, message=f"the output could not be encoded: {reason}")
            entries.append(_entry(error, route.encoding))
            return OutputWrite(route, first, [*events[:i], error], entries)
    return OutputWrite(route, first, events, entries)


def _entry(event: Event, encoding: Encoding) -> tuple[str, bytes]:
    fields = encode_event(event, encoding)
    return as_text(fields["type"]), fields[encoding]  # type: ignore[return-value]
