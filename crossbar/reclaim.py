"""Memory held by large or abandoned bodies goes back soon, without a long collector pause.

A body (a request the client gave up on half-way, or a large request or answer that is done) is
referenced from mitmproxy's flow and connection objects, which form reference cycles: it stays in
memory until the cyclic garbage collector examines its oldest generation, which may not happen
for a long time. So such a body schedules one full collection shortly after (at most one per
`min_interval`). To keep that collection short,
everything alive once crossbar has started (modules, configuration, mitmproxy's addons) is moved
out of the collector's view with `gc.freeze()`: a full collection then walks only what was
created since.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable


def freeze_startup() -> None:
    """Collect once, then exempt every object alive now from later collections."""
    gc.collect()
    gc.freeze()


def thaw() -> None:
    """Undo `freeze_startup` (on stop: an in-process restart must not keep the old objects)."""
    gc.unfreeze()


class Reclaimer:
    def __init__(self, delay: float = 0.5, min_interval: float = 2.0,
                 collect: Callable[[], object] = gc.collect,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.delay = delay
        self.min_interval = min_interval
        self._collect = collect
        self._clock = clock
        self._pending: asyncio.TimerHandle | None = None
        self._last = -min_interval
        self.collections = 0

    def soon(self) -> None:
        """A large or unfinished body was let go: collect `delay` seconds from now (or, right
        after a collection, once `min_interval` has passed). Calls while one is pending are
        folded in."""
        if self._pending is not None:
            return
        wait = max(self.delay, self._last + self.min_interval - self._clock())
        self._pending = asyncio.get_running_loop().call_later(wait, self._run)

    def _run(self) -> None:
        self._pending = None
        self._last = self._clock()
        self.collections += 1
        self._collect()

    def cancel(self) -> None:
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
