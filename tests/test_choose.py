from __future__ import annotations

import pytest

from crossbar.choose import Candidate, Choice, choose


def cand(
    name: str,
    *,
    healthy: bool = True,
    draining: bool = False,
    loaded: bool = True,
    listed: bool = True,
    free: int = 1,
    weight: float = 1.0,
    queued: int = 0,
    order: int = 0,
) -> Candidate:
    return Candidate(name, healthy, draining, loaded, listed, free, weight, queued, order)


CASES: list[tuple[str, list[Candidate], Choice | None]] = [
    ("empty", [], None),
    ("single loaded host", [cand("a")], Choice("a", False)),
    ("most free slots", [cand("a", free=1, order=0), cand("b", free=3, order=1)], Choice("b", False)),
    (
        "weight beats slots",
        [cand("a", free=3, weight=1.0, order=0), cand("b", free=2, weight=2.0, order=1)],
        Choice("b", False),
    ),
    (
        "fractional weight loses",
        [cand("a", free=4, weight=0.5, order=0), cand("b", free=3, order=1)],
        Choice("b", False),
    ),
    (
        "tie broken by queue depth",
        [cand("a", free=2, queued=3, order=0), cand("b", free=2, queued=1, order=1)],
        Choice("b", False),
    ),
    (
        "tie on queue broken by config order",
        [cand("b", free=2, order=1), cand("a", free=2, order=0)],
        Choice("a", False),
    ),
    (
        "no free slots anywhere: shortest queue",
        [cand("a", free=0, queued=2, order=0), cand("b", free=0, queued=1, order=1)],
        Choice("b", False),
    ),
    (
        "negative free slots count as zero",
        [cand("a", free=-5, queued=0, order=0), cand("b", free=0, queued=0, order=1)],
        Choice("a", False),
    ),
    (
        "negative free slots never beat zero with weight",
        [cand("a", free=-1, weight=-1.0, order=1), cand("b", free=0, order=0)],
        Choice("b", False),
    ),
    ("unhealthy skipped", [cand("a", healthy=False, free=9), cand("b", order=1)], Choice("b", False)),
    ("draining skipped", [cand("a", draining=True, free=9), cand("b", order=1)], Choice("b", False)),
    (
        "loaded beats listed with more slots",
        [cand("a", loaded=False, free=9, order=0), cand("b", free=1, order=1)],
        Choice("b", False),
    ),
    (
        "listed fallback loads the model",
        [cand("a", loaded=False, free=1, order=0), cand("b", loaded=False, free=2, order=1)],
        Choice("b", True),
    ),
    (
        "listed fallback ties by queue then order",
        [
            cand("a", loaded=False, free=1, queued=1, order=0),
            cand("b", loaded=False, free=1, queued=0, order=2),
            cand("c", loaded=False, free=1, queued=0, order=1),
        ],
        Choice("c", True),
    ),
    (
        "loaded only on an unhealthy host: fall back to listed",
        [cand("a", healthy=False), cand("b", loaded=False, order=1)],
        Choice("b", True),
    ),
    (
        "neither loaded nor listed never chosen",
        [cand("a", loaded=False, listed=False, free=9)],
        None,
    ),
    (
        "nothing eligible",
        [cand("a", healthy=False), cand("b", draining=True, order=1)],
        None,
    ),
]


@pytest.mark.parametrize(("candidates", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_choose(candidates: list[Candidate], expected: Choice | None) -> None:
    assert choose(candidates) == expected


def test_order_of_input_does_not_matter() -> None:
    hosts = [cand("a", free=2, order=0), cand("b", free=2, order=1), cand("c", free=2, order=2)]
    assert choose(hosts) == choose(list(reversed(hosts))) == Choice("a", False)


def held(name: str, order: int, *, free: int = 0, slots: int = 1, in_flight: int = 0, queued: int = 0,
         leases: int = 0, busy: float = 0.0, weight: float = 1.0) -> Candidate:
    return Candidate(name, True, False, True, True, free, weight, queued, order, slots=slots,
                     in_flight=in_flight, active_leases=leases, recent_busy=busy)


HELD: list[tuple[str, list[Candidate], str]] = [
    ("all busy: fewer conversations held wins over config order",
     [held("a", 0, in_flight=1, leases=3), held("b", 1, in_flight=1, leases=1)], "b"),
    ("all busy: less recent busy time wins",
     [held("a", 0, in_flight=1, leases=1, busy=0.95), held("b", 1, in_flight=1, leases=1, busy=0.4)], "b"),
    ("a free slot wins over held work: the turn starts now",
     [held("a", 0, in_flight=1, leases=1), held("b", 1, free=1, leases=4, busy=0.9)], "b"),
    ("same free slots: the host holding less",
     [held("a", 0, free=1, leases=4, busy=0.9), held("b", 1, free=1, in_flight=1, leases=1)], "b"),
    ("held work is per slot: two slots hold twice as much",
     [held("a", 0, in_flight=1, leases=3), held("b", 1, slots=2, in_flight=2, leases=3)], "b"),
    ("held work is per weight",
     [held("a", 0, in_flight=1, leases=2), held("b", 1, in_flight=1, leases=3, weight=2.0)], "b"),
    ("queued requests count as held work",
     [held("a", 0, in_flight=1, queued=2, leases=1), held("b", 1, in_flight=1, leases=2)], "b"),
    ("zero weight ranks last", [held("a", 0, weight=0.0), held("b", 1, leases=5)], "b"),
    ("equal holdings: free slots, then config order",
     [held("a", 0, leases=1), held("b", 1, free=1, leases=1), held("c", 2, free=1, leases=1)], "b"),
]


@pytest.mark.parametrize(("candidates", "expected"), [h[1:] for h in HELD], ids=[h[0] for h in HELD])
def test_choose_by_held_work(candidates: list[Candidate], expected: str) -> None:
    assert choose(candidates) == Choice(expected, False)
    assert choose(list(reversed(candidates))) == Choice(expected, False)
