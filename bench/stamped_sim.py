"""`python bench/stamped_sim.py [llamasim options]`: the simulated llama-server of
`llamasim`, unchanged except that every JSON SSE event carries one extra field,
`"bench_ns"`: `time.monotonic_ns()` taken just before the event is written to the socket.

CLOCK_MONOTONIC is shared by all processes on a Linux machine, so the load generator can
subtract the stamp from an event's arrival time and get the delay each path added to that
event (the method of ../shared/docs/mitmproxy-notes.md §4). Every target in a run gets the
same stamped events, so the extra ~20 bytes per event cost all of them alike.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llamasim import server as sim

_plain_send = sim.StreamSink.send


async def _stamped_send(self: sim.StreamSink, obj: Any) -> None:
    if isinstance(obj, dict):
        obj = {**obj, "bench_ns": time.monotonic_ns()}
    await _plain_send(self, obj)


def main() -> None:
    sim.StreamSink.send = _stamped_send  # type: ignore[method-assign]
    sim.main(sys.argv[1:])


if __name__ == "__main__":
    main()
