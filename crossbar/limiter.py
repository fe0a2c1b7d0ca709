"""Per-(host, model) concurrency limit with a bounded FIFO queue (asyncio).

Capacity is asked for at every admission, because it can change as slots are learned.
Waiters sit in a deque of futures rather than behind an asyncio.Semaphore so that a
capacity change takes effect at once and a waiter that gives up leaves the queue at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

DEFAULT_HOLD_S = 10.0  # hold-time estimate before any request has finished
EWMA_ALPHA = 0.3
RETRY_MIN_S = 1
RETRY_MAX_S = 120


class QueueFull(Exception):
    """The (host, model) queue is at its bound; retry after `retry_after` seconds (≥ 1)."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"queue full, retry after {retry_after}s")
        self.retry_after = retry_after


class ClientGone(Exception):
    """The client disconnected while its request was waiting for a slot."""


async def unless_gone[T](work: Awaitable[T], gone: asyncio.Event | None) -> T:
    """What `work` gives, or `ClientGone` (and `work` cancelled) when the client leaves first."""
    task = asyncio.ensure_future(work)
    left = asyncio.ensure_future(gone.wait()) if gone is not None else None
    try:
        await asyncio.wait([f for f in (task, left) if f is not None], return_when=asyncio.FIRST_COMPLETED)
    finally:
        if left is not None:
            left.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        raise ClientGone()
    return task.result()


class HostDown(Exception):
    """The host was marked down while the request waited for one of its slots: place it again."""

    def __init__(self, host: str = "") -> None:
        super().__init__(host)
        self.host = host  # the host that went down


@dataclass(eq=False, slots=True)
class Ticket:
    host: str
    model: str
    queued_s: float = 0.0
    held: bool = True  # False: counted in flight, never waited (routes with queue = false)
    granted_at: float = field(default=0.0, repr=False)
    released: bool = field(default=False, repr=False)


@dataclass(eq=False, slots=True)
class _Waiter:
    ticket: Ticket
    enqueued: float
    future: asyncio.Future[None]


@dataclass(eq=False, slots=True)
class _Slot:
    in_flight: int = 0
    waiters: deque[_Waiter] = field(default_factory=deque)
    hold_s: float = DEFAULT_HOLD_S
    observed: bool = False
    granted: int = 0  # slots ever granted (a poll uses it to see what ran while it looked)


