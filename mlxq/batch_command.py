"""`mlxq batch`: OpenAI Batch API files run on a queue, from the command line.

    submit FILE.jsonl --queue Q [--wait]   status ID   results ID [-o out.jsonl]   cancel ID   list

`submit --wait` drives the batch itself whenever no gateway does, with a progress bar on
a terminal (plain lines otherwise). Reading and writing OpenAI's line shapes is the
gateway's code (`gateway.batch_lines`), so this command needs the gateway extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO, TypeVar

from client import AsyncClient
from client.batch_driver import drive_until_ended
from client.batches import Batch, BatchStore, completion_window_s

from .errors import CommandError

T = TypeVar("T")
PLAIN_EVERY_S = 5.0  # without a terminal, a progress line this often (and at every change of status)
BAR = 30
NEWLINE = b"\n"


def run(args: argparse.Namespace) -> int:
    from client.diagnose import redis_url_problem

    problem = redis_url_problem(args.redis_url)
    if problem:
        raise CommandError(f"--redis-url: {problem}", status=2)
    action: Callable[[AsyncClient, argparse.Namespace], Awaitable[int]] = ACTIONS[args.action]

    async def main() -> int:
        async with AsyncClient(args.redis_url, queue=args.queue, prefix=args.prefix) as client:
            return await action(client, args)

    return asyncio.run(main())


async def _submit(client: AsyncClient, args: argparse.Namespace) -> int:
    from gateway.batch_lines import read_input
    from gateway.errors import ApiError

    if args.batch is None:
        raise CommandError("submit needs the input file: mlxq batch submit FILE.jsonl --queue Q", status=2)
    try:
        content = Path(args.batch).read_bytes()
        completion_window_s(args.completion_window)
        read = read_input(content, args.endpoint)
    except (OSError, ValueError) as e:
        raise CommandError(str(e), status=2) from e
    except ApiError as e:
        raise CommandError(e.message, status=2) from e
    if read.errors:
        reasons = "; ".join(f"{'line ' + str(e['line']) + ': ' if e['line'] else ''}{e['message']}"
                            for e in read.errors)
        raise CommandError(f"{args.batch}: {reasons}")
    batch = await BatchStore(client.redis, client.keys).create(
        read.lines, queue=args.queue, endpoint=args.endpoint, completion_window=args.completion_window,
        model=read.model)
    print(batch.id, flush=True)
    if not args.wait:
        return 0
    progress = Progress(sys.stderr)
    batch = await drive_until_ended(client, batch.id, on_progress=progress.show)
    progress.end(batch)
    return 0 if batch.status == "completed" else 1


async def _status(client: AsyncClient, args: argparse.Namespace) -> int:
    batch = await _batch(client, args)
    if args.json:
        print(json.dumps(_as_json(batch)))
    else:
        print(describe(batch))
    return 0


async def _results(client: AsyncClient, args: argparse.Namespace) -> int:
    from gateway.batch_lines import result_file

    async def no_markers(_: str) -> None:  # no directory here: a text's tool-call markup stays in its content
        return None

    batch = await _batch(client, args)
    content = await result_file(BatchStore(client.redis, client.keys), batch, "errors" if args.errors else "output",
                                no_markers)
    if args.output is None:
        sys.stdout.buffer.write(content)
    else:
        args.output.write_bytes(content)
        print(f"{content.count(NEWLINE)} lines to {args.output} ({batch.status}: {batch.completed} completed, "
              f"{batch.failed} failed of {batch.total})", file=sys.stderr)
    return 0


async def _cancel(client: AsyncClient, args: argparse.Namespace) -> int:
    batch = await BatchStore(client.redis, client.keys).cancel((await _batch(client, args)).id)
    assert batch is not None
    print(describe(batch))
    return 0


async def _list(client: AsyncClient, args: argparse.Namespace) -> int:
    batches, _ = await BatchStore(client.redis, client.keys).listing(limit=args.count)
    for batch in batches:
        print(describe(batch))
    return 0


async def _batch(client: AsyncClient, args: argparse.Namespace) -> Batch:
    if args.batch is None:
        raise CommandError(f"{args.action} needs a batch id (mlxq batch list shows them)", status=2)
    batch = await BatchStore(client.redis, client.keys).get(args.batch)
    if batch is None:
        raise CommandError(f"no batch {args.batch} (never made, or ended more than a week ago)")
    return batch


ACTIONS = {"submit": _submit, "status": _status, "results": _results, "cancel": _cancel, "list": _list}


def describe(batch: Batch) -> str:
    """One line: id, status, counts, queue."""
    return (f"{batch.id}  {batch.status:<11} {batch.completed} completed, {batch.failed} failed of {batch.total}"
            f"  queue {batch.queue}  {batch.tokens} tokens")


def _as_json(batch: Batch) -> dict[str, Any]:
    return {"id": batch.id, "status": batch.status, "queue": batch.queue, "endpoint": batch.endpoint,
            "request_counts": batch.request_counts, "tokens": batch.tokens, "created_at": batch.created_at,
            "expires_at": batch.expires_at, **batch.times}


class Progress:
    """A batch's progress: a bar redrawn in place on a terminal, else a line now and then."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.tty = out.isatty()
        self.started = time.monotonic()
        self.first: tuple[float, int, int] | None = None  # when, lines ended, tokens: the rates' start
        self._printed_at = 0.0
        self._status = ""

    def show(self, batch: Batch) -> None:
        now = time.monotonic()
        ended = batch.completed + batch.failed
        if self.first is None:
            self.first = (now, ended, batch.tokens)
        line = self._line(batch, now, ended)
        if self.tty:
            self.out.write("\r\x1b[2K" + line)
        elif now - self._printed_at >= PLAIN_EVERY_S or batch.status != self._status:
            self.out.write(line + "\n")
            self._printed_at = now
        else:
            return
        self._status = batch.status
        self.out.flush()

    def _line(self, batch: Batch, now: float, ended: int) -> str:
        assert self.first is not None
        since, lines_then, tokens_then = self.first
        elapsed = max(now - since, 1e-6)
        tok_s = (batch.tokens - tokens_then) / elapsed
        line_rate = (ended - lines_then) / elapsed
        left = batch.total - ended
        eta = f"{left / line_rate:.0f}s" if line_rate > 0 and left else ("0s" if not left else "?")
        filled = BAR * ended // max(batch.total, 1)
        bar = f"[{'#' * filled}{'.' * (BAR - filled)}] " if self.tty else ""
        return (f"{bar}{batch.id} {batch.status}: {batch.completed} done, {batch.failed} failed / {batch.total} · "
                f"{tok_s:,.0f} tok/s · ETA {eta}")

    def end(self, batch: Batch) -> None:
        if self.tty:
            self.out.write("\n")
        self.out.write(describe(batch) + "\n")
        self.out.flush()
