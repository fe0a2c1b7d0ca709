"""A queued turn that yields goes to the host placement chose only when it gets there: when that
host's queue filled meanwhile (between the rebalance pass that moved it and the turn's next step),
the turn waits at home again instead of being turned away with a 503."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from crossbar import errors
from crossbar.app import Router, Yielded
from crossbar.config import parse_config
from crossbar.decisions import Decision, Reason, Rejection
from crossbar.exchange import Exchange
from crossbar.lease import Key
from crossbar.limiter import Ticket
from crossbar.placement import Change, LeaseChange, Placement

CHAT = "/v1/chat/completions"
TURN = Key("r", "conversation", "m")


@contextlib.contextmanager
def router(tmp_path: Path, hosts: tuple[str, ...] = ("a", "b"), queue_max: int = 1) -> Iterator[Router]:
    """Route r over `hosts`, one slot each for model m."""
    r = Router(parse_config({
        "listen": "127.0.0.1:7777", "db": str(tmp_path / "crossbar.db"), "queue_max": queue_max,
        "hosts": {n: {"base_url": f"http://127.0.0.1:{18081 + i}", "models": {"m": {"parallel": 1}}}
                  for i, n in enumerate(hosts)},
        "routes": {"r": {"hosts": list(hosts), "default_model": "m"}},
    }))
    try:
        yield r
    finally:
        r.store.close()


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def busy(r: Router, host: str) -> Ticket:
    """Another request holds the host's one slot."""
    return await r.limiter.acquire(host, r.fleet.slot_key(host, "m"), hold=False)


def queued_turn(r: Router) -> tuple[Exchange, asyncio.Future[None]]:
    """The conversation's turn, leased to a, waiting in a's queue."""
    r.leases.apply(TURN, LeaseChange(Change.CREATE, "a"), time.time())
    ex = Exchange(route=r.cfg.routes["r"], key=TURN, path=CHAT, completion=True, prompt_bytes=100)
    r.admit(ex)
    return ex, asyncio.ensure_future(r.lease(ex, None))


def yield_to_b(r: Router, ex: Exchange) -> None:
    """What a rebalance pass does when placement says the turn is served sooner on b."""
    (ticket,) = r._waiting[("a", r.fleet.slot_key("a", "m"))].values()
    moved = Placement("b", Decision.YIELD, LeaseChange(Change.MOVE, "b", "a", Reason.YIELD))
    assert r.limiter.withdraw(ticket, Yielded(moved))
    ex.yielded = True


async def test_a_turn_whose_yield_host_filled_up_waits_at_home_again(tmp_path: Path) -> None:
    with router(tmp_path) as r:
        on_a = await busy(r, "a")
        ex, turn = queued_turn(r)
        await settle()
        assert r.queued("a", "m") == 1 and not turn.done()
        await busy(r, "b")
        b_queue = asyncio.ensure_future(r.limiter.acquire("b", r.fleet.slot_key("b", "m")))  # b's queue: full
        await settle()
        yield_to_b(r, ex)
        await settle()
        assert not turn.done(), turn.exception() if turn.done() else None  # not a 503: back in a's queue
        assert r.queued("a", "m") == 1 and ex.host == "a"
        r.limiter.release(on_a)
        await asyncio.wait_for(turn, 5)
        assert (ex.host, ex.decision, ex.err) == ("a", Decision.REUSED, None)
        assert r.leases.view(TURN).host == "a"  # the lease never moved
        ex.end()
        b_queue.cancel()


async def test_with_both_queues_full_the_turn_gets_the_queue_full_answer(tmp_path: Path) -> None:
    with router(tmp_path) as r:
        await busy(r, "a")
        ex, turn = queued_turn(r)
        await settle()
        await busy(r, "b")
        waiters = [asyncio.ensure_future(r.limiter.acquire("b", r.fleet.slot_key("b", "m")))]
        await settle()
        yield_to_b(r, ex)
        # before the turn runs again, another request takes its place in a's queue (its first
        # step runs at once, up to its wait in that queue)
        waiters.append(asyncio.Task(r.limiter.acquire("a", r.fleet.slot_key("a", "m")),
                                    loop=asyncio.get_running_loop(), eager_start=True))
        assert r.queued("a", "m") == 1
        await settle()
        with pytest.raises(errors.CrossbarError) as refused:
            await asyncio.wait_for(turn, 5)
        assert (refused.value.status, refused.value.reason) == (503, Rejection.QUEUE_FULL)
        assert ex.host == "a" and r.leases.view(TURN).host == "a"
        ex.end()
        for waiter in waiters:
            waiter.cancel()


async def test_a_yield_target_going_down_is_logged_as_that_host_not_the_home_host(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The turn queued on a yields to b, queues there, and b goes down (its queue evicted): the
    warning must name b, not a, which is up and where the turn goes back to."""
    with router(tmp_path) as r:
        on_a = await busy(r, "a")
        ex, turn = queued_turn(r)
        await settle()
        on_b = await busy(r, "b")
        yield_to_b(r, ex)
        await settle()
        assert r.queued("b", "m") == 1 and not turn.done()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="crossbar"):
            r.passive_mark("b", "connect failed")
            await settle()
        assert not turn.done() and r.queued("a", "m") == 1 and r.fleet.healthy("a")
        went_down = [rec.getMessage() for rec in caplog.records if "went down" in rec.getMessage()]
        try:
            assert went_down and all(m.startswith("b went down") for m in went_down), went_down
        finally:
            r.limiter.release(on_a)
            await asyncio.wait_for(turn, 5)
            ex.end()
            r.limiter.release(on_b)
