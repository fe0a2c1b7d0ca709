"""`GET /_crossbar/metrics`: Prometheus text that parses, follows the naming conventions, and
moves with real traffic through a real crossbar in front of simulated llama-servers."""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from accounting_util import host, parse_exposition, scrape, send_turn, summed, total
from harness import (
    Proxy,
    conversation,
    fleet_with_route,
    lease_event_rows,
    wait_until,
)
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import Counter as Counter_
from prometheus_client import metrics as client_metrics

from crossbar.decisions import Rejection
from crossbar.metrics import LEASE_REASONS, CounterCollector, LiveCollector, Metrics

FAMILIES = {
    "crossbar_requests": "counter",
    "crossbar_tokens": "counter",
    "crossbar_queue_wait_seconds": "histogram",
    "crossbar_ttfb_seconds": "histogram",
    "crossbar_lease_moves": "counter",
    "crossbar_generation_tokens_per_second": "histogram",
    "crossbar_rejected": "counter",
    "crossbar_host_healthy": "gauge",
    "crossbar_slots_free": "gauge",
    "crossbar_slots_capacity": "gauge",
    "crossbar_in_flight": "gauge",
    "crossbar_queued": "gauge",
    "crossbar_leases": "gauge",
    "crossbar_store_errors": "counter",
    "crossbar_store_dropped": "counter",
    "crossbar_store_bad_figures": "counter",
}


setup = fleet_with_route


async def admin_post(proxy: Proxy, path: str, body: Any) -> None:
    async with aiohttp.ClientSession() as s, s.post(f"{proxy.url}/_crossbar/{path}", json=body) as resp:
        assert resp.status == 200, await resp.text()


# ---------------------------------------------------------------- shape


async def test_exposition_parses_and_follows_the_conventions(tmp_path: Path) -> None:
    async with setup(tmp_path, {"a": host(), "b": host()}) as (_, proxy):
        types, samples = await scrape(proxy.url)
    for name, kind in FAMILIES.items():
        assert types.get(name) == kind, (name, types.get(name))
    for name in types:
        assert name.startswith("crossbar_")
        assert not any(unit in name for unit in ("_ms", "millis", "_minutes")), name  # base units
    counters = {n for n, kind in types.items() if kind == "counter"}
    for sample_name, _ in samples:
        family = next((c for c in counters if sample_name.startswith(c)), None)
        if family:
            assert sample_name in (family + "_total", family + "_created"), sample_name
    assert summed(samples, "crossbar_host_healthy") == 2
    assert samples[("crossbar_slots_capacity", frozenset({("host", "a"), ("model", "m")}))] == 2
    assert samples[("crossbar_store_errors_total", frozenset())] == 0
    for reason in LEASE_REASONS:  # every reason is there from the start, at 0
        assert samples[("crossbar_lease_moves_total", frozenset({("reason", reason)}))] == 0


def test_store_errors_and_live_gauges_are_read_at_scrape_time() -> None:
    metrics = Metrics()
    state = {"errors": 0, "healthy": True}
    metrics.add_live(LiveCollector(lambda: [("a", state["healthy"])], lambda: [("a", "m", 1, 2, 3, 3)],
                                   lambda: state["errors"], lambda: 5))
    state["errors"], state["healthy"] = 7, False
    _, samples = parse_exposition(metrics.exposition().decode())
    assert samples[("crossbar_store_errors_total", frozenset())] == 7
    assert samples[("crossbar_host_healthy", frozenset({("host", "a")}))] == 0
    am = frozenset({("host", "a"), ("model", "m")})
    assert [samples[(n, am)] for n in ("crossbar_slots_free", "crossbar_in_flight", "crossbar_queued",
                                       "crossbar_slots_capacity")] == [1, 2, 3, 3]
    assert samples[("crossbar_leases", frozenset())] == 5


