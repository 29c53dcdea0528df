"""The Responses API's routes: create (whole, streamed, or in the background), retrieve,
delete, cancel, and a response's input items.

A foreground response runs through the relay like any chat call; a background one is
submitted to its request's own output stream and left: whichever gateway is next asked
about it reads that stream and, once its request has ended, stores the finished
response. So no gateway holds state another one needs.
"""

from __future__ import annotations

import time
import uuid
from functools import partial
from typing import Any

import structlog
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from client import AsyncClient, QueueFull, RequestRejected
from client.diagnose import describe
from client.protocol import Done, Error, decode_event

from ..errors import ApiError
from ..models import ModelDirectory
from ..quotas import Quotas
from ..relay import Relay
from ..requests import Call
from ..tenants import Caller
from .output import ResponseShape, Skeleton
from .request import ResponsesRequest, dumps, read_request
from .store import ResponseStore, StoredResponse

log = structlog.get_logger("mlxq.gateway")
LOST_AFTER_S = 60  # past its gateway's request timeout, a foreground response still running lost its gateway


class ResponsesApi:
    """`/v1/responses`, on the gateway's relay and Redis."""

    def __init__(self, client: AsyncClient, directory: ModelDirectory, relay: Relay, quotas: Quotas,
                 store: ResponseStore, *, timeout_s: float, max_conversation_bytes: int) -> None:
        self.client = client
        self.directory = directory
        self.relay = relay
        self.quotas = quotas
        self.store = store
        self.timeout_s = timeout_s
        self.max_conversation_bytes = max_conversation_bytes

    async def create(self, request: Request, raw: Any, caller: Caller) -> Response:
        started = time.monotonic()
        asked = read_request(raw)
        earlier = await self.store.get(asked.previous_response_id, caller) if asked.previous_response_id else None
        if earlier is not None:
            await self._catch_up(earlier)
            if not earlier.ended:
                raise ApiError.invalid(f"previous_response_id: {earlier.id} is still {earlier.response['status']}; "
                                       "continue from it once it has ended", param="previous_response_id")
        inputs = asked.input_items()
        conversation = [*(earlier.items() if earlier else []), *inputs]
        if len(dumps(conversation)) > self.max_conversation_bytes:
            raise ApiError(413, "the conversation (the earlier turns with this input) is over the gateway's "
                           "max_body_bytes; start a new one", "invalid_request_error", "too_large", "input")
        call = asked.to_call(conversation)
        served = await self.directory.resolve(call.model, caller)
        request_id = uuid.uuid4().hex
        skeleton = Skeleton(asked, f"resp_{request_id}", call.model)
        record = StoredResponse(skeleton.response("queued" if asked.background else "in_progress"), caller.tenant,
                                inputs, conversation, request_id, served.queue,
                                list(served.tool_call) if served.tool_call else None, call.offers_tools,
                                asked.background, time.time() + self.timeout_s + LOST_AFTER_S)
        if asked.background:
            return await self._start_in_background(call, record, caller, asked)
        if asked.store:
            await self.store.put(record, new=True)
        keep = partial(self._keep, record) if asked.store else _keep_nothing
        shape_for = partial(_shape, skeleton=skeleton, keep=keep)
        try:
            return await self.relay.serve(request, call, started, caller, shape_for=shape_for, request_id=request_id)
        except ApiError as e:
            if asked.store:
                await keep(skeleton.failed(e))
            raise

    async def retrieve(self, response_id: str, caller: Caller) -> dict[str, Any]:
        record = await self.store.get(response_id, caller)
        await self._catch_up(record)
        return record.response

    async def delete(self, response_id: str, caller: Caller) -> dict[str, Any]:
        record = await self.store.get(response_id, caller)
        await self.store.delete(record)
        return {"id": record.id, "object": "response.deleted", "deleted": True}

    async def cancel(self, response_id: str, caller: Caller) -> dict[str, Any]:
        """Cancel a response whose request runs or waits (on whichever gateway); it ends
        `cancelled` (or as it ended, if it ended first)."""
        record = await self.store.get(response_id, caller)
        await self._catch_up(record)
        if record.ended:
            raise ApiError.invalid(f"response {record.id} is {record.response['status']}: only a response that is "
                                   "queued or in progress can be cancelled", param="response_id")
        await self.client.cancel(record.request_id, queue=record.queue)
        if record.background:
            record.response = {**record.response, "status": "cancelled"}
            await self.store.put(record)
        return record.response

    async def input_items(self, response_id: str, caller: Caller, request: Request) -> dict[str, Any]:
        record = await self.store.get(response_id, caller)
        order = request.query_params.get("order", "desc")
        limit = request.query_params.get("limit", "20")
        if order not in ("asc", "desc"):
            raise ApiError.invalid(f"order {order[:10]!r}: asc or desc", param="order")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise ApiError.invalid(f"limit {limit[:10]!r}: a number from 1 to 100", param="limit")
        items = record.input if order == "asc" else record.input[::-1]
        after = request.query_params.get("after")
        if after is not None:
            at = next((i for i, item in enumerate(items) if item.get("id") == after), None)
            items = items[at + 1:] if at is not None else []
        page = items[:int(limit)]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}

    # ---- parts ----------------------------------------------------------------------

    async def _start_in_background(self, call: Call, record: StoredResponse, caller: Caller,
                                   asked: ResponsesRequest) -> Response:
        """Queue the request onto its own output stream, store the response `queued`, answer at once."""
        body = dict(call.body)
        caller.shape(body)
        admission = await self.quotas.admit(caller, record.request_id)  # its rate; no lease: nobody waits on it
        try:
            await self.client.submit(id=record.request_id, queue=record.queue, encoding="msgpack", **body)
        except (RequestRejected, QueueFull) as e:
            raise ApiError.from_mlxq(e) from e
        finally:
            await admission.close(0)
        await self.store.put(record, new=True)
        return JSONResponse(record.response)

    async def _catch_up(self, record: StoredResponse) -> None:
        """Finish a record whose request has ended since it was written: a background one
        from its output stream; a foreground one whose gateway is gone, as failed."""
        if record.ended:
            return
        if not record.background:
            if time.time() > record.gone_after:
                record.response = Skeleton.from_stored(record.response).failed(ApiError(
                    500, "the gateway that served this response stopped before it ended", "server_error", "lost"))
                await self.store.put(record)
            return
        entries: list[Any] = await self.client.redis.xrange(  # type: ignore[assignment]
            self.client.keys.output(record.queue, record.request_id))
        events = [decode_event(fields) for _, fields in entries]
        skeleton = Skeleton.from_stored(record.response)
        last = events[-1] if events else None
        if isinstance(last, Done):
            start = record.tool_call[0] if record.tool_call and record.offers_tools else None
            record.response = skeleton.finished(last, record.request_id, start)
        elif isinstance(last, Error):
            record.response = skeleton.failed(ApiError.from_code(last.code, last.message))
        elif events and record.response["status"] == "queued":
            record.response = {**record.response, "status": "in_progress"}
        else:
            return
        await self.store.put(record)

    async def _keep(self, record: StoredResponse, response: dict[str, Any]) -> None:
        """Store the finished response; Redis failing here loses the stored copy, never the answer."""
        record.response = response
        try:
            await self.store.put(record)
        except (RedisError, OSError) as e:
            log.warning("could not store a finished response; it was answered, not kept", response_id=record.id,
                        error=describe(e))


async def _keep_nothing(_: dict[str, Any]) -> None:
    pass


def _shape(call: Call, request_id: str, tool_call: tuple[str, str] | None, *, skeleton: Skeleton,
           keep: Any) -> ResponseShape:
    return ResponseShape(call, request_id, tool_call, skeleton, keep)
