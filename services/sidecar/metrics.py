"""Prometheus metrics of one sidecar (its own registry: the demo runs several per process).

What every request touches (its outcome, the time it waited for its version) is counted
in plain ints and dicts, and turned into the `deltaboard_sidecar_requests` counter and the
`deltaboard_sidecar_version_wait_seconds` histogram when Prometheus scrapes (`_PerRequest`):
a `prometheus_client` counter or histogram takes a lock on every update, a cost paid per
request on the sidecar's request path. The rest (swaps, versions, requests in flight)
changes once per swap or scrape and stays with `prometheus_client`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

WAIT_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120)


class _PerRequest:
    """The per-request series, counted on the event loop that serves the requests and read
    at scrape time (a scrape from another thread reads a count a request may be adding to:
    off by that request at most, as a scrape taken a moment earlier)."""

    def __init__(self) -> None:
        self.outcomes: dict[str, int] = {}
        self.waits = [0] * (len(WAIT_BUCKETS) + 1)  # per bucket, not cumulative; the last: +Inf
        self.wait_sum = 0.0

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "deltaboard_sidecar_requests", "Requests by outcome", labels=["outcome"]
        )
        for outcome, count in sorted(self.outcomes.items()):
            requests.add_metric([outcome], count)
        yield requests
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, map(float, WAIT_BUCKETS)), "+Inf"), self.waits, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(
            "deltaboard_sidecar_version_wait_seconds",
            "Time requests waited for their weight version",
            buckets=buckets,
            sum_value=self.wait_sum,
        )


class SidecarMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._per_request = _PerRequest()
        self.registry.register(self._per_request)
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

    def count(self, outcome: str) -> None:
        """One request more with `outcome` (proxied, not_found, stale, ...)."""
        outcomes = self._per_request.outcomes
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    def waited(self, seconds: float) -> None:
        """An admitted request waited `seconds` for its version."""
        per_request = self._per_request
        per_request.waits[bisect_left(WAIT_BUCKETS, seconds)] += 1
        per_request.wait_sum += seconds

    def render(self) -> bytes:
        return generate_latest(self.registry)
