"""`retrying` rides out an unreachable Redis but never swallows a cancellation."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from worker.retrying import retrying


async def test_transient_errors_are_retried_until_the_call_succeeds():
    calls = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise RedisConnectionError("refused")
        return "ok"

    assert await retrying(flaky, "a test") == "ok"
    assert len(calls) == 3


async def test_a_cancellation_that_comes_back_as_a_connection_error_still_cancels():
    """A Redis client that turns the cancellation of a blocked read into a connection
    error must not make the loop retry forever: that hung a worker's shutdown."""
    async def read() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise RedisConnectionError("connection closed by cancellation") from None

    task = asyncio.create_task(retrying(read, "a test"))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, timeout=2)
