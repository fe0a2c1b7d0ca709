"""Many requests' deadlines on a few event-loop timers.

Nearly every first-byte deadline is cancelled moments after it is armed, by the first byte. A loop
timer per request (`loop.call_later`) makes each request pay for a timer handle, a push onto the
loop's heap and a cancellation. Here a deadline joins the bucket of the `tick` in which it falls
due, and one loop timer per bucket fires the bucket's deadlines, at most `tick` late. Arming and
cancelling are a dict insert and removal; the bucket's timer is made by its first deadline and
cancelled with its last, so memory holds only deadlines still armed.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Hashable

log = logging.getLogger("crossbar")

TICK = 0.05  # seconds a deadline may fire late


class Deadlines:
    """Deadlines on one event loop, each keyed by its owner (one deadline per owner and bucket)."""

    def __init__(self, tick: float = TICK) -> None:
        if not tick > 0:
            raise ValueError("tick must be positive")
        self.tick = tick
        self._buckets: dict[int, dict[Hashable, Callable[[], None]]] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}

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
            self._timers[due] = loop.call_at(due * self.tick, self._fire, due)
        bucket[owner] = call
        return due

    def cancel(self, owner: Hashable, due: int) -> None:
        bucket = self._buckets.get(due)
        if bucket is None or bucket.pop(owner, None) is None or bucket:
            return
        del self._buckets[due]
        self._timers.pop(due).cancel()

    def _fire(self, due: int) -> None:
        self._timers.pop(due, None)
        for call in self._buckets.pop(due, {}).values():
            try:
                call()
            except Exception:  # one failing deadline must not keep the others from firing
                log.exception("crossbar: a deadline's handler failed")
