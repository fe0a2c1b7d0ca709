"""Many requests' deadlines on one event-loop timer.

Nearly every first-byte deadline is cancelled moments after it is armed, by the first byte. A loop
timer per request (`loop.call_later`) makes each request pay for a timer handle, a push onto the
loop's heap and a cancellation; so did a timer per bucket cancelled with the bucket's last
deadline, since a bucket usually empties before the next request arms. Here a deadline joins the
bucket of the `tick` in which it falls due, and one loop timer, set for the earliest bucket that
holds a deadline, fires buckets at most `tick` late. Arming and cancelling are a dict insert and
removal: a bucket emptied by cancellations keeps its place until it falls due, so arming into it
again costs nothing, and the timer is moved only when a deadline falls due before it.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
from collections.abc import Callable, Hashable

log = logging.getLogger("crossbar")

TICK = 0.05  # seconds a deadline may fire late


class Deadlines:
    """Deadlines on one event loop, each keyed by its owner (one deadline per owner and bucket).

    Memory: one bucket per tick that had a deadline, until that tick passes (an emptied one is an
    empty dict), so at most the longest delay ÷ `tick` of them: 18,000 at the default
    `first_byte_timeout` of 900 s, about 2 MB."""

    def __init__(self, tick: float = TICK) -> None:
        if not tick > 0:
            raise ValueError("tick must be positive")
        self.tick = tick
        self._buckets: dict[int, dict[Hashable, Callable[[], None]]] = {}
        self._dues: list[int] = []  # a heap of the buckets' dues, each bucket's once
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = math.inf  # the bucket the timer is set for

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
        if due < self._timer_due:
            self._set_timer(loop, due)
        return due

    def cancel(self, owner: Hashable, due: int) -> None:
        bucket = self._buckets.get(due)
        if bucket is not None and bucket.pop(owner, None) is not None and not bucket:
            bucket.clear()  # an emptied dict keeps its table; a cleared one lets it go

    def _set_timer(self, loop: asyncio.AbstractEventLoop, due: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_due = loop.call_at(due * self.tick, self._fire, due), due

    def _fire(self, due: int) -> None:
        self._timer, self._timer_due = None, math.inf
        ready = []
        while self._dues and self._dues[0] <= due:
            bucket = self._buckets.pop(heapq.heappop(self._dues))
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
        """Set the timer for the earliest bucket that holds a deadline; emptied buckets before it
        go (arming into one again makes it anew)."""
        dues, buckets = self._dues, self._buckets
        while dues:
            if buckets[dues[0]]:
                self._set_timer(asyncio.get_running_loop(), dues[0])
                return
            del buckets[heapq.heappop(dues)]
