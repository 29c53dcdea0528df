"""The gateway's own Prometheus metrics, on its own registry (served at `/metrics`)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

FIRST_BYTE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    """Requests by route and status, open streams, and time to the first byte of each answer."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total: what the gateway costs per token
        self.requests = Counter("mlxq_gateway_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.open_streams = Gauge("mlxq_gateway_open_streams", "SSE streams being relayed now",
                                  registry=self.registry)
        self.time_to_first_byte = Histogram("mlxq_gateway_time_to_first_byte_seconds",
                                            "from the request's arrival to the first byte of its answer "
                                            "(a stream's headers, or a whole response)", ["route"],
                                            buckets=FIRST_BYTE_BUCKETS, registry=self.registry)

    def first_byte(self, route: str, started: float) -> None:
        self.time_to_first_byte.labels(route).observe(time.monotonic() - started)

    def answered(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()
