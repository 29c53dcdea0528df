"""Who looks at the dashboard: a session opened with a key, kept in Redis.

A browser cannot send a bearer key with each page, so the key is given once, on the
sign-in form, and traded for a session: a random token in an HttpOnly, SameSite=Strict
cookie, whose hash names the session in Redis (`mlxq:dashboard:session:<sha256>`, with a
TTL), so any gateway of the fleet knows it and none stores the key. The session keeps the
key's digest and is checked against it on every page, so a revoked key's session ends
within `REFRESH_S`. Every action is a POST carrying the session's CSRF token.

    key                                 dashboard
    a configured api_key, admin key     sees everything, may act
    viewer key                          sees everything; its actions are refused
    user key                            refused: it would see other tenants
    none, on an open gateway            as an admin (the API is open too)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass

import redis.asyncio as aioredis

from client.keys import Keys
from client.replies import as_text

from ..tenants import KEY_PREFIX, KeyStore, digest, matches_any

COOKIE = "mlxq_dashboard"
SESSION_TTL_S = 8 * 3600


class Refused(Exception):
    """A key that opens no dashboard session; the message says why."""


@dataclass(frozen=True)
class Viewer:
    """The one looking: what to call them, whether they may act, their session's CSRF token."""

    name: str
    may_act: bool
    csrf: str

    def csrf_matches(self, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self.csrf.encode())


class Sessions:
    """Opens, reads and closes dashboard sessions."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, key_store: KeyStore, configured: list[bytes]) -> None:
        self.redis = redis
        self.keys = keys
        self.key_store = key_store
        self.configured = configured  # the gateway's api_keys: admins
        self._configured_digests = {hashlib.sha256(key).hexdigest() for key in configured}

    async def open(self, key: str) -> str:
        """A new session's token for `key`; raises `Refused`."""
        if key and matches_any(key, self.configured):
            return await self._store({"kind": "configured", "digest": digest(key)})
        record = await self.key_store.lookup(key) if key.startswith(KEY_PREFIX) else None
        if record is None:
            if await self.open_gateway():
                return await self.open_anonymous()
            raise Refused("that is not a key of this gateway")
        if not (record.admin or record.viewer):
            raise Refused(f"a user key (tenant {record.tenant}) does not open the dashboard, which shows every "
                          "tenant: use an admin or a viewer key (`mlxq keys create --role viewer`)")
        return await self._store({"kind": "key", "digest": digest(key)})

    async def open_anonymous(self) -> str:
        """A session on a gateway with no key at all (callers are admins there, as on its API)."""
        return await self._store({"kind": "open", "digest": ""})

    async def open_gateway(self) -> bool:
        return not self.configured and not await self.key_store.any()

    async def who(self, token: str | None) -> Viewer | None:
        """The viewer of a session; None for no session, an expired one, or one whose key is gone."""
        if not token or len(token) > 100:
            return None
        raw = await self.redis.get(self._key(token))
        try:
            session = json.loads(as_text(raw)) if raw else None
        except ValueError:
            return None
        if not isinstance(session, dict):
            return None
        kind, hashed, csrf = session.get("kind"), str(session.get("digest", "")), str(session.get("csrf", ""))
        if kind == "configured" and hashed in self._configured_digests:
            return Viewer("admin", True, csrf)
        if kind == "open" and await self.open_gateway():
            return Viewer("admin (open gateway)", True, csrf)
        record = await self.key_store.lookup_digest(hashed) if kind == "key" else None
        if record is not None and (record.admin or record.viewer):
            return Viewer(f"{record.tenant} ({record.role}, {record.id})", record.admin, csrf)
        return None

    async def close(self, token: str) -> None:
        await self.redis.delete(self._key(token))

    async def _store(self, session: dict[str, str]) -> str:
        token = secrets.token_urlsafe(32)
        session["csrf"] = secrets.token_urlsafe(32)
        await self.redis.set(self._key(token), json.dumps(session), ex=SESSION_TTL_S)
        return token

    def _key(self, token: str) -> str:
        return self.keys.dashboard_session(hashlib.sha256(token.encode()).hexdigest())