def test_counters_kept_elsewhere_are_read_at_scrape_time() -> None:
    metrics = Metrics()
    figures = {"crossbar_shared_errors": 0.0}
    metrics.add_live(CounterCollector(lambda: [(n, "help", v) for n, v in figures.items()]))
    figures["crossbar_shared_errors"] = 3
    types, samples = parse_exposition(metrics.exposition().decode())
    assert types["crossbar_shared_errors"] == "counter"
    assert samples[("crossbar_shared_errors_total", frozenset())] == 3


# ---------------------------------------------------------------- values move with traffic


async def test_counters_and_histograms_follow_the_traffic(tmp_path: Path) -> None:
    sessions, turns = 4, 3
    async with setup(tmp_path, {"a": host(), "b": host()}) as (_, proxy):
        _, before = await scrape(proxy.url)
        async with aiohttp.ClientSession() as s:
            told = []
            for i in range(sessions):
                for t, messages in enumerate(conversation(f"m{i}", turns)):
                    told.append(await send_turn(s, proxy.url, "r", messages, stream=bool((i + t) % 2),
                                                include_usage=t == 2))
        _, after = await scrape(proxy.url)
    n = sessions * turns
    assert summed(before, "crossbar_requests_total") == 0
    assert summed(after, "crossbar_requests_total", route="r", status="200") == n
    sent = total(told)
    assert summed(after, "crossbar_tokens_total", route="r", type="prompt") == sent.prompt
    assert summed(after, "crossbar_tokens_total", route="r", type="cached") == sent.cached
    assert summed(after, "crossbar_tokens_total", route="r", type="completion") == sent.completion
    assert sent.cached > 0  # later turns hit the cache of their host
    for histogram in ("crossbar_ttfb_seconds", "crossbar_queue_wait_seconds",
                      "crossbar_generation_tokens_per_second"):
        assert summed(after, histogram + "_count") == n, histogram
        assert summed(after, histogram + "_bucket", le="+Inf") == n, histogram
    assert summed(after, "crossbar_lease_moves_total", reason="new") == sessions
    assert summed(after, "crossbar_leases") == sessions
    assert summed(after, "crossbar_in_flight") == 0 and summed(after, "crossbar_queued") == 0


async def test_in_flight_queued_and_free_slots_are_live(tmp_path: Path) -> None:
    """One slot, three slow requests at once: one runs, two wait, none free; then all drain."""
    async with setup(tmp_path, {"a": host(parallel=1, token_ms=60.0)}) as (_, proxy):
        am = frozenset({("host", "a"), ("model", "m")})

        async def busy() -> bool:
            _, s = await scrape(proxy.url)
            return (s[("crossbar_in_flight", am)], s[("crossbar_queued", am)],
                    s[("crossbar_slots_free", am)]) == (1, 2, 0)

        async with aiohttp.ClientSession() as s:
            turns = [send_turn(s, proxy.url, "r", conversation(f"q{i}", 1)[0]) for i in range(3)]
            running = asyncio.gather(*turns)
            await wait_until(busy, 10, 0.02, "one request in flight and two queued")
            await running

            async def free() -> bool:  # the host's own /slots view: back at the next poll
                _, s = await scrape(proxy.url)
                return s[("crossbar_slots_free", am)] == 1

            await wait_until(free, 10, 0.05, "the slot to be free again")
        _, done = await scrape(proxy.url)
    assert (done[("crossbar_in_flight", am)], done[("crossbar_queued", am)]) == (0, 0)
    assert summed(done, "crossbar_queue_wait_seconds_count") == 3
    assert summed(done, "crossbar_queue_wait_seconds_sum") > 0.5  # two waited a whole request


