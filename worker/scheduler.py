"""Which waiting request runs next. Pure bookkeeping: no model, no tensors."""

from __future__ import annotations

import heapq
import itertools

from .messages import EngineRequest


class Scheduler:
    """Requests waiting for a slot: lower `priority` first, first come first served among
    equals, and every `aging_s` seconds of waiting counts as one priority level better, so
    that a low priority cannot starve forever.

    Aging is the same for every waiting request, so the order never changes while they
    wait: ranking by `priority + arrived_at / aging_s` once, at arrival, is exact.
    """

    def __init__(self, aging_s: float = 10.0) -> None:
        self.aging_s = aging_s
        self._heap: list[tuple[float, int, str]] = []
        self._waiting: dict[str, tuple[int, EngineRequest]] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def add(self, request: EngineRequest) -> None:
        """Queue a request."""
        rank = request.priority + request.arrived_at / self.aging_s  # first: it is what can fail
        order = next(self._order)
        heapq.heappush(self._heap, (rank, order, request.id))
        self._waiting[request.id] = (order, request)

    def remove(self, request_id: str) -> EngineRequest | None:
        """Take a waiting request out (cancelled); None if it is not waiting."""
        entry = self._waiting.pop(request_id, None)
        return None if entry is None else entry[1]

    def take(self, slots: int) -> list[EngineRequest]:
        """Up to `slots` requests to start now, best first."""
        taken: list[EngineRequest] = []
        while self._heap and len(taken) < slots:
            _, order, request_id = heapq.heappop(self._heap)
            entry = self._waiting.get(request_id)
            if entry is not None and entry[0] == order:  # else removed earlier: a stale heap entry
                del self._waiting[request_id]
                taken.append(entry[1])
        return taken

    def drain(self) -> list[EngineRequest]:
        """Take every waiting request out, in order."""
        return self.take(len(self._waiting))
