"""How the thread that drives MLX is scheduled by Linux.

MLX's CPU backend runs a stream's ops on a thread of its own: the driving thread walks
the step's graph and hands each op over, waking that thread. Under Linux's default
policy a woken thread that has slept preempts the one that woke it, so on one core the
two switched at every op of a step (5 times a token each on the small demo model,
docs/benchmarks.md, "What is left"), and each switch costs more than a small op.
SCHED_BATCH threads do not preempt on waking: the driver hands the whole graph over,
then waits, and the stream thread runs it (0.4 switches a token). Threads inherit the
policy, so a thread that starts MLX's stream threads after calling this makes them
batch threads too. Nothing changes elsewhere: macOS has no such policy (Metal takes the
ops there), and a sandbox that refuses it only costs speed.
"""

from __future__ import annotations

import os

import structlog

log = structlog.get_logger("mlxq.engine")


def use_batch_scheduling() -> bool:
    """Make the calling thread (and the threads it starts) SCHED_BATCH where Linux
    allows; True if it did. The event loop's thread must not call this: its wake-ups
    (a reply from Redis, a step handed over) should still come first."""
    if not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # 0: the calling thread
    except OSError as e:
        log.info("could not use batch scheduling for the engine thread", error=str(e))
        return False
    return True
