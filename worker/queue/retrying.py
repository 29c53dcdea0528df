"""Which Redis failures pass, and waiting them out.

Transient: the connection (refused, reset, timed out, TLS, DNS, auth while a password
rotates) and the error replies Redis gives while it is busy or changing role: `BUSY` (a
script running), `OOM` (maxmemory reached), `LOADING`, `READONLY` (a replica after a
failover), `MASTERDOWN`, `TRYAGAIN`, `CLUSTERDOWN`. These are retried with backoff and
jitter. Anything else (`NOPERM`, `WRONGTYPE`, a script error) is an answer, not an
outage: it is raised to the caller, which decides whose failure it is.

An outage is logged when it starts and whenever its cause changes, with Redis's own
words, and once more when Redis answers again; not once per retry.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from client.diagnose import describe, reply_code

log = structlog.get_logger("mlxq.redis")

T = TypeVar("T")
TRANSIENT_REPLIES = frozenset({"BUSY", "OOM", "LOADING", "READONLY", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN"})


def is_transient(error: BaseException) -> bool:
    """Whether waiting may cure the failure."""
    if isinstance(error, (RedisConnectionError, RedisTimeoutError, OSError)):
        return True
    return reply_code(error) in TRANSIENT_REPLIES


def is_permission_error(error: BaseException) -> bool:
    """Whether Redis refused a command or key to this user (an ACL)."""
    return isinstance(error, NoPermissionError) or reply_code(error) == "NOPERM"


class _Outage:
    """The process's view of Redis: down since when, and for what reason last logged."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.reason: str | None = None
        self.ended = 0  # outages over so far: a reader can tell that one passed since it last looked

    def failed(self, what: str, reason: str, retry_in_s: float) -> None:
        if self.since is None:
            self.since = time.monotonic()
        if reason != self.reason:
            self.reason = reason
            log.warning("redis unavailable; retrying until it answers", operation=what, reason=reason,
                        retry_in_s=round(retry_in_s, 2))

    def answered(self) -> None:
        if self.since is not None:
            log.info("redis answers again", down_s=round(time.monotonic() - self.since, 1), last_reason=self.reason)
            self.since, self.reason = None, None
            self.ended += 1


outage = _Outage()


async def retrying(operation: Callable[[], Awaitable[T]], what: str) -> T:
    """Run a Redis operation until it succeeds, backing off (with jitter) while the
    failure is transient; any other failure is raised."""
    for attempt in itertools.count(1):
        try:
            result = await operation()
        except (RedisError, OSError) as e:
            stop_if_cancelled(e)
            if not is_transient(e):
                raise
            pause = min(5.0, 0.05 * 2**attempt) * random.uniform(0.5, 1.0)
            outage.failed(what, describe(e), pause)
            await asyncio.sleep(pause)
            continue
        outage.answered()
        return result
    raise AssertionError("unreachable")


def stop_if_cancelled(error: BaseException) -> None:
    """Re-raise a cancellation that a Redis client turned into a timeout or connection
    error on its way out: a loop that retries it would never stop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():  # type: ignore[attr-defined]  # 3.11+, as is the worker
        raise asyncio.CancelledError from error
