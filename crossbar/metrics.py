"""Prometheus metrics, on a registry of crossbar's own (served at /_crossbar/metrics).

Counters and histograms are updated for every request, within 50 ms of its end
(`Router.account_finished`, which every scrape calls first). prometheus-client's own `Counter` and
`Histogram` take a lock on every update, check the label values on every `labels()` call and walk
the buckets one by one: well over a hundred Python lines a request. They are plain accumulators
here instead (`CounterFamily`, `HistogramFamily`: one dict lookup and an add, a bucket found by
bisection), turned into prometheus-client's metric families only at scrape time by the registry, so
the exposition is the one prometheus-client's classes give, `_created` samples included. No lock is
needed: every update (the request hooks, the lease table's listeners) and every scrape (the admin
API's handler calls `exposition()` without leaving the loop) runs on the event loop's thread. A
scrape moved to another thread would need one: a request's ending can add a series to a dict while
`collect` iterates it.

A family keeps one series per set of label values, for as long as the process runs. The values
come from the configuration (routes, hosts, models, reasons) and from status codes, never from
what a client sends, so the series stay as few as the configuration makes them.

Live gauges (health, slots, in-flight, queue, store errors) are read at scrape time by a
collector, so they are never stale.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import metrics as client_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from crossbar.decisions import MOVES, Reason, Rejection
from crossbar.lease import LeaseEvent

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TPS_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000, 2000, 5000)

# the reasons a lease changes, shown at 0 before the first one happens (a drain moves nothing)
LEASE_REASONS = tuple(str(r) for r in Reason if r in MOVES)

# (host, model, free_slots, in_flight, queued, capacity)
SlotRow = tuple[str, str, int, int, int, int]

Labels = tuple[str, ...]  # one series' label values, in the order of its family's label names


def _created_shown() -> bool:
    """prometheus-client's own switch (PROMETHEUS_DISABLE_CREATED_SERIES) for `_created` samples."""
    return getattr(client_metrics, "_use_created", True)


class _Family:
    """What a counter and a histogram family share: name, help, label names, series creation."""

    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self._created: dict[Labels, float] = {}  # series → when it was created, in creation order

    def _start(self, labels: Labels) -> None:
        """A new series: its label values checked once, its creation time noted."""
        if len(labels) != len(self.labelnames):
            raise ValueError(f"{self.name}: {len(labels)} label values for {self.labelnames}")
        self._created[labels] = time.time()

    def describe(self) -> Iterable[Metric]:
        """The family without its samples: what the registry checks names against."""
        return [self._metric()]

    def _metric(self) -> Metric:
        return Metric(self.name, self.documentation, self.kind)


class CounterFamily(_Family):
    """A counter with labels: label values → running total. Exposed as prometheus-client's
    `Counter` exposes one: `_total` and `_created` per series, series in creation order."""

    kind = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        super().__init__(name, documentation, labelnames)
        self._totals: dict[Labels, float] = {}

    def inc(self, labels: Labels, amount: float = 1.0) -> None:
        """Add a non-negative `amount` to the series of `labels`, created at 0 if new."""
        try:
            self._totals[labels] += amount
        except KeyError:
            self.ensure(labels)
            self._totals[labels] += amount

    def ensure(self, labels: Labels) -> None:
        """The series of `labels` exists (at 0 if new), so it is exposed before it first moves."""
        if labels not in self._totals:
            self._start(labels)
            self._totals[labels] = 0.0

    def collect(self) -> Iterable[Metric]:
        metric, created = self._metric(), _created_shown()
        for labels, total in self._totals.items():
            series = dict(zip(self.labelnames, labels, strict=True))
            metric.add_sample(self.name + "_total", series, total)
            if created:
                metric.add_sample(self.name + "_created", series, self._created[labels])
        return [metric]


class _Buckets:
    """One histogram series: observations per bucket (not cumulative) and their sum."""

    __slots__ = ("counts", "sum")

    def __init__(self, n: int) -> None:
        self.counts = [0] * n
        self.sum = 0.0


