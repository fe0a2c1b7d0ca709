"""Placement as a table: request facts + fleet snapshot + lease view → placement or refusal.

Each row is one situation, including the combined faults the request path meets: a host down while
the request queued for it, a retry with nowhere to go, a pinned host down, a draining host, a prompt
that outgrew its host, a lease idle by the clock but with a request in flight, excluded hosts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from strategies_util import mostly

from crossbar.choose import Candidate
from crossbar.decisions import Decision, Reason, Rejection
from crossbar.guard import fits
from crossbar.placement import (
    Ask,
    Change,
    Home,
    LeaseChange,
    LeaseView,
    Placement,
    Refusal,
    Snapshot,
    place,
    stay,
)
from crossbar.yieldpolicy import YIELD, HostLoad, Rates, Running

HOSTS = ("a", "b", "c")
NOW = 10_000.0
IDLE = 600.0


@dataclass(frozen=True)
class H:
    """A host's state for the model; defaults: healthy, open, loaded, one free slot."""

    healthy: bool = True
    draining: bool = False
    loaded: bool = True
    listed: bool = True
    free: int = 1
    ctx: int = 0


@dataclass(frozen=True)
class Case:
    hosts: dict[str, H] = field(default_factory=lambda: {h: H() for h in HOSTS})
    lease: LeaseView = field(default_factory=LeaseView)
    model: str = "m"
    fp: str = "fp"
    read: bool = False
    tokens: int = 0
    excluded: frozenset[str] = frozenset()
    why: Reason = Reason.UNHEALTHY
    known: bool = True
    yield_factor: float = 0.0
    loads: dict[str, HostLoad] | None = None


def run(case: Case) -> Placement | Refusal:
    snap = Snapshot(
        {n: Candidate(n, h.healthy, h.draining, h.loaded, h.listed, h.free, 1.0, 0, i)
         for i, (n, h) in enumerate(case.hosts.items())},
        {n: h.ctx for n, h in case.hosts.items()}, case.known, loads=case.loads)
    ask = Ask("r", case.model, tuple(case.hosts), fp=case.fp, read=case.read, tokens=case.tokens,
              excluded=case.excluded, why=case.why, yield_factor=case.yield_factor)
    return place(ask, snap, case.lease, NOW, IDLE)


def fleet(**changes: H) -> dict[str, H]:
    return {h: changes.get(h, H()) for h in HOSTS}


LIVE = LeaseView(host="a", last_used=NOW - 1)

# Lease yield: 20k tok/s prefill, 1k tok/s generation. Host a runs a 5,000-token reply that just
# started (5 s left); the turn's 10,000-token prompt is cached on a, so moving costs 0.5 s of
# prefill (charged twice) on an idle host: the wait far exceeds 2 x 1 s.
RATES = Rates(prefill_tps=20_000, gen_tps=1_000, reply_tokens=500, prefill_tokens=1_000)
LONG_REPLY = (Running(elapsed_s=0.0, reply_tokens=5_000),)


def loads(rates: Rates = RATES, a_running: tuple[Running, ...] = LONG_REPLY) -> dict[str, HostLoad]:
    return {"a": HostLoad("a", 1, rates, a_running, cached_tokens=10_000),
            "b": HostLoad("b", 1, rates), "c": HostLoad("c", 1, rates, LONG_REPLY)}


BUSY_A = fleet(a=H(free=0), c=H(free=0))
YIELDING = Case(hosts=BUSY_A, lease=LIVE, tokens=10_000, yield_factor=2.0, loads=loads())
STAY_A = Placement("a", Decision.REUSED, LeaseChange(Change.USE, "a"))

P = Placement
CREATE_B = LeaseChange(Change.CREATE, "b")

