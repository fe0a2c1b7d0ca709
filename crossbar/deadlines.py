"""Many requests' deadlines on one event-loop timer.

Nearly every first-byte deadline is cancelled moments after it is armed, by the first byte. A loop
timer per request (`loop.call_later`) makes each request pay for a timer handle, a push onto the
loop's heap and a cancellation; so did a timer per bucket cancelled with the bucket's last
deadline, since a bucket usually empties before the next request arms. Here a deadline joins the
bucket of the `tick` in which it falls due, and one loop timer, set for the earliest bucket,
fires buckets at most `tick` late. Arming and cancelling are a dict insert and removal and a push
of the bucket's due onto a heap; the timer is moved only when a deadline falls due before it. A
bucket goes with its last deadline; its due is left on the heap, skipped when it comes up, and the
heap is rebuilt from the buckets when such dues outnumber them, so memory follows the deadlines
armed.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
from collections.abc import Callable, Hashable

log = logging.getLogger("crossbar")

TICK = 0.05  # seconds a deadline may fire late
SLACK = 64  # dues of gone buckets the heap may hold beyond twice the buckets before it is rebuilt


class Deadlines:
    """Deadlines on one event loop, each keyed by its owner (one deadline per owner and bucket)."""

    def __init__(self, tick: float = TICK) -> None:
        if not tick > 0:
            raise ValueError("tick must be positive")
        self.tick = tick
        self._buckets: dict[int, dict[Hashable, Callable[[], None]]] = {}
        self._dues: list[int] = []  # a heap: every bucket's due, and some of buckets gone
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = math.inf  # the bucket the timer is set for
        self._timer_loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        """Deadlines armed and not yet fired or cancelled."""
        return sum(map(len, self._buckets.values()))

    def arm(self, owner: Hashable, delay: float, call: Callable[[], None]) -> int:
        """Call `call()` once `delay` seconds have passed (up to `tick` later), unless `cancel`
        comes first; returns the bucket, which `cancel` takes."""
        loop = asyncio.get_running_loop()
        due = math.ceil((loop.time() + delay) / self.tick)
        bucket = self._buckets.get(due)
        if bucket is None:
            bucket = self._buckets[due] = {}
            heapq.heappush(self._dues, due)
        bucket[owner] = call
        if loop is not self._timer_loop:  # the first, or a loop that stopped with the timer on it
            self._set_timer(loop, self._dues[0])
        elif due < self._timer_due:
            self._set_timer(loop, due)
        return due

    def cancel(self, owner: Hashable, due: int) -> None:
        bucket = self._buckets.get(due)
        if bucket is None or bucket.pop(owner, None) is None or bucket:
            return
        del self._buckets[due]
        if len(self._dues) > 2 * len(self._buckets) + SLACK:
            self._dues = sorted(self._buckets)  # a sorted list is a heap

    def _set_timer(self, loop: asyncio.AbstractEventLoop, due: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(due * self.tick, self._fire, due)
        self._timer_due, self._timer_loop = due, loop

    def _fire(self, due: int) -> None:
        self._timer, self._timer_due = None, math.inf
        ready = []
        while self._dues and self._dues[0] <= due:
            bucket = self._buckets.pop(heapq.heappop(self._dues), None)
            if bucket:
                ready.append(bucket)
        self._set_next_timer()
        for bucket in ready:  # a handler may arm again: the timer is set for what waits already
            for call in bucket.values():
                try:
                    call()
                except Exception:  # one failing deadline must not keep the others from firing
                    log.exception("crossbar: a deadline's handler failed")

    def _set_next_timer(self) -> None:
        """Set the timer for the earliest bucket; the dues of buckets gone before it go."""
        dues = self._dues
        while dues and dues[0] not in self._buckets:
            heapq.heappop(dues)
        if dues:
            self._set_timer(asyncio.get_running_loop(), dues[0])
