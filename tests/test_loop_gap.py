"""The loop-pause check every test of long work off the event loop relies on (`within_loop_gap`):
a C call that holds the interpreter fails it on a quiet machine and on a busy one, and a machine
busy elsewhere is measured, so that work which only waits its turn for a CPU passes there too."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from harness import QUIET_PROBE_GAP_S, machine_state, within_loop_gap

# spins until a minute has passed or the test process that started it is gone
_SPIN = ("import os, time\n"
         "parent, end = os.getppid(), time.monotonic() + 60\n"
         "while time.monotonic() < end and os.getppid() == parent:\n"
         "    pass\n")


def _hold_the_interpreter(seconds: float) -> int:
    """`sum` over a range is one C call that never lets go of the interpreter: long enough for
    `seconds` on this machine (measured on a short one first)."""
    started = time.perf_counter()
    sum(range(1_000_000))
    per_item = (time.perf_counter() - started) / 1_000_000
    return sum(range(int(seconds / per_item)))


def _python_for(seconds: float) -> None:
    """Python work, which lets go of the interpreter at every switch interval."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@contextmanager
def _every_cpu_busy_elsewhere() -> Iterator[None]:
    """Three busy processes a CPU this process may use: the event loop waits for a CPU after every
    sleep. (Entered from a test's coroutine: its short sleep holds nothing else up.)"""
    busy: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(3 * len(os.sched_getaffinity(0))):
            busy.append(subprocess.Popen([sys.executable, "-c", _SPIN]))
        time.sleep(0.2)
        yield
    finally:
        for process in busy:
            process.kill()
            process.wait()


async def test_one_c_call_longer_than_the_bound_fails_every_try() -> None:
    with pytest.raises(AssertionError, match=r"stalled .* in 3 runs \(bound 10 ms on a quiet machine\)"):
        await within_loop_gap(lambda: asyncio.to_thread(_hold_the_interpreter, 0.15), 0.01, tries=3)


async def test_work_that_waits_its_turn_passes_on_a_busy_machine_and_a_long_c_call_does_not() -> None:
    """A CI run failed two tests at 12-16 and 23-51 ms against 12 and 15 ms in five tries running;
    with four busy processes beside it here, one of them failed alike (16-36 ms). With six, the
    loop's pauses beside Python work were 9-20 ms (2.5-4 ms on the quiet machine): every try failed
    an 8 ms bound before the machine was measured."""
    quiet = await machine_state()
    with _every_cpu_busy_elsewhere():
        busy = await machine_state()
        assert busy.gap > QUIET_PROBE_GAP_S + 0.002, (str(quiet), str(busy))
        await within_loop_gap(lambda: asyncio.to_thread(_python_for, 0.3), 0.008)
        with pytest.raises(AssertionError, match=r"stalled .* in 3 runs"):
            await within_loop_gap(lambda: asyncio.to_thread(_hold_the_interpreter, 0.03), 0.01, tries=3)
