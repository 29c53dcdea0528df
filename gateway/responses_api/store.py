"""Stored responses, in Redis, so that any gateway continues any conversation, after a
restart too (mlx-vlm's and vLLM's servers keep them in one process's memory).

    mlxq:response:{<id>}              the record (JSON), with a TTL (`response_ttl_s`)
    mlxq:tenant:{<tenant>}:responses  its tenant's ids, scored by creation; past
                                      `max_stored_responses` the oldest are deleted

A record holds the response as the API shows it, this request's input items, and the
whole conversation up to its output (the earlier turns' items, its input, its output),
so continuing from it reads one key. Until it ends it also says where its request runs
(request id and queue), for a cancel from any gateway and for a background response to
be finished by whichever gateway is asked about it first.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis.asyncio as aioredis

from client.keys import Keys
from client.replies import as_text

from ..errors import ApiError
from ..tenants import Caller

ENDED = ("completed", "incomplete", "failed", "cancelled")


@dataclass
class StoredResponse:
    """One response's record."""

    response: dict[str, Any]
    tenant: str
    input: list[dict[str, Any]]
    conversation: list[dict[str, Any]]  # every turn's items before this response's output
    request_id: str
    queue: str
    tool_call: list[str] | None = None  # the model's tool-call markers, to read a background done
    offers_tools: bool = False
    background: bool = False
    gone_after: float = 0.0  # unix s: a foreground one still running past this lost its gateway
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return str(self.response["id"])

    @property
    def ended(self) -> bool:
        return self.response["status"] in ENDED

    def items(self) -> list[dict[str, Any]]:
        """The conversation a next turn continues: every earlier item and this output."""
        return [*self.conversation, *self.response.get("output", [])]


class ResponseStore:
    """Stored responses of every tenant, each seen only by its own."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: int, max_per_tenant: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self.max_per_tenant = max_per_tenant

    async def put(self, record: StoredResponse, new: bool = False) -> None:
        """Write a record; a new one counts in its tenant's set, whose oldest past the
        budget are deleted."""
        # ASCII JSON: a lone surrogate a body held (JSON's "\ud800") is kept escaped, never an encoding error
        await self.redis.set(self._key(record.id), json.dumps(asdict(record)), ex=self.ttl_s)
        if not new:
            return
        index = self.keys.tenant(record.tenant, "responses")
        await self.redis.zadd(index, {record.id: time.time()})
        await self.redis.expire(index, self.ttl_s)
        over = await self.redis.zcard(index) - self.max_per_tenant
        if over > 0:
            oldest: list[bytes] = await self.redis.zrange(index, 0, over - 1)  # type: ignore[assignment]
            await self.redis.delete(*(self._key(as_text(i)) for i in oldest))
            await self.redis.zrem(index, *oldest)

    async def get(self, response_id: str, caller: Caller) -> StoredResponse:
        """The record, if `caller` may see it; else 404, as one that never existed."""
        raw = await self.redis.get(self._key(response_id)) if len(response_id) <= 128 else None
        record = _record(raw)
        if record is None or not caller.owns(record.tenant):
            raise ApiError(404, f"Response with id '{response_id[:128]}' not found.", "invalid_request_error",
                           "not_found", "response_id")
        return record

    async def delete(self, record: StoredResponse) -> None:
        await self.redis.delete(self._key(record.id))
        await self.redis.zrem(self.keys.tenant(record.tenant, "responses"), record.id)

    def _key(self, response_id: str) -> str:
        return self.keys.response(response_id)


def _record(raw: bytes | str | None) -> StoredResponse | None:
    try:
        body = json.loads(raw) if raw else None
        return StoredResponse(**body) if isinstance(body, dict) else None
    except (ValueError, TypeError):
        return None
