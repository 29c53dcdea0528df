"""API keys with owners, stored in Redis so that every gateway sees the same set.

A key belongs to a tenant and carries its limits, as LiteLLM's virtual keys do. Only a
hash of each key is stored (`<prefix>:apikeys`, a hash: sha256 of the key -> its record
as JSON); the key itself is shown once, when it is made. A gateway reads a key's record
at most once a `REFRESH_S`, so a revoke reaches every gateway within about that long.

The keys a gateway is configured with (`api_keys`) are admin keys of the tenant
`ADMIN_TENANT`; an admin sees and acts on every tenant's files and batches. A gateway with
no configured key and no key in Redis is open: every caller is an admin (as before keys
had owners).

    role    sees                                      may
    admin   every tenant                              everything
    user    its tenant's files, batches, its models   create and cancel its own
    viewer  the dashboard, every tenant               nothing: it reads the dashboard only
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from client.keys import Keys
from client.replies import as_text

ADMIN_TENANT = "admin"  # the tenant of the configured api_keys (and of every caller of an open gateway)
KEY_PREFIX = "sk-mlxq-"
TENANT_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
REFRESH_S = 1.0

Role = Literal["admin", "user", "viewer"]


class KeyRecord(BaseModel):
    """What is stored of one key: never the key itself."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(pattern=r"^key_[0-9a-f]{12}$")
    tenant: str = Field(pattern=TENANT_PATTERN)
    role: Role = "user"
    models: list[str] | None = None  # model or queue names it may call; None: every model
    rpm: int | None = Field(None, ge=1, description="requests per minute")
    tpm: int | None = Field(None, ge=1, description="tokens (prompt + generated) per minute")
    max_concurrency: int | None = Field(None, ge=1, description="requests in flight at once")
    max_priority: int | None = Field(0, description="the best (lowest) priority its requests get; None: any")
    files_budget_bytes: int | None = Field(None, ge=1, description="None: the gateway's default per tenant")
    max_batches: int | None = Field(None, ge=1, description="active batches at once; None: the gateway's default")
    isolate_cache: bool = Field(False, description="its requests hit only prefix and vision caches its tenant filled")
    created_at: int = 0
    hint: str = ""  # the key's last four characters, to tell keys apart in a list

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    @property
    def viewer(self) -> bool:
        return self.role == "viewer"

    @model_validator(mode="after")
    def _admin_tenant_is_for_admins(self) -> KeyRecord:
        if self.tenant == ADMIN_TENANT and self.role != "admin":  # it owns what admins and older versions made
            raise ValueError(f"tenant {ADMIN_TENANT!r} is the admins' own: give a {self.role} key another tenant")
        return self


@dataclass(frozen=True)
class Caller:
    """Who a request comes from: its tenant, and its key's record (None for the
    configured admin keys and for everyone on an open gateway)."""

    tenant: str
    record: KeyRecord | None = None

    @property
    def admin(self) -> bool:
        return self.record is None or self.record.admin

    @property
    def viewer(self) -> bool:
        return self.record is not None and self.record.viewer

    def owns(self, tenant: str | None) -> bool:
        """Whether this caller may see what `tenant` made (data made before owners: the admin tenant's)."""
        return self.admin or (tenant or ADMIN_TENANT) == self.tenant

    def shape(self, body: dict[str, Any]) -> None:
        """Fit a request body to the key: its priority no better than the key's best (a
        lower number is served first), and its `cache_salt` in the key's namespace: the
        tenant's own when the key isolates its caches, else one no isolated tenant's salt
        can equal, so that no caller reaches another tenant's cached prefixes."""
        best = None if self.record is None else self.record.max_priority
        if best is not None and (body.get("priority") or 0) < best:
            body["priority"] = best
        given = body.get("cache_salt")
        isolated = self.record is not None and self.record.isolate_cache
        if isolated or given is not None:
            body["cache_salt"] = f"{self.tenant if isolated else '*'}:{given or ''}"

    def may_call(self, *names: str) -> bool:
        """Whether a model known by any of `names` (its id, its queue) is in the key's list."""
        allowed = None if self.record is None else self.record.models
        return allowed is None or any(name in allowed for name in names)


ADMIN = Caller(ADMIN_TENANT)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    """The keys in Redis: made and revoked by `mlxq keys`, read by every gateway."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.hash = keys.api_keys
        self._seen: dict[str, tuple[float, KeyRecord | None]] = {}
        self._any_at = -REFRESH_S
        self._any = False

    async def create(self, tenant: str, **limits: object) -> tuple[str, KeyRecord]:
        """A new key and its record; the key is not stored, only its hash."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        record = KeyRecord(id=f"key_{secrets.token_hex(6)}", tenant=tenant, created_at=int(time.time()),
                           hint=key[-4:], **limits)  # type: ignore[arg-type]
        await self.redis.hset(self.hash, digest(key), record.model_dump_json())
        return key, record

    async def records(self) -> list[KeyRecord]:
        """Every key's record, oldest first."""
        stored = await self.redis.hgetall(self.hash)
        return sorted((KeyRecord.model_validate_json(raw) for raw in stored.values()), key=lambda r: r.created_at)

    async def revoke(self, key_id: str) -> bool:
        """Delete the key with this id; False if there is none."""
        stored = await self.redis.hgetall(self.hash)
        for hashed, raw in stored.items():
            if json.loads(raw).get("id") == key_id:
                return bool(await self.redis.hdel(self.hash, as_text(hashed)))
        return False

    async def lookup(self, key: str) -> KeyRecord | None:
        """The record of `key`, or None if it is not a key (read at most once a `REFRESH_S`)."""
        return await self.lookup_digest(digest(key))

    async def lookup_digest(self, hashed: str) -> KeyRecord | None:
        """`lookup` by the key's digest (what a dashboard session keeps of its key)."""
        now = time.monotonic()
        seen = self._seen.get(hashed)
        if seen is not None and now - seen[0] < REFRESH_S:
            return seen[1]
        raw = await self.redis.hget(self.hash, hashed)
        try:
            record = None if raw is None else KeyRecord.model_validate_json(raw)
        except ValidationError:
            record = None  # a record this gateway cannot read grants nothing
        if len(self._seen) > 10_000:  # a flood of wrong keys does not grow the gateway
            self._seen.clear()
        self._seen[hashed] = (now, record)
        return record

    async def any(self) -> bool:
        """Whether Redis holds any key (read at most once a `REFRESH_S`)."""
        now = time.monotonic()
        if now - self._any_at >= REFRESH_S:
            self._any, self._any_at = bool(await self.redis.hlen(self.hash)), now
        return self._any


def matches_any(given: str, configured: list[bytes]) -> bool:
    """Whether `given` is one of the configured keys, compared in constant time."""
    return any(hmac.compare_digest(given.encode(), key) for key in configured)
