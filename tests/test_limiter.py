from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from crossbar.limiter import ClientGone, Limiter, QueueFull, Ticket, unless_gone

H = "alpha"
M = "ornith"


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Capacity:
    slots: dict[tuple[str, str], int] = field(default_factory=dict)
    default: int = 1
    asked: int = 0

    def __call__(self, host: str, model: str) -> int:
        self.asked += 1
        return self.slots.get((host, model), self.default)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


@dataclass
class Rig:
    limiter: Limiter
    clock: Clock
    capacity: Capacity
    admitted: list[str] = field(default_factory=list)
    tickets: dict[str, Ticket] = field(default_factory=dict)

    def spawn(self, name: str, gone: asyncio.Event | None = None, model: str = M) -> asyncio.Task[Ticket]:
        async def run() -> Ticket:
            ticket = await self.limiter.acquire(H, model, gone)
            self.admitted.append(name)
            self.tickets[name] = ticket
            return ticket

        return asyncio.ensure_future(run())


def rig(queue_max: int = 8, capacity: int = 1) -> Rig:
    clock, cap = Clock(), Capacity(default=capacity)
    return Rig(Limiter(queue_max, cap, clock), clock, cap)


async def test_admits_at_once_when_there_is_room() -> None:
    r = rig(capacity=2)
    first = await r.limiter.acquire(H, M)
    second = await r.limiter.acquire(H, M)
    assert (first.queued_s, second.queued_s) == (0.0, 0.0)
    assert r.limiter.in_flight(H, M) == 2
    assert r.limiter.queued(H, M) == 0


async def test_waiters_are_admitted_in_fifo_order() -> None:
    r = rig()
    holder = await r.limiter.acquire(H, M)
    for name in ["a", "b", "c"]:
        r.spawn(name)
        await settle()
    assert r.limiter.queued(H, M) == 3
    r.limiter.release(holder)
    await settle()
    assert r.admitted == ["a"]
    r.limiter.release(r.tickets["a"])
    await settle()
    r.limiter.release(r.tickets["b"])
    await settle()
    assert r.admitted == ["a", "b", "c"]
    assert r.limiter.queued(H, M) == 0


async def test_never_more_than_capacity_in_flight() -> None:
    r = rig(capacity=2)
    for i in range(6):
        r.spawn(f"t{i}")
    await settle()
    assert (r.limiter.in_flight(H, M), r.limiter.queued(H, M)) == (2, 4)
    released = 0
    while released < 6:
        assert r.limiter.in_flight(H, M) == min(2, 6 - released)
        r.limiter.release(r.tickets[r.admitted[released]])
        released += 1
        await settle()
    assert r.admitted == [f"t{i}" for i in range(6)]
    assert (r.limiter.in_flight(H, M), r.limiter.queued(H, M)) == (0, 0)


async def test_queue_full_at_the_bound() -> None:
    r = rig(queue_max=2)
    await r.limiter.acquire(H, M)
    r.spawn("a")
    r.spawn("b")
    await settle()
    with pytest.raises(QueueFull) as full:
        await r.limiter.acquire(H, M)
    assert full.value.retry_after >= 1
    assert r.limiter.queued(H, M) == 2
    assert r.limiter.in_flight(H, M) == 1


async def test_zero_queue_refuses_at_once() -> None:
    r = rig(queue_max=0)
    await r.limiter.acquire(H, M)
    with pytest.raises(QueueFull):
        await r.limiter.acquire(H, M)


async def test_client_gone_while_queued_leaves_at_once() -> None:
    r = rig()
    holder = await r.limiter.acquire(H, M)
    gone = asyncio.Event()
    a = r.spawn("a", gone)
    r.spawn("b")
    await settle()
    assert r.limiter.queued(H, M) == 2
    gone.set()
    await settle()
    assert r.limiter.queued(H, M) == 1
    with pytest.raises(ClientGone):
        await a
    r.limiter.release(holder)
    await settle()
    assert r.admitted == ["b"]
    assert r.limiter.in_flight(H, M) == 1


