"""An event loop on a thread of its own: the blocking client runs the asyncio client on
it, so there is one implementation of every call (anyio's blocking portal, in small)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


class Portal:
    """Runs coroutines on its loop's thread and waits for them in the caller's."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="mlxq-client", daemon=True)
        self._thread.start()

    def call(self, make: Callable[[], Awaitable[T]]) -> T:
        """`await make()` on the loop; an interrupt here (Ctrl-C) cancels it there."""
        async def run() -> T:
            return await make()

        future = asyncio.run_coroutine_threadsafe(run(), self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def iterate(self, items: AsyncIterator[T]) -> Iterator[T]:
        """The async iterator's items, one loop call each; closed on the loop when left."""
        try:
            while True:
                try:
                    yield self.call(items.__anext__)
                except StopAsyncIteration:
                    return
        finally:
            aclose = getattr(items, "aclose", None)
            if aclose is not None and self.loop.is_running():
                self.call(aclose)

    def close(self) -> None:
        """Stop the loop and its thread."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self.loop.close()
