"""The router's shortcut for a turn that stays on its lease host gives the placement the full
placement would, whatever the fleet, the slots, the lease table and the learned estimates say."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from strategies_util import mostly

from crossbar.app import Router
from crossbar.config import parse_config
from crossbar.decisions import Decision, Reason, Rejection
from crossbar.exchange import Exchange
from crossbar.hosts import PollResult
from crossbar.lease import Key
from crossbar.placement import Change, LeaseChange, Placement
from crossbar.yieldpolicy import HostLoad, Rates, Running

HOSTS = ("alpha", "beta", "gamma")
CHAT = "/v1/chat/completions"
# learned rates under which a turn whose host runs a long reply would rather move
RATES = Rates(prefill_tps=20_000, gen_tps=1_000, reply_tokens=500, prefill_tokens=1_000)


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stay") / "crossbar.db"


@contextlib.contextmanager
def router(db: Path, yield_factor: float, idle: str) -> Iterator[Router]:
    r = Router(parse_config({
        "listen": "127.0.0.1:7777", "db": str(db), "lease_idle": idle, "yield_factor": yield_factor,
        "hosts": {"alpha": {"base_url": "http://127.0.0.1:18081", "models": {"m": {"parallel": 2}}},
                  "beta": {"base_url": "http://127.0.0.1:18082", "models": ["m"]},
                  "gamma": {"base_url": "http://127.0.0.1:18083", "models": ["other"]}},
        "routes": {"r": {"hosts": list(HOSTS), "default_model": "m"},
                   "s": {"hosts": ["beta", "gamma"], "default_model": "m"}},
    }))
    try:
        yield r
    finally:
        r.store.close()


async def occupy(r: Router, host: str, model: str, n: int) -> None:
    key = r.fleet.slot_key(host, model)
    for _ in range(n):
        await r.limiter.acquire(host, key, hold=False)


@st.composite
def worlds(draw: st.DrawFn) -> dict:
    """A router's state, drawn mostly as the usual turn's, so every way of leaving it is met often."""
    return {
        "yield_factor": draw(st.sampled_from((0.0, 2.0))),
        "idle": draw(st.sampled_from(("10m", "1s"))),
        "down": draw(mostly(frozenset(), *({h} for h in HOSTS))),
        "draining": draw(mostly(frozenset(), *({h} for h in HOSTS))),
        "polls": {h: draw(st.sampled_from((None, 0, 2000, 4096))) for h in HOSTS},
        "busy": {h: draw(st.sampled_from((0, 2))) for h in HOSTS},
        "lease": draw(mostly("beta", "", "alpha", "gamma")),  # alpha is not one of route s's hosts
        "used_ago": draw(mostly(0.0, 5.0)),
        "pin": draw(mostly("", "beta", "gamma")),
        "route": draw(st.sampled_from(("r", "s"))),
        "model": draw(mostly("m", "other", "unknown")),
        "prompt_bytes": draw(st.sampled_from((100, 4000, 40_000))),
        "learned": draw(st.booleans()),
        "excluded": draw(mostly(frozenset(), *({h} for h in HOSTS))),
        "long_reply_on": draw(st.sets(st.sampled_from(HOSTS))),
    }


def build(r: Router, w: dict) -> Exchange:
    for host in HOSTS:
        n_ctx = w["polls"][host]
        if n_ctx is not None:
            r.fleet.apply(host, PollResult(ok=True, n_ctx=n_ctx, slots=2))
        if host in w["down"]:
            r.fleet.mark_down(host, "test")
        r.fleet.state[host].draining = host in w["draining"]
        if w["busy"][host]:
            asyncio.run(occupy(r, host, w["model"], w["busy"][host]))
        if w["learned"]:
            for _ in range(5):
                r.estimator.learn(host, w["model"], CHAT, 40_000, 30_000)
    def host_load(host: str, model: str, conversation: Key, ahead: int | None = None) -> HostLoad:
        running = (Running(elapsed_s=0.0, reply_tokens=5_000),) if host in w["long_reply_on"] else ()
        return HostLoad(host, 1, RATES, running, cached_tokens=10_000 if host == w["lease"] else 0)

    r.host_load = host_load  # type: ignore[method-assign]  # what the learner would say
    route = r.cfg.routes[w["route"]]
    key = Key(route.name, "fp", w["model"])
    if w["lease"]:  # a lease on a host the route no longer lists too (a reload removed it there)
        r.leases.apply(key, LeaseChange(Change.CREATE, w["lease"]), 1.0)
        r.leases.apply(key, LeaseChange(Change.USE, w["lease"]), time.time() - w["used_ago"])
    if w["pin"] in route.hosts:
        r.leases.pin(route.name, w["pin"], route.hosts, 1.0)
    ex = Exchange(route=route, key=key, path=CHAT, completion=True, prompt_bytes=w["prompt_bytes"])
    ex.excluded.update(w["excluded"])
    r.admit(ex)  # as the request hook does: the turn holds its own conversation
    return ex


@settings(max_examples=600, deadline=None)
@given(worlds())
def test_the_shortcut_agrees_with_placement(db: Path, w: dict) -> None:
    with router(db, w["yield_factor"], w["idle"]) as r:
        ex = build(r, w)
        full = r._place_once(ex, Reason.UNHEALTHY)
        kept = r._stays(ex)
        event(f"placed: {full.decision if isinstance(full, Placement) else full.reason}; "
              f"shortcut answered: {kept is not None}")
        if kept is not None:
            assert kept == full


def test_the_usual_turn_takes_the_shortcut(db: Path) -> None:
    """A live lease on a healthy host with a free slot: the shortcut answers (else the property
    above would hold vacuously); the same turn on a host marked down is left to placement."""
    with router(db, 2.0, "10m") as r:
        ex = build(r, USUAL)
        assert r._stays(ex) == Placement("beta", Decision.REUSED, LeaseChange(Change.USE, "beta"))
        r.fleet.mark_down("beta", "test")
        assert r._stays(ex) is None


USUAL = {"yield_factor": 2.0, "idle": "10m", "down": set(), "draining": set(), "polls": dict.fromkeys(HOSTS),
         "busy": dict.fromkeys(HOSTS, 0), "lease": "beta", "used_ago": 0.0, "pin": "", "route": "r",
         "model": "m", "prompt_bytes": 4000, "learned": False, "excluded": set(), "long_reply_on": set()}


@pytest.mark.parametrize(("change", "decision"), [
    # no free slot on the lease host and a long reply running there: the turn yields
    ({"busy": {"alpha": 0, "beta": 1, "gamma": 0}, "long_reply_on": {"beta"}}, Decision.YIELD),
    # what the host's replies taught says the prompt no longer fits there (the byte estimate would)
    ({"learned": True, "polls": {"alpha": 4096, "beta": 2000, "gamma": None}}, Decision.CONTEXT),
    ({"down": {"beta"}}, Decision.MOVED),
    ({"used_ago": 5.0, "idle": "1s"}, Decision.IDLE),
    ({"pin": "alpha"}, Decision.PINNED),
    ({"route": "s", "lease": "alpha"}, Decision.MOVED),  # the route no longer lists the lease's host
    ({"model": "unknown"}, Rejection.UNKNOWN_MODEL),  # no host lists or reports it
])
def test_a_turn_placement_must_weigh_is_left_to_it(db: Path, change: dict,
                                                   decision: Decision | Rejection) -> None:
    w = USUAL | change
    with router(db, w["yield_factor"], w["idle"]) as r:
        ex = build(r, w)
        assert r._stays(ex) is None
        full = r._place_once(ex, Reason.UNHEALTHY)
        assert (full.decision if isinstance(full, Placement) else full.reason) == decision
