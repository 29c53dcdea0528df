"""The `mlxq` command: worker, gateway, submit, batch, status, dead, redis, bench, demo-model.

`submit`, `status`, `dead` and `redis stop` need only the base install (the client);
the other commands import what they need when they run, and say which extra to install
when it is missing. A command's expected failures end in one line on stderr saying what
went wrong and what to do, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from functools import partial
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import redis

from client.diagnose import describe
from client.keys import DEFAULT_PREFIX, DEFAULT_QUEUE
from client.which_redis import default_url, embedded_port

from . import blas, client_commands, demo_model, demo_vision, embedded
from .errors import CommandError, unreachable

WORKER_EXTRA = "pip install '.[worker,embedded]' in the mlxq checkout"
GATEWAY_EXTRA = "pip install '.[gateway]' in the mlxq checkout"


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `mlxq` console script."""
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "extra_missing", False):  # without its extra a command has no flags to check
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "command", None):
        parser.print_help()
        sys.exit(2)
    args.argv = sys.argv[1:] if argv is None else argv
    sys.exit(_run(args))


def _run(args: argparse.Namespace) -> int:
    """Run the command; its expected failures end in one line on stderr."""
    try:
        return int(args.run(args))
    except CommandError as e:
        print(f"mlxq {args.command}: {e}", file=sys.stderr)
        return e.status
    except (redis.ConnectionError, redis.TimeoutError) as e:
        url = getattr(args, "redis_url", None) or embedded.url(getattr(args, "port", embedded_port()))
        print(f"mlxq {args.command}: {unreachable(url, e, url == embedded.url(embedded_port()))}", file=sys.stderr)
        return 1
    except redis.RedisError as e:
        print(f"mlxq {args.command}: Redis refused: {describe(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


class _Formatter(argparse.HelpFormatter):
    """Every option's default in its help, unless the help says it already."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxq", description="LLM inference from a Redis Streams queue, on MLX.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (_add_worker, _add_gateway, _add_dashboard, _add_keys, _add_submit, _add_batch, _add_status,
                _add_dead, _add_adapters, _add_redis, _add_bench, _add_demo_model):
        add(commands)
    return parser


def _command(commands: Any, name: str, help: str, description: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(name, help=help, description=description,
                                                          formatter_class=_Formatter)
    return parser


def _add_redis_url(parser: argparse.ArgumentParser, prefix: bool = True) -> None:
    parser.add_argument("--redis-url", default=default_url(),
                        help="Redis URL (default: $MLXQ_REDIS_URL, else the embedded Valkey at "
                             f"{embedded.url(embedded_port())}, its port $MLXQ_EMBEDDED_PORT or 6390)")
    if prefix:
        parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="key prefix of the workers")


def _add_queue(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--queue", default=os.environ.get("MLXQ_QUEUE", DEFAULT_QUEUE),
                        help=f"queue name (default: $MLXQ_QUEUE, else {DEFAULT_QUEUE})")


def _add_worker(commands: Any) -> None:
    """`mlxq worker`: one flag per worker setting (none on a client-only install)."""
    worker = _command(commands, "worker", "run a worker daemon",
                      "Serve one queue. Flags override MLXQ_* variables, which override the --config file, "
                      "which overrides the defaults.")
    worker.add_argument("--config", type=Path, help="TOML file of settings (see config/worker.toml)")
    worker.add_argument("--check", action="store_true", help="check the settings (the --config file with the flags "
                        "and MLXQ_* variables) and exit: 0 valid, 2 and the reason")
    try:
        from worker.settings import WorkerSettings
    except ImportError as e:  # a client-only install
        worker.set_defaults(run=partial(_missing_extra, "worker", e), extra_missing=True)
    else:
        for name, field in WorkerSettings.model_fields.items():
            if name != "models":  # tables: TOML only
                _add_setting(worker, name, field)
        worker.set_defaults(run=_run_worker)


def _run_worker(args: argparse.Namespace) -> int:
    try:
        from . import worker_command
    except ImportError as e:
        return _missing_extra("worker", e, args)
    return worker_command.run(args)


def _add_gateway(commands: Any) -> None:
    """`mlxq gateway`: one flag per gateway setting (none without the gateway extra)."""
    _add_gateway_command(commands, "gateway", "serve the OpenAI API in front of the queues",
                         "An HTTP server that enqueues each request and streams its output back: OpenAI's "
                         "/v1/chat/completions, /v1/completions, /v1/responses (stored in Redis), /v1/embeddings, "
                         "/v1/rerank, /v1/models, /v1/files and /v1/batches; Anthropic's /v1/messages; the live "
                         "dashboard at /dashboard; /health and /metrics. Flags override MLXQ_GATEWAY_* variables, "
                         "which override the --config file, which overrides the defaults.", api=True)


def _add_dashboard(commands: Any) -> None:
    """`mlxq dashboard`: the gateway's dashboard alone, with the gateway's settings."""
    _add_gateway_command(commands, "dashboard", "serve the live web dashboard alone (no API)",
                         "The fleet, queues, running requests, dead letters, batches and the last hour's charts "
                         "at http://HOST:PORT/dashboard, as `mlxq gateway` serves them beside its API. It takes "
                         "the gateway's settings: sign in with one of its api_keys or a key made by `mlxq keys "
                         "create --role admin|viewer`.", api=False)


def _add_gateway_command(commands: Any, name: str, help: str, description: str, api: bool) -> None:
    """A command that serves the gateway's app (with its API or without): its settings as flags."""
    parser = _command(commands, name, help, description)
    parser.add_argument("--config", type=Path, help="TOML file of settings (see config/gateway.toml)")
    parser.add_argument("--check", action="store_true", help="check the settings (the --config file with the "
                        "flags and MLXQ_GATEWAY_* variables) and exit: 0 valid, 2 and the reason")
    try:
        import starlette  # noqa: F401 - the extra's packages, so that --help says what is missing
        import uvicorn  # noqa: F401

        from gateway.settings import ENV_PREFIX, GatewaySettings
    except ImportError as e:
        parser.epilog = f"This install lacks the gateway extra ({e.name} is missing): {GATEWAY_EXTRA}."
        parser.set_defaults(run=partial(_missing_extra, name, e), extra_missing=True)
    else:
        for setting, field in GatewaySettings.model_fields.items():
            _add_setting(parser, setting, field, ENV_PREFIX)
        parser.set_defaults(run=partial(_run_gateway, api=api))


def _run_gateway(args: argparse.Namespace, api: bool) -> int:
    from . import gateway_command

    return gateway_command.run(args, api)


def _add_keys(commands: Any) -> None:
    """`mlxq keys`: the gateways' API keys, in Redis."""
    keys = _command(commands, "keys", "create, list or revoke the gateways' API keys",
                    "Keys belong to a tenant and carry its limits; every gateway on the Redis reads them. `create` "
                    "prints the key once (Redis keeps only its hash). A user key sees only its tenant's files and "
                    "batches and calls only its --models; an admin key sees every tenant.")
    keys.add_argument("action", choices=["create", "list", "revoke"])
    keys.add_argument("key_id", nargs="?", metavar="KEY_ID", help="revoke: the key's id (key_..., from `list`)")
    keys.add_argument("--tenant", help="create: the team the key belongs to (A-Za-z0-9_.-)")
    keys.add_argument("--role", choices=["user", "admin", "viewer"], default="user",
                      help="create: an admin sees every tenant and acts on it; a viewer reads the dashboard only")
    keys.add_argument("--models", help="create: the models (names or queues) it may call, comma-separated "
                      "(default: every model)")
    keys.add_argument("--rpm", type=int, help="create: requests per minute (default: no limit)")
    keys.add_argument("--tpm", type=int, help="create: tokens per minute, prompt and generated (default: no limit)")
    keys.add_argument("--max-concurrency", type=int, help="create: requests in flight at once (default: no limit)")
    keys.add_argument("--max-priority", type=int, help="create: the best (lowest) priority its requests get "
                      "(default: 0 for a user key, any for an admin)")
    keys.add_argument("--files-budget", dest="files_budget_bytes", type=int, metavar="BYTES",
                      help="create: bytes its tenant's files and batches may hold (default: the gateway's)")
    keys.add_argument("--max-batches", type=int, help="create: batches in progress at once (default: the gateway's)")
    keys.add_argument("--isolate-cache", action="store_true", help="create: its requests hit only the prefix and "
                      "vision caches its own tenant's requests filled (vLLM's cache_salt)")
    keys.add_argument("--json", action="store_true", help="create, list: JSON")
    _add_redis_url(keys)
    keys.set_defaults(run=_run_keys)


def _run_keys(args: argparse.Namespace) -> int:
    try:
        from . import keys_command
    except ImportError as e:
        return _missing_extra("keys", e, args)
    return keys_command.run(args)


def _add_submit(commands: Any) -> None:
    """`mlxq submit`: one request, its text printed."""
    submit = _command(commands, "submit", "submit a request and print its output",
                      "Submit one request and print the generated text (or with --embed the embedding, with "
                      "--rerank the documents' scores). Exit status: 0 done, 1 failed, "
                      "2 bad usage, 75 queue full (retry later), 130 interrupted (the request is cancelled).")
    submit.add_argument("prompt", help="the prompt text")
    submit.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    submit.add_argument("--stream", action="store_true", help="print text as it arrives")
    submit.add_argument("--max-tokens", type=int, help="most tokens to generate (default: the worker's)")
    submit.add_argument("--temperature", type=float, help="0 is greedy (default: 0)")
    submit.add_argument("--top-p", type=float, help="nucleus sampling (default: 1, off)")
    submit.add_argument("--top-k", type=int, help="sample among the k most likely tokens (default: 0, off)")
    submit.add_argument("--seed", type=int, help="seed for sampling (default: random)")
    submit.add_argument("--stop", action="append", help="stop string (repeatable; default: none)")
    submit.add_argument("--priority", type=int, help="lower is served first (default: 0)")
    submit.add_argument("--lane", help="submit to this priority lane of the queue (default: the queue itself)")
    submit.add_argument("--adapter", help="a LoRA adapter of the queue's model to generate with (README, \"Adapters\")")
    submit.add_argument("--image", action="append", type=Path, help="image file sent with the prompt, for a "
                        "vision model's queue (repeatable; sent as raw bytes in msgpack)")
    submit.add_argument("--embed", action="store_true", help="ask an embedding model's queue for the prompt's "
                        "embedding, printed as a JSON array")
    submit.add_argument("--dimensions", type=int, help="with --embed: cut the embedding to this size (a "
                        "Matryoshka model's)")
    submit.add_argument("--rerank", action="append", metavar="DOCUMENT", help="ask a reranker's queue how relevant "
                        "each document (repeatable) is to the prompt, printed best first: index, score, document")
    submit.add_argument("--top-n", type=int, help="with --rerank: print only the best N")
    submit.add_argument("--id", help="request id (default: random)")
    _add_queue(submit)
    _add_redis_url(submit, prefix=False)
    submit.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for the result; then the request is cancelled")
    submit.set_defaults(run=client_commands.run_submit)


def _add_batch(commands: Any) -> None:
    """`mlxq batch`: OpenAI Batch API files on a queue."""
    batch = _command(commands, "batch", "run an OpenAI Batch API file on a queue, follow it, get its results",
                     "A batch's lines wait behind the queue's interactive requests (its batch lane). `submit` "
                     "prints the batch id; with --wait it follows (and drives, when no gateway does) the batch "
                     "to its end. Exit status of submit --wait: 0 completed, 1 failed, expired or cancelled.")
    batch.add_argument("action", choices=["submit", "status", "results", "cancel", "list"])
    batch.add_argument("batch", nargs="?", metavar="FILE|ID", help="submit: the JSONL file; others: the batch id")
    _add_queue(batch)
    batch.add_argument("--endpoint", default="/v1/chat/completions", choices=["/v1/chat/completions",
                       "/v1/completions"], help="the url of every line")
    batch.add_argument("--completion-window", default="24h", help="24h, or a duration such as 30m, 2h")
    batch.add_argument("--wait", action="store_true", help="submit: follow the batch to its end, with progress")
    batch.add_argument("-o", "--output", type=Path, help="results: write the lines here (default: stdout)")
    batch.add_argument("--errors", action="store_true", help="results: the error lines instead of the output")
    batch.add_argument("--json", action="store_true", help="status: one JSON object")
    batch.add_argument("--count", type=int, default=20, help="list: how many, newest first")
    _add_redis_url(batch)
    batch.set_defaults(run=_run_batch)


def _run_batch(args: argparse.Namespace) -> int:
    try:
        import gateway.batch_lines  # noqa: F401 - OpenAI's line shapes are the gateway's

        from . import batch_command
    except ImportError as e:
        return _missing_extra("batch", e, args)
    return batch_command.run(args)


def _add_status(commands: Any) -> None:
    """`mlxq status`: the fleet on one screen."""
    status = _command(commands, "status", "show the queues and workers",
                      "The fleet from Redis alone: each queue's backlog, in flight and dead letters; each "
                      "worker seen in the last hour, its state (ready, draining, stopped, gone), load and totals.")
    _add_redis_url(status)
    status.add_argument("--queue", action="append", help="show only this queue (repeatable): its streams, workers "
                        "and batches, served or not")
    status.add_argument("--json", action="store_true", help="one JSON object (per refresh with --watch)")
    status.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                        help="refresh every SECONDS (2 if not given) until interrupted")
    status.set_defaults(run=client_commands.run_status)