async def test_client_already_gone_takes_no_slot() -> None:
    r = rig()
    gone = asyncio.Event()
    gone.set()
    with pytest.raises(ClientGone):
        await r.limiter.acquire(H, M, gone)
    assert r.limiter.in_flight(H, M) == 0


async def test_granted_waiter_whose_client_left_gives_the_slot_back() -> None:
    r = rig()
    holder = await r.limiter.acquire(H, M)
    gone = asyncio.Event()
    a = r.spawn("a", gone)
    r.spawn("b")
    await settle()
    r.limiter.release(holder)  # grants "a" ...
    gone.set()  # ... whose client leaves before it runs
    await settle()
    with pytest.raises(ClientGone):
        await a
    assert r.admitted == ["b"]
    assert r.limiter.in_flight(H, M) == 1


async def test_cancelled_waiter_leaves_the_queue() -> None:
    r = rig()
    holder = await r.limiter.acquire(H, M)
    a = r.spawn("a")
    r.spawn("b")
    await settle()
    a.cancel()
    await settle()
    assert a.cancelled()
    assert r.limiter.queued(H, M) == 1
    r.limiter.release(holder)
    await settle()
    assert r.admitted == ["b"]


async def test_cancelled_after_grant_gives_the_slot_back() -> None:
    r = rig()
    holder = await r.limiter.acquire(H, M)
    a = r.spawn("a")
    r.spawn("b")
    await settle()
    r.limiter.release(holder)
    a.cancel()
    await settle()
    assert a.cancelled()
    assert r.admitted == ["b"]
    assert r.limiter.in_flight(H, M) == 1


async def test_release_is_idempotent() -> None:
    r = rig()
    holder = await r.limiter.acquire(H, M)
    r.spawn("a")
    r.spawn("b")
    await settle()
    r.limiter.release(holder)
    r.limiter.release(holder)
    await settle()
    assert r.admitted == ["a"]
    assert r.limiter.in_flight(H, M) == 1
    r.limiter.release(r.tickets["a"])
    r.limiter.release(r.tickets["a"])
    await settle()
    assert r.admitted == ["a", "b"]
    r.limiter.release(r.tickets["b"])
    r.limiter.release(r.tickets["b"])
    assert r.limiter.in_flight(H, M) == 0


async def test_capacity_increase_admits_more_waiters_on_release() -> None:
    r = rig()
    holder = await r.limiter.acquire(H, M)
    for name in ["a", "b", "c", "d"]:
        r.spawn(name)
    await settle()
    r.capacity.default = 3
    r.limiter.release(holder)
    await settle()
    assert r.admitted == ["a", "b", "c"]
    assert (r.limiter.in_flight(H, M), r.limiter.queued(H, M)) == (3, 1)


async def test_capacity_increase_admits_on_refresh_and_on_the_next_arrival() -> None:
    r = rig()
    await r.limiter.acquire(H, M)
    for name in ["a", "b", "c"]:
        r.spawn(name)
    await settle()
    r.capacity.default = 2
    r.limiter.refresh()
    await settle()
    assert r.admitted == ["a"]
    r.capacity.default = 4
    r.spawn("d")  # the newcomer lets the queue move first, in order
    await settle()
    assert r.admitted == ["a", "b", "c"]
    assert r.limiter.queued(H, M) == 1


async def test_capacity_decrease_holds_admissions() -> None:
    r = rig(capacity=2)
    first = await r.limiter.acquire(H, M)
    await r.limiter.acquire(H, M)
    r.spawn("a")
    await settle()
    r.capacity.default = 1
    r.limiter.release(first)
    await settle()
    assert r.admitted == []
    assert r.limiter.in_flight(H, M) == 1


async def test_capacity_below_one_counts_as_one() -> None:
    r = rig(capacity=0)
    await r.limiter.acquire(H, M)
    assert r.limiter.in_flight(H, M) == 1


async def test_hold_false_counts_but_never_waits_or_is_refused() -> None:
    r = rig(queue_max=0)
    await r.limiter.acquire(H, M)
    tickets = [await r.limiter.acquire(H, M, hold=False) for _ in range(3)]
    assert r.limiter.in_flight(H, M) == 4
    assert r.limiter.queued(H, M) == 0
    for ticket in tickets:
        r.limiter.release(ticket)
    assert r.limiter.in_flight(H, M) == 1


