"""`mlxq bench`: drive a running worker fleet through Redis with a workload and measure
what the producers see; optionally run the same workload in process for comparison.

Prompts are random token ids (exact lengths, no tokenizer needed on this side), so a
request's cost is what the workload says. Arrivals are a burst or a Poisson process.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from client import AsyncClient, AsyncJob
from client.connect import connect_async, is_cluster

from .bench_metrics import STAGES, RequestTiming, command_stats


@dataclass(frozen=True)
class Workload:
    """What to send: how many, how fast, how long, how much shared."""

    requests: int = 64
    rate: float | None = None  # requests per second, Poisson arrivals; None: all at once
    input_len: int = 100
    output_len: int = 128
    len_jitter: float = 0.0  # lengths drawn uniformly within ±this fraction
    shared_prefix: float = 0.0  # fraction of requests that start with one common prefix
    prefix_len: int = 64
    stream_interval: int = 1
    vocab: int = 1000  # prompt ids are drawn from [10, vocab): clear of special tokens
    seed: int = 0
    response_format: str = "none"  # json, regex or none: what the constrained requests ask for
    constrained: float = 1.0  # the share of requests that ask for it
    adapters: tuple[str, ...] = ()  # LoRA adapters the requests name, in turn (none: the model alone)
    tenants: int = 0  # each request starts with one of this many tenants' own prefix_len-token prefixes

    def ideal_cached(self, planned: list[Planned]) -> int:
        """With tenants: the prompt tokens a fleet could take from its prefix caches, every
        request after each tenant's first hitting its tenant's prefix."""
        firsts = {tuple(p.prompt_tokens[:self.prefix_len]) for p in planned}
        return (len(planned) - len(firsts)) * self.prefix_len if self.tenants else 0

    def plan(self) -> list[Planned]:
        """The requests, each with its send time (seconds after the start)."""
        rng = random.Random(self.seed)
        prefix = [rng.randrange(10, self.vocab) for _ in range(self.prefix_len)]
        systems = [[rng.randrange(10, self.vocab) for _ in range(self.prefix_len)] for _ in range(self.tenants)]
        planned, at = [], 0.0
        for i in range(self.requests):
            length = self._jittered(rng, self.input_len)
            if systems:  # a tenant's system prompt, then its question
                head = systems[rng.randrange(len(systems))]
                length += len(head)
            else:
                head = prefix[:length - 1] if rng.random() < self.shared_prefix else []
            tokens = head + [rng.randrange(10, self.vocab) for _ in range(length - len(head))]
            constrained = self.response_format != "none" and rng.random() < self.constrained
            planned.append(Planned(tokens, self._jittered(rng, self.output_len), at,
                                   RESPONSE_FORMATS[self.response_format] if constrained else None,
                                   self.adapters[i % len(self.adapters)] if self.adapters else None))
            if self.rate:
                at += rng.expovariate(self.rate)
        return planned

    def _jittered(self, rng: random.Random, mean: int) -> int:
        return max(1, round(mean * (1 + rng.uniform(-self.len_jitter, self.len_jitter))))


# Formats that keep a request going until its max_tokens, so that constrained and free
# requests generate alike: a JSON array that cannot close sooner (the JSON lexer's masks,
# the realistic cost), and free lower-case words.
RESPONSE_FORMATS: dict[str, dict[str, Any]] = {
    "json": {"type": "json_schema", "json_schema": {"name": "rows", "schema": {
        "type": "object", "required": ["items"], "additionalProperties": False,
        "properties": {"items": {"type": "array", "minItems": 10_000, "items": {
            "type": "object", "required": ["name", "score"], "additionalProperties": False,
            "properties": {"name": {"type": "string", "maxLength": 12},
                           "score": {"type": "integer", "minimum": 0, "maximum": 100}}}}}}}},
    "regex": {"type": "regex", "pattern": "[a-z ]+"},
}


@dataclass(frozen=True)
class Planned:
    prompt_tokens: list[int]
    max_tokens: int
    send_at: float
    response_format: dict[str, Any] | None = None
    adapter: str | None = None


Progress = Callable[[int], None]  # called with the number of requests just finished
WARM_UP = Planned([10] * 8, max_tokens=2, send_at=0.0)  # sent untimed first: no run pays first-call costs


async def through_redis(url: str, queue: str, planned: list[Planned], concurrency: int | None,
                        stream_interval: int, progress: Progress, timeout: float) -> tuple[list[RequestTiming], dict]:
    """Send the workload to the fleet serving `queue`; each request's timing, and the Redis
    commands the run cost."""
    # Each outstanding request blocks one connection in XREAD: size the pool for all of them.
    connections = connect_async(url, socket_timeout=10, max_connections=(concurrency or len(planned)) + 8)
    async with AsyncClient(url, queue=queue, redis=connections) as client:
        await (await client.submit(prompt_tokens=WARM_UP.prompt_tokens, max_tokens=WARM_UP.max_tokens)).result(
            timeout=timeout)
        info = connect_async(url)
        before = await _commandstats(info)
        limit = asyncio.Semaphore(concurrency or len(planned))
        start = time.monotonic()

        def body(request: Planned) -> dict[str, Any]:
            return {"prompt_tokens": request.prompt_tokens, "max_tokens": request.max_tokens,
                    "stream_interval": stream_interval, "response_format": request.response_format,
                    "adapter": request.adapter}

        async def follow(job: AsyncJob, timing: RequestTiming) -> RequestTiming:
            async for delta in job.stream(timeout=timeout):
                timing.token_times.append((time.monotonic(), len(delta.tokens)))
            done = await job.result(timeout=timeout)
            timing.done = time.monotonic()
            timing.tokens = done.usage.completion_tokens
            timing.queued_ms = done.timing.queued_ms
            timing.cached_tokens = done.usage.cached_tokens
            timing.stages_ms = {s: v for s in STAGES if (v := getattr(done.timing, s)) is not None}
            progress(1)
            return timing

        async def one(request: Planned) -> RequestTiming:
            await asyncio.sleep(max(0.0, start + request.send_at - time.monotonic()))
            async with limit:
                timing = RequestTiming(submitted=time.monotonic())
                return await follow(await client.submit(**body(request)), timing)

        if concurrency is None and not any(request.send_at for request in planned):
            # A backlog: pushed in one call, so that the worker finds it whole, as a queue's
            # backlog is, rather than as fast as one client can send it.
            submitted = time.monotonic()
            jobs = await client.submit_many([body(request) for request in planned])
            timings = await asyncio.gather(*(follow(job, RequestTiming(submitted=submitted)) for job in jobs))
        else:
            timings = await asyncio.gather(*(one(r) for r in planned))
        after = await _commandstats(info)
        await info.aclose()
    return list(timings), command_stats(before, after, sum(t.tokens for t in timings))


async def _commandstats(redis: Any) -> dict[str, Any]:
    """`INFO commandstats`, summed over every node of a cluster."""
    if not is_cluster(redis):
        return await redis.info("commandstats")  # type: ignore[no-any-return]
    per_node = await redis.info("commandstats", target_nodes=redis.PRIMARIES)
    total: dict[str, Any] = {}
    for stats in per_node.values():
        for name, row in stats.items():
            total.setdefault(name, {"calls": 0})["calls"] += row["calls"]
    return total


def in_process(model_path: str, planned: list[Planned], concurrency: int | None, progress: Progress,
               sequential: bool = False, detokenize: bool = False,
               backlog_width: int | None = None, cpus: set[int] | None = None) -> list[RequestTiming]:
    """The same workload through mlx-lm's BatchGenerator in this process (no Redis, no
    queue): the ceiling the worker is measured against. `sequential` runs one at a time;
    `detokenize` turns every token into text with mlx-lm's streaming detokenizer, one per
    request, as mlx-lm's server does (the worker must too, raw BatchGenerator does not).
    `backlog_width`: every request is inserted at once into a batch that wide, which
    works through them as rows free (a queue's backlog).
    It runs as the worker runs its engine: on a thread of its own, batch-scheduled on
    Linux (`worker.cpu_scheduling`), so that the ratio is the worker's own cost; with
    `cpus` (Linux), every thread of this process on those CPUs meanwhile."""
    run = functools.partial(_in_process, model_path, planned, concurrency, progress, sequential, detokenize,
                            backlog_width)
    with _threads_on(cpus):
        return _on_engine_like_thread(run)


@contextlib.contextmanager
def _threads_on(cpus: set[int] | None) -> Iterator[None]:
    """Every thread of this process on `cpus` (MLX's own threads too, made before), then
    back where each was; nothing without `cpus`."""
    if not cpus:
        yield
        return
    threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    before = {tid: os.sched_getaffinity(tid) for tid in threads}
    for tid in threads:
        os.sched_setaffinity(tid, cpus)
    try:
        yield
    finally:
        for tid, affinity in before.items():
            with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
                os.sched_setaffinity(tid, affinity)


def _on_engine_like_thread(run: Callable[[], list[RequestTiming]]) -> list[RequestTiming]:
    import mlx.core as mx

    from worker.engine.cpu_scheduling import use_batch_scheduling

    def main() -> list[RequestTiming]:
        use_batch_scheduling()
        try:
            return run()
        finally:
            mx.clear_streams()  # this thread's MLX streams, before the thread ends (see worker.engine)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(main).result()


def _in_process(model_path: str, planned: list[Planned], concurrency: int | None, progress: Progress,
                sequential: bool, detokenize: bool, backlog_width: int | None) -> list[RequestTiming]:
    from mlx_lm.generate import BatchGenerator

    model, tokenizer = _loaded(model_path)
    texts: dict[int, Any] = {}
    width = 1 if sequential else (backlog_width or concurrency or len(planned))
    admitted = len(planned) if backlog_width else width  # a backlog waits inside BatchGenerator
    generator = BatchGenerator(model, stop_tokens=[[i] for i in tokenizer.eos_token_ids],
                               completion_batch_size=width, prefill_batch_size=min(width, 8))
    timings: dict[int, RequestTiming] = {}
    waiting = list(planned)
    running = 0
    start = time.monotonic()
    freed = collections.deque([start] * admitted)  # when each free slot became free
    while waiting or running:
        now = time.monotonic()
        while waiting and running < admitted and (sequential or start + waiting[0].send_at <= now):
            request = waiting.pop(0)
            (uid,) = generator.insert([request.prompt_tokens], max_tokens=[request.max_tokens])
            if detokenize:
                texts[uid] = tokenizer.detokenizer
            # Submitted when it was due and had room, like the Redis client's request: not
            # when this loop got to it, which is after the step in progress (a prefill can
            # take hundreds of ms) and would leave that wait out of its TTFT.
            due = start + request.send_at if not sequential else now
            timings[uid] = RequestTiming(submitted=max(due, freed.popleft()))
            running += 1
        if not running:
            time.sleep(max(0.0, start + waiting[0].send_at - now))
            continue
        generated = generator.next_generated()
        arrived = time.monotonic()
        for response in generated:
            timing = timings[response.uid]
            if response.finish_reason != "stop":
                timing.token_times.append((arrived, 1))
                timing.tokens += 1
                if detokenize:
                    texts[response.uid].add_token(response.token)
                    _ = texts[response.uid].last_segment
            if response.finish_reason is not None:
                if detokenize:
                    texts.pop(response.uid).finalize()
                timing.done = arrived
                running -= 1
                freed.append(arrived)
                progress(1)
    generator.close()
    return list(timings.values())


@functools.lru_cache(maxsize=1)
def _loaded(model_path: str) -> tuple[Any, Any]:
    """The baselines' model, loaded once for all their runs, and warmed up like a worker
    that has served a request."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    model, tokenizer = load(model_path)[:2]
    generator = BatchGenerator(model, stop_tokens=[])
    generator.insert([WARM_UP.prompt_tokens], max_tokens=[WARM_UP.max_tokens])
    while not any(r.finish_reason for r in generator.next_generated()):
        pass
    generator.close()
    return model, tokenizer


def result_table(rows: list[dict[str, Any]]) -> str:
    """One line per run: throughput and the latency percentiles."""
    header = (f"{'run':<22}{'tok/s':>9}{'req/s':>8}{'TTFT p50':>10}{'p95':>8}{'p99':>8}"
              f"{'ITL p50':>9}{'p95':>7}{'p99':>7}{'max':>7}{'E2E p50':>9}{'queue p50':>10}")
    lines = [header]
    for row in rows:
        t, i, e, q = row["ttft_ms"], row["itl_ms"], row["e2e_ms"], row["queue_ms"]
        lines.append(f"{row['name']:<22}{_n(row['throughput_tok_s']):>9}{_n(row['requests_s']):>8}"
                     f"{_n(t['p50']):>10}{_n(t['p95']):>8}{_n(t['p99']):>8}{_n(i['p50']):>9}{_n(i['p95']):>7}"
                     f"{_n(i['p99']):>7}{_n(i['max']):>7}{_n(e['p50']):>9}{_n(q['p50']):>10}")
    return "\n".join(lines)


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def workload_dict(workload: Workload) -> dict[str, Any]:
    return asdict(workload)
