"""Prometheus metrics, on a registry of crossbar's own (served at /_crossbar/metrics).

Counters and histograms are updated when a request finishes; live gauges (health, slots,
in-flight, queue, store errors) are read at scrape time by a collector, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from crossbar.decisions import MOVES, Reason, Rejection
from crossbar.lease import LeaseEvent

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TPS_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000, 2000, 5000)

# the reasons a lease changes, shown at 0 before the first one happens (a drain moves nothing)
LEASE_REASONS = tuple(str(r) for r in Reason if r in MOVES)

# (host, model, free_slots, in_flight, queued, capacity)
SlotRow = tuple[str, str, int, int, int, int]


class LiveCollector(Collector):
    """Reads live state through callables at scrape time."""

    def __init__(
        self,
        health: Callable[[], Iterable[tuple[str, bool]]],
        slots: Callable[[], Iterable[SlotRow]],
        store_errors: Callable[[], int],
        leases: Callable[[], int],
    ):
        self.health, self.slots, self.store_errors, self.leases = health, slots, store_errors, leases

    def collect(self) -> Iterable[Metric]:
        healthy = GaugeMetricFamily("crossbar_host_healthy", "1 when the host passes health", labels=["host"])
        for host, ok in self.health():
            healthy.add_metric([host], 1.0 if ok else 0.0)
        yield healthy
        labels = ["host", "model"]
        free = GaugeMetricFamily("crossbar_slots_free", "Free slots per (host, model)", labels=labels)
        busy = GaugeMetricFamily("crossbar_in_flight", "Requests running per (host, model)", labels=labels)
        queued = GaugeMetricFamily("crossbar_queued", "Requests waiting per (host, model)", labels=labels)
        cap = GaugeMetricFamily("crossbar_slots_capacity", "Slot capacity per (host, model)", labels=labels)
        for host, model, n_free, n_busy, n_queued, n_cap in self.slots():
            free.add_metric([host, model], n_free)
            busy.add_metric([host, model], n_busy)
            queued.add_metric([host, model], n_queued)
            cap.add_metric([host, model], n_cap)
        yield from (free, busy, queued, cap)
        errors = CounterMetricFamily("crossbar_store_errors", "Failed database writes (retried)")
        errors.add_metric([], self.store_errors())
        yield errors
        yield GaugeMetricFamily("crossbar_leases", "Live conversation leases", value=self.leases())


class CounterCollector(Collector):
    """Counters kept elsewhere (the store's, the shared database's), read at scrape time as
    (name, help, value)."""

    def __init__(self, figures: Callable[[], Iterable[tuple[str, str, float]]]):
        self.figures = figures

    def collect(self) -> Iterable[Metric]:
        for name, text, value in self.figures():
            counter = CounterMetricFamily(name, text)
            counter.add_metric([], value)
            yield counter


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.requests = Counter(
            "crossbar_requests", "Proxied requests by route, host and status", ["route", "host", "status"],
            registry=r,
        )
        self.tokens = Counter(
            "crossbar_tokens", "Tokens reported by the upstream (type: prompt, cached, completion)",
            ["route", "host", "type"], registry=r,
        )
        self.queue_wait = Histogram(
            "crossbar_queue_wait_seconds", "Time spent waiting for a slot", ["host", "model"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.ttfb = Histogram(
            "crossbar_ttfb_seconds", "Time from request to the upstream's first byte", ["host"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.lease_moves = Counter(
            "crossbar_lease_moves", "Lease changes by reason (lease_events rows, drains excepted)",
            ["reason"], registry=r,
        )
        for reason in LEASE_REASONS:
            self.lease_moves.labels(reason)
        self.generation_tps = Histogram(
            "crossbar_generation_tokens_per_second", "Generation speed from llama-server timings",
            ["host", "model"], buckets=_TPS_BUCKETS, registry=r,
        )
        self.rejected = Counter(
            "crossbar_rejected", "Requests crossbar answered itself with an error, by reason", ["reason"],
            registry=r,
        )
        for rejection in Rejection:
            self.rejected.labels(str(rejection))
        self.usage_dropped = Counter(
            "crossbar_usage_figures_dropped", "Usage figures from a host that were out of range (stored as "
            "NULL)", ["host"], registry=r,
        )

    def child(self, metric: MetricWrapperBase, *values: str) -> Any:
        """`metric.labels(*values)`, remembered: prometheus-client takes a lock and checks the values
        on every call, and the request path asks for several series per request. Label values come
        from the configuration and from status codes, so this stays as small as the series are."""
        key = (id(metric), values)  # the metrics live as long as this object
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def lease_event(self, event: LeaseEvent) -> None:
        """A lease table listener: count every change of where a conversation lives."""
        if event.reason in MOVES:
            self.child(self.lease_moves, str(event.reason)).inc()

    def add_live(self, collector: LiveCollector) -> None:
        self.registry.register(collector)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