async def test_lease_moves_count_every_lease_event_by_reason(tmp_path: Path) -> None:
    """new, pin, release, unhealthy and idle: the counter equals the lease_events rows; a drain is
    recorded as an event but moves nothing, so it is not counted."""
    async with setup(tmp_path, {"a": host(), "b": host()}, lease_idle="4s") as (fleet, proxy):
        async with aiohttp.ClientSession() as s:

            async def turn(session: str, n: int = 0) -> None:
                await send_turn(s, proxy.url, "r", conversation(session, n + 1)[n])

            await turn("one")
            first = proxy.router.leases.leases_of("r")[0].host
            await admin_post(proxy, f"hosts/{first}", {"drain": True})  # drain: the lease stays
            await admin_post(proxy, f"hosts/{first}", {"drain": False})
            other = "b" if first == "a" else "a"
            await admin_post(proxy, "routes/r", {"host": other, "pin": True})  # pin: the lease moves
            await turn("one", 1)
            await admin_post(proxy, "routes/r", {"release": True})  # release: leases and pin dropped

            await turn("two")
            doomed = proxy.router.leases.leases_of("r")[0].host
            fleet[doomed].set(refuse=True)
            await turn("two", 1)  # refused: the lease moves to the healthy host (unhealthy)
            _, mid = await scrape(proxy.url)
            assert mid[("crossbar_host_healthy", frozenset({("host", doomed)}))] == 0
            await wait_until(lambda: proxy.router.leases.count() == 0, 20, 0.1, "leases to expire (idle)")
        events = Counter(e.reason for e in await lease_event_rows(proxy))
        _, samples = await scrape(proxy.url)
    counted = {reason: summed(samples, "crossbar_lease_moves_total", reason=reason) for reason in events}
    assert counted == {**events, "drain": 0}
    assert {"new", "drain", "pin", "release", "unhealthy", "idle"} <= set(events)
    assert summed(samples, "crossbar_lease_moves_total") == sum(events.values()) - events["drain"]


def test_a_series_is_kept_per_family_and_label_values() -> None:
    m = Metrics()
    m.requests.inc(("r", "h1", "200"))
    m.requests.inc(("r", "h1", "200"), 2)
    m.tokens.inc(("r", "h1", "200"), 5)  # same values, another metric: another series
    text = m.exposition().decode()
    assert 'crossbar_requests_total{host="h1",route="r",status="200"} 3.0' in text
    assert 'crossbar_tokens_total{host="h1",route="r",type="200"} 5.0' in text


def test_a_series_needs_a_value_for_every_label() -> None:
    m = Metrics()
    with pytest.raises(ValueError):
        m.requests.inc(("r", "h1"))
    with pytest.raises(ValueError):
        m.ttfb.observe(("h1", "extra"), 0.1)
    assert b"crossbar_requests_total{" not in m.exposition()


# ---------------------------------------------------------------- the same text as prometheus-client's


def client_library_metrics() -> tuple[CollectorRegistry, dict[str, Any]]:
    """crossbar's counters and histograms as prometheus-client's own classes (what they were)."""
    r = CollectorRegistry(auto_describe=True)
    latency = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
    tps = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000, 2000, 5000)
    families: dict[str, Any] = {
        "requests": Counter_("crossbar_requests", "Proxied requests by route, host and status",
                             ["route", "host", "status"], registry=r),
        "tokens": Counter_("crossbar_tokens", "Tokens reported by the upstream (type: prompt, cached, "
                           "completion)", ["route", "host", "type"], registry=r),
        "queue_wait": Histogram("crossbar_queue_wait_seconds", "Time spent waiting for a slot",
                                ["host", "model"], buckets=latency, registry=r),
        "ttfb": Histogram("crossbar_ttfb_seconds", "Time from request to the client's first byte", ["host"],
                          buckets=latency, registry=r),
        "lease_moves": Counter_("crossbar_lease_moves", "Lease changes by reason (lease_events rows, drains "
                                "excepted)", ["reason"], registry=r),
        "generation_tps": Histogram("crossbar_generation_tokens_per_second", "Generation speed from "
                                    "llama-server timings", ["host", "model"], buckets=tps, registry=r),
        "rejected": Counter_("crossbar_rejected", "Requests crossbar answered itself with an error, by "
                             "reason", ["reason"], registry=r),
        "usage_dropped": Counter_("crossbar_usage_figures_dropped", "Usage figures from a host that were out "
                                  "of range or unreadable (stored as NULL)", ["host"], registry=r),
    }
    for reason in LEASE_REASONS:
        families["lease_moves"].labels(reason)
    for rejection in Rejection:
        families["rejected"].labels(str(rejection))
    return r, families


