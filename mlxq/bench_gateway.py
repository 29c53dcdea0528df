"""`mlxq bench --gateway URL`: the same workload through an mlxq gateway's OpenAI API
(streaming /v1/completions over HTTP), timed as an OpenAI client sees it, and the
gateway's own CPU time per 1,000 streamed tokens (its /metrics)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from .bench import Planned, Progress
from .bench_metrics import RequestTiming


async def through_gateway(url: str, model: str, planned: list[Planned], concurrency: int | None,
                          stream_interval: int, progress: Progress, timeout: float,
                          api_key: str | None = None) -> tuple[list[RequestTiming], dict[str, Any]]:
    """Send the workload to the gateway at `url` (for `model`, a model or queue name)."""
    width = concurrency or len(planned)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=width + 4, max_keepalive_connections=width + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as http:
        cpu_before = await _gateway_cpu_s(http)
        limit = asyncio.Semaphore(width)
        start = time.monotonic()

        async def one(request: Planned) -> RequestTiming:
            await asyncio.sleep(max(0.0, start + request.send_at - time.monotonic()))
            async with limit:
                timing = await _stream_one(http, model, request, stream_interval)
                progress(1)
                return timing

        timings = list(await asyncio.gather(*(one(r) for r in planned)))
        cpu_after = await _gateway_cpu_s(http)
    tokens = sum(t.tokens for t in timings)
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return timings, {"gateway_cpu_s": None if cpu is None else round(cpu, 3),
                     "gateway_cpu_ms_per_1k_tokens": None if cpu is None or not tokens else
                     round(cpu * 1000 / tokens * 1000, 1)}


async def _stream_one(http: httpx.AsyncClient, model: str, request: Planned, stream_interval: int) -> RequestTiming:
    body: dict[str, Any] = {"model": model, "prompt": request.prompt_tokens, "max_tokens": request.max_tokens,
                            "stream": True, "stream_options": {"include_usage": True},
                            "stream_interval": stream_interval}
    if request.response_format is not None:
        body["response_format"] = request.response_format
    timing = RequestTiming(submitted=time.monotonic())
    arrivals = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the gateway answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                timing.tokens = chunk["usage"]["completion_tokens"]
                timing.cached_tokens = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.monotonic())
    timing.done = time.monotonic()
    timing.token_times = _spread(arrivals, timing.tokens or stream_interval * len(arrivals))
    return timing


def _spread(arrivals: list[float], tokens: int) -> list[tuple[float, int]]:
    """Each chunk's arrival with its share of the tokens: an API chunk does not say how
    many it carries (the worker may join several steps' tokens into one), so they are
    shared out evenly, the first chunks taking one more where they do not divide."""
    share, extra = divmod(max(tokens, len(arrivals)), len(arrivals)) if arrivals else (0, 0)
    return [(at, share + (i < extra)) for i, at in enumerate(arrivals)]


async def _gateway_cpu_s(http: httpx.AsyncClient) -> float | None:
    """The gateway process's CPU seconds so far (Prometheus' process collector), if it says."""
    try:
        text = (await http.get("/metrics")).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("process_cpu_seconds_total "):
            return float(line.split()[1])
    return None