class HistogramFamily(_Family):
    """A histogram with labels. Exposed as prometheus-client's `Histogram` exposes one: cumulative
    `_bucket` samples (`le` as it formats it, `+Inf` last), `_count`, `_sum` and `_created` per
    series, series in creation order."""

    kind = "histogram"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str],
                 buckets: Sequence[float]) -> None:
        super().__init__(name, documentation, labelnames)
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds) or not bounds:
            raise ValueError(f"{name}: buckets must be given in increasing order")
        self.bounds = (*bounds, math.inf) if bounds[-1] != math.inf else tuple(bounds)
        self._les = tuple(floatToGoString(b) for b in self.bounds)
        self._series: dict[Labels, _Buckets] = {}

    def observe(self, labels: Labels, amount: float) -> None:
        """Count `amount` in the first bucket whose bound is >= it. The values observed are never
        NaN (prometheus-client counts a NaN in no bucket; here it would land in the first)."""
        try:
            series = self._series[labels]
        except KeyError:
            series = self._new(labels)
        series.counts[bisect_left(self.bounds, amount)] += 1
        series.sum += amount

    def _new(self, labels: Labels) -> _Buckets:
        self._start(labels)
        series = self._series[labels] = _Buckets(len(self.bounds))
        return series

    def collect(self) -> Iterable[Metric]:
        metric, created = self._metric(), _created_shown()
        for labels, series in self._series.items():
            named = dict(zip(self.labelnames, labels, strict=True))
            self._add_samples(metric, named, series)
            if created:
                metric.add_sample(self.name + "_created", named, self._created[labels])
        return [metric]

    def _add_samples(self, metric: Metric, labels: dict[str, str], series: _Buckets) -> None:
        cumulative = 0.0
        for le, count in zip(self._les, series.counts, strict=True):
            cumulative += count
            metric.add_sample(self.name + "_bucket", {**labels, "le": le}, cumulative)
        metric.add_sample(self.name + "_count", labels, cumulative)
        if self.bounds[0] >= 0:  # as prometheus-client: no `_sum` where values may be negative
            metric.add_sample(self.name + "_sum", labels, series.sum)


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
        self.requests = self._add(CounterFamily(
            "crossbar_requests", "Proxied requests by route, host and status", ("route", "host", "status")))
        self.tokens = self._add(CounterFamily(
            "crossbar_tokens", "Tokens reported by the upstream (type: prompt, cached, completion)",
            ("route", "host", "type")))
        self.queue_wait = self._add(HistogramFamily(
            "crossbar_queue_wait_seconds", "Time spent waiting for a slot", ("host", "model"),
            _LATENCY_BUCKETS))
        self.ttfb = self._add(HistogramFamily(
            "crossbar_ttfb_seconds", "Time from request to the client's first byte", ("host",),
            _LATENCY_BUCKETS))
        self.lease_moves = self._add(CounterFamily(
            "crossbar_lease_moves", "Lease changes by reason (lease_events rows, drains excepted)",
            ("reason",)))
        for reason in LEASE_REASONS:
            self.lease_moves.ensure((reason,))
        self.generation_tps = self._add(HistogramFamily(
            "crossbar_generation_tokens_per_second", "Generation speed from llama-server timings",
            ("host", "model"), _TPS_BUCKETS))
        self.rejected = self._add(CounterFamily(
            "crossbar_rejected", "Requests crossbar answered itself with an error, by reason", ("reason",)))
        for rejection in Rejection:
            self.rejected.ensure((str(rejection),))
        self.usage_dropped = self._add(CounterFamily(
            "crossbar_usage_figures_dropped", "Usage figures from a host that were out of range or "
            "unreadable (stored as NULL)", ("host",)))

    def _add[F: Collector](self, family: F) -> F:
        self.registry.register(family)
        return family

    def lease_event(self, event: LeaseEvent) -> None:
        """A lease table listener: count every change of where a conversation lives."""
        if event.reason in MOVES:
            self.lease_moves.inc((str(event.reason),))

    def add_live(self, collector: Collector) -> None:
        self.registry.register(collector)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
