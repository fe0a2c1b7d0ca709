"""Reload, the state side: what the fleet, the limiter, the lease table, the token estimator and the
router keep, drop and retire when a new configuration arrives (no network; a real SQLite file)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crossbar.app import Router
from crossbar.config import Config, parse_config
from crossbar.decisions import Reason
from crossbar.exchange import Exchange
from crossbar.guard import TokenEstimator
from crossbar.hosts import Fleet, Poller, PollResult
from crossbar.lease import Key
from crossbar.limiter import Limiter, QueueFull
from crossbar.placement import Change, LeaseChange
from crossbar.reload import plan_reload


def raw(db: Path) -> dict[str, Any]:
    return {
        "listen": "127.0.0.1:7777",
        "db": str(db),
        "hosts": {
            "alpha": {"base_url": "http://127.0.0.1:18081", "models": {"m": {"parallel": 2}}},
            "beta": {"base_url": "http://127.0.0.1:18082", "models": ["m"]},
        },
        "routes": {"r": {"hosts": ["alpha", "beta"], "default_model": "m"}},
    }


def edit(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(data)
    *parents, last = path.split(".")
    table = data
    for part in parents:
        table = table[part]
    if value is None:
        del table[last]
    else:
        table[last] = value
    return data


# ------------------------------------------------------------------ Fleet


def learned(fleet: Fleet, name: str) -> None:
    fleet.apply(name, PollResult(ok=True, loaded=frozenset({"m"}), n_ctx=4096, slots=3))


@pytest.mark.parametrize(
    ("path", "value", "kept", "fresh", "retired"),
    [
        ("hosts.beta.weight", 5.0, {"alpha", "beta"}, [], set()),
        ("hosts.alpha.models", {"m": {"parallel": 1}}, {"alpha", "beta"}, [], set()),
        ("hosts.beta.base_url", "http://127.0.0.1:18089", {"alpha"}, ["beta"], set()),
        ("hosts.beta", None, {"alpha", "beta"}, [], {"beta"}),
    ],
)
def test_fleet_keeps_what_it_learned_about_hosts_that_stay(
        tmp_path: Path, path: str, value: Any, kept: set[str], fresh: list[str], retired: set[str]) -> None:
    old = parse_config(raw(tmp_path / "x.db"))
    new_raw = edit(raw(tmp_path / "x.db"), path, value)
    if value is None:
        new_raw["routes"]["r"]["hosts"] = ["alpha"]
    new = parse_config(new_raw)
    fleet = Fleet(old.hosts)
    for name in old.hosts:
        learned(fleet, name)
    assert fleet.reconfigure(new.hosts) == fresh
    assert {n for n, st in fleet.state.items() if st.polled} == kept
    assert set(fleet.retired) == retired
    for name in retired:  # a request holding it still reads its settings
        assert fleet.conf_of(name) is old.hosts[name]
        assert fleet.capacity(name, "") == 3  # as learned


def test_fleet_forgets_a_retired_host_once_nothing_holds_it(tmp_path: Path) -> None:
    old = parse_config(raw(tmp_path / "x.db"))
    fleet = Fleet(old.hosts)
    fleet.reconfigure({"alpha": old.hosts["alpha"]})
    assert fleet.sweep(lambda host: True) == [] and "beta" in fleet.state
    assert fleet.sweep(lambda host: False) == ["beta"]
    assert "beta" not in fleet.state and not fleet.retired


def test_a_host_added_back_before_it_was_forgotten_is_no_longer_retired(tmp_path: Path) -> None:
    old = parse_config(raw(tmp_path / "x.db"))
    fleet = Fleet(old.hosts)
    learned(fleet, "beta")
    fleet.reconfigure({"alpha": old.hosts["alpha"]})
    fleet.reconfigure(old.hosts)
    assert not fleet.retired and fleet.state["beta"].polled


# ------------------------------------------------------------------ Limiter, estimator, leases


async def test_limiter_queue_bound_and_forgetting_a_host() -> None:
    caps = {"a": 1}
    limiter = Limiter(1, lambda host, model: caps[host])
    first = await limiter.acquire("a", "m")
    assert limiter.in_flight("a", "m") == 1
    limiter.set_queue_max(0)
    with pytest.raises(QueueFull):
        await limiter.acquire("a", "m")
    limiter.release(first)
    limiter.forget("a")
    assert limiter.usage("a") == {}


def test_estimator_forgets_one_host_only() -> None:
    est = TokenEstimator(clock=lambda: 0.0)
    for host in ("a", "b"):
        est.learn(host, "m", "/v1/chat/completions", 4000, 2000)
    est.forget("a")
    assert est.ratio("a", "m") is None and est.ratio("b", "m") is not None


# ------------------------------------------------------------------ Router.reconfigure


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Router]:
    r = Router(parse_config(raw(tmp_path / "crossbar.db")))
    r.open()
    try:
        yield r
    finally:
        r.store.close()


def lease(router: Router, fp: str, host: str) -> Key:
    key = Key("r", fp, "m")
    router.leases.apply(key, LeaseChange(Change.CREATE, host), 1.0)
    return key


def reconfigure(router: Router, new_raw: dict[str, Any]) -> tuple[Config, int]:
    new = parse_config(new_raw)
    return new, router.reconfigure(new, plan_reload(router.cfg, new))


def events(router: Router) -> list[tuple[str, str | None, str]]:
    router.store.flush()
    return [(e.fp, e.from_host, e.reason) for e in reversed(router.store.lease_events(100))]


def test_router_drops_only_the_leases_a_reload_strands(router: Router, tmp_path: Path) -> None:
    on_alpha, on_beta = lease(router, "f1", "alpha"), lease(router, "f2", "beta")
    base = raw(tmp_path / "crossbar.db")
    _, dropped = reconfigure(router, edit(base, "routes.r.hosts", ["alpha"]))
    assert dropped == 1
    assert {x.key for x in router.leases.snapshot()} == {on_alpha}
    assert ("f2", "beta", str(Reason.ROUTE_CHANGED)) in events(router)
    assert on_beta not in {x.key for x in router.leases.snapshot()}

    gone = edit(edit(base, "hosts.alpha", None), "routes.r.hosts", ["beta"])
    _, dropped = reconfigure(router, gone)
    assert dropped == 1 and router.leases.count() == 0
    assert ("f1", "alpha", str(Reason.HOST_REMOVED)) in events(router)


def test_router_applies_changed_pins_and_clears_stranded_ones(router: Router, tmp_path: Path) -> None:
    base = raw(tmp_path / "crossbar.db")
    reconfigure(router, edit(base, "routes.r.pin", "beta"))
    assert router.leases.pinned("r") == "beta"
    reconfigure(router, base)
    assert router.leases.pinned("r") == ""
    router.leases.pin("r", "alpha", ("alpha", "beta"), 2.0)  # pinned by the admin API
    reconfigure(router, base)
    assert router.leases.pinned("r") == "alpha"  # the config did not change it
    reconfigure(router, edit(base, "routes.r.hosts", ["beta"]))
    assert router.leases.pinned("r") == ""


def test_a_concrete_route_of_a_template_loses_a_pin_its_template_no_longer_allows(
        router: Router, tmp_path: Path) -> None:
    base = edit(raw(tmp_path / "crossbar.db"), "routes.t-*", {"hosts": ["alpha", "beta"]})
    reconfigure(router, base)
    router.leases.pin("t-x", "beta", ("alpha", "beta"), 2.0)  # pinned by the admin API
    router.leases.pin("t-y", "alpha", ("alpha", "beta"), 2.0)
    reconfigure(router, edit(base, "routes.t-*.hosts", ["alpha"]))
    assert router.leases.pins() == {"t-y": "alpha"}


def test_router_gives_running_requests_their_route_as_configured_now(router: Router, tmp_path: Path) -> None:
    route = router.cfg.routes["r"]
    ex = Exchange(route=route, key=Key("r", "f", "m"), path="/v1/chat/completions", completion=True)
    gone = Exchange(route=route, key=Key("old", "f", "m"), path="/v1/chat/completions", completion=True)
    ex.host = gone.host = "beta"
    router.admit(ex)
    router.admit(gone)
    base = raw(tmp_path / "crossbar.db")
    new, _ = reconfigure(router, edit(edit(base, "hosts.beta", None), "routes.r.hosts", ["alpha"]))
    assert ex.route is new.routes["r"]
    assert gone.route.hosts == ("alpha",) and gone.route.name == "r"
    assert router.host_conf("beta").port == 18082  # retired while requests hold it
    router.finish(ex)
    router.finish(gone)
    router._on_poll_round()
    assert "beta" not in router.fleet.state and not router.fleet.retired


def test_a_request_routed_before_a_reload_and_admitted_after_it_gets_the_new_route(
        router: Router, tmp_path: Path) -> None:
    ex = Exchange(route=router.cfg.routes["r"], key=Key("r", "f", "m"), path="/v1/chat/completions",
                  completion=True)
    base = raw(tmp_path / "crossbar.db")
    new, _ = reconfigure(router, edit(edit(base, "hosts.beta", None), "routes.r.hosts", ["alpha"]))
    assert "beta" not in router.fleet.state  # nothing held it: forgotten at once
    router.admit(ex)
    assert ex.route is new.routes["r"]
    placed = router._place_once(ex, Reason.NEW)
    assert getattr(placed, "host", None) == "alpha"
    router.finish(ex)


def test_router_takes_the_new_settings(router: Router, tmp_path: Path) -> None:
    base = raw(tmp_path / "crossbar.db")
    new_raw = {**base, "queue_max": 3, "lease_idle": "5m", "poll_interval": "7s"}
    new, _ = reconfigure(router, new_raw)
    assert router.cfg is new
    assert router.leases.idle == 300 and router.poller.interval == 7
    assert router.limiter._queue_max == 3


async def test_a_new_poll_timeout_takes_a_new_session_and_the_old_one_is_closed(tmp_path: Path) -> None:
    cfg = parse_config(raw(tmp_path / "x.db"))
    poller = Poller(Fleet(cfg.hosts), interval=60, timeout=5)
    old = poller._client()
    poller.reconfigure(interval=30, timeout=2)
    new = poller._client()
    assert new is not old and new.timeout.total == 2 and poller.interval == 30
    assert not old.closed  # what it runs may still finish
    poller.reconfigure(interval=30, timeout=2)
    assert poller._client() is new  # the same timeout keeps the session
    await poller.stop()
    assert old.closed and new.closed
