"""What a worker group adds to each step, measured on two ranks (run under mlx.launch):
rank 0's plan to the other rank (msgpack over TCP, `worker.process.group`), and the
sampled tokens' `all_sum` that hands rank 0's tokens to every rank.

    .venv/bin/mlx.launch --hosts 127.0.0.1 -n 2 --backend ring --python .venv/bin/python docs/group_step_cost.py
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from worker.process.group import receive_frame, send_frame  # noqa: E402

STEPS = 2000
PORT = 47399


def plans() -> dict[str, list]:
    return {"a decode step": [["step", 256, 8]],
            "a step that starts a 100-token prompt": [["insert", list(range(100)), 128, "greedy"], ["step", 256, 8]],
            "a step that ends 4 rows and starts 4": [["remove", [1, 2, 3, 4]]]
            + [["insert", list(range(100)), 128, "greedy"]] * 4 + [["step", 256, 8]]}


def main() -> None:
    group = mx.distributed.init(strict=True)
    rank = group.rank()
    if rank == 0:
        server = socket.create_server(("127.0.0.1", PORT))
        sock, _ = server.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for name, plan in plans().items():
            started = time.perf_counter()
            for _ in range(STEPS):
                send_frame(sock, plan)
            print(f"plan, {name}: {1e6 * (time.perf_counter() - started) / STEPS:.1f} us to send", flush=True)
        send_frame(sock, None)
    else:
        time.sleep(0.5)
        sock = socket.create_connection(("127.0.0.1", PORT))
        reader = sock.makefile("rb")
        while receive_frame(reader) is not None:
            pass
    for rows in (1, 16):
        times = []
        for _ in range(200):
            tokens = mx.zeros((rows,), dtype=mx.uint32)
            started = time.perf_counter()
            mx.eval(mx.distributed.all_sum(tokens, group=group))
            times.append(time.perf_counter() - started)
        if rank == 0:
            print(f"tokens' all_sum, {rows} row(s): median {1e6 * statistics.median(times):.0f} us, "
                  f"p90 {1e6 * sorted(times)[int(0.9 * len(times))]:.0f} us", flush=True)


if __name__ == "__main__":
    main()
