"""The requests this worker holds and where each stands: the one owner of that state.

    READ ──> ADMITTED ──> STREAMING ──> FINISHING ──> (ACKED)
      │          │           │            │
      └──────────┴────────────┴─────────────┴──> (LOST | SETTLED | HANDED_BACK)

A request is READ when its entry is taken from the stream (before anything else, so
no cancel slips past it), ADMITTED when it is handed to the engine, STREAMING once its
first event is written and FINISHING once its terminal event is on its way. It leaves
the table ACKED (its terminal event written and its entry acknowledged), LOST (another
worker holds its entry now), SETTLED (acknowledged with no output of ours: a repeat, a
duplicate, an output stream Redis refuses) or HANDED_BACK (still pending at exit, for
another worker to resume). The intake, the publisher, the lease keeper and the cancel
listener all go through this table, and change a request only through its methods;
only it tells the engine to drop a request. What crosses to the engine and back is a
`RequestRef` (id and entry), never a copy of the route or the timings kept here.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import heapq
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import structlog

from client.protocol import Done, Event
from worker.messages import RequestRef, Route

log = structlog.get_logger("mlxq.worker")


class RequestStatus(enum.Enum):
    """Where a held request stands (the last four: why it left the table)."""

    READ = "read"
    ADMITTED = "admitted"
    STREAMING = "streaming"
    FINISHING = "finishing"
    ACKED = "acked"
    LOST = "lost"
    SETTLED = "settled"
    HANDED_BACK = "handed_back"


ENDED = frozenset({RequestStatus.ACKED, RequestStatus.LOST, RequestStatus.SETTLED, RequestStatus.HANDED_BACK})


@dataclass
class HeldRequest:
    """One request this worker holds."""

    route: Route
    status: RequestStatus = RequestStatus.READ
    written: int = 0  # events (deltas and terminal) in its output stream: the next one's position
    cancel_requested: bool = False  # a cancel was seen, maybe before the engine had the request
    read_at: float = field(default_factory=time.time)  # unix seconds, for the request's stage timings
    arrived_at: float | None = None  # its entry id's stamp on this host's clock, once known
    prepared_at: float | None = None  # when it was decoded, validated and tokenized
    first_published_at: float | None = None  # when its first delta was written
    tokens: int = 0  # generated and written so far
    alone: bool = False  # it was in an engine's death: it runs alone, and this worker reads nothing new meanwhile
    chain: tuple[int, ...] = ()  # its prompt prefix as the fleet names it, once it is served here (`affinity`)

    def timed(self, event: Event) -> Event:
        """A `done` with the stages the engine does not see: read, prepared, first delta
        written (the engine times the rest from the arrival)."""
        if not isinstance(event, Done) or self.arrived_at is None:
            return event

        def since_arrival(at: float | None) -> float | None:
            return None if at is None or self.arrived_at is None else round((at - self.arrived_at) * 1000.0, 1)

        return replace(event, timing=replace(event.timing, read_ms=since_arrival(self.read_at),
                                             prepared_ms=since_arrival(self.prepared_at),
                                             published_ms=since_arrival(self.first_published_at)))


class RequestTable:
    """Every request held, by id; at most `slots` and a read-ahead at once."""

    def __init__(self, slots: int, abandon: Callable[[str], None]) -> None:
        self.slots = slots
        self._abandon = abandon  # tells the engine to drop a request without a word
        self._held: dict[str, HeldRequest] = {}
        self._room = asyncio.Event()

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[HeldRequest]:
        return iter(list(self._held.values()))

    def room(self, read_ahead: int) -> int:
        """How many more requests may be taken in now, `read_ahead` of them beyond the
        slots: none while one that runs alone is held (what this worker read would wait
        behind it; the queue's other workers take it)."""
        if any(held.alone for held in self._held.values()):
            return 0
        return self.slots + read_ahead - len(self._held)

    def wake(self) -> None:
        """End the waits for room or a leave now (their caller looks again)."""
        self._room.set()

    async def wait_for_room(self, read_ahead: int) -> None:
        """Return once a request has left the table (or at once if there is room)."""
        if self.room(read_ahead) > 0:
            return
        self._room.clear()
        await self._room.wait()

    async def wait_for_leave(self, timeout_s: float) -> None:
        """Return once a request has left the table, or after `timeout_s`."""
        self._room.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._room.wait(), timeout_s)

    def chains(self) -> Iterator[tuple[int, ...]]:
        """The prompt prefixes of the requests served here, as the fleet names them."""
        return (held.chain for held in self._held.values() if held.chain)

    def get(self, request_id: str) -> HeldRequest | None:
        return self._held.get(request_id)

    def holding(self, ref: RequestRef) -> HeldRequest | None:
        """The request if this very entry is held (not another entry with its id)."""
        held = self._held.get(ref.id)
        return held if held is not None and held.route.entry_id == ref.entry_id else None

    def read(self, route: Route) -> HeldRequest:
        """Hold a request just read from the stream."""
        held = self._held[route.id] = HeldRequest(route)
        return held

    def reroute(self, request_id: str, **changes: object) -> Route | None:
        """Change where a held request's events go (its reply stream, its encoding); None
        if it is not held any more (these three are called after awaits, in which another
        worker may have taken it: see `Leases`)."""
        held = self._held.get(request_id)
        if held is None:
            return None
        held.route = replace(held.route, **changes)  # type: ignore[arg-type]
        return held.route

    def fenced(self, request_id: str, token: str, written: int) -> None:
        """This worker took the request's fence: its token, and the events already written."""
        held = self._held.get(request_id)
        if held is None:
            return
        held.route = replace(held.route, fence=token)
        held.written = written

    def prepared(self, request_id: str, arrived_at: float, prepared_at: float | None = None) -> None:
        """The request is decoded, validated and tokenized (at `prepared_at`, by default
        now); its entry id says it arrived at `arrived_at`."""
        held = self._held.get(request_id)
        if held is None:
            return
        held.arrived_at, held.prepared_at = arrived_at, time.time() if prepared_at is None else prepared_at

    def advance(self, request_id: str, status: RequestStatus) -> None:
        """Move a held request forward (not to an end: see `end`)."""
        assert status not in ENDED, status
        held = self._held.get(request_id)
        if held is not None:
            held.status = status

    def wrote(self, ref: RequestRef, written: int, terminal: bool) -> None:
        """Events up to `written` of this entry are in its output stream; a terminal one ends it."""
        held = self.holding(ref)
        if held is None:
            return
        if held.first_published_at is None and written > held.written and not terminal:
            held.first_published_at = time.time()
        held.written = written
        if terminal:
            self.end(ref.id, RequestStatus.ACKED)
        elif held.status is not RequestStatus.FINISHING:
            held.status = RequestStatus.STREAMING

    def cancel(self, request_id: str) -> bool:
        """Note a cancel for a held request; False if none is held under that id."""
        held = self._held.get(request_id)
        if held is not None:
            held.cancel_requested = True
        return held is not None

    def hold_again(self, route: Route, written: int) -> None:
        """Hold a request afresh at `written`, to write its terminal error there; the
        engine drops what it still has of it."""
        self._abandon(route.id)
        self._held[route.id] = HeldRequest(route, RequestStatus.FINISHING, written)

    def end(self, request_id: str, status: RequestStatus) -> None:
        """The request leaves the table. Unless its terminal event is written (ACKED: the
        engine made it, or never had the request), the engine drops what it has of it."""
        assert status in ENDED, status
        held = self._held.pop(request_id, None)
        if held is None:
            return
        held.status = status
        if status is not RequestStatus.ACKED:
            self._abandon(request_id)
        self._room.set()

    def by_stream(self) -> dict[str, list[str]]:
        """Entry ids held, by the request stream they are in."""
        grouped: dict[str, list[str]] = {}
        for held in self._held.values():
            grouped.setdefault(held.route.stream, []).append(held.route.entry_id)
        return grouped

    def longest(self, count: int) -> list[HeldRequest]:
        """The `count` requests held longest, longest first."""
        return heapq.nsmallest(count, self._held.values(), key=lambda held: held.read_at)

    def by_entry(self, entry_id: str) -> HeldRequest | None:
        return next((h for h in self._held.values() if h.route.entry_id == entry_id), None)
