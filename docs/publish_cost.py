"""The publisher's own CPU per step, against a real Valkey: 16 held requests, one delta
each per step, through `Publisher` exactly as the worker runs it (no model, no engine).

    .venv/bin/mlxq redis --port 6411 &
    taskset -c 0 .venv/bin/python docs/publish_cost.py 6411 [STEPS] [WIDTH]
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid

import redis.asyncio as aioredis

from client import Delta
from client.keys import GROUP, Keys
from worker.messages import Outgoing, Route, StepOutput
from worker.queue.fencing import Fencing
from worker.queue.publisher import Publisher
from worker.queue.requests import RequestTable
from worker.queue.streams import RequestStreams, ensure_groups

KEYS = Keys()


async def held_requests(r: aioredis.Redis, fencing: Fencing, queue: str, width: int) -> tuple[RequestTable,
                                                                                             list[Route]]:
    await ensure_groups(r, [KEYS.queue(queue)])
    requests, routes = RequestTable(4 * width, abandon=lambda _: None), []
    for i in range(width):
        request_id = f"{queue}-{i}"
        entry_id = (await r.xadd(KEYS.queue(queue), {"id": request_id, "json": "{}"})).decode()
        route = Route(request_id, entry_id, KEYS.output(queue, request_id), "json", KEYS.queue(queue))
        requests.read(route)
        requests.fenced(request_id, (await fencing.take(route)).token, 0)
        routes.append(route)
    await r.xreadgroup(GROUP, "c1", {KEYS.queue(queue): ">"}, count=width)
    return requests, routes


async def main(port: int, steps: int, width: int) -> None:
    r = aioredis.Redis(port=port)
    queue = f"cost{uuid.uuid4().hex[:6]}"
    fencing = Fencing(r, KEYS, queue, "c1", 60)
    requests, routes = await held_requests(r, fencing, queue, width)
    publisher = Publisher(RequestStreams(r, KEYS, queue, "c1", dedupe_ttl_s=60), fencing, requests)
    task = asyncio.create_task(publisher.run())
    wall, cpu = time.perf_counter(), time.process_time()
    for step in range(steps):
        publisher.outputs.put_nowait(StepOutput([Outgoing(route.ref, Delta(id=route.id, seq=step, text=" tok",
                                                                           tokens=[step % 1000])) for route in routes]))
        await publisher.outputs.join()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    task.cancel()
    print(f"{steps} steps of {width} deltas: {1e3 * cpu / steps:.3f} ms CPU a step ({1e6 * cpu / steps / width:.1f} µs "
          f"a delta), {1e3 * wall / steps:.3f} ms wall")
    await r.delete(*[key for route in routes for key in (route.reply_to, KEYS.progress(route.id))], KEYS.queue(queue))
    await r.aclose()


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    asyncio.run(main(*(args + [6411, 2000, 16][len(args):])))
