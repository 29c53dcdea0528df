"""The gateway's own reply streams, one per queue: every request it relays names its
queue's as `reply_to`, and one reader follows each for all of them, one XREAD per worker
step instead of one per request and token. Each event goes to its request's queue, found by the event's id;
events of requests nobody waits for any more (a client that left) are dropped.

Nobody else reads the stream, so what has been read is trimmed away as it goes.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError, ResponseError

from client.diagnose import describe
from client.keys import Keys
from client.protocol import Delta, Done, Event, decode_event
from client.replies import stream_entries

from .quotas import OPEN, Admission

log = structlog.get_logger("mlxq.gateway")
BLOCK_MS = 1000
TRIM_EVERY_S = 1.0


class Followed:
    """The events of one request, as the reader hands them over."""

    def __init__(self, request_id: str) -> None:
        self.id = request_id
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.next_seq = 0  # deltas below it were handed over already (a failover can write them again)
        self.finished = False  # its terminal event was handed over
        self.released = False  # the relay is done with it
        self.on_queue = ""  # the mlxq queue it was sent to
        self.tokens = 0  # prompt and generated, once its `done` came: what its key is charged
        self.admission: Admission = OPEN  # its key's limits, given back when it ends

    async def read(self, wait_s: float) -> list[Event]:
        """Its next events (the terminal one last), waiting up to `wait_s` for the first; [] if none came."""
        if self.finished:
            return []
        events = []
        try:
            events.append(await asyncio.wait_for(self.queue.get(), timeout=max(0.001, wait_s)))
        except TimeoutError:
            return []
        while not self.queue.empty():
            events.append(self.queue.get_nowait())
        for i, event in enumerate(events):
            if not isinstance(event, Delta):
                self.finished = True
                if isinstance(event, Done):
                    self.tokens = event.usage.prompt_tokens + event.usage.completion_tokens
                return events[:i + 1]
        return events


class ReplyStream:
    """Reads the gateway's reply streams, one per queue it relays to
    (`mlxq:reply:<queue>:{gateway-<random>}`, under the queue as every output is), each by
    a reader of its own, for every request this gateway relays there."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.name = f"{{gateway-{uuid.uuid4().hex[:16]}}}"  # a hash tag: each stream in the slot of its fences
        self._followed: dict[str, Followed] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}  # by stream

    @property
    def streams(self) -> list[str]:
        return sorted(self._readers)

    def follow(self, request_id: str, queue: str) -> tuple[Followed, str]:
        """Start collecting the events of `request_id`, a request of `queue`, before it is
        submitted (none is missed); and the stream to name as its `reply_to`."""
        stream = self.keys.reply(queue, self.name)
        reader = self._readers.get(stream)
        if reader is None or reader.done():
            self._readers[stream] = asyncio.create_task(_Reader(self.redis, stream, self._followed).run(),
                                                        name=f"mlxq-gateway-replies-{queue}")
        followed = self._followed[request_id] = Followed(request_id)
        return followed, stream

    def forget(self, request_id: str) -> None:
        """Stop collecting its events (it finished, or its client left)."""
        self._followed.pop(request_id, None)

    async def close(self) -> None:
        for reader in self._readers.values():
            reader.cancel()
        await asyncio.gather(*self._readers.values(), return_exceptions=True)


class _Reader:
    """Follows one reply stream, handing each event to the request waiting for it. Nobody
    else reads the stream, so what has been read is trimmed away as it goes."""

    def __init__(self, redis: aioredis.Redis, stream: str, followed: dict[str, Followed]) -> None:
        self.redis = redis
        self.stream = stream
        self._followed = followed
        self._last_id = "0-0"
        self._trimmed_at = time.monotonic()
        self._trim_refused = False

    async def run(self) -> None:
        failing = False
        while True:
            try:
                reply = await self.redis.xread({self.stream: self._last_id}, count=1000, block=BLOCK_MS)
                self._hand_over(reply)
                await self._trim()
            except (RedisError, OSError) as e:
                if not failing:
                    log.warning("cannot read the gateway's reply stream; retrying", stream=self.stream,
                                reason=describe(e))
                failing = True
                await asyncio.sleep(0.5)
                continue
            if failing:
                log.info("reading the gateway's reply stream again", stream=self.stream)
                failing = False

    def _hand_over(self, reply: object) -> None:
        for entry_id, fields in stream_entries(reply):
            self._last_id = entry_id
            if fields is None:
                continue
            try:
                event = decode_event(fields)
            except Exception as e:  # noqa: BLE001 - not a worker's event: whatever it holds, skip it, keep reading
                log.warning("an entry of the reply stream is not an event", entry=entry_id, reason=str(e))
                continue
            followed = self._followed.get(event.id)
            if followed is None or (isinstance(event, Delta) and event.seq < followed.next_seq):
                continue
            if isinstance(event, Delta):
                followed.next_seq = event.seq + 1
            followed.queue.put_nowait(event)

    async def _trim(self) -> None:
        """Drop what has been read. A trim Redis refuses (an ACL without XTRIM, OOM) is
        logged and costs memory, never the reading."""
        if self._last_id == "0-0" or time.monotonic() - self._trimmed_at < TRIM_EVERY_S:
            return
        self._trimmed_at = time.monotonic()
        ms, seq = self._last_id.split("-")
        try:
            await self.redis.xtrim(self.stream, minid=f"{ms}-{int(seq) + 1}")  # everything up to the last read
        except ResponseError as e:
            if not self._trim_refused:  # once: it is tried again every second
                log.warning("cannot trim the gateway's reply stream; it grows until it expires", reason=describe(e))
            self._trim_refused = True