CASES: dict[str, tuple[Case, Placement | Refusal]] = {
    "new conversation → most free slots": (
        Case(hosts=fleet(b=H(free=3))), P("b", Decision.NEW, CREATE_B)),
    "lease reused": (Case(lease=LIVE), P("a", Decision.REUSED, LeaseChange(Change.USE, "a"))),
    "lease reused though another host is freer": (
        Case(hosts=fleet(b=H(free=9)), lease=LIVE), P("a", Decision.REUSED, LeaseChange(Change.USE, "a"))),
    "lease host down → moves": (
        Case(hosts=fleet(a=H(healthy=False), b=H(free=2)), lease=LIVE),
        P("b", Decision.MOVED, LeaseChange(Change.MOVE, "b", "a", Reason.UNHEALTHY))),
    "host marked down while the request queued for it → moves": (
        Case(hosts=fleet(a=H(healthy=False, free=0), c=H(free=2)), lease=LIVE),
        P("c", Decision.MOVED, LeaseChange(Change.MOVE, "c", "a", Reason.UNHEALTHY))),
    "refused connect → retried elsewhere, reason unhealthy": (
        Case(lease=LIVE, excluded=frozenset({"a"})),
        P("b", Decision.RETRIED, LeaseChange(Change.MOVE, "b", "a", Reason.UNHEALTHY))),
    "500 → retried elsewhere, reason retried": (
        Case(lease=LIVE, excluded=frozenset({"a"}), why=Reason.RETRIED),
        P("b", Decision.RETRIED, LeaseChange(Change.MOVE, "b", "a", Reason.RETRIED))),
    "retry with every other host excluded or down → no host": (
        Case(hosts=fleet(c=H(healthy=False)), lease=LIVE, excluded=frozenset({"a", "b"})),
        Refusal(Rejection.NO_HOST, "route 'r': no usable host for model 'm'", wake=("c",))),
    "busy lease host, wait >> re-prefill → yields to the idle host": (
        YIELDING, P("b", Decision.YIELD, LeaseChange(Change.MOVE, "b", "a", Reason.YIELD))),
    "busy lease host, rates not learned → stays": (replace(YIELDING, loads=loads(Rates(0, 0))), STAY_A),
    "busy lease host, short wait → stays": (
        replace(YIELDING, loads=loads(a_running=(Running(elapsed_s=0.0, reply_tokens=1_500),))), STAY_A),
    "lease host has a free slot → never yields": (replace(YIELDING, hosts=fleet(c=H(free=0))), STAY_A),
    "yield factor 0 (off, or the route opts out) → stays": (replace(YIELDING, yield_factor=0.0), STAY_A),
    "a larger factor than the gain → stays": (replace(YIELDING, yield_factor=6.0), STAY_A),
    "pinned route never yields": (
        replace(YIELDING, lease=LIVE._replace(pin="a")),
        P("a", Decision.PINNED, LeaseChange(Change.USE, "a"))),
    "no yield to a draining or unloaded host": (
        replace(YIELDING, hosts=fleet(a=H(free=0), b=H(draining=True), c=H(loaded=False))), STAY_A),
    "no yield for a request re-placed after a failure": (
        replace(YIELDING, excluded=frozenset({"c"})), STAY_A),
    "draining host keeps its lease": (
        Case(hosts=fleet(a=H(draining=True)), lease=LIVE),
        P("a", Decision.REUSED, LeaseChange(Change.USE, "a"))),
    "draining host takes no new conversation": (
        Case(hosts=fleet(a=H(draining=True, free=5))), P("b", Decision.NEW, CREATE_B)),
    "draining host's lease fails → moves to an open host": (
        Case(hosts=fleet(a=H(draining=True), b=H(draining=True)), lease=LIVE, excluded=frozenset({"a"})),
        P("c", Decision.RETRIED, LeaseChange(Change.MOVE, "c", "a", Reason.UNHEALTHY))),
    "pinned": (Case(lease=LeaseView(pin="b")), P("b", Decision.PINNED, CREATE_B)),
    "pinned, lease elsewhere → moves to the pin": (
        Case(lease=LIVE._replace(pin="b")),
        P("b", Decision.PINNED, LeaseChange(Change.MOVE, "b", "a", Reason.PIN))),
    "pinned host down → refused, wake it, nothing moves": (
        Case(hosts=fleet(b=H(healthy=False)), lease=LIVE._replace(pin="b")),
        Refusal(Rejection.PINNED_DOWN, "route 'r' is pinned to 'b', which is not healthy", wake=("b",))),
    "pinned host failed this request → refused, not moved": (
        Case(lease=LeaseView(pin="b", host="b", last_used=NOW), excluded=frozenset({"b"})),
        Refusal(Rejection.PINNED_DOWN, "route 'r' is pinned to 'b', which is not healthy", wake=("b",))),
    "prompt outgrew its host → moves where it fits": (
        Case(hosts=fleet(a=H(ctx=4096), b=H(ctx=2048), c=H(ctx=32768)), lease=LIVE, tokens=5000),
        P("c", Decision.CONTEXT, LeaseChange(Change.MOVE, "c", "a", Reason.CONTEXT))),
    "prompt fits nowhere → refused with the largest context of the route": (
        Case(hosts=fleet(a=H(ctx=4096), b=H(ctx=8192), c=H(ctx=2048)), lease=LIVE, tokens=9000),
        Refusal(Rejection.CONTEXT, "prompt too large: request (~9000 tokens) exceeds the available context "
                "size (8192 tokens) of every host that serves this model", n_ctx=8192)),
    "unknown context never refuses": (Case(lease=LIVE, tokens=10**6),
                                      P("a", Decision.REUSED, LeaseChange(Change.USE, "a"))),
    "idle by the clock, but a request in flight → reused": (
        Case(lease=LeaseView(host="a", last_used=NOW - 10 * IDLE, busy=True)),
        P("a", Decision.REUSED, LeaseChange(Change.USE, "a"))),
    "idle → placed anew": (
        Case(hosts=fleet(b=H(free=4)), lease=LeaseView(host="a", last_used=NOW - IDLE - 1)),
        P("b", Decision.IDLE, LeaseChange(Change.RENEW, "b", "a", Reason.IDLE))),
    "its lease was swept for idleness → placed anew, recorded as idle": (
        Case(lease=LeaseView(idled="a"), hosts=fleet(b=H(free=3))),
        P("b", Decision.IDLE, LeaseChange(Change.CREATE, "b"))),
    "new fingerprint inherits the route lease": (
        Case(hosts=fleet(b=H(free=4)), lease=LeaseView(parent="c")),
        P("c", Decision.INHERITED, LeaseChange(Change.CREATE, "c"))),
    "no inheritance onto a full host: placed by load": (
        Case(hosts=fleet(b=H(free=2), c=H(free=0)), lease=LeaseView(parent="c")),
        P("b", Decision.NEW, CREATE_B)),
    "no inheritance from a draining host": (
        Case(hosts=fleet(c=H(draining=True)), lease=LeaseView(parent="c")),
        P("a", Decision.NEW, LeaseChange(Change.CREATE, "a"))),
    "nobody has the model loaded → a host that lists it will load it": (
        Case(hosts=fleet(a=H(loaded=False), b=H(loaded=False), c=H(loaded=False, listed=False))),
        P("a", Decision.NEW, LeaseChange(Change.CREATE, "a"), loads_model=True)),
    "every host down → refused, the sleeping ones named for waking": (
        Case(hosts={h: H(healthy=False) for h in HOSTS}),
        Refusal(Rejection.NO_HOST, "route 'r': no usable host for model 'm'", wake=HOSTS)),
    "missing model": (
        Case(model=""), Refusal(Rejection.MISSING_MODEL, "model name is missing from the request")),
    "unknown model": (
        Case(model="fake1", known=False), Refusal(Rejection.UNKNOWN_MODEL, "model 'fake1' not found")),
    "read follows the route's lease": (
        Case(read=True, lease=LeaseView(route_hosts=("c", "a"))), P("c", Decision.REUSED)),
    "read skips a lease host that is down": (
        Case(read=True, hosts=fleet(c=H(healthy=False)), lease=LeaseView(route_hosts=("c", "b"))),
        P("b", Decision.REUSED)),
    "read without a model goes to the first usable host": (
        Case(read=True, model="", hosts=fleet(a=H(healthy=False))), P("b", Decision.NEW)),
    "read on a pinned route → the pin, no lease change": (
        Case(read=True, lease=LeaseView(pin="c")), P("c", Decision.PINNED)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_placement(name: str) -> None:
    case, expected = CASES[name]
    assert run(case) == expected


def test_no_change_on_a_refusal_or_a_read() -> None:
    """Refusals carry no lease change at all, and reads never create one."""
    for case, expected in CASES.values():
        if case.read and isinstance(expected, Placement):
            assert expected.change.kind == Change.NONE


def test_the_yield_reason_is_the_policys_word() -> None:
    assert str(Reason.YIELD) == YIELD and str(Decision.YIELD) == f"moved:{YIELD}"


# ------------------------------------------------------------------ the usual turn, decided alone

@st.composite
def situations(draw: st.DrawFn) -> tuple[Ask, Snapshot, LeaseView, Home]:
    """A request, the route's fleet as the router builds it, the conversation's lease and its
    host's facts as the router reads them for `stay`. Drawn mostly as the usual turn (a live lease
    on a healthy route host with room), so that every way of leaving it is met often."""
    hosts = tuple(draw(st.permutations(HOSTS))[:draw(st.integers(1, 3))])
    cands, ctx, tokens = {}, {}, {}
    for i, name in enumerate(hosts):
        cands[name] = Candidate(name, draw(mostly(True, False)), draw(mostly(False, True)),
                                draw(mostly(True, False)), draw(mostly(True, False)),
                                draw(st.sampled_from((1, 2, 0, -1))), 1.0, draw(st.integers(0, 2)), i)
        ctx[name] = draw(st.sampled_from((0, 100, 1000)))
        tokens[name] = draw(st.sampled_from((50, 100, 500, 2000)))
    learned = draw(st.booleans())
    snap = Snapshot(cands, ctx, any(c.loaded or c.listed for c in cands.values()),
                    tokens if learned else None, loads() if draw(st.booleans()) else None)
    ask = Ask("r", draw(mostly("m", "")), hosts, fp=draw(mostly("fp", "")), read=draw(mostly(False, True)),
              tokens=draw(st.sampled_from((0, 100, 500))),
              excluded=frozenset(draw(mostly((), ("a",), ("b",), ("a", "c")))),
              why=draw(st.sampled_from((Reason.UNHEALTHY, Reason.RETRIED))),
              yield_factor=draw(st.sampled_from((0.0, 2.0))))
    # the lease host: one of the route's mostly, else none, or a host the route no longer lists
    others = ("", "c", "gone")
    host = draw(st.sampled_from(hosts)) if draw(st.integers(0, 7)) else draw(st.sampled_from(others))
    lease = LeaseView(pin=draw(mostly("", "a", "b")), host=host,
                      last_used=NOW - draw(mostly(1.0, IDLE, IDLE + 1)), busy=draw(st.booleans()),
                      parent=draw(st.sampled_from(("", "b"))))
    if host in cands:
        c = cands[host]
        host_tokens = ask.tokens if snap.tokens is None else snap.tokens.get(host, ask.tokens)
        home = Home(known=c.loaded or c.listed, healthy=c.healthy, fits=fits(host_tokens, ctx[host]),
                    free=c.free_slots > 0)
    else:  # the router reads such a host's own state, which may well look fine
        home = Home(*(draw(mostly(True, False)) for _ in range(4)))
    return ask, snap, lease, home


@settings(max_examples=1500, deadline=None)
@given(situations())
def test_a_turn_that_stays_is_placed_as_place_would(situation: tuple[Ask, Snapshot, LeaseView, Home]) -> None:
    ask, snap, lease, home = situation
    full = place(ask, snap, lease, NOW, IDLE)
    kept = stay(ask, lease, home, NOW, IDLE)
    outcome = full.decision if isinstance(full, Placement) else full.reason
    event(f"place: {outcome}; stay answered: {kept is not None}")
    if kept is not None:
        assert kept == full


def test_the_usual_turn_stays_without_the_fleet() -> None:
    """`stay` answers the common case (else the property above would hold vacuously), and hands
    each thing it cannot weigh to `place`."""
    ask = Ask("r", "m", HOSTS, fp="fp", yield_factor=2.0)
    home = Home(known=True, healthy=True, fits=True, free=True)
    assert stay(ask, LIVE, home, NOW, IDLE) == P("a", Decision.REUSED, LeaseChange(Change.USE, "a"))
    assert stay(ask._replace(yield_factor=0.0), LIVE, home._replace(free=False), NOW, IDLE) is not None
    assert stay(ask, LIVE._replace(last_used=NOW - IDLE - 1, busy=True), home, NOW, IDLE) is not None
    for ask_, lease, home_ in [
        (ask, LIVE, home._replace(free=False)),  # yield is weighed by place
        (ask, LIVE, home._replace(healthy=False)),
        (ask, LIVE, home._replace(fits=False)),
        (ask, LIVE, home._replace(known=False)),
        (ask, LIVE._replace(last_used=NOW - IDLE - 1), home),  # idle
        (ask, LIVE._replace(pin="b"), home),
        (ask, LeaseView(), home),
        (ask._replace(excluded=frozenset({"c"})), LIVE, home),
        (ask._replace(read=True), LIVE, home),
        (ask._replace(model=""), LIVE, home),
        (ask._replace(hosts=("b", "c")), LIVE, home),
    ]:
        assert stay(ask_, lease, home_, NOW, IDLE) is None, (ask_, lease, home_)
