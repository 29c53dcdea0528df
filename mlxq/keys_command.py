"""`mlxq keys`: the gateways' API keys, made, listed and revoked in Redis.

    create --tenant T [--models a,b] [--rpm N] [--tpm N] [--max-concurrency N]
           [--max-priority P] [--files-budget BYTES] [--max-batches N] [--role admin|user|viewer]
    list                revoke KEY_ID

`create` prints the key once; Redis keeps only its hash. A revoke reaches every gateway
within about a second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from pydantic import ValidationError

from client.connect import connect_async
from client.keys import Keys

from .errors import CommandError

LIMITS = ("rpm", "tpm", "max_concurrency", "files_budget_bytes", "max_batches")


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    from gateway.tenants import KeyStore

    redis = connect_async(args.redis_url)
    try:
        store = KeyStore(redis, Keys(args.prefix))
        if args.action == "create":
            return await _create(store, args)
        if args.action == "list":
            return await _list(store, args)
        if not args.key_id:
            raise CommandError("revoke: which key? give its id (from `mlxq keys list`)", status=2)
        if not await store.revoke(args.key_id):
            raise CommandError(f"revoke: no key {args.key_id}")
        print(f"revoked {args.key_id}: every gateway refuses it within a second or two")
        return 0
    finally:
        await redis.aclose()


async def _create(store: Any, args: argparse.Namespace) -> int:
    if not args.tenant:
        raise CommandError("create: --tenant is required (the team the key belongs to)", status=2)
    limits: dict[str, Any] = {name: getattr(args, name) for name in LIMITS if getattr(args, name) is not None}
    if args.models:
        limits["models"] = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.isolate_cache:
        limits["isolate_cache"] = True
    if args.max_priority is not None or args.role == "admin":
        limits["max_priority"] = args.max_priority
    try:
        key, record = await store.create(args.tenant, role=args.role, **limits)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, p['loc'])) or 'key'}: {p['msg']}" for p in e.errors())
        raise CommandError(f"create: {problems}", status=2) from e
    if args.json:
        print(json.dumps({"key": key, **record.model_dump()}))
    else:
        print(key)
        print(f"# {record.id}, tenant {record.tenant}, role {record.role}: shown once, store it now", flush=True)
    return 0


async def _list(store: Any, args: argparse.Namespace) -> int:
    records = await store.records()
    if args.json:
        print(json.dumps([r.model_dump() for r in records]))
        return 0
    print(f"{'ID':18} {'TENANT':16} {'ROLE':6} {'KEY':10} LIMITS")
    for r in records:
        shown = {k: v for k, v in r.model_dump(exclude={"id", "tenant", "role", "created_at", "hint"}).items()
                 if v is not None}
        print(f"{r.id:18} {r.tenant:16} {r.role:6} {'...' + r.hint:10} "
              + " ".join(f"{k}={','.join(v) if isinstance(v, list) else v}" for k, v in shown.items()))
    return 0
