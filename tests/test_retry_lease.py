"""The lease follows a retry only once the retry's host answered, and only from where the retry
found it: what happened to the lease meanwhile (another turn moved it, an operator pinned or
released the route) stands."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
from test_yield_race import CHAT, TURN, busy, router
from test_yield_race import settle as settle_loop

from crossbar.app import Router
from crossbar.decisions import Reason
from crossbar.exchange import Exchange
from crossbar.placement import Change, LeaseChange, Placement


def turn(r: Router) -> Exchange:
    ex = Exchange(route=r.cfg.routes["r"], key=TURN, path=CHAT, completion=True, prompt_bytes=100)
    r.admit(ex)
    return ex


async def retried_to_b(r: Router) -> tuple[Exchange, Placement, list[tuple[str | None, str | None, str]]]:
    """A turn of the conversation leased to a, answered 503 there and moved to b for its retry
    (the lease not yet following); the lease events so far."""
    events: list[tuple[str | None, str | None, str]] = []
    r.leases.subscribe(lambda e: events.append((e.from_host, e.to_host, str(e.reason))))
    r.leases.apply(TURN, LeaseChange(Change.CREATE, "a"), time.time())
    first = turn(r)
    await r.lease(first, None)
    r.passive_mark("a", "answered 503")
    placed = await r.move(first, "answered 503", None, reason=Reason.UNHEALTHY, settle=False)
    assert first.host == "b" and r.leases.view(TURN).host == "a"
    return first, placed, events


async def test_the_lease_follows_an_answered_retry(tmp_path: Path) -> None:
    with router(tmp_path) as r:
        first, placed, events = await retried_to_b(r)
        await r.follow(first, placed)
        first.end()
        assert r.leases.view(TURN).host == "b"
    assert events == [(None, "a", "new"), ("a", "b", "unhealthy")]


@pytest.mark.parametrize("meanwhile", ["another turn moved it", "the route was pinned",
                                       "the route was released"])
async def test_what_happened_to_the_lease_during_the_retry_stands(tmp_path: Path, meanwhile: str) -> None:
    with router(tmp_path) as r:
        first, placed, events = await retried_to_b(r)
        first.drop_slot()  # b has one slot: the other turn may take it
        if meanwhile == "another turn moved it":
            second = turn(r)
            await r.lease(second, None)
            assert second.host == "b"
            second.end()
        elif meanwhile == "the route was pinned":
            r.pin_route("r", "b", ("a", "b"))
        else:
            r.release_route("r")
        before = list(events)
        await r.follow(first, placed)
        first.end()
        assert events == before  # following changed nothing more


def three_hosts(tmp_path: Path) -> contextlib.AbstractContextManager[Router]:
    return router(tmp_path, ("a", "b", "c"), queue_max=2)


@pytest.mark.parametrize("settle", [True, False], ids=["failover", "retry"])
async def test_a_move_queued_on_a_host_that_goes_down_is_placed_again(tmp_path: Path, settle: bool) -> None:
    """A turn moved off its failed host waits in the queue of the host it moved to; that host goes
    down too. Another host can take it: the turn goes there, it is not turned away with a 503."""
    with three_hosts(tmp_path) as r:
        r.leases.apply(TURN, LeaseChange(Change.CREATE, "a"), time.time())
        ex = turn(r)
        await r.lease(ex, None)
        assert ex.host == "a"
        b_held = await busy(r, "b")  # b runs another request: the turn will queue there
        r.fleet.set_draining("c", True)  # c takes no new conversation for now
        r.passive_mark("a", "connect failed")
        moving = asyncio.ensure_future(r.move(ex, "connect failed", None, reason=Reason.UNHEALTHY,
                                              settle=settle))
        await settle_loop()
        assert not moving.done() and r.queued("b", "m"), "the turn should wait in b's queue"
        r.fleet.set_draining("c", False)
        r.passive_mark("b", "connect failed")
        placed = await asyncio.wait_for(moving, 5)
        assert ex.host == placed.host == "c"
        ex.end()
        r.limiter.release(b_held)


async def test_a_move_granted_a_slot_on_a_host_that_went_down_meanwhile_is_placed_again(
        tmp_path: Path) -> None:
    """The turn moved off a waits in b's queue; b's running request ends (its slot goes to the
    turn) and b is marked down before the turn resumes (the limiter's eviction passes over a
    waiter already granted): the turn must not run, nor its lease move, on b; c takes it."""
    with three_hosts(tmp_path) as r:
        r.leases.apply(TURN, LeaseChange(Change.CREATE, "a"), time.time())
        ex = turn(r)
        await r.lease(ex, None)
        assert ex.host == "a"
        b_held = await busy(r, "b")
        r.fleet.set_draining("c", True)
        r.passive_mark("a", "connect failed")
        moving = asyncio.ensure_future(r.move(ex, "connect failed", None, reason=Reason.UNHEALTHY))
        await settle_loop()
        assert not moving.done() and r.queued("b", "m")
        r.fleet.set_draining("c", False)
        r.limiter.release(b_held)  # b's running request ends: its slot goes to the queued turn
        r.passive_mark("b", "connect failed")  # ...and b is found down in the same tick
        await asyncio.wait_for(moving, 5)
        try:
            assert r.fleet.healthy(ex.host), f"the moved turn runs on {ex.host}, which is down"
        finally:
            ex.end()
