"""A slot granted without a wait takes `take_slot`'s shortcut (the ticket straight from the limiter,
never entered where rebalance passes look for queued requests); it must end exactly as the general
path (`_wait_for_slot`: queue, wait, then the slot across instances) would, whatever the host's
capacity, its slots in use, the requests queued there, the queue's bound and the client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from strategies_util import mostly

from crossbar import errors
from crossbar.app import Router
from crossbar.config import parse_config
from crossbar.exchange import Exchange
from crossbar.hosts import PollResult
from crossbar.lease import Key
from crossbar.limiter import ClientGone

CHAT = "/v1/chat/completions"


class SharedWithoutParallel:
    """Instances share the database (so every slot goes through `_wait_for_slot`), and the config
    sets no `parallel`: no slot across the instances is needed, and this is never asked."""


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("take") / "crossbar.db"


@contextlib.contextmanager
def router(db: Path, w: dict[str, Any]) -> Iterator[Router]:
    r = Router(parse_config({
        "listen": "127.0.0.1:7777", "db": str(db), "queue_max": w["queue_max"],
        "hosts": {"a": {"base_url": "http://127.0.0.1:18081", "models": ["m"]}},
        "routes": {"r": {"hosts": ["a"], "default_model": "m", "queue": w["queue"]}},
    }))
    try:
        yield r
    finally:
        r.store.close()


@st.composite
def worlds(draw: st.DrawFn) -> dict[str, Any]:
    """The host's slots as the turn finds them, drawn mostly as the usual turn's (a free slot)."""
    return {
        "slots": draw(mostly(2, 0, 1, 3)),  # learned from a poll; 0: never polled (1 slot)
        "running": draw(st.sampled_from((0, 1, 2, 3))),  # slots other requests hold
        "queued": draw(mostly(0, 1, 2)),  # requests that asked for a slot before this turn
        "later": draw(st.sampled_from((0, 1, 2))),  # requests that ask for one after it
        "grown": draw(mostly(0, 1, 2)),  # slots a poll adds once they queued (no refresh since)
        "queue_max": draw(st.sampled_from((8, 0, 1))),
        "queue": draw(mostly(True, False)),  # the route's `queue`
        "gone": draw(mostly("none", "open", "left")),  # the client's event: none, not set, set
    }


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def poll(r: Router, slots: int) -> None:
    if slots:
        r.fleet.apply("a", PollResult(ok=True, slots=slots))


def waits_counted(r: Router) -> float:
    return sum(sample.value for family in r.metrics.queue_wait.collect() for sample in family.samples
               if sample.name.endswith("_count"))


def turn_on_a(r: Router, fp: str) -> Exchange:
    ex = Exchange(route=r.cfg.routes["r"], key=Key("r", fp, "m"), path=CHAT, completion=True)
    ex.host = "a"
    return ex


async def outcome(r: Router, w: dict[str, Any]) -> dict[str, Any]:
    """Run one turn's `take_slot` on the drawn world; what it did, then what its release did."""
    poll(r, w["slots"])
    for _ in range(w["running"]):
        await r.limiter.acquire("a", "", hold=False)
    ahead = [asyncio.ensure_future(r.take_slot(turn_on_a(r, f"ahead{i}"), None)) for i in range(w["queued"])]
    await settle()
    poll(r, w["slots"] + w["grown"] if w["slots"] else w["grown"])
    gone = None if w["gone"] == "none" else asyncio.Event()
    if w["gone"] == "left":
        gone.set()
    ex = turn_on_a(r, "fp")
    turn = asyncio.ensure_future(r.take_slot(ex, gone))
    await settle()
    ahead += [asyncio.ensure_future(r.take_slot(turn_on_a(r, f"later{i}"), None)) for i in range(w["later"])]
    await settle()
    seen: dict[str, Any] = {"in_flight": r.limiter.in_flight("a", ""), "queued": r.limiter.queued("a", ""),
                            "ahead_granted": sum(t.done() for t in ahead), "holds": ex.ticket is not None,
                            "waiting": {k: len(v) for k, v in r._waiting.items()}, "err": ex.err,
                            "waits_counted": waits_counted(r)}
    if turn.done():
        failed = turn.exception()
        seen["ended"] = type(failed).__name__ if failed else "granted"
        if isinstance(failed, errors.CrossbarError):
            seen["status"] = failed.status
        if ex.ticket is not None:  # (`queued_ms` is not compared: the general path reads the clock
            seen["queued_s"] = ex.ticket.queued_s  # around its sub-millisecond, which may round to 1)
    else:
        seen["ended"] = "waiting"
    ex.drop_slot()  # the turn's ending gives the slot back: the next one queued takes it, or yields
    rebalancing = r._rebalance_due
    await settle()
    seen["after_release"] = (rebalancing, r.limiter.in_flight("a", ""), r.limiter.queued("a", ""),
                             sum(t.done() for t in ahead))
    for task in (turn, *ahead):
        task.cancel()
    await asyncio.gather(turn, *ahead, return_exceptions=True)
    return seen


@settings(max_examples=400, deadline=None)
@given(worlds())
def test_a_slot_taken_at_once_ends_as_the_general_path_would(db: Path, w: dict[str, Any]) -> None:
    with router(db, w) as fast, router(db, w) as general:
        general.fleetwide = SharedWithoutParallel()  # type: ignore[assignment]
        shortcut = asyncio.run(outcome(fast, w))
        full = asyncio.run(outcome(general, w))
    event(f"turn: {full['ended']}")
    assert shortcut == full


def test_the_usual_turn_takes_the_shortcut(db: Path) -> None:
    """A free slot and nobody queued: the slot is granted at once, without the turn ever being
    entered for rebalance passes (else the property above would hold vacuously)."""
    w = {"slots": 2, "running": 1, "queued": 0, "later": 0, "grown": 0, "queue_max": 8, "queue": True,
         "gone": "open"}
    with router(db, w) as r:
        entered: list[object] = []
        r._waiting = _Recording(entered)  # type: ignore[assignment]
        seen = asyncio.run(outcome(r, w))
    assert seen["ended"] == "granted" and seen["in_flight"] == 2 and seen["waits_counted"] == 1
    assert seen["queued_s"] == 0.0 and entered == []


class _Recording(dict):  # type: ignore[type-arg]
    """`Router._waiting` that records every request entered in it."""

    def __init__(self, entered: list[object]) -> None:
        super().__init__()
        self.entered = entered

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self.entered.append(key)
        return super().setdefault(key, default)


def test_a_client_already_gone_is_never_granted_a_slot(db: Path) -> None:
    w = {"slots": 2, "running": 0, "queued": 0, "later": 0, "grown": 0, "queue_max": 8, "queue": True,
         "gone": "left"}
    with router(db, w) as r:
        seen = asyncio.run(outcome(r, w))
    assert seen["ended"] == ClientGone.__name__ and seen["in_flight"] == 0 and not seen["holds"]
    assert seen["err"] == "client left while queued"
