"""CPU seconds each thread of a running worker spends while a command runs (Linux).

    .venv/bin/python docs/thread_cpu.py WORKER_PID -- .venv/bin/mlxq bench --redis-url ... --concurrency 16

Reads /proc/PID/task/*/stat and status (CPU, context switches) before and after the command; threads are named through
`py-spy dump` when py-spy is installed (`pip install py-spy`), else shown by id (MLX's
compute thread is the busy one without a Python name).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time


def cpu_seconds(pid: int) -> dict[int, tuple[float, float]]:
    """Each thread's (user, system) CPU seconds so far."""
    tick = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except FileNotFoundError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        seconds[int(tid)] = (int(fields[11]) / tick, int(fields[12]) / tick)  # utime, stime
    return seconds


def switches(pid: int) -> dict[int, tuple[int, int]]:
    """Each thread's (voluntary, involuntary) context switches so far."""
    counts = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            lines = open(f"/proc/{pid}/task/{tid}/status").read().splitlines()
        except FileNotFoundError:
            continue
        fields = dict(line.split(":\t", 1) for line in lines if ":\t" in line)
        counts[int(tid)] = (int(fields["voluntary_ctxt_switches"]), int(fields["nonvoluntary_ctxt_switches"]))
    return counts


def python_names(pid: int) -> dict[int, str]:
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        return {}
    dump = subprocess.run([spy, "dump", "-p", str(pid)], capture_output=True, text=True).stdout
    return {int(line.split()[1]): line.rsplit(":", 1)[-1].strip().strip('"')
            for line in dump.splitlines() if line.startswith("Thread ")}


def main() -> None:
    pid, command = int(sys.argv[1]), sys.argv[sys.argv.index("--") + 1:]
    names = python_names(pid)
    before, switched, started = cpu_seconds(pid), switches(pid), time.time()
    result = subprocess.run(command, capture_output=True, text=True)
    after, now, wall = cpu_seconds(pid), switches(pid), time.time() - started
    print(result.stdout.strip())
    spent = sorted(((user - before.get(tid, (0.0, 0.0))[0], system - before.get(tid, (0.0, 0.0))[1], tid)
                    for tid, (user, system) in after.items()), key=lambda t: -(t[0] + t[1]))
    for user, system, tid in spent:
        if user + system >= 0.05:
            (v1, i1), (v0, i0) = now.get(tid, (0, 0)), switched.get(tid, (0, 0))
            print(f"{tid:>8} {names.get(tid, 'native'):<14} {user + system:6.2f} s ({system:.2f} in the kernel), "
                  f"switches: {v1 - v0} voluntary, {i1 - i0} involuntary")
    print(f"all threads {sum(u + k for u, k, _ in spent):.2f} s over {wall:.2f} s of wall time")


if __name__ == "__main__":
    main()
