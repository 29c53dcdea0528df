"""OpenAI's Files and Batches APIs over Redis, so that any gateway answers for any file
or batch (state: `client.batches`; who drives a batch: `client.batch_driver`).

    POST /v1/files          GET /v1/files          GET|DELETE /v1/files/{id}     GET /v1/files/{id}/content
    POST /v1/batches        GET /v1/batches        GET /v1/batches/{id}          POST /v1/batches/{id}/cancel

A batch's output and error files are made from its results when read (`file-<batch>-output`,
`file-<batch>-errors`), so finishing a batch writes nothing twice.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Literal

import redis.asyncio as aioredis
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request

from client.batches import RETENTION_S, Batch, BatchStore, completion_window_s, new_batch_id
from client.keys import Keys
from client.replies import as_text

from .batch_lines import ReadFile, read_input, result_file
from .bodies import bounded
from .budget import TenantBudget
from .errors import ApiError
from .models import ModelDirectory, Served
from .tenants import ADMIN_TENANT, Caller

MAX_METADATA = 16
FORM_OVERHEAD = 64 * 1024  # a multipart body's bytes beside the file: boundaries, headers, the purpose
FILE_FIELDS = ("id", "bytes", "created_at", "expires_at", "filename", "purpose")
RESULT_FILES: tuple[Literal["output", "errors"], ...] = ("output", "errors")


def not_found(what: str, name: str) -> ApiError:
    return ApiError(404, f"No such {what}: {name!r}", "invalid_request_error", f"{what}_not_found")


class Files:
    """Uploaded files, each a hash in Redis with its owner, under its tenant's budget and a TTL."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, budget: TenantBudget, *, max_bytes: int,
                 budget_bytes: int, ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.budget = budget
        self.max_bytes = max_bytes
        self.budget_bytes = budget_bytes  # a tenant's, unless its key says otherwise
        self.ttl_s = ttl_s

    def budget_of(self, caller: Caller) -> int:
        given = None if caller.record is None else caller.record.files_budget_bytes
        return given or self.budget_bytes

    async def upload(self, request: Request, caller: Caller) -> dict[str, Any]:
        counted = bounded(request, self.max_bytes + FORM_OVERHEAD, self._too_large)
        try:
            form = await counted.form(max_files=1, max_fields=8, max_part_size=64 * 1024)
        except (MultiPartException, HTTPException) as e:  # Starlette raises the latter for the former
            why = e.message if isinstance(e, MultiPartException) else e.detail
            raise ApiError.invalid(f"the upload is not a form this gateway reads: {why}", param="file") from e
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise ApiError.invalid("file: a multipart file part named 'file' is required", param="file")
            if purpose != "batch":
                raise ApiError.invalid(f"purpose {purpose!r}: this gateway takes files for 'batch'", param="purpose")
            data = await upload.read(self.max_bytes + 1)
            if len(data) > self.max_bytes:
                raise self._too_large(len(data))
            return await self._store(caller, upload.filename or "upload.jsonl", data)
        finally:
            await form.close()

    def _too_large(self, size: int) -> ApiError:
        return ApiError(413, f"the file is {size} bytes or more; this gateway takes files of at most "
                        f"{self.max_bytes} bytes (max_file_bytes)", "invalid_request_error", "too_large")

    async def _store(self, caller: Caller, filename: str, data: bytes) -> dict[str, Any]:
        now = int(time.time())
        file_id = f"file-{uuid.uuid4().hex}"
        fields = {"id": file_id, "bytes": len(data), "created_at": now, "expires_at": now + self.ttl_s,
                  "filename": filename[:255], "purpose": "batch", "tenant": caller.tenant}
        await self.budget.reserve(caller.tenant, file_id, len(data), now + self.ttl_s, self.budget_of(caller))
        key = self.keys.file(file_id)
        await self.redis.hset(key, mapping={**fields, "data": data})  # type: ignore[arg-type,dict-item]
        await self.redis.expire(key, self.ttl_s)
        await self.redis.zadd(self.keys.files, {file_id: now})
        await self.redis.zadd(self.keys.tenant(caller.tenant, "files"), {file_id: now})
        return _file_object(fields)

    async def retrieve(self, file_id: str, caller: Caller) -> dict[str, Any]:
        values = await self.redis.hmget(self.keys.file(file_id), [*FILE_FIELDS, "tenant"])
        if values[0] is None or not caller.owns(as_text(values[-1] or "")):
            raise not_found("file", file_id)
        return _file_object(dict(zip(FILE_FIELDS, (as_text(v or "") for v in values), strict=False)))

    async def content(self, file_id: str, caller: Caller) -> bytes:
        data, tenant = await self.redis.hmget(self.keys.file(file_id), ["data", "tenant"])
        if data is None or not caller.owns(as_text(tenant or "")):
            raise not_found("file", file_id)
        return data if isinstance(data, bytes) else data.encode()

    async def delete(self, file_id: str, caller: Caller) -> dict[str, Any]:
        tenant = as_text(await self.redis.hget(self.keys.file(file_id), "tenant") or "")
        if not caller.owns(tenant) or not await self.redis.delete(self.keys.file(file_id)):
            raise not_found("file", file_id)
        owner = tenant or ADMIN_TENANT
        await self.redis.zrem(self.keys.files, file_id)
        await self.redis.zrem(self.keys.tenant(owner, "files"), file_id)
        await self.budget.release(owner, file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def listing(self, after: str | None, limit: int, caller: Caller) -> dict[str, Any]:
        index = self.keys.files if caller.admin else self.keys.tenant(caller.tenant, "files")
        stored: list[bytes] = await self.redis.zrevrange(index, 0, -1)  # type: ignore[assignment]
        ids = [as_text(i) for i in stored]
        if after in ids:
            ids = ids[ids.index(after) + 1:]
        found: list[dict[str, Any]] = []
        for file_id in ids:
            if len(found) > limit:
                break
            try:
                found.append(await self.retrieve(file_id, caller))
            except ApiError:
                await self.redis.zrem(index, file_id)
        return _page(found, limit)


def _file_object(fields: dict[str, Any]) -> dict[str, Any]:
    return {"id": fields["id"], "object": "file", "bytes": int(fields["bytes"]),
            "created_at": int(fields["created_at"]),
            "expires_at": int(fields["expires_at"]) if fields.get("expires_at") else None,
            "filename": fields["filename"], "purpose": fields["purpose"], "status": "processed",
            "status_details": None}


def _page(items: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    shown = items[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(items) > limit}


class Batches:
    """`/v1/batches`, and the files each batch's results make; each batch its tenant's."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, files: Files, directory: ModelDirectory, *,
                 max_batches: int) -> None:
        self.store = BatchStore(redis, keys)
        self.files = files
        self.directory = directory
        self.max_batches = max_batches  # a tenant's active batches, unless its key says otherwise

    async def create(self, body: Any, caller: Caller) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiError.invalid("the request body must be a JSON object")
        unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
        if unknown:
            raise ApiError.invalid(f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0])
        endpoint, window = body.get("endpoint"), body.get("completion_window", "24h")
        metadata = _metadata(body.get("metadata"))
        if not isinstance(window, str):
            raise ApiError.invalid("completion_window: a string such as '24h'", param="completion_window")
        try:
            window_s = completion_window_s(window)
        except ValueError as e:
            raise ApiError.invalid(str(e), param="completion_window") from e
        file_id = body.get("input_file_id")
        if not isinstance(file_id, str):
            raise ApiError.invalid("input_file_id: the id of a file uploaded with purpose 'batch'",
                                   param="input_file_id")
        content = await self.files.content(file_id, caller)
        read = await asyncio.to_thread(read_input, content, str(endpoint))
        served, errors = await self._check(read, str(endpoint), caller)
        _shape_lines(read, caller, served)
        queue = served.queue if served else ""
        batch_id = new_batch_id()
        if not errors:
            await self._hold(caller, batch_id, len(content), int(time.time()) + window_s)
        try:
            batch = await self.store.create(read.lines, queue=queue or "none", endpoint=str(endpoint),
                                            completion_window=window, model=read.model, metadata=metadata,
                                            input_file_id=file_id, errors=errors or None, tenant=caller.tenant,
                                            batch_id=batch_id)
        except BaseException:
            await asyncio.shield(self._let_go(caller.tenant, batch_id))
            raise
        return openai_batch(batch)

    async def _check(self, read: ReadFile, endpoint: str, caller: Caller) -> tuple[Served | None, list[dict[str, Any]]]:
        """What serves the batch's model, or why it fails validation."""
        if read.errors:
            return None, read.errors
        if read.model is None:
            return None, [{"code": "invalid_request", "message": "no line of the file can run (see the error file's "
                         "reasons): every line failed to read", "param": None, "line": None}]
        return await self._queue_for(read.model, endpoint, caller)

    async def _hold(self, caller: Caller, batch_id: str, size: int, expires_at: int) -> None:
        """Count the batch's stored lines (`size`: its input file's, which they never pass:
        images are stored raw, not as base64) against the tenant's budget, and the batch
        against its active batches (both given back if the second is refused)."""
        budget = self.files.budget
        await budget.reserve(caller.tenant, batch_id, size, expires_at + RETENTION_S, self.files.budget_of(caller))
        most = (caller.record.max_batches if caller.record else None) or self.max_batches
        try:
            await budget.start_batch(caller.tenant, batch_id, expires_at, most)
        except BaseException:
            await asyncio.shield(budget.release(caller.tenant, batch_id))
            raise

    async def _let_go(self, tenant: str, batch_id: str) -> None:
        await self.files.budget.release(tenant, batch_id)
        await self.store.redis.zrem(self.store.keys.tenant(tenant, "active"), batch_id)

    async def _queue_for(self, model: str, endpoint: str, caller: Caller) -> tuple[Served | None, list[dict[str, Any]]]:
        """What serves `model`, or why the batch cannot run: no live worker serves it
        (404, 503), the caller's key may not call it, or it serves another task than the endpoint's."""
        try:
            served = await self.directory.resolve(model, caller)
        except ApiError as e:
            return None, [{"code": e.code or "model_not_found", "message": e.message, "param": "body.model",
                         "line": None}]
        wanted = "embed" if endpoint == "/v1/embeddings" else "generate"
        if served.task is not None and served.task != wanted:
            return None, [{"code": "invalid_request", "message": f"model {model!r} serves {served.task}; {endpoint} "
                           f"needs a model that serves {wanted}", "param": "body.model", "line": None}]
        return served, []

    async def retrieve(self, batch_id: str, caller: Caller) -> dict[str, Any]:
        return openai_batch(await self._get(batch_id, caller))

    async def cancel(self, batch_id: str, caller: Caller) -> dict[str, Any]:
        batch = await self._get(batch_id, caller)
        if batch.status not in ("validating", "in_progress", "cancelling"):
            raise ApiError(409, f"batch {batch_id} is {batch.status}: it cannot be cancelled",
                           "invalid_request_error", "batch_not_cancellable")
        cancelled = await self.store.cancel(batch_id)
        return openai_batch(cancelled or batch)

    async def listing(self, after: str | None, limit: int, caller: Caller) -> dict[str, Any]:
        batches, more = await self.store.listing(after, limit, None if caller.admin else caller.tenant)
        page = _page([openai_batch(b) for b in batches], limit)
        return {**page, "has_more": more}

    async def _get(self, batch_id: str, caller: Caller) -> Batch:
        batch = await self.store.get(batch_id)
        if batch is None or not caller.owns(batch.tenant):
            raise not_found("batch", batch_id)
        return batch

    async def result_file(self, file_id: str, caller: Caller) -> tuple[Batch, Literal["output", "errors"]] | None:
        """The batch and part (`output`, `errors`) a result file's id names, if it does (and
        the caller may see it)."""
        for part in RESULT_FILES:
            if file_id.startswith("file-") and file_id.endswith(f"-{part}"):
                batch = await self.store.get(file_id[len("file-"):-len(part) - 1])
                if batch is not None and batch.ended and caller.owns(batch.tenant):
                    return batch, part
        return None

    async def render(self, batch: Batch, part: Literal["output", "errors"]) -> bytes:
        """A result file's content."""
        return await result_file(self.store, batch, part, self._tool_call)

    async def _tool_call(self, model: str) -> tuple[str, str] | None:
        try:
            return (await self.directory.resolve(model)).tool_call
        except ApiError:
            return None

def _metadata(raw: Any) -> dict[str, str] | None:
    if raw is None:
        return None
    if (not isinstance(raw, dict) or len(raw) > MAX_METADATA
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                       for k, v in raw.items())):
        raise ApiError.invalid(f"metadata: at most {MAX_METADATA} string pairs (keys up to 64 characters, "
                               "values up to 512)", param="metadata")
    return raw


def openai_batch(batch: Batch) -> dict[str, Any]:
    """A batch as OpenAI's API shows it."""
    ended = batch.ended and batch.status != "failed"
    return {
        "id": batch.id, "object": "batch", "endpoint": batch.endpoint,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_id, "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": f"file-{batch.id}-output" if ended and batch.completed else None,
        "error_file_id": f"file-{batch.id}-errors" if ended and batch.failed else None,
        "created_at": batch.created_at, "expires_at": batch.expires_at,
        **{f"{s}_at": batch.times.get(f"{s}_at") for s in
           ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")},
        "request_counts": batch.request_counts, "metadata": batch.metadata, "model": batch.model,
    }


def _shape_lines(read: ReadFile, caller: Caller, served: Served | None) -> None:
    """Each line as the key's own request (its priority, its cache salt) and, where the
    batch's model is an adapter's name, for that adapter."""
    for line in read.lines:
        if line.body is not None:
            caller.shape(line.body)
            if served is not None and served.adapter:
                line.body["adapter"] = served.adapter
