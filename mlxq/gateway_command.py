"""`mlxq gateway`: settings, the listening socket, uvicorn."""

from __future__ import annotations

import argparse
import faulthandler
import signal
import socket
from functools import partial
from typing import Any

from .errors import CommandError, settings_for_command


def run(args: argparse.Namespace, api: bool = True) -> int:
    """`mlxq gateway`, or with `api` False `mlxq dashboard`: the dashboard alone."""
    import structlog
    import uvicorn

    from client.diagnose import redacted
    from common import logs
    from gateway.app import create_app
    from gateway.settings import GatewaySettings, load_gateway_settings

    overrides: dict[str, Any] = {name: getattr(args, name) for name in GatewaySettings.model_fields}
    overrides["models"] = _pairs(args.models)
    settings = settings_for_command(partial(load_gateway_settings, args.config, **overrides))
    if args.check:
        print(f"mlxq {'gateway' if api else 'dashboard'}: {args.config or 'the flags and environment'}: the settings "
              "are valid")
        return 0
    logs.configure(settings.log_format, settings.log_level)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack to stderr
    log = structlog.get_logger("mlxq.gateway")
    sock = _listen(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    if not settings.api_keys:
        log.warning("no api_keys are configured: anyone who can connect may use the queue, unless keys made by "
                    "`mlxq keys create` are in Redis", listening=f"{host}:{port}")
    if api:
        log.info("gateway serving the OpenAI API", url=f"http://{host}:{port}/v1", redis=redacted(settings.redis_url),
                 models=settings.models or "from the workers' heartbeats", dashboard=f"http://{host}:{port}/dashboard")
    else:
        log.info("serving the dashboard", url=f"http://{host}:{port}/dashboard", redis=redacted(settings.redis_url))
    config = uvicorn.Config(create_app(settings, api), log_level=settings.log_level, access_log=False,
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _pairs(items: list[str] | None) -> dict[str, str] | None:
    """`--models name=queue ...` as a map."""
    if not items:
        return None
    pairs = {}
    for item in items:
        name, equals, queue = item.partition("=")
        if not equals or not name:
            raise CommandError(f"--models {item!r}: give MODEL=QUEUE", status=2)
        pairs[name] = queue
    return pairs


def _listen(host: str, port: int) -> socket.socket:
    """The socket, bound now so that a busy port is one clear line, not uvicorn's exit."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family)
        # Connections accepted from it inherit this. asyncio sets it only on sockets it made
        # itself; without it, each stream's first chunk waited ~40 ms behind its headers
        # (Nagle's algorithm meeting the client's delayed ACK).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError as e:
        raise CommandError(f"cannot listen on {host}:{port}: {e.strerror}; set --port (MLXQ_GATEWAY_PORT)",
                           status=2) from e
    sock.set_inheritable(True)
    return sock
