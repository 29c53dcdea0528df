"""The gateway's HTTP routes (Starlette: FastAPI would add only what we do not use).

    POST /v1/chat/completions   POST /v1/completions    (streaming or not)
    GET  /v1/models             GET  /v1/models/{model}
    /v1/files, /v1/batches      OpenAI's Batch API (gateway/batches.py)
    POST /v1/responses          GET|DELETE /v1/responses/{id}, POST .../cancel, GET .../input_items
                                (OpenAI's Responses API, state in Redis: gateway/responses_api/)
    POST /v1/messages           POST /v1/messages/count_tokens   (Anthropic's API, gateway/anthropic.py)
    GET  /health                GET  /metrics
    /dashboard                  the fleet, live, in a browser (gateway/dashboard/)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Literal

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from client import AsyncClient, JobFailed, JobTimeout, QueueFull, RequestRejected
from client.batch_driver import BatchRunner
from client.diagnose import describe

from .anthropic import MessageShape, anthropic_error, read_messages
from .batches import Batches, Files
from .bodies import read_body
from .budget import TenantBudget
from .dashboard.access import Sessions
from .dashboard.pages import Dashboard
from .errors import TIMEOUT, ApiError
from .metrics import GatewayMetrics
from .models import ModelDirectory
from .pooling import PoolingKind, PoolingShape, read_pooling_call
from .quotas import Quotas, rate_limit_storage
from .relay import Relay
from .replies import ReplyStream
from .requests import read_call
from .responses_api.service import ResponsesApi
from .responses_api.store import ResponseStore
from .settings import GatewaySettings
from .tenants import ADMIN, KEY_PREFIX, Caller, KeyStore, matches_any

log = structlog.get_logger("mlxq.gateway")

CLOSE_TIMEOUT_S = 5.0  # for the Redis connections at shutdown; redis-py's close can hang (redis-py #3941)
Handler = Callable[[Request], Awaitable[Response]]


class Gateway:
    """The gateway's state: its Redis client, the model directory, the relay, the metrics."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.client = AsyncClient(settings.redis_url, prefix=settings.prefix)
        self.metrics = GatewayMetrics()
        self.directory = ModelDirectory(self.client.redis, self.client.keys, settings.models)
        self.replies = ReplyStream(self.client.redis, self.client.keys)
        redis, keys = self.client.redis, self.client.keys
        self.key_store = KeyStore(redis, keys)
        self.quotas = Quotas(redis, keys, rate_limit_storage(settings.redis_url, redis, keys),
                             lease_s=settings.request_timeout_s + 60)
        self.relay = Relay(self.client, self.directory, self.replies, self.metrics, self.quotas,
                           timeout_s=settings.request_timeout_s, keepalive_s=settings.keepalive_s)
        self._keys = [key.get_secret_value().encode() for key in settings.api_keys]
        self.files = Files(redis, keys, TenantBudget(redis, keys), max_bytes=settings.max_file_bytes,
                           budget_bytes=settings.files_budget_bytes, ttl_s=settings.file_ttl_s)
        self.batches = Batches(redis, keys, self.files, self.directory, max_batches=settings.max_batches)
        self.runner = BatchRunner(self.client, lease_s=settings.batch_lease_s, window=settings.batch_window)
        self.responses = ResponsesApi(self.client, self.directory, self.relay, self.quotas,
                                      ResponseStore(redis, keys, settings.response_ttl_s,
                                                    settings.max_stored_responses),
                                      timeout_s=settings.request_timeout_s,
                                      max_conversation_bytes=settings.max_body_bytes)
        self.dashboard = Dashboard(self.client, Sessions(redis, keys, self.key_store, self._keys), self.batches,
                                   settings.redis_url)

    async def close(self) -> None:
        """Stop reading the reply stream and close the Redis connections."""
        await self.replies.close()
        self.dashboard.close()
        await self.client.aclose()

    async def authorize(self, request: Request) -> Caller:
        """Who sends `request`: the owner of its key; raises 401 for a missing or unknown key.
        A gateway with no configured key and no key in Redis lets everyone in (whatever key
        they send, as OpenAI's SDKs always send one), as an admin."""
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if "x-api-key" in request.headers:  # Anthropic's SDKs send the key so
            scheme, given = "bearer", request.headers["x-api-key"]
        bearer = given if scheme.lower() == "bearer" else ""
        if bearer and matches_any(bearer, self._keys):
            return ADMIN
        record = await self.key_store.lookup(bearer) if bearer.startswith(KEY_PREFIX) else None
        if record is not None and record.viewer:
            raise ApiError(403, "this is a viewer key: it reads the dashboard (/dashboard) and calls no API",
                           "permission_error", "viewer_key")
        if record is not None:
            return Caller(record.tenant, record)
        if not self._keys and not await self.key_store.any():
            return ADMIN
        how = "'x-api-key: <key>'" if "x-api-key" in request.headers else "'Authorization: Bearer <key>'"
        raise ApiError(401, f"Incorrect API key provided: send {how} with one of the gateway's api_keys or a key "
                       "made by `mlxq keys create`", "invalid_request_error", "invalid_api_key")

    async def completions(self, request: Request, kind: Literal["chat", "completion"]) -> Response:
        started = time.monotonic()
        caller = await self.authorize(request)
        call = read_call(kind, await self._json(request))
        return await self.relay.serve(request, call, started, caller)

    async def pooling(self, request: Request, kind: PoolingKind) -> Response:
        started = time.monotonic()
        caller = await self.authorize(request)
        call = read_pooling_call(kind, await self._json(request))
        return await self.relay.serve(request, call, started, caller, shape_for=PoolingShape)

    async def messages(self, request: Request) -> Response:
        started = time.monotonic()
        caller = await self.authorize(request)
        _, call = read_messages(await self._json(request))
        return await self.relay.serve(request, call, started, caller, shape_for=MessageShape)

    async def create_response(self, request: Request) -> Response:
        caller = await self.authorize(request)
        return await self.responses.create(request, await self._json(request), caller)

    async def response(self, request: Request) -> Response:
        """GET or DELETE a stored response, or POST .../cancel."""
        caller = await self.authorize(request)
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            return JSONResponse(await self.responses.delete(response_id, caller))
        if request.url.path.endswith("/cancel"):
            return JSONResponse(await self.responses.cancel(response_id, caller))
        return JSONResponse(await self.responses.retrieve(response_id, caller))

    async def response_input_items(self, request: Request) -> Response:
        caller = await self.authorize(request)
        return JSONResponse(await self.responses.input_items(request.path_params["response_id"], caller, request))

    async def count_tokens(self, request: Request) -> Response:
        """The prompt a message would have, counted by a worker of its model (templated,
        with its tools and images): the gateway has no tokenizer."""
        caller = await self.authorize(request)
        _, call = read_messages(await self._json(request), counting=True)
        served = await self.directory.resolve(call.model, caller)
        body = dict(call.body)
        caller.shape(body)
        admission = await self.quotas.admit(caller, uuid.uuid4().hex)  # a request like any: its rate, its lease
        try:
            done = await self.client.generate(queue=served.queue, encoding="msgpack", count_only=True,
                                              timeout=self.settings.request_timeout_s, **body)
        except (RequestRejected, QueueFull, JobFailed) as e:
            raise ApiError.from_mlxq(e) from e
        except JobTimeout as e:
            raise ApiError.from_code(TIMEOUT, f"no worker counted the tokens within {e}") from e
        finally:
            await admission.close(0)
        return JSONResponse({"input_tokens": done.usage.prompt_tokens})

    async def _json(self, request: Request) -> object:
        body = await read_body(request, self.settings.max_body_bytes)
        try:
            return json.loads(body)
        except ValueError as e:
            raise ApiError.invalid(f"We could not parse the JSON body of your request ({e})") from e
        except RecursionError as e:
            raise ApiError.invalid("We could not parse the JSON body of your request (nested too deeply)") from e

    async def models(self, request: Request) -> Response:
        caller = await self.authorize(request)
        return JSONResponse({"object": "list", "data": await self.directory.listing(caller)})

    async def model(self, request: Request) -> Response:
        caller = await self.authorize(request)
        name = request.path_params["model"]
        await self.directory.resolve(name, caller)  # 404 or 503
        entry = next((m for m in await self.directory.listing(caller) if m["id"] == name), None)
        return JSONResponse(entry or {"id": name, "object": "model", "created": 0, "owned_by": "mlxq"})

    async def upload(self, request: Request) -> Response:
        caller = await self.authorize(request)
        return JSONResponse(await self.files.upload(request, caller))

    async def file(self, request: Request) -> Response:
        caller = await self.authorize(request)
        file_id = request.path_params["file_id"]
        made = await self.batches.result_file(file_id, caller)
        if request.method == "DELETE":
            return JSONResponse(await self.files.delete(file_id, caller))
        if made is None:
            return JSONResponse(await self.files.retrieve(file_id, caller))
        batch, part = made
        size = len(await self.batches.render(batch, part))
        return JSONResponse({"id": file_id, "object": "file", "bytes": size, "created_at": batch.created_at,
                             "expires_at": None, "filename": f"{batch.id}_{part}.jsonl", "purpose": "batch_output",
                             "status": "processed", "status_details": None})

    async def file_content(self, request: Request) -> Response:
        caller = await self.authorize(request)
        file_id = request.path_params["file_id"]
        made = await self.batches.result_file(file_id, caller)
        content = await self.files.content(file_id, caller) if made is None else await self.batches.render(*made)
        return Response(content, media_type="application/octet-stream")

    async def list_files(self, request: Request) -> Response:
        caller = await self.authorize(request)
        return JSONResponse(await self.files.listing(*_page_params(request), caller))

    async def create_batch(self, request: Request) -> Response:
        caller = await self.authorize(request)
        return JSONResponse(await self.batches.create(await self._json(request), caller))

    async def batch(self, request: Request) -> Response:
        caller = await self.authorize(request)
        batch_id = request.path_params["batch_id"]
        if request.url.path.endswith("/cancel"):
            return JSONResponse(await self.batches.cancel(batch_id, caller))
        return JSONResponse(await self.batches.retrieve(batch_id, caller))

    async def list_batches(self, request: Request) -> Response:
        caller = await self.authorize(request)
        return JSONResponse(await self.batches.listing(*_page_params(request), caller))

    async def health(self, request: Request) -> Response:
        """`{"status": "ok"}` when Redis answers, and nothing else; to an admin key, also the
        models served and the gateway's reply stream."""
        await self.client.redis.ping()
        if {"authorization", "x-api-key"} & set(request.headers) and (await self.authorize(request)).admin:
            return JSONResponse({"status": "ok", "models": self.directory.names(),
                                 "reply_streams": self.replies.streams})
        return JSONResponse({"status": "ok"})

    async def scrape(self, _: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def route(self, name: str, handler: Handler, render: Callable[[ApiError], Response] = ApiError.response) -> Handler:
        """`handler` with errors in OpenAI's shape (or `render`'s), and its answers counted."""
        async def answer(request: Request) -> Response:
            try:
                response = await handler(request)
            except ApiError as e:
                response = render(e)
            except (RedisError, OSError) as e:
                log.warning("Redis unreachable", error=describe(e))
                response = render(ApiError(503, f"the queue's Redis cannot be reached: {describe(e)}", "server_error",
                                           "redis_unavailable", headers={"Retry-After": "5"}))
            except Exception:  # noqa: BLE001 - a bug here answers this request alone, in its API's shape
                log.exception("the gateway failed a request", route=name)
                response = render(ApiError(500, "the gateway failed this request; its log has the details",
                                           "server_error", "internal"))
            self.metrics.answered(name, response.status_code)
            return response
        return answer


def _page_params(request: Request) -> tuple[str | None, int]:
    """`after` and `limit` (1-100, default 20) of a list call."""
    limit = request.query_params.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        raise ApiError.invalid(f"limit {limit!r}: a number from 1 to 100", param="limit")
    return request.query_params.get("after"), int(limit)


def create_app(settings: GatewaySettings, api: bool = True) -> Starlette:
    """The ASGI app of one gateway; without `api`, its dashboard alone (`mlxq dashboard`)."""
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        # An API gateway drives the batches nobody drives; a dashboard alone only shows them.
        runners = [asyncio.create_task(gateway.runner.run())] if api else []
        yield
        for runner in runners:
            runner.cancel()
        if runners:  # bounded as the close below: a Redis call cancelled mid-way can hang in
            # redis-py's disconnect; what is left is cancelled once more as the loop ends
            await asyncio.wait(runners, timeout=CLOSE_TIMEOUT_S)
        try:
            await asyncio.wait_for(gateway.close(), CLOSE_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("the Redis connections did not close in time; exiting without waiting for them",
                        timeout_s=CLOSE_TIMEOUT_S)

    api_routes = [
        Route("/v1/chat/completions", gateway.route("chat", lambda r: gateway.completions(r, "chat")),
              methods=["POST"]),
        Route("/v1/completions", gateway.route("completion", lambda r: gateway.completions(r, "completion")),
              methods=["POST"]),
        Route("/v1/embeddings", gateway.route("embeddings", lambda r: gateway.pooling(r, "embeddings")),
              methods=["POST"]),
        *(Route(path, gateway.route("rerank", lambda r: gateway.pooling(r, "rerank")), methods=["POST"])
          for path in ("/v1/rerank", "/v2/rerank", "/rerank")),  # Jina's, Cohere's v2, vLLM's bare path
        Route("/v1/models", gateway.route("models", gateway.models)),
        Route("/v1/models/{model:path}", gateway.route("models", gateway.model)),
        Route("/v1/files", gateway.route("files", gateway.upload), methods=["POST"]),
        Route("/v1/files", gateway.route("files", gateway.list_files), methods=["GET"]),
        Route("/v1/files/{file_id}", gateway.route("files", gateway.file), methods=["GET", "DELETE"]),
        Route("/v1/files/{file_id}/content", gateway.route("files", gateway.file_content)),
        Route("/v1/batches", gateway.route("batches", gateway.create_batch), methods=["POST"]),
        Route("/v1/batches", gateway.route("batches", gateway.list_batches), methods=["GET"]),
        Route("/v1/batches/{batch_id}", gateway.route("batches", gateway.batch)),
        Route("/v1/batches/{batch_id}/cancel", gateway.route("batches", gateway.batch), methods=["POST"]),
        Route("/v1/responses", gateway.route("responses", gateway.create_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", gateway.route("responses", gateway.response), methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/cancel", gateway.route("responses", gateway.response), methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items", gateway.route("responses", gateway.response_input_items)),
        Route("/v1/messages", gateway.route("messages", gateway.messages, anthropic_error), methods=["POST"]),
        Route("/v1/messages/count_tokens", gateway.route("messages", gateway.count_tokens, anthropic_error),
              methods=["POST"]),
    ]
    common = [Route("/health", gateway.route("health", gateway.health)), Route("/metrics", gateway.scrape)]
    app = Starlette(routes=[*(api_routes if api else []), *gateway.dashboard.routes(), *common], lifespan=lifespan)
    app.state.gateway = gateway
    return app
