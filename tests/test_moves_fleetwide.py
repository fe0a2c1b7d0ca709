"""Two instances sharing PostgreSQL move one conversation at the same moment (both see its host
fail): the database decides where it goes, so both instances end up naming one host, and the
change feed cannot swap them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from test_reload_fleetwide import opened, pg_raw

from crossbar.app import Router
from crossbar.decisions import Reason
from crossbar.exchange import Exchange
from crossbar.lease import Key
from crossbar.placement import Change as Placed
from crossbar.placement import LeaseChange
from crossbar.shared import Change

HOSTS = ("alpha", "beta", "gamma")
K = Key("r", "fp", "m")
Two = tuple[Router, Router, dict[str, list[Change]]]


@pytest.fixture
def two(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Two]:
    """Instances "one" and "two" on one database, each with what it publishes recorded (the feed is
    not running: a test delivers the notices itself)."""
    with ExitStack() as stack:
        routers = [stack.enter_context(opened(pg_raw(pg_url, hosts=HOSTS))) for _ in range(2)]
        published: dict[str, list[Change]] = {"one": [], "two": []}
        for name, r in zip(published, routers, strict=True):
            monkeypatch.setattr(r.store, "publish", published[name].append)
        yield routers[0], routers[1], published


def turn(r: Router) -> Exchange:
    ex = Exchange(route=r.cfg.routes["r"], key=K, path="/v1/chat/completions", completion=True,
                  prompt_bytes=100)
    r.admit(ex)
    return ex


async def on_alpha(one: Router, two: Router) -> None:
    """The conversation lives on alpha: placed there by one, known to two."""
    now = time.time()
    assert one.fleetwide is not None
    assert await one.fleetwide.claim(K, "alpha") == "alpha"
    one.leases.apply(K, LeaseChange(Placed.CREATE, "alpha"), now)
    two.leases.adopt(K, "alpha", now, now)


async def moved_at_once(one: Router, two: Router, settle: bool) -> None:
    """alpha fails on both; one would move the conversation to beta, two to gamma (each has the
    other host draining, as far as it knows); both turns move at the same moment. Unsettled (a
    retry's move), the lease follows once the new host answered."""
    one.fleet.set_draining("gamma", True)
    two.fleet.set_draining("beta", True)
    turns = []
    for r in (one, two):
        ex = turn(r)
        await r.lease(ex, None)
        assert ex.host == "alpha"
        r.passive_mark("alpha", "answered 502")
        turns.append((r, ex))
    placed = await asyncio.gather(*(r.move(ex, "answered 502", None, reason=Reason.UNHEALTHY, settle=settle)
                                    for r, ex in turns))
    if not settle:
        for (r, ex), where in zip(turns, placed, strict=True):
            r.follow(ex, where)


def deliver(published: dict[str, list[Change]], one: Router, two: Router) -> None:
    """The change feed: each instance's notices reach the other."""
    for source, target in (("one", two), ("two", one)):
        assert target.fleetwide is not None
        for change in published[source]:
            target.fleetwide.on_change(change)


@pytest.mark.parametrize("settle", [True, False], ids=["failover", "retry"])
async def test_two_instances_moving_one_conversation_at_once_agree_on_its_host(
        two: Two, settle: bool) -> None:
    one, other, published = two
    await on_alpha(one, other)
    await moved_at_once(one, other, settle)
    deliver(published, one, other)
    hosts = one.leases.view(K).host, other.leases.view(K).host
    assert hosts[0] == hosts[1], f"the conversation is split across instances: {hosts}"
    assert hosts[0] in ("beta", "gamma")
    assert one.store.shared is not None
    row = await one.store.shared.find_lease("r", "fp", "m")
    assert row is not None and row.host == hosts[0], "the database names another host than both instances"


async def test_a_move_of_a_conversation_another_instance_moved_first_joins_it(two: Two) -> None:
    """The second mover finds the database naming the first one's host (not the one both saw
    fail): its turn goes there too, and it announces nothing of its own."""
    one, other, published = two
    await on_alpha(one, other)
    assert one.fleetwide is not None and one.store.shared is not None
    await one.store.shared.move_lease("r", "fp", "m", "alpha", "beta", time.time())
    ex = turn(other)
    await other.lease(ex, None)
    other.passive_mark("alpha", "connect failed")
    other.fleet.set_draining("beta", True)  # gamma is where two itself would move it
    await other.move(ex, "connect failed", None, reason=Reason.UNHEALTHY)
    assert ex.host == "beta" and other.leases.view(K).host == "beta"
    assert not [c for c in published["two"] if c.kind == "lease"], published["two"]

