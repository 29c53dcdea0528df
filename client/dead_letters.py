"""A queue's dead letters (`mlxq:q:<queue>:dead`): read, requeued and purged by `mlxq
dead` and the dashboard.

A dead letter holds why the entry died (`reason`, `consumer`, `deliveries`, ...), where it
came from (`stream`, `entry_id`) and a bounded copy of its fields (`field:<name>`; a field
cut short has `field:<name>:bytes`, its full size). Requeueing adds the body again under a
new id, `<id>-r<hex>`: the old id's output stream and done marker stay as they were (its
reader was told it failed), so nothing is computed twice under one id and the new
request's output starts clean.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import redis as redis_py

from .keys import Keys
from .replies import as_text

BODY_FIELDS = ("json", "msgpack")


class DeadLetterError(Exception):
    """A dead letter cannot be requeued; the message says why."""


@dataclass(frozen=True)
class DeadLetter:
    """One entry of a dead-letter stream."""

    entry_id: str
    fields: dict[str, bytes]

    def text(self, name: str) -> str:
        return self.fields.get(name, b"").decode(errors="replace")

    @property
    def request_id(self) -> str | None:
        return self.text("field:id") or None

    @property
    def died_at(self) -> float:
        return int(self.entry_id.split("-")[0]) / 1000


class DeadLetters:
    """The dead-letter stream of one queue."""

    def __init__(self, redis: redis_py.Redis, keys: Keys, queue: str) -> None:
        self.redis = redis
        self.keys = keys
        self.queue = queue
        self.stream = keys.dead(queue)

    def newest(self, count: int) -> list[DeadLetter]:
        """The newest `count`, newest first."""
        return [_letter(e) for e in self.redis.xrevrange(self.stream, count=count)]  # type: ignore[union-attr]

    def get(self, entry_id: str) -> DeadLetter | None:
        rows: list[Any] = self.redis.xrange(self.stream, entry_id, entry_id)  # type: ignore[assignment]
        return _letter(rows[0]) if rows else None

    def all_ids(self) -> list[str]:
        rows: list[Any] = self.redis.xrange(self.stream)  # type: ignore[assignment]
        return [as_text(entry_id) for entry_id, _ in rows]

    def requeue(self, entry_id: str) -> tuple[str, str]:
        """Add the dead letter's body again under a new id and remove it from the dead
        letters; returns (new id, stream). Raises `DeadLetterError`."""
        letter = self.get(entry_id)
        if letter is None:
            raise DeadLetterError(f"{entry_id}: no such dead letter in {self.stream}")
        body_field = next((name for name in BODY_FIELDS if f"field:{name}" in letter.fields), None)
        if body_field is None:
            raise DeadLetterError(f"{entry_id}: it has no json or msgpack body to requeue")
        if f"field:{body_field}:bytes" in letter.fields:
            raise DeadLetterError(f"{entry_id}: its body was cut to {len(letter.fields[f'field:{body_field}'])} of "
                                  f"{letter.text(f'field:{body_field}:bytes')} bytes when it died; it cannot be "
                                  "requeued, submit it again from its source")
        new_id = f"{(letter.request_id or 'dead')[:118]}-r{uuid.uuid4().hex[:6]}"
        stream = self._home(letter.text("stream"))
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(stream, {"id": new_id, body_field: letter.fields[f"field:{body_field}"]})
            pipe.xdel(self.stream, entry_id)
            pipe.execute()
        return new_id, stream

    def purge(self, entry_ids: list[str] | None) -> int:
        """Delete these dead letters, or all of them (None); returns how many went."""
        if entry_ids is None:
            count = int(self.redis.xlen(self.stream))  # type: ignore[arg-type]
            self.redis.delete(self.stream)
            return count
        return int(self.redis.xdel(self.stream, *entry_ids)) if entry_ids else 0  # type: ignore[arg-type]

    def _home(self, stream: str) -> str:
        """The stream a dead letter came from, if it is this queue's or one of its lanes;
        else the queue itself (a dead letter's fields are not trusted to name any key)."""
        queue_stream = self.keys.queue(self.queue)
        lane = stream.removeprefix(queue_stream + ":")
        if stream == queue_stream or (lane != stream and lane and ":" not in lane and lane != "dead"):
            return stream
        return queue_stream


def _letter(row: Any) -> DeadLetter:
    entry_id, fields = row
    return DeadLetter(as_text(entry_id), {as_text(k): v for k, v in fields.items()})
