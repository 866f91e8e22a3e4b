"""Prometheus metrics of one sidecar (its own registry: the demo runs several per process).

What every request touches (its outcome, the time it waited for its version) is counted
in plain ints and dicts, and turned into the `deltaboard_sidecar_requests` counter and the
`deltaboard_sidecar_version_wait_seconds` histogram when Prometheus scrapes (`_PerRequest`):
a `prometheus_client` counter or histogram takes a lock on every update, a cost paid per
request on the sidecar's request path. The rest (swaps, versions, requests in flight)
changes once per swap or scrape and stays with `prometheus_client`.

With several worker processes (`services.sidecar.workers`) a scrape reaches one worker,
whichever the kernel hands the connection to, so `/metrics` must not be that worker's own:
its counters would jump between workers from one scrape to the next, and a counter that
goes down reads as a reset. The owner process answers for the fleet (`exposition` with
every worker's `Share`): the per-request series summed over the workers, the requests in
flight too, and the swap series, which only the owner's version loop records. A worker
gets that text through `fleet`. `prometheus_client`'s multiprocess mode would do it with a
file per process and metric, at the cost of a locked write to a mapped file per update on
the request path (what `_PerRequest` avoids) and an environment variable read when
`prometheus_client` is first imported (the demo runs several sidecars in one process).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

WAIT_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120)


@dataclass(frozen=True)
class Share:
    """A worker's part of the fleet's metrics: its per-request counts, its requests in flight."""

    outcomes: dict[str, int]
    waits: list[int]  # per bucket of `WAIT_BUCKETS`, not cumulative; the last: +Inf
    wait_sum: float
    inflight: int


class _PerRequest:
    """The per-request series, counted on the event loop that serves the requests and read
    at scrape time (a scrape from another thread reads a count a request may be adding to:
    off by that request at most, as a scrape taken a moment earlier), with the workers'
    `shares` added while the owner renders the fleet's."""

    def __init__(self) -> None:
        self.outcomes: dict[str, int] = {}
        self.waits = [0] * (len(WAIT_BUCKETS) + 1)  # per bucket, not cumulative; the last: +Inf
        self.wait_sum = 0.0
        self.shares: Sequence[Share] = ()

    def collect(self) -> Iterator[Metric]:
        outcomes, waits, wait_sum = dict(self.outcomes), list(self.waits), self.wait_sum
        for share in self.shares:
            for outcome, count in share.outcomes.items():
                outcomes[outcome] = outcomes.get(outcome, 0) + count
            waits = [mine + theirs for mine, theirs in zip(waits, share.waits, strict=True)]
            wait_sum += share.wait_sum
        requests = CounterMetricFamily(
            "deltaboard_sidecar_requests", "Requests by outcome", labels=["outcome"]
        )
        for outcome, count in sorted(outcomes.items()):
            requests.add_metric([outcome], count)
        yield requests
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, map(float, WAIT_BUCKETS)), "+Inf"), waits, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(
            "deltaboard_sidecar_version_wait_seconds",
            "Time requests waited for their weight version",
            buckets=buckets,
            sum_value=wait_sum,
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
        # In a worker of several: the fleet's metrics, asked of the owner (blocking; set by
        # `services.sidecar.workers`). None: this process serves every request itself.
        self.fleet: Callable[[], bytes] | None = None

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

    def share(self, inflight: int) -> Share:
        """This worker's part of the fleet's metrics (`inflight`: its gate's requests in flight)."""
        per_request = self._per_request
        return Share(dict(per_request.outcomes), list(per_request.waits), per_request.wait_sum, inflight)

    def exposition(
        self, served: int | None, head: int | None, inflight: int, shares: Sequence[Share] = ()
    ) -> bytes:
        """The text a scrape gets: this registry with the gate's versions (None: -1) and
        requests in flight, and the per-request series with every worker's `shares` added
        (the owner's, for the fleet; one process's own: none). One caller at a time."""
        self.served.set(served if served is not None else -1)
        self.head.set(head if head is not None else -1)
        self.inflight.set(inflight + sum(share.inflight for share in shares))
        self._per_request.shares = shares
        try:
            return self.render()
        finally:
            self._per_request.shares = ()
