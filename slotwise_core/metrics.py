"""Prometheus metrics of one service: its own registry, served on its own port."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import Metric
from prometheus_client.registry import Collector


class ServiceMetrics:
    def __init__(self, service: str):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            f"slotwise_{service}_requests",
            "gRPC calls by method and status code",
            ["method", "code"],
            registry=self.registry,
        )
        self.latency = Histogram(
            f"slotwise_{service}_request_seconds",
            "gRPC call duration by method (streams: until the last event)",
            ["method"],
            registry=self.registry,
            buckets=(
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                0.5,
                1,
                2.5,
                5,
                10,
                30,
                60,
            ),
        )

    def observe(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        name = method.rpartition("/")[2]
        self.requests.labels(name, code.name).inc()
        self.latency.labels(name).observe(seconds)

    def collect_from(self, collect: Callable[[], Iterable[Metric]]) -> None:
        """Add metrics read at scrape time (no cost on the hot path)."""

        class _Live(Collector):
            def collect(self) -> Iterable[Metric]:
                return collect()

        self.registry.register(_Live())

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        self._http, _ = start_http_server(port, addr=host, registry=self.registry)

    def close(self) -> None:
        http = getattr(self, "_http", None)
        if http is not None:
            http.shutdown()
            http.server_close()
