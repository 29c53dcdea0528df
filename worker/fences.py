"""Taking a request's fence: what makes this worker the one writer of its output.

A worker takes the fence (see `scripts.TAKE`) when it starts serving an entry, before
its first write: from then on a cut-off worker that served the entry before is refused,
and the fence says where the output stands. Two findings end the request here instead:
another entry with the same id serves it (the entry is settled as a repeat), or its
terminal event is already written (a worker died between writing it and settling the
entry: the settling is done now).
"""

from __future__ import annotations

from functools import partial

import structlog

from .redis_queue import RedisQueue, Taken
from .requests import HeldRequest, RequestStatus, RequestTable
from .retrying import retrying

log = structlog.get_logger("mlxq.worker")


async def take_fence(redis_queue: RedisQueue, requests: RequestTable, held: HeldRequest) -> Taken | None:
    """Take the fence of a held request and hold it at the position the fence gives;
    None when the request ended here instead (see the module's doc)."""
    route = held.route
    taken = await retrying(partial(redis_queue.take, route), "taking a request's fence")
    if not taken.taken:
        log.warning("another entry with this id is served; dropping this one", request_id=route.id,
                    entry_id=route.entry_id)
        await retrying(partial(redis_queue.settle, route.stream, [route.entry_id]), "settling a duplicate")
    elif taken.finished:
        log.info("this request's output was already complete; settling it", request_id=route.id)
        await retrying(partial(redis_queue.finish, [route]), "settling a finished request")
    else:
        requests.fenced(route.id, taken.token, taken.written)
        return taken
    requests.end(route.id, RequestStatus.SETTLED)
    return None