def every_bucket(bounds: tuple[float, ...]) -> list[float]:
    """Below the first bound, on every bound, between every two, above the last, and infinity."""
    between = [(a + b) / 2 for a, b in itertools.pairwise(bounds)]
    return [-1.0, 0.0, bounds[0] / 2, *bounds, *between, bounds[-1] * 1.5, math.inf]


def updates(m: Metrics) -> list[tuple[str, str, tuple[str, ...], float]]:
    """(family, inc|observe, label values, amount): several series per family, created out of
    sorted order, some updated more than once."""
    out: list[tuple[str, str, tuple[str, ...], float]] = []
    for labels in [("r", "b", "200"), ("r", "a", "200"), ("other", "a", "503"), ("r", "b", "200")]:
        out += [("requests", "inc", labels, 1), ("requests", "inc", labels, 2)]
    for n, kind in enumerate(["prompt", "cached", "completion", "prompt"]):
        out.append(("tokens", "inc", ("r", "b", kind), 1000 * n + 7))
        out.append(("tokens", "inc", ("r", "a", kind), 0.1))  # float sums added in the same order
    out += [("lease_moves", "inc", ("pin",), 1), ("lease_moves", "inc", ("new",), 3),
            ("rejected", "inc", (str(Rejection.TOO_LARGE),), 1), ("usage_dropped", "inc", ("b",), 2),
            ("usage_dropped", "inc", ("a",), 0)]
    for family, labelsets in (("queue_wait", [("b", "m"), ("a", "m")]), ("ttfb", [("b",), ("a",)]),
                              ("generation_tps", [("b", "m"), ("a", "other")])):
        values = every_bucket(getattr(m, family).bounds[:-1])
        for i, value in enumerate(values):
            out.append((family, "observe", labelsets[0], value))
            if i % 3 == 0:
                out.append((family, "observe", labelsets[1], value))
    return out


_CREATED = re.compile(r"^(\w+_created(?:\{[^}]*\})?) (\S+)$", re.MULTILINE)


def without_created_values(text: str) -> tuple[str, list[float]]:
    """The exposition with every `_created` sample's value replaced by T, and those values."""
    values = [float(v) for _, v in _CREATED.findall(text)]
    return _CREATED.sub(r"\1 T", text), values


@pytest.mark.parametrize("created", [True, False])
def test_the_exposition_is_prometheus_clients_own(created: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same updates on crossbar's accumulators and on prometheus-client's Counter and Histogram
    give the same text, line for line (`_created` values aside: they are creation times)."""
    monkeypatch.setattr(client_metrics, "_use_created", created)
    began = time.time()
    registry, theirs = client_library_metrics()
    ours = Metrics()
    fed = updates(ours)
    for family, op, labels, amount in fed:
        getattr(getattr(ours, family), op)(labels, amount)
        getattr(theirs[family].labels(*labels), op)(amount)
    ended = time.time()
    expected, their_created = without_created_values(generate_latest(registry).decode())
    got, our_created = without_created_values(ours.exposition().decode())
    assert got.splitlines() == expected.splitlines()
    series = ({("lease_moves", (r,)) for r in LEASE_REASONS} | {("rejected", (str(r),)) for r in Rejection}
              | {(family, labels) for family, _, labels, _ in fed})
    assert len(our_created) == len(their_created) == (len(series) if created else 0)
    assert all(began <= t <= ended for t in our_created)
    # a value on a bound counts in that bound's bucket: -1, 0, 0.0025 and 0.005 in the first, then
    # one value between two bounds and one on the bound for each bucket after it
    assert 'crossbar_ttfb_seconds_bucket{host="b",le="0.005"} 4.0\n' in got
    assert 'crossbar_ttfb_seconds_bucket{host="b",le="0.01"} 6.0\n' in got
    assert 'crossbar_ttfb_seconds_bucket{host="b",le="600.0"} 34.0\n' in got
    assert 'crossbar_ttfb_seconds_bucket{host="b",le="+Inf"} 36.0\n' in got
