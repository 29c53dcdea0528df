"""The metrics of a worker of several models: each loaded model's worker serves its own on
a local port the host gave it, and the host's `metrics_port` serves them all at once,
each series labelled `model="<name>"` (prometheus-client's own server and parser)."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Callable, Iterator

import structlog
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

log = structlog.get_logger("mlxq.host")

SCRAPE_TIMEOUT_S = 2.0  # a model worker that does not answer in time is left out of this scrape


class ModelWorkersCollector(Collector):
    """At each scrape, every model worker's metrics, merged by name, with its model's label."""

    def __init__(self, ports: Callable[[], dict[str, int]]) -> None:
        self.ports = ports  # model name -> the metrics port of its worker, for the models that have one

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for model, port in sorted(self.ports().items()):
            for family in _scrape(model, port):
                into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
                for sample in family.samples:
                    into.add_sample(sample.name, {**sample.labels, "model": model}, sample.value)
        yield from merged.values()


def serve(host: str, port: int, ports: Callable[[], dict[str, int]]) -> None:
    """Serve /metrics on (`host`, `port`) from a thread of prometheus-client's; raises `OSError` if the port is busy."""
    registry = CollectorRegistry()
    registry.register(ModelWorkersCollector(ports))
    start_http_server(port, addr=host, registry=registry)


def free_local_port() -> int:
    """A port nothing listens on now, for a model worker's metrics."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _scrape(model: str, port: int) -> list[Metric]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as reply:
            return list(text_string_to_metric_families(reply.read().decode()))
    except (OSError, ValueError) as e:  # starting, stopping, or stuck: this scrape goes without it
        log.debug("a model worker's metrics did not answer", model=model, port=port, error=str(e))
        return []
