"""Prometheus metrics and the health check of one worker (`--metrics-port`).

Names follow vLLM's (`vllm:time_to_first_token_seconds` is `mlxq_time_to_first_token_seconds`
here). Latency histograms are observed as events are published, so they measure what a
reader sees; counters are read from `Totals` at scrape time, so they match what `mlxq
status` shows and continue across restarts under one consumer name. The server runs on
the worker's event loop; it never touches MLX.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import structlog
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from client.engine_stats import EngineStats
from client.heartbeat import counter_names
from client.protocol import Delta, Done, Event
from worker.queue.requests import RequestStatus, RequestTable
from worker.queue.totals import Totals

log = structlog.get_logger("mlxq.worker")

# Seconds; vLLM's buckets, cut to what a Mac serves.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
WAITING = (RequestStatus.READ, RequestStatus.ADMITTED)


class Metrics:
    """The worker's metrics registry: histograms observed here, the rest collected at scrape."""

    def __init__(self, totals: Totals, requests: RequestTable, engine_stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.ttft = self._histogram("time_to_first_token_seconds", "Time from arrival to the first token",
                                    LATENCY_BUCKETS)
        self.inter_token = self._histogram("inter_token_latency_seconds",
                                           "Time between tokens as published", TOKEN_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Time from arrival to the terminal event",
                                   LATENCY_BUCKETS)
        self.queue_time = self._histogram("request_queue_time_seconds", "Time from arrival to admission",
                                          LATENCY_BUCKETS)
        self._last_delta: dict[str, float] = {}  # request id -> when its last delta was published
        self.registry.register(_Collected(totals, requests, engine_stats))  # the engine's latest, the worker's

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(f"mlxq_{name}", documentation, buckets=buckets, registry=self.registry)

    def observe(self, event: Event, now: float | None = None) -> None:
        """One published event: its latencies."""
        now = time.monotonic() if now is None else now
        if isinstance(event, Delta):
            last = self._last_delta.get(event.id)
            if last is not None and event.tokens:
                per_token = (now - last) / len(event.tokens)
                for _ in event.tokens:
                    self.inter_token.observe(per_token)
            self._last_delta[event.id] = now
            if len(self._last_delta) > 4096:  # requests that left without a terminal event here
                self._last_delta.clear()
            return
        self._last_delta.pop(event.id, None)
        if isinstance(event, Done):
            timing = event.timing
            self.queue_time.observe(timing.queued_ms / 1000)
            self.e2e.observe(timing.total_ms / 1000)
            if timing.ttft_ms is not None:
                self.ttft.observe(timing.ttft_ms / 1000)


class _Collected(Collector):
    """Counters and gauges read when scraped: from the totals, the request table and
    the engine's latest stats."""

    def __init__(self, totals: Totals, requests: RequestTable, engine_stats: Callable[[], EngineStats | None]) -> None:
        self.totals = totals
        self.requests = requests
        self.engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        counts = self.totals.as_fields()
        yield _counter("prompt_tokens", "Prompt tokens of finished requests", counts["prompt_tokens"])
        yield _counter("generation_tokens", "Tokens generated", counts["generation_tokens"])
        # vLLM counts the prefix cache in tokens: prompt tokens looked up, and those found.
        yield _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", counts["prompt_tokens"])
        yield _counter("prefix_cache_hits", "Prompt tokens found in the prefix cache", counts["cached_tokens"])
        yield _counter("takeovers", "Requests taken over from silent workers", counts["takeovers"])
        yield _counter("dead_letters", "Entries moved to the dead-letter stream", counts["dead_letters"])
        yield _counter("engine_restarts", "Engine processes started again after one died or hung",
                       counts["engine_restarts"])
        finished = CounterMetricFamily("mlxq_request_success", "Requests finished, by reason",
                                       labels=["finished_reason"])
        errors = CounterMetricFamily("mlxq_request_errors", "Requests failed, by error code", labels=["code"])
        placed = CounterMetricFamily("mlxq_placements", "Requests placed by their prompt's prefix, by reason: "
                                     "served where it is cached (affine), moved to the worker that caches it "
                                     "(forwarded), kept because that worker was full (balanced), taken from a "
                                     "worker's lane past affinity_wait_ms (stolen)", labels=["reason"])
        for name in counter_names():
            kind, _, label = name.partition(":")
            family = {"finished": finished, "errors": errors, "placed": placed}.get(kind)
            if family is not None:
                family.add_metric([label], counts[name])
        yield finished
        yield errors
        yield placed
        statuses = [held.status for held in self.requests]
        streaming = sum(s is RequestStatus.STREAMING for s in statuses)
        yield _gauge("num_requests_running", "Requests streaming (first event written)", streaming)
        yield _gauge("num_requests_waiting", "Requests held, not yet generating", sum(s in WAITING for s in statuses))
        stats = self.engine_stats()
        spent = stats.time if stats is not None and stats.time is not None else None
        engine = CounterMetricFamily("mlxq_engine_seconds", "Engine thread time: in the model's step, around it "
                                     "(admitting, masks, detokenizing, events), handing steps to the event loop, "
                                     "waiting for work", labels=["part"])
        for part in ("model", "other", "handoff", "idle"):
            engine.add_metric([part], getattr(spent, f"{part}_s", 0.0))
        yield engine
        yield _counter("engine_steps", "Batch steps the engine took", spent.steps if spent else 0)
        # vLLM's spec-decode counters: draft tokens proposed and accepted.
        speculation = (stats.speculation if stats is not None else None) or {}
        yield _counter("spec_decode_num_draft_tokens", "Draft tokens proposed (prompt lookup or the draft model)",
                       speculation.get("draft_tokens", 0))
        yield _counter("spec_decode_num_accepted_tokens", "Draft tokens the model accepted",
                       speculation.get("accepted_tokens", 0))
        yield _counter("spec_decode_steps", "Speculative batch steps", speculation.get("steps", 0))
        yield from _adapters(stats.adapters if stats is not None else None)
        memory = GaugeMetricFamily("mlxq_mlx_memory_bytes", "MLX memory, by kind", labels=["kind"])
        for kind, value in (stats.memory if stats else {}).items():
            memory.add_metric([kind], value)
        yield memory


def _adapters(listed: list[dict[str, Any]] | None) -> Iterator[Metric]:
    """Per LoRA adapter (vLLM's `lora_requests_info`, as counts): requests started with
    it since the engine process started, and those running now."""
    started = CounterMetricFamily("mlxq_lora_requests", "Requests started with each LoRA adapter", labels=["adapter"])
    running = GaugeMetricFamily("mlxq_lora_running_requests", "Requests running with each LoRA adapter",
                                labels=["adapter"])
    for adapter in listed or []:
        if "error" not in adapter:
            started.add_metric([str(adapter.get("name"))], adapter.get("requests", 0))
            running.add_metric([str(adapter.get("name"))], adapter.get("running", 0))
    yield started
    yield running


def _counter(name: str, documentation: str, value: int) -> CounterMetricFamily:
    return CounterMetricFamily(f"mlxq_{name}", documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"mlxq_{name}", documentation, value=value)


def app(metrics: Metrics, healthy: Callable[[], Any]) -> Starlette:
    """`/metrics` and `/healthz`; `healthy` is awaited and returns None or why not."""
    async def healthz(_: Request) -> PlainTextResponse:
        problem = await healthy()
        return PlainTextResponse("ok\n" if problem is None else f"{problem}\n", status_code=200 if problem is None
                                 else 503)

    async def scrape(_: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return Starlette(routes=[Route("/healthz", healthz), Route("/metrics", scrape)])


class _Server(uvicorn.Server):
    """uvicorn on the worker's own loop: the worker, not uvicorn, handles SIGINT and SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def listen(host: str, port: int) -> socket.socket:
    """The metrics socket, bound at start so that a busy port is a clear error then
    (uvicorn would exit the process from inside its task)."""
    sock = socket.create_server((host, port), reuse_port=False)
    sock.set_inheritable(True)
    return sock


async def serve(metrics: Metrics, healthy: Callable[[], Any], sock: socket.socket) -> None:
    """Serve on `sock` until cancelled."""
    server = _Server(uvicorn.Config(app(metrics, healthy), log_config=None, access_log=False, lifespan="off"))
    await server.serve(sockets=[sock])