async def test_queued_seconds_are_measured() -> None:
    r = rig()
    holder = await r.limiter.acquire(H, M)
    r.spawn("a")
    await settle()
    r.clock.now += 2.5
    r.limiter.release(holder)
    await settle()
    assert r.tickets["a"].queued_s == pytest.approx(2.5)


async def test_counts_are_per_host_and_model() -> None:
    r = rig()
    await r.limiter.acquire(H, "m1")
    await r.limiter.acquire(H, "m2")
    await r.limiter.acquire("beta", "m1")
    r.spawn("a", model="m1")
    await settle()
    assert r.limiter.host_totals(H) == (2, 1)
    assert r.limiter.host_totals("beta") == (1, 0)
    assert r.limiter.host_totals("nobody") == (0, 0)
    assert r.limiter.queued("nobody", M) == 0


async def test_retry_after_grows_with_the_queue() -> None:
    r = rig(queue_max=50)
    assert r.limiter.retry_after(H, M) == 10  # no observation yet: 10 s x 1 / 1
    await r.limiter.acquire(H, M)
    seen = []
    for i in range(3):
        r.spawn(f"w{i}")
        await settle()
        seen.append(r.limiter.retry_after(H, M))
    assert seen == [20, 30, 40]
    for i in range(20):
        r.spawn(f"x{i}")
    await settle()
    assert r.limiter.retry_after(H, M) == 120


async def test_retry_after_learns_hold_times() -> None:
    r = rig(capacity=2)
    ticket = await r.limiter.acquire(H, M)
    r.clock.now += 4.0
    r.limiter.release(ticket)
    assert r.limiter.retry_after(H, M) == 2  # 4 s x 1 / 2
    ticket = await r.limiter.acquire(H, M)
    r.clock.now += 14.0
    r.limiter.release(ticket)
    assert r.limiter.retry_after(H, M) == 4  # EWMA 0.3 x 14 + 0.7 x 4 = 7 → 7 / 2 → 4
    ticket = await r.limiter.acquire(H, M)
    r.limiter.release(ticket)
    for _ in range(20):
        ticket = await r.limiter.acquire(H, M)
        r.limiter.release(ticket)
    assert r.limiter.retry_after(H, M) == 1  # near-zero holds still give at least 1 s


class Moved(Exception):
    pass


async def test_a_withdrawn_waiter_leaves_the_queue_with_the_given_reason() -> None:
    r = rig()
    holder = await r.limiter.acquire(H, M)
    mine = Ticket(H, M)
    waiting = asyncio.ensure_future(r.limiter.acquire(H, M, ticket=mine))
    r.spawn("behind")
    await settle()
    r.clock.now += 2.5
    assert r.limiter.withdraw(mine, Moved()) is True
    with pytest.raises(Moved):
        await waiting
    assert mine.queued_s == 2.5
    assert r.limiter.queued(H, M) == 1 and r.limiter.in_flight(H, M) == 1
    assert r.limiter.withdraw(mine, Moved()) is False  # no longer waiting
    r.limiter.release(holder)
    await settle()
    assert r.admitted == ["behind"]  # the one behind moved up; nothing was granted twice
    assert r.limiter.withdraw(r.tickets["behind"], Moved()) is False  # granted already


async def test_unless_gone_gives_the_work_or_cancels_it_when_the_client_leaves() -> None:
    gone = asyncio.Event()
    assert await unless_gone(asyncio.sleep(0, "done"), gone) == "done"
    assert await unless_gone(asyncio.sleep(0, "done"), None) == "done"
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.sleep(3600)

    work = asyncio.ensure_future(forever())
    waiting = asyncio.ensure_future(unless_gone(work, gone))
    await started.wait()
    gone.set()
    with pytest.raises(ClientGone):
        await waiting
    await asyncio.sleep(0)
    assert work.cancelled()
    with pytest.raises(ValueError, match="own error"):  # the work's own failure, as it is
        await unless_gone(_fails(), asyncio.Event())


async def _fails() -> None:
    raise ValueError("the work's own error")