def _add_dead(commands: Any) -> None:
    """`mlxq dead`: the dead-letter stream of a queue."""
    dead = _command(commands, "dead", "list, show, requeue or purge a queue's dead letters",
                    "Entries that could not be served go to mlxq:q:<queue>:dead with the reason. `requeue` adds "
                    "one again under a new id (<id>-r<hex>) and removes it from the dead letters.")
    dead.add_argument("action", choices=["list", "show", "requeue", "purge"])
    dead.add_argument("entries", nargs="*", metavar="ENTRY", help="dead-letter entry ids (from `list`)")
    _add_queue(dead)
    dead.add_argument("--all", action="store_true", help="requeue or purge every dead letter of the queue")
    dead.add_argument("--count", type=int, default=20, help="how many `list` shows, newest first")
    _add_redis_url(dead)
    dead.set_defaults(run=client_commands.run_dead)


def _add_adapters(commands: Any) -> None:
    """`mlxq adapters`: a queue's LoRA adapters, loaded and unloaded at runtime."""
    adapters = _command(commands, "adapters", "load, unload or list a queue's LoRA adapters on its running workers",
                        "`load NAME PATH` has every worker of the queue serve the adapter at PATH (a directory as "
                        "mlx_lm.lora writes it, at that path on each worker's host) as NAME, without a restart; "
                        "`unload NAME` stops serving it (running requests finish); workers started later follow. "
                        "Waits for each live worker's answer.")
    adapters.add_argument("action", choices=["load", "unload", "list"])
    adapters.add_argument("name", nargs="?", help="the adapter's name (what requests give as `adapter`)")
    adapters.add_argument("path", nargs="?", help="with load: the adapter's directory")
    _add_queue(adapters)
    adapters.add_argument("--wait", type=float, default=30.0, help="seconds to wait for every worker's answer")
    _add_redis_url(adapters)
    adapters.set_defaults(run=_run_adapters)


