from __future__ import annotations

import pytest

from crossbar.yieldpolicy import YIELD, HostLoad, Move, Rates, Running, Stay, decide, slot_wait_s

# 10k tok/s prefill, 100 tok/s generation, typical reply 100 tokens (1 s), typical prefill 1k (0.1 s)
RATES = Rates(prefill_tps=10_000.0, gen_tps=100.0, reply_tokens=100.0, prefill_tokens=1_000.0)
UNKNOWN = Rates(0.0, 0.0)


def host(name: str = "a", slots: int = 1, running: tuple[Running, ...] = (), queued: int = 0,
         cached: int = 0, rates: Rates = RATES) -> HostLoad:
    return HostLoad(name, slots, rates, running, queued, cached)


def job(elapsed: float, reply: float = 100.0, prefill: float = 0.0) -> Running:
    return Running(elapsed, reply, prefill)


WAITS: list[tuple[str, HostLoad, float]] = [
    ("idle host", host(), 0.0),
    ("free slot beside a running request", host(slots=2, running=(job(0.0),)), 0.0),
    ("running request: its remaining generation", host(running=(job(0.25),)), 0.75),
    ("prefill counts toward the remaining time", host(running=(job(0.0, prefill=5_000),)), 1.5),
    ("a request past its estimate counts as about to end", host(running=(job(9.0),)), 0.0),
    ("long reply expected for the conversation", host(running=(job(1.0, reply=500),)), 4.0),
    ("the earliest of two slots", host(slots=2, running=(job(0.0, reply=300), job(0.5))), 0.5),
    ("a queued request waits for the first slot", host(running=(job(0.5),), queued=1), 1.6),
    ("two queued on two slots", host(slots=2, running=(job(0.0), job(0.5)), queued=2), 1.6),
    ("requests past the slot count wait inside the server, oldest in the slot",
     host(running=(job(0.0, reply=200), job(0.5, reply=100)), queued=0), 2.5),
    ("negative queue counts as none", host(running=(job(0.5),), queued=-3), 0.5),
]


@pytest.mark.parametrize(("load", "expected"), [w[1:] for w in WAITS], ids=[w[0] for w in WAITS])
def test_slot_wait(load: HostLoad, expected: float) -> None:
    assert slot_wait_s(load) == pytest.approx(expected)


BUSY_HOME = host("home", running=(job(0.0, reply=1_000),), cached=40_000)  # 10 s of generation ahead

DECISIONS: list[tuple[str, int, HostLoad, list[HostLoad], float, Stay | Move]] = [
    ("free slot at home: stay", 40_000, host("home", cached=40_000), [host("b")], 2.0, Stay(0.0)),
    # re-prefill of 40k on b: 4 s, charged twice = 8 s; wait 10 s < 2 x 8 s
    ("wait below factor x twice the re-prefill: stay", 41_000, BUSY_HOME, [host("b")], 2.0, Stay(10.0)),
    # at factor 1 the same wait pays: 10 s > 8 s
    ("factor 1: the same wait moves", 41_000, BUSY_HOME, [host("b")], 1.0, Move("b", 10.0, 0.0, 4.0)),
    # charged once, 1.5 x 4 s = 6 s < 10 s would move; charged twice (12 s) it must not
    ("re-prefill counted twice, not once", 41_000, BUSY_HOME, [host("b")], 1.5, Stay(10.0)),
    ("small context: cheap to move", 2_000, host("home", running=(job(0.0, reply=1_000),), cached=1_900),
     [host("b")], 2.0, Move("b", 10.0, 0.0, 0.19)),
    ("the host caching the prompt is the cheaper target", 41_000, BUSY_HOME,
     [host("b"), host("c", cached=39_000)], 2.0, Move("c", 10.0, 0.0, 0.1)),
    ("a busy target's wait counts", 2_000, host("home", running=(job(0.0, reply=1_000),), cached=1_900),
     [host("b", running=(job(0.0, reply=900),)), host("c", running=(job(0.0, reply=200),))], 2.0,
     Move("c", 10.0, 2.0, 0.19)),
    ("target as busy as home: stay", 2_000, host("home", running=(job(0.0, reply=1_000),), cached=1_900),
     [host("b", running=(job(0.0, reply=600),))], 2.0, Stay(10.0)),
    ("a new conversation (nothing cached anywhere) moves for any gain", 30_000,
     host("home", running=(job(0.0, reply=1_000),)), [host("b", running=(job(0.0, reply=400),))], 2.0,
     Move("b", 10.0, 4.0, 0.0)),
    ("factor 0 turns yielding off", 2_000, BUSY_HOME, [host("b")], 0.0, Stay(0.0)),
    ("home rates not learned: stay", 2_000, host("home", running=(job(0.0),), rates=UNKNOWN), [host("b")],
     2.0, Stay(0.0)),
    ("target rates not learned: never a target", 2_000, BUSY_HOME, [host("b", rates=UNKNOWN)], 2.0,
     Stay(10.0)),
    ("no other host", 2_000, BUSY_HOME, [], 2.0, Stay(10.0)),
    ("home listed among the others is ignored", 2_000, BUSY_HOME, [BUSY_HOME], 2.0, Stay(10.0)),
]


@pytest.mark.parametrize(
    ("prompt", "home", "others", "factor", "expected"), [d[1:] for d in DECISIONS],
    ids=[d[0] for d in DECISIONS],
)
def test_decide(
    prompt: int, home: HostLoad, others: list[HostLoad], factor: float, expected: Stay | Move
) -> None:
    verdict = decide(prompt, home, others, factor)
    assert type(verdict) is type(expected)
    if isinstance(expected, Move):
        assert isinstance(verdict, Move)
        assert verdict.host == expected.host
        assert (verdict.wait_s, verdict.target_wait_s, verdict.reprefill_s) == pytest.approx(
            (expected.wait_s, expected.target_wait_s, expected.reprefill_s)
        )
    else:
        assert verdict.wait_s == pytest.approx(expected.wait_s)


def test_pinned_route_never_yields() -> None:
    assert decide(2_000, BUSY_HOME, [host("b")], 2.0, pinned=True) == Stay(0.0)
    assert isinstance(decide(2_000, BUSY_HOME, [host("b")], 2.0), Move)


def test_move_cost_charges_the_reprefill_twice() -> None:
    assert Move("b", 10.0, 1.5, 2.0).cost_s == pytest.approx(5.5)


def test_reason_name() -> None:
    assert YIELD == "yield"
