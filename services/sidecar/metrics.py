"""Prometheus metrics of one sidecar (its own registry: the demo runs several per process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "deltaboard_sidecar_requests", "Requests by outcome", ["outcome"], registry=self.registry
        )
        self.wait_seconds = Histogram(
            "deltaboard_sidecar_version_wait_seconds",
            "Time requests waited for their weight version",
            buckets=(0.001, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.swap_seconds = Histogram(
            "deltaboard_sidecar_swap_seconds",
            "Time from stopping admissions to serving the new version",
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.swaps = Counter(
            "deltaboard_sidecar_swaps", "Versions swapped into the engine", registry=self.registry
        )
        self.swap_failures = Counter(
            "deltaboard_sidecar_swap_failures", "Engine reloads that failed", registry=self.registry
        )
        self.served = Gauge(
            "deltaboard_sidecar_served_version", "Version the engine serves", registry=self.registry
        )
        self.head = Gauge(
            "deltaboard_sidecar_head_version", "Board head seen by this node", registry=self.registry
        )
        self.inflight = Gauge(
            "deltaboard_sidecar_inflight", "Requests admitted and not finished", registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
