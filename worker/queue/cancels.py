"""The cancel listener: ids published on `mlxq:cancel:<queue>` stop the requests this worker holds.

A request not yet read is caught by its flag when it is (see `intake`); one held here
is marked, and the engine drops it at its next step boundary (answering `cancelled`).
The flag gets a TTL if whoever set it gave none, so flags never pile up.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from worker.messages import EngineInbox
from worker.queue.requests import RequestTable
from worker.queue.retrying import describe, outage, stop_if_cancelled
from worker.queue.streams import RequestMarks

log = structlog.get_logger("mlxq.worker")

RESUBSCRIBE_S = 1.0


async def listen_for_cancels(redis: aioredis.Redis, marks: RequestMarks, requests: RequestTable, engine: EngineInbox,
                             flag_ttl_s: int) -> None:
    """Act on cancels until cancelled; a lost subscription is made again."""
    while True:
        pubsub = redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(marks.keys.cancel_channel(marks.queue))
            outage.answered()
            while True:
                message = await pubsub.get_message(timeout=1.0)
                if message is None:
                    continue
                request_id = message["data"].decode(errors="replace")
                if requests.cancel(request_id):
                    engine.cancel(request_id)
                    await _limit_flag(marks, request_id, flag_ttl_s)
        except (RedisError, OSError) as e:
            stop_if_cancelled(e)
            outage.failed("subscribing to cancels", describe(e), RESUBSCRIBE_S)  # logged once per outage
            await asyncio.sleep(RESUBSCRIBE_S)
        finally:
            await pubsub.aclose()


async def _limit_flag(marks: RequestMarks, request_id: str, ttl_s: int) -> None:
    """Give the flag a TTL; a failure here costs a flag's cleanup, not the subscription."""
    try:
        await marks.limit_cancel_flag(request_id, ttl_s)
    except (RedisError, OSError) as e:
        stop_if_cancelled(e)
        log.warning("could not give a cancel flag a TTL", request_id=request_id, reason=describe(e))
