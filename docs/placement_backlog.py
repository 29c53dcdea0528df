"""Samples each worker's backlog on a queue while a benchmark runs: what it holds (its
heartbeat's in-flight count) and what waits unread in its placement lane, every 0.25 s;
prints the largest backlog any worker had while another held nothing.

    .venv/bin/python docs/placement_backlog.py REDIS_URL QUEUE SECONDS
"""

from __future__ import annotations

import json
import sys
import time

import redis

from client.keys import GROUP, Keys


def backlogs(r: redis.Redis, keys: Keys, queue: str) -> dict[str, int]:
    found = {}
    for raw_name in r.smembers(keys.affinity_lanes(queue)):
        name = raw_name.decode()
        beat = r.get(keys.worker(name))
        if beat is None:
            continue
        groups = r.xinfo_groups(keys.affinity_lane(queue, name))
        lag = next((g.get("lag") or 0 for g in groups if g["name"].decode() == GROUP), 0)
        found[name] = json.loads(beat)["in_flight"] + lag
    return found


def main(url: str, queue: str, seconds: float) -> None:
    r, keys = redis.Redis.from_url(url), Keys()
    worst, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        now = backlogs(r, keys, queue)
        if len(now) > 1 and min(now.values()) == 0:
            worst = max(worst, max(now.values()))
        time.sleep(0.25)
    print(f"  largest backlog of a worker while another held nothing: {worst}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