def _run_adapters(args: argparse.Namespace) -> int:
    from . import adapters_command

    return adapters_command.run(args)


def _add_redis(commands: Any) -> None:
    """`mlxq redis`: the embedded Valkey in the foreground, or stop it."""
    server = _command(commands, "redis", "run the embedded Valkey in the foreground, or stop it",
                      "`mlxq redis` runs the embedded Valkey (persistent, AOF) until interrupted; `mlxq redis "
                      "stop` shuts down the one on --port (a worker leaves the one it started running while "
                      "others use it).")
    server.add_argument("action", nargs="?", choices=["run", "stop"], default="run",
                        help="run it (the default) or stop it")
    server.add_argument("--port", type=int, default=embedded_port(), help="port on 127.0.0.1 ($MLXQ_EMBEDDED_PORT, "
                        "else 6390)")
    server.add_argument("--dir", type=Path, default=None, help=f"data directory (default: {embedded.default_dir()} "
                        "for port 6390, valkey-<port> beside it for another; one server a directory)")
    server.set_defaults(run=client_commands.run_redis)


def _cpu_list(text: str) -> set[int]:
    if not hasattr(os, "sched_setaffinity"):
        raise argparse.ArgumentTypeError("pinning threads to CPUs needs Linux")
    try:
        cpus = {int(part) for part in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of CPU numbers: {text!r}") from None
    if any(not 0 <= cpu < (os.cpu_count() or 1) for cpu in cpus):
        raise argparse.ArgumentTypeError(f"this machine's CPUs are 0 to {(os.cpu_count() or 1) - 1}: {text!r}")
    return cpus


def _add_bench(commands: Any) -> None:
    """`mlxq bench`: a workload through Redis, and its report."""
    bench = _command(commands, "bench", "measure a running worker fleet through Redis",
                     "Send a workload to the workers serving a queue and report latency percentiles and "
                     "throughput; optionally the same workload in process.")
    _add_redis_url(bench, prefix=False)
    _add_queue(bench)
    bench.add_argument("--requests", type=int, default=64, help="number of requests per run")
    bench.add_argument("--rate", type=float, help="Poisson arrivals, requests per second (default: a burst)")
    bench.add_argument("--concurrency", default="16",
                       help="most requests outstanding; a comma list sweeps it (e.g. 1,4,16); 0: no limit")
    bench.add_argument("--backlog", action="store_true",
                       help="push every request at once, as a queue of background jobs: the workers read as slots "
                       "free, and the baselines insert them all into one batch as wide as the workers' max_num_seqs "
                       "(replaces --concurrency)")
    bench.add_argument("--input-len", type=int, default=100, help="prompt tokens (mean)")
    bench.add_argument("--output-len", type=int, default=128, help="generated tokens (mean)")
    bench.add_argument("--len-jitter", type=float, default=0.0, help="lengths uniform within ± this fraction")
    bench.add_argument("--shared-prefix", type=float, default=0.0,
                       help="fraction of requests starting with one common prefix")
    bench.add_argument("--prefix-len", type=int, default=64, help="length of the common prefix (of each tenant's)")
    bench.add_argument("--tenants", type=int, default=0,
                       help="each request starts with one of this many tenants' own --prefix-len-token system "
                       "prompts, then --input-len tokens of its own (placement by prefix); reports the cached "
                       "share of prompt tokens against the ideal")
    bench.add_argument("--stream-interval", type=int, default=1, help="tokens per delta")
    bench.add_argument("--response-format", choices=["none", "json", "regex"], default="none",
                       help="constrain requests: a JSON schema, or a regex (see mlxq/bench.py)")
    bench.add_argument("--constrained", type=float, default=1.0,
                       help="with --response-format, the share of requests constrained")
    bench.add_argument("--adapter", action="append", metavar="NAME",
                       help="a LoRA adapter the requests name, in turn with the others given (repeatable); the "
                            "in-process baselines run the model alone")
    bench.add_argument("--vocab", type=int, default=1000, help="prompt token ids are drawn below this")
    bench.add_argument("--seed", type=int, help="seed of the workload (default: random, so that prompts are new "
                                               "to the workers' prefix cache; the report has it)")
    bench.add_argument("--baseline", action="append", choices=["inprocess", "detokenizing", "sequential"],
                       default=[], help="also run the workload through mlx-lm in this process (needs --model): "
                       "raw BatchGenerator, the same with every token detokenized as mlx-lm's server does, or "
                       "one request at a time")
    bench.add_argument("--model", help="model path for the baselines (the workers' model)")
    bench.add_argument("--baseline-cpus", metavar="LIST", type=_cpu_list,
                       help="Linux: run the baselines with every thread of this process on these CPUs "
                       "(e.g. 0: the core a worker's engine process is pinned to, so that both run on one core)")
    bench.add_argument("--gateway", metavar="URL", help="also send the workload through an mlxq gateway at URL "
                       "(e.g. http://127.0.0.1:8000), the queue's name as the model, and compare")
    bench.add_argument("--api-key", help="bearer key for --gateway")
    bench.add_argument("--json", type=Path, help="write every figure to this file")
    bench.add_argument("--plot", type=Path, help="draw throughput and TTFT against concurrency (PNG), "
                       "baselines included")
    bench.add_argument("--repeat", type=int, default=1, help="runs per concurrency level; the median is "
                       "reported, and a spread over 10%% is warned about")
    bench.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take")
    bench.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    try:
        from . import bench_cli
    except ImportError as e:
        return _missing_extra("bench", e, args)
    blas.exec_with_blas([sys.executable, "-m", "mlxq", *args.argv])  # returns if there is nothing to put in front
    return bench_cli.run(args)


def _add_demo_model(commands: Any) -> None:
    """`mlxq demo-model`: the offline demo model."""
    demo = _command(commands, "demo-model", "build the tiny offline demo model",
                    "Build the demo model (random weights, real BPE tokenizer) into PATH.")
    demo.add_argument("path", type=Path, nargs="?", default=demo_model.default_path(),
                      help=f"output directory (default: {demo_model.default_path()})")
    demo.add_argument("--size", choices=sorted(demo_model.SIZES), default="demo",
                      help="demo: ~150k parameters (tests); bench: ~25M parameters (benchmarks); also the shape "
                           "of --embedding and --reranker")
    demo.add_argument("--vision", action="store_true",
                      help="a tiny vision model instead (~200k parameters, served through mlx-vlm)")
    demo.add_argument("--family", choices=sorted(demo_vision.FAMILIES), default=demo_model.DEFAULT_VISION_FAMILY,
                      help=f"with --vision, the model family (default {demo_model.DEFAULT_VISION_FAMILY})")
    demo.add_argument("--text-family", choices=["qwen3", "qwen2", "llama"], default="qwen3",
                      help="the text model's family (default qwen3): mlx-lm shards llama tensor-parallel and qwen2 "
                           "tensor- or pipeline-parallel, for a worker group (--distributed)")
    demo.add_argument("--vocab", type=int, default=demo_model.VOCAB_SIZE,
                      help="tokenizer vocabulary; above the default it is trained on the standard library's "
                           "sources (e.g. 32768, for honest structured-output benchmarks)")
    demo.add_argument("--trained", action="store_true",
                      help="a model trained here on the standard library's sources (~0.6M parameters, heads "
                           "32 wide) and its one-layer draft in PATH/draft: honest figures for quantized KV and "
                           "speculative decoding (a few minutes on 2 cores)")
    demo.add_argument("--thinking", action="store_true",
                      help="a thinking variant: <think> </think> tokens, a template that opens the reasoning "
                           "(enable_thinking: false closes it)")
    demo.add_argument("--embedding", action="store_true",
                      help="an embedding model shaped as Qwen3-Embedding (last-token pooling, normalized, any "
                           "Matryoshka size): its worker serves embeddings")
    demo.add_argument("--reranker", action="store_true",
                      help="a reranker shaped as Qwen3-Reranker (serve it with --task rerank)")
    demo.add_argument("--cross-encoder", action="store_true",
                      help="a reranker shaped as a BERT cross-encoder (BertForSequenceClassification)")
    demo.add_argument("--adapter", type=Path, metavar="DIR",
                      help="write a LoRA adapter for the model at --base into DIR instead (mlx-lm's format, random "
                           "weights that visibly change its text), to serve with --adapter NAME=DIR")
    demo.add_argument("--base", type=Path, default=None, metavar="MODEL",
                      help=f"with --adapter, the demo model it is for (default: {demo_model.default_path()}, built if "
                           "missing)")
    demo.add_argument("--rank", type=int, default=8, help="with --adapter, its rank (default 8)")
    demo.add_argument("--seed", type=int, default=0, help="with --adapter, its random seed (default 0)")
    demo.set_defaults(run=_run_demo_model)


def _run_demo_model(args: argparse.Namespace) -> int:
    if args.adapter is not None:
        return _run_demo_adapter(args)
    if args.base is not None:
        raise SystemExit("mlxq demo-model: --base goes with --adapter")
    if args.family != demo_model.DEFAULT_VISION_FAMILY and not args.vision:
        raise SystemExit("mlxq demo-model: --family goes with --vision")
    kinds = {"vision": args.vision, "thinking": args.thinking, "trained": args.trained,
             "embedding": args.embedding, "reranker": args.reranker, "cross-encoder": args.cross_encoder}
    chosen = [kind for kind, wanted in kinds.items() if wanted]
    if len(chosen) > 1:
        raise SystemExit(f"mlxq demo-model: choose one of --{' --'.join(chosen)}")
    size = chosen[0] if chosen else args.size
    if args.text_family != "qwen3" and chosen:
        raise SystemExit(f"mlxq demo-model: --text-family goes with a text model, not --{chosen[0]}")
    path = demo_model.build(args.path, size=size, vocab=args.vocab, family=args.family, shape=args.size,
                            text_family=args.text_family)
    print(f"demo model written to {path}")
    return 0


def _run_demo_adapter(args: argparse.Namespace) -> int:
    from . import demo_adapter

    if args.rank < 1:
        raise SystemExit("mlxq demo-model: --rank must be 1 or more")
    base = args.base or demo_model.ensure(demo_model.default_path())
    if not demo_model.is_built(base):
        raise SystemExit(f"mlxq demo-model: {base} is not a demo model (build one with mlxq demo-model {base})")
    path = demo_adapter.write_adapter(args.adapter, base, seed=args.seed, rank=args.rank)
    print(f"adapter for {base} written to {path}")
    return 0


def _add_setting(parser: argparse.ArgumentParser, name: str, field: Any, env_prefix: str = "MLXQ_") -> None:
    kind, choices = _flag_type(field.annotation)
    default = field.get_default(call_default_factory=True)
    default = "unset" if default is None else default
    several = any(get_origin(a) in (list, dict) for a in (field.annotation, *get_args(field.annotation)))
    flags = ["--" + name.replace("_", "-")] + (["--adapter"] if name == "adapters" else [])
    metavar = "NAME=QUEUE" if get_origin(field.annotation) is dict else "NAME=PATH" if name == "adapters" else None
    parser.add_argument(*flags, dest=name, type=kind, choices=choices, default=None,
                        nargs="+" if several else None, action="extend" if several else "store", metavar=metavar,
                        help=f"{field.description} (default: {default or 'none'}; env {env_prefix}{name.upper()})"
                        .replace("%", "%%"))


def _flag_type(annotation: Any) -> tuple[type, list[Any] | None]:
    """argparse's type and choices for a settings field's annotation."""
    if get_origin(annotation) is Literal:
        values = get_args(annotation)
        return type(values[0]), list(values)  # kv_bits' choices are ints, log_format's strings
    inner = [a for a in get_args(annotation) if a is not type(None)]
    if inner and all(get_origin(a) is Literal for a in inner):  # Literal["auto"] | Task: every value
        merged = [value for a in inner for value in get_args(a)]
        return type(merged[0]), merged
    if inner:  # Optional[X]
        return _flag_type(inner[0])
    return (annotation if annotation in (int, float, Path) else str), None


def _missing_extra(command: str, error: ImportError, args: argparse.Namespace) -> int:
    needs = "gateway" if command in ("gateway", "batch") else "worker"
    extra = GATEWAY_EXTRA if needs == "gateway" else WORKER_EXTRA
    print(f"mlxq {command}: this install lacks the {needs} extra ({error.name} is missing): {extra}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    main()
