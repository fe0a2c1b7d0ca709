"""The first-byte deadlines' buckets on a real event loop."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest

from crossbar.deadlines import SLACK, Deadlines


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


async def test_cancelled_deadlines_never_fire_and_their_buckets_go() -> None:
    deadlines, fired = Deadlines(tick=0.05), []
    due_a = deadlines.arm("a", 0.02, lambda: fired.append("a"))
    due_b = deadlines.arm("b", 0.02, lambda: fired.append("b"))
    assert due_a == due_b  # the same tick: one bucket
    deadlines.cancel("a", due_a)
    deadlines.cancel("b", due_b)
    assert len(deadlines) == 0 and not deadlines._buckets
    await asyncio.sleep(0.15)
    assert fired == []
    assert not deadlines._dues and deadlines._timer is None


async def test_deadlines_armed_and_cancelled_one_after_another_share_one_loop_timer() -> None:
    """Each request's deadline is usually cancelled (its first byte) before the next one is armed:
    a timer per bucket, cancelled with the bucket's last deadline, was a loop timer per request."""
    loop = asyncio.get_running_loop()
    deadlines, fired = Deadlines(tick=10.0), []
    with mock.patch.object(loop, "call_at", wraps=loop.call_at) as call_at:
        for n in range(100):
            due = deadlines.arm(n, 30.0, lambda: fired.append("late"))
            deadlines.cancel(n, due)
    assert call_at.call_count == 1 and len(deadlines) == 0
    assert deadlines._timer is not None
    deadlines._timer.cancel()


async def test_an_emptied_bucket_is_skipped_for_the_next_one_that_holds_a_deadline() -> None:
    loop = asyncio.get_running_loop()
    deadlines, fired = Deadlines(tick=0.01), []
    first = deadlines.arm("early", 0.02, lambda: fired.append("early"))
    deadlines.arm("middle", 0.2, lambda: fired.append("middle"))
    later = deadlines.arm("late", 0.4, lambda: fired.append("late"))
    deadlines.cancel("late", later)
    deadlines.cancel("early", first)
    await asyncio.sleep(0.1)
    assert fired == [] and deadlines._timer is not None
    assert deadlines._timer.when() == pytest.approx(loop.time() + 0.1, abs=0.03)  # the middle one's
    await asyncio.sleep(0.2)
    assert fired == ["middle"]
    assert not deadlines._buckets and deadlines._timer is None  # the emptied later bucket went too


async def test_a_handler_that_arms_again_is_fired_again() -> None:
    deadlines, fired = Deadlines(tick=0.01), []

    def again() -> None:
        fired.append(len(fired))
        if len(fired) < 3:
            deadlines.arm("a", 0.02, again)

    deadlines.arm("a", 0.02, again)
    await asyncio.sleep(0.3)
    assert fired == [0, 1, 2] and len(deadlines) == 0 and deadlines._timer is None


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


def test_a_deadline_armed_on_a_new_loop_fires_after_the_old_loop_stopped_with_its_timer_pending() -> None:
    """The one timer's due outlived the loop it was set on: every later deadline fell due after
    it, so none set a timer on the new loop and none fired."""
    deadlines, fired = Deadlines(tick=0.01), []

    async def old_loop() -> None:
        deadlines.arm("old", 0.01, lambda: fired.append("old"))  # the loop stops before it is due

    asyncio.run(old_loop())

    async def new_loop() -> None:
        deadlines.arm("new", 0.02, lambda: fired.append("new"))
        await asyncio.sleep(0.3)

    asyncio.run(new_loop())
    assert "new" in fired


async def test_memory_follows_the_deadlines_armed_not_the_longest_delay() -> None:
    """A deadline armed and cancelled each tick left an emptied bucket per tick until it fell due:
    `first_byte_timeout` ÷ tick of them (230 MB at a day), with no deadline armed."""
    deadlines = Deadlines(tick=0.002)
    for n in range(500):
        due = deadlines.arm(n, 3600.0, lambda: None)
        deadlines.cancel(n, due)
        await asyncio.sleep(0.0005 if n % 4 else 0.003)
    assert len(deadlines) == 0 and not deadlines._buckets
    assert len(deadlines._dues) <= SLACK + 1
    assert deadlines._timer is not None
    deadlines._timer.cancel()


class _FakeLoop:
    """A loop whose time moves only when told; its timers run in order of their time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[_FakeTimer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Any, *args: Any) -> _FakeTimer:
        timer = _FakeTimer(when, callback, args)
        self.timers.append(timer)
        return timer

    def advance(self, seconds: float) -> None:
        until = self.now + seconds
        while (due := [t for t in self.timers if not t.cancelled and t.when <= until]):
            timer = min(due, key=lambda t: t.when)
            self.timers.remove(timer)
            self.now = max(self.now, timer.when)
            timer.callback(*timer.args)
        self.now = until
        self.timers = [t for t in self.timers if not t.cancelled]


@dataclass
class _FakeTimer:
    when: float
    callback: Any
    args: tuple[Any, ...]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@pytest.mark.parametrize("seed", range(40))
def test_random_arming_and_cancelling_fire_each_live_deadline_once_and_on_time(seed: int) -> None:
    rng = random.Random(seed)
    loop, tick = _FakeLoop(), 0.05
    deadlines = Deadlines(tick)
    armed: dict[str, tuple[int, float, float]] = {}  # owner -> (bucket, armed at, delay)
    fired: list[tuple[str, float]] = []

    def fire(owner: str) -> None:
        fired.append((owner, loop.now))
        _, at, delay = armed.pop(owner)  # a cancelled or fired one is not there: KeyError
        assert at + delay <= loop.now + 1e-9, "fired early"
        assert loop.now <= at + delay + tick + 1e-9, "fired more than a tick late"
        if rng.random() < 0.2:  # a handler that arms again
            again = f"{owner}+"
            armed[again] = (deadlines.arm(again, 0.3, lambda: fire(again)), loop.now, 0.3)

    with mock.patch("asyncio.get_running_loop", return_value=loop):
        for step in range(400):
            action = rng.random()
            if action < 0.45:
                owner, delay = f"o{step}", rng.choice([0.01, 0.3, 0.3, 0.3, 2.0])
                armed[owner] = (deadlines.arm(owner, delay, lambda owner=owner: fire(owner)), loop.now, delay)
            elif action < 0.8 and armed:
                owner = rng.choice(sorted(armed))
                deadlines.cancel(owner, armed.pop(owner)[0])
            else:
                loop.advance(rng.choice([0.001, 0.02, 0.07, 0.4]))
            live = [t for t in loop.timers if not t.cancelled]
            assert len(live) <= 1
            assert len(deadlines) == len(armed)
            assert len(deadlines._dues) <= 2 * len(deadlines._buckets) + SLACK + 1
        loop.advance(10.0)
    assert armed == {} and len(deadlines) == 0
    assert len({owner for owner, _ in fired}) == len(fired)  # none fired twice
    assert not [t for t in loop.timers if not t.cancelled]
