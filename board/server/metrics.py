"""Prometheus metrics of one board process (each replica exports its own)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class BoardMetrics:
    """A registry per app, so that several apps in one process (tests) do not collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "deltaboard_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.commits = Counter("deltaboard_commits", "Committed versions", registry=self.registry)
        self.prepared_commits = Counter(
            "deltaboard_prepared_commits",
            "Commits that named a manifest this board had prepared",
            registry=self.registry,
        )
        self.commit_seconds = Histogram(
            "deltaboard_commit_seconds",
            "Commit latency inside the board",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
            registry=self.registry,
        )
        # Long-polls and event streams waiting in the service (`waits`, moved by it) and
        # long-polls parked in the HTTP protocol (`parked`, counted by `ParkedPolls`), summed
        # when the gauge is read: a gauge moved at every poll cost ~7% of the event loop's
        # time under a thousand re-polling clients (py-spy).
        self.waits = 0
        self.parked: Callable[[], int] = lambda: 0
        self.waiting = Gauge(
            "deltaboard_long_polls", "Long-polls and event streams waiting", registry=self.registry
        )
        self.waiting.set_function(lambda: self.waits + self.parked())
        self.blob_bytes_in = Counter(
            "deltaboard_blob_bytes_in", "Blob bytes uploaded", registry=self.registry
        )
        self.blob_bytes_out = Counter(
            "deltaboard_blob_bytes_out", "Blob bytes served (not redirected)", registry=self.registry
        )
        self.heartbeats = Counter(
            "deltaboard_heartbeats", "Fleet heartbeats received", registry=self.registry
        )
        self.unreadable_records = Counter(
            "deltaboard_unreadable_records",
            "Stored records (manifests, run records) the board could not read and skipped",
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