class Limiter:
    def __init__(
        self,
        queue_max: int,
        capacity: Callable[[str, str], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._queue_max = queue_max
        self._capacity = capacity
        self._clock = clock
        self._slots: dict[tuple[str, str], _Slot] = {}

    async def acquire(
        self, host: str, model: str, gone: asyncio.Event | None = None, *, hold: bool = True,
        ticket: Ticket | None = None,
    ) -> Ticket:
        """A slot on (host, model): at once, after a FIFO wait, or QueueFull / ClientGone (or the
        exception `withdraw` gave). `ticket`: the caller's own for (host, model) and `hold`, to
        name the wait to `withdraw`."""
        if gone is not None and gone.is_set():
            raise ClientGone
        ticket = Ticket(host, model, held=hold) if ticket is None else ticket
        if self.take(ticket):
            return ticket
        slot = self._slot(host, model)
        if len(slot.waiters) >= self._queue_max:
            raise QueueFull(self.retry_after(host, model))
        waiter = _Waiter(ticket, self._clock(), asyncio.get_running_loop().create_future())
        slot.waiters.append(waiter)
        await self._wait(host, model, slot, waiter, gone)
        return ticket

    def take(self, ticket: Ticket) -> bool:
        """Grant the ticket its slot where that needs no wait: always to one that does not hold
        a place (`held` False), else when nobody is queued and a slot is free (queued requests are
        first given what a capacity increase freed). False: nothing granted; `acquire` queues it."""
        host, model = ticket.host, ticket.model
        slot = self._slot(host, model)
        if ticket.held:
            self._admit(host, model, slot)
            if slot.waiters or slot.in_flight >= self._cap(host, model):
                return False
        self._grant(slot, ticket, self._clock())
        return True

    def release(self, ticket: Ticket) -> None:
        """Free the ticket's slot and admit the next waiter(s); a second call does nothing."""
        if ticket.released:
            return
        ticket.released = True
        slot = self._slot(ticket.host, ticket.model)
        self._observe(slot, self._clock() - ticket.granted_at)
        self._free(ticket.host, ticket.model, slot)

    def withdraw(self, ticket: Ticket, reason: Exception) -> bool:
        """Take a waiting ticket out of its queue: its `acquire` raises `reason`. False when it is
        not waiting (granted already, or gone)."""
        slot = self._slots.get((ticket.host, ticket.model))
        waiter = next((w for w in slot.waiters if w.ticket is ticket), None) if slot else None
        if slot is None or waiter is None or waiter.future.done():
            return False
        slot.waiters.remove(waiter)
        ticket.queued_s = self._clock() - waiter.enqueued
        waiter.future.set_exception(reason)
        return True

    def refresh(self) -> None:
        """Admit waiters that a capacity increase (learned since the last admission) now allows."""
        for (host, model), slot in self._slots.items():
            self._admit(host, model, slot)

    def set_queue_max(self, queue_max: int) -> None:
        """A reloaded queue bound: it applies to the next arrival; nobody already queued leaves."""
        self._queue_max = queue_max

    def forget(self, host: str) -> None:
        """Drop what was learned about a host that left the configuration (its hold times).
        Only called once nothing of it runs or waits."""
        for key in [k for k in self._slots if k[0] == host]:
            del self._slots[key]

    def evict(self, host: str) -> int:
        """The host went down: every request queued for it leaves the queue at once with
        `HostDown`, to be placed elsewhere. Returns how many."""
        moved = 0
        for (h, _), slot in self._slots.items():
            if h != host:
                continue
            while slot.waiters:
                waiter = slot.waiters.popleft()
                if not waiter.future.done():
                    waiter.future.set_exception(HostDown(host))
                    moved += 1
        return moved

    def usage(self, host: str) -> dict[str, tuple[int, int]]:
        """Per model of `host`: (in flight now, slots granted so far)."""
        return {m: (slot.in_flight, slot.granted) for (h, m), slot in self._slots.items() if h == host}

    def in_flight(self, host: str, model: str) -> int:
        slot = self._slots.get((host, model))
        return slot.in_flight if slot else 0

    def queued(self, host: str, model: str) -> int:
        slot = self._slots.get((host, model))
        return len(slot.waiters) if slot else 0

    def host_totals(self, host: str) -> tuple[int, int]:
        """(in_flight, queued) summed over every model of `host`."""
        slots = [slot for (h, _), slot in self._slots.items() if h == host]
        return sum(s.in_flight for s in slots), sum(len(s.waiters) for s in slots)

    def retry_after(self, host: str, model: str) -> int:
        """Seconds until a place is likely: mean hold time x (queued + 1) / capacity, in [1, 120]."""
        slot = self._slots.get((host, model))
        hold_s = slot.hold_s if slot else DEFAULT_HOLD_S
        estimate = math.ceil(hold_s * (self.queued(host, model) + 1) / self._cap(host, model))
        return min(max(estimate, RETRY_MIN_S), RETRY_MAX_S)

    # ---- internals --------------------------------------------------------------------------

    def _slot(self, host: str, model: str) -> _Slot:
        try:  # not `setdefault`: it would build a _Slot at every call
            return self._slots[(host, model)]
        except KeyError:
            slot = self._slots[(host, model)] = _Slot()
            return slot

    def _cap(self, host: str, model: str) -> int:
        return max(1, self._capacity(host, model))

    def _grant(self, slot: _Slot, ticket: Ticket, now: float) -> None:
        slot.in_flight += 1
        slot.granted += 1
        ticket.granted_at = now

    def _admit(self, host: str, model: str, slot: _Slot) -> None:
        """Hand free slots to waiters in FIFO order."""
        while slot.waiters and slot.in_flight < self._cap(host, model):
            waiter = slot.waiters.popleft()
            if waiter.future.done():
                continue
            now = self._clock()
            self._grant(slot, waiter.ticket, now)
            waiter.ticket.queued_s = now - waiter.enqueued
            waiter.future.set_result(None)

    def _free(self, host: str, model: str, slot: _Slot) -> None:
        slot.in_flight -= 1
        self._admit(host, model, slot)

    async def _wait(
        self, host: str, model: str, slot: _Slot, waiter: _Waiter, gone: asyncio.Event | None
    ) -> None:
        gone_task = asyncio.ensure_future(gone.wait()) if gone is not None else None
        try:
            if gone_task is None:
                await waiter.future
                return
            await asyncio.wait({waiter.future, gone_task}, return_when=asyncio.FIRST_COMPLETED)
            if gone is not None and gone.is_set():
                self._abandon(host, model, slot, waiter)
                raise ClientGone
            waiter.future.result()  # HostDown when the host's queue was evicted
        except asyncio.CancelledError:
            self._abandon(host, model, slot, waiter)
            raise
        finally:
            if gone_task is not None:
                gone_task.cancel()

    def _abandon(self, host: str, model: str, slot: _Slot, waiter: _Waiter) -> None:
        """The waiter gives up: leave the queue, or give back a slot it was already granted."""
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            waiter.ticket.released = True
            self._free(host, model, slot)
            return
        future.cancel()
        if waiter in slot.waiters:
            slot.waiters.remove(waiter)

    def _observe(self, slot: _Slot, held_s: float) -> None:
        held_s = max(held_s, 0.0)
        slot.hold_s = held_s if not slot.observed else EWMA_ALPHA * held_s + (1 - EWMA_ALPHA) * slot.hold_s
        slot.observed = True
