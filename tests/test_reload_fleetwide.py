"""Reloading the configuration of one of several instances sharing PostgreSQL: what the other
instances announce, the shared claim and fleet-wide drains follow this instance's reloaded
configuration."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from crossbar.app import Router
from crossbar.config import parse_config
from crossbar.lease import Key
from crossbar.placement import Change as Placed
from crossbar.placement import LeaseChange
from crossbar.reload import plan_reload
from crossbar.shared import Change


def pg_raw(db: str, hosts: tuple[str, ...] = ("alpha", "beta"), **top: Any) -> dict[str, Any]:
    return {
        "listen": "127.0.0.1:7777",
        "db": db,
        "hosts": {n: {"base_url": f"http://127.0.0.1:{18081 + i}", "models": ["m"]}
                  for i, n in enumerate(hosts)},
        "routes": {"r": {"hosts": list(hosts), "default_model": "m"}},
        **top,
    }


@contextmanager
def opened(raw: dict[str, Any]) -> Iterator[Router]:
    """A router of one instance on the shared database, open while the block runs."""
    router = Router(parse_config(raw))
    router.open()
    try:
        yield router
    finally:
        router.store.close()


@pytest.fixture
def pg_router(pg_url: str) -> Iterator[Router]:
    with opened(pg_raw(pg_url)) as router:
        yield router


def reconfigure(router: Router, new_raw: dict[str, Any]) -> int:
    new = parse_config(new_raw)
    return router.reconfigure(new, plan_reload(router.cfg, new))


def route_on_alpha(db: str) -> dict[str, Any]:
    """Both hosts configured, route r on alpha alone."""
    raw = copy.deepcopy(pg_raw(db))
    raw["routes"]["r"]["hosts"] = ["alpha"]
    return raw


async def test_a_reloaded_lease_idle_governs_the_shared_claim(pg_url: str) -> None:
    """README: `lease_idle` reloads live. The shared claim (`Fleetwide.claim`) keeps the value the
    router started with, so a lease idle past the new `lease_idle` is not taken over."""
    base = pg_raw(pg_url, lease_idle="1h")
    with opened(base) as r:
        assert r.fleetwide is not None and r.store.shared is not None
        now = time.time()
        # another instance placed the conversation on alpha ten minutes ago; it has been idle since
        await r.store.shared.claim_lease("r", "fp", "m", "alpha", now - 600)
        reconfigure(r, {**base, "lease_idle": "5m"})
        assert r.cfg.lease_idle == 300 and r.leases.idle == 300
        # idle for 600 s > lease_idle 300 s: placed anew here, as a fresh instance would
        assert await r.fleetwide.claim(Key("r", "fp", "m"), "beta") == "beta"


def test_a_host_added_by_reload_takes_a_drain_another_instance_announced(pg_url: str) -> None:
    """A host drained through another instance and added here by a reload must be draining here
    too, as it is on an instance started with that configuration."""
    with opened(pg_raw(pg_url)) as other, opened(pg_raw(pg_url, hosts=("alpha",))) as here:
        assert here.fleetwide is not None
        other.set_draining("beta", True)
        here.fleetwide.on_change(Change("drain", host="beta", instance="other"))  # as the feed delivers it
        reconfigure(here, pg_raw(pg_url))
        assert "beta" in here.fleet.conf
        assert here.fleet.draining("beta"), "the fleet-wide drain of beta is ignored after the reload"


def test_a_host_added_by_reload_takes_a_drain_read_at_start_up(pg_url: str) -> None:
    """The same when this instance read the drain from host_drains as it started."""
    with opened(pg_raw(pg_url)) as other:
        other.set_draining("beta", True)  # written to host_drains and announced
        assert other.store.flush()
        with opened(pg_raw(pg_url, hosts=("alpha",))) as here:
            reconfigure(here, pg_raw(pg_url))
            assert here.fleet.draining("beta"), "the fleet-wide drain of beta is ignored after the reload"


def test_a_drained_host_whose_address_changes_stays_drained(pg_router: Router, pg_url: str) -> None:
    """An operator's drain is not something crossbar learned: a reload that moves the host to
    another address must not undrain it (the database still says it is drained)."""
    pg_router.set_draining("alpha", True)
    assert pg_router.store.flush()
    new = copy.deepcopy(pg_raw(pg_url))
    new["hosts"]["alpha"]["base_url"] = "http://127.0.0.1:18099"
    reconfigure(pg_router, new)
    assert pg_router.store.drained_hosts() == {"alpha"}
    assert pg_router.fleet.draining("alpha"), "the reload undrained alpha in memory only"


def test_a_lease_announced_on_a_host_this_instance_removed_is_not_adopted(
        pg_router: Router, pg_url: str) -> None:
    """Another instance (not reloaded yet) announces a conversation on beta; this instance's reload
    removed beta: no lease here may point at a host that no longer exists."""
    reconfigure(pg_router, pg_raw(pg_url, hosts=("alpha",)))
    assert pg_router.fleetwide is not None
    pg_router.fleetwide.on_change(Change("lease", "r", "fp", "m", "beta", instance="other"))
    hosts = {lease.host for lease in pg_router.leases.snapshot()}
    assert "beta" not in hosts, f"lease adopted on a host not in the configuration: {hosts}"


def test_a_pin_announced_on_a_host_this_instances_route_no_longer_lists_is_not_applied(
        pg_router: Router, pg_url: str) -> None:
    """This instance's reload took beta out of route r (its own pins there are cleared, see
    Router._repin); another instance, not reloaded yet, pins r to beta. Applied as is, every turn
    of r on this instance is refused (503 pinned_down) for a host its route does not have."""
    reconfigure(pg_router, route_on_alpha(pg_url))
    assert pg_router.fleetwide is not None
    pg_router.fleetwide.on_change(Change("pin", "r", host="beta", instance="other"))
    assert pg_router.leases.pinned("r") != "beta", "route r pinned to a host it does not list"


async def test_a_resync_leaves_out_leases_and_pins_on_hosts_the_route_no_longer_lists(pg_url: str) -> None:
    """After the feed was lost the database's leases and pins are read back: those another
    instance made on a host this instance's reloaded route does not list stay out, as their
    notices would."""
    with opened(pg_raw(pg_url)) as other, opened(pg_raw(pg_url)) as here:
        reconfigure(here, route_on_alpha(pg_url))
        now = time.time()
        other.leases.apply(Key("r", "fp", "m"), LeaseChange(Placed.CREATE, "beta"), now)
        other.leases.apply(Key("r", "fp2", "m"), LeaseChange(Placed.CREATE, "alpha"), now)
        assert other.store.flush()
        assert here.fleetwide is not None
        await here.fleetwide.resync()
        assert {lease.key.fp: lease.host for lease in here.leases.snapshot()} == {"fp2": "alpha"}
        other.leases.pin("r", "beta", ("alpha", "beta"), now)
        assert other.store.flush()
        await here.fleetwide.resync()
        assert here.leases.pinned("r") == ""


@pytest.mark.parametrize("drain_here", [True, False])
def test_a_drain_made_here_decides_a_host_a_reload_adds_back(pg_url: str, drain_here: bool) -> None:
    """This instance's own drain or undrain (never announced back to it) decides too: a host taken
    out and put back by reloads keeps what the database says of it."""
    with opened(pg_raw(pg_url)) as other:
        other.set_draining("beta", not drain_here)  # the state this instance then changes
        assert other.store.flush()
        with opened(pg_raw(pg_url)) as here:
            here.set_draining("beta", drain_here)
            assert here.store.flush()
            assert here.store.drained_hosts() == ({"beta"} if drain_here else set())
            reconfigure(here, pg_raw(pg_url, hosts=("alpha",)))
            reconfigure(here, pg_raw(pg_url))
            assert here.fleet.draining("beta") is drain_here


async def test_a_shared_lease_on_a_host_the_route_no_longer_lists_is_not_adopted(pg_url: str) -> None:
    """A conversation's first turn here reads its shared lease (or loses the claim to another
    instance): one on a host this configuration took from the route is placed here anew."""
    with opened(pg_raw(pg_url)) as other, opened(pg_raw(pg_url)) as here:
        reconfigure(here, pg_raw(pg_url, hosts=("alpha",)))
        assert other.store.shared is not None and here.fleetwide is not None
        await other.store.shared.claim_lease("r", "fp", "m", "beta", time.time())
        await here.fleetwide.adopt_shared(Key("r", "fp", "m"))
        assert here.leases.snapshot() == []
        assert await here.fleetwide.claim(Key("r", "fp", "m"), "alpha") == "alpha"
        assert here.leases.snapshot() == []  # the placement's own lease is applied by the router
