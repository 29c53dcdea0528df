"""An event loop on a thread of its own: the blocking client runs the asyncio client on
it, so there is one implementation of every call (anyio's blocking portal, in small)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")

CANCEL_WAIT_S = 2.0  # the most an interrupted call waits for its cancellation to land on the loop


class Portal:
    """Runs coroutines on its loop's thread and waits for them in the caller's."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="mlxq-client", daemon=True)
        self._thread.start()

    def call(self, make: Callable[[], Awaitable[T]]) -> T:
        """`await make()` on the loop; an interrupt here (Ctrl-C) cancels it there, and
        returns once the cancellation has reached it (what runs next, an iterator's
        close, would otherwise find it still running)."""
        ended = threading.Event()

        async def run() -> T:
            try:
                return await make()
            finally:
                ended.set()

        future = asyncio.run_coroutine_threadsafe(run(), self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            ended.wait(CANCEL_WAIT_S)  # (not set if it was cancelled before it began)
            raise

    def iterate(self, items: AsyncIterator[T]) -> Iterator[T]:
        """The async iterator's items, one loop call each; closed on the loop when left."""
        try:
            while True:
                try:
                    yield self.call(items.__anext__)
                except StopAsyncIteration:
                    return
        finally:  # left early, or collected: close it there (never waiting on the loop from the loop)
            aclose = getattr(items, "aclose", None)
            if aclose is not None and self.loop.is_running() and threading.current_thread() is not self._thread:
                self.call(aclose)

    def close(self, last: Callable[[], Awaitable[object]] | None = None) -> None:
        """Run `last` on the loop (a client's aclose), then stop the loop and its thread.
        Called on the loop's own thread (a client collected there), it only schedules that."""
        if not self.loop.is_running():
            return
        if threading.current_thread() is self._thread:
            async def finish() -> None:
                try:
                    if last is not None:
                        await last()
                finally:
                    self.loop.stop()

            self.loop.create_task(finish())
            return
        try:
            if last is not None:
                self.call(last)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()
