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
import ctypes
import ctypes.util
import gc
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def freeze_startup() -> None:
    """Collect once, then exempt every object alive now from later collections."""
    gc.collect()
    gc.freeze()


_pauses = 0  # collector_paused blocks running now
_resume = True  # whether the collector was on when the first of them began
_pauses_lock = threading.Lock()


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection while a worker builds and frees a large parsed body: its millions of
    containers are freed by their reference counts, and a full collection over them, run by
    whichever thread allocates, held the event loop 130 ms per 8 MiB. Nested and concurrent
    pauses count; the collector resumes when the last ends (if it was on when the first began)."""
    global _pauses, _resume
    with _pauses_lock:
        if _pauses == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pauses_lock:
            _pauses -= 1
            if _pauses == 0 and _resume:
                gc.enable()


def thaw() -> None:
    """Undo `freeze_startup` (on stop: an in-process restart must not keep the old objects)."""
    gc.unfreeze()


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None on a C library without it."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()


def collect_and_trim() -> None:
    """A full collection, then the freed heap handed back to the system (glibc keeps it)."""
    gc.collect()
    if _TRIM is not None:
        _TRIM(0)


class Reclaimer:
    def __init__(self, delay: float = 0.5, min_interval: float = 2.0,
                 collect: Callable[[], object] = collect_and_trim,
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
