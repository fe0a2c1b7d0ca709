"""The first-byte deadlines' buckets on a real event loop."""

from __future__ import annotations

import asyncio
import logging

import pytest

from crossbar.deadlines import Deadlines


async def test_a_deadline_fires_once_not_before_its_delay_and_at_most_a_tick_late() -> None:
    loop = asyncio.get_running_loop()
    deadlines, fired = Deadlines(tick=0.02), []
    armed = loop.time()
    deadlines.arm("a", 0.1, lambda: fired.append(loop.time()))
    await asyncio.sleep(0.05)
    assert fired == [] and len(deadlines) == 1
    await asyncio.sleep(0.25)
    assert len(fired) == 1 and len(deadlines) == 0
    assert armed + 0.1 <= fired[0] <= armed + 0.1 + 0.02 + 0.1  # a tick late at most (+ slack)


async def test_cancelled_deadlines_never_fire_and_the_last_one_takes_its_bucket_timer() -> None:
    deadlines, fired = Deadlines(tick=0.05), []
    due_a = deadlines.arm("a", 0.02, lambda: fired.append("a"))
    due_b = deadlines.arm("b", 0.02, lambda: fired.append("b"))
    assert due_a == due_b  # the same tick: one bucket, one loop timer
    deadlines.cancel("a", due_a)
    assert deadlines._timers  # "b" still waits on it
    deadlines.cancel("b", due_b)
    assert not deadlines._timers and not deadlines._buckets and len(deadlines) == 0
    await asyncio.sleep(0.15)
    assert fired == []


async def test_cancelling_one_of_a_bucket_leaves_the_others_to_fire() -> None:
    deadlines, fired = Deadlines(tick=0.05), []
    due = deadlines.arm("a", 0.01, lambda: fired.append("a"))
    deadlines.arm("b", 0.01, lambda: fired.append("b"))
    deadlines.cancel("a", due)
    await asyncio.sleep(0.15)
    assert fired == ["b"]


@pytest.mark.parametrize("owner, due", [("nobody", 0), ("a", 10**12)])
async def test_cancelling_what_is_not_armed_changes_nothing(owner: str, due: int) -> None:
    deadlines, fired = Deadlines(tick=0.01), []
    deadlines.arm("a", 0.02, lambda: fired.append("a"))
    deadlines.cancel(owner, due)
    await asyncio.sleep(0.1)
    assert fired == ["a"]
    deadlines.cancel("a", due)  # after it fired
    assert len(deadlines) == 0


async def test_a_failing_handler_is_logged_and_the_bucket_still_fires_the_rest(
        caplog: pytest.LogCaptureFixture) -> None:
    deadlines, fired = Deadlines(tick=0.05), []

    def fails() -> None:
        raise RuntimeError("boom")

    deadlines.arm("a", 0.01, fails)
    deadlines.arm("b", 0.01, lambda: fired.append("b"))
    with caplog.at_level(logging.ERROR, logger="crossbar"):
        await asyncio.sleep(0.15)
    assert fired == ["b"]
    assert "a deadline's handler failed" in caplog.text


async def test_deadlines_of_different_delays_fire_in_their_own_order() -> None:
    deadlines, fired = Deadlines(tick=0.01), []
    for name, delay in (("late", 0.12), ("early", 0.02), ("middle", 0.06)):
        deadlines.arm(name, delay, lambda name=name: fired.append(name))
    await asyncio.sleep(0.3)
    assert fired == ["early", "middle", "late"]


def test_the_tick_must_be_positive() -> None:
    for tick in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            Deadlines(tick=tick)
