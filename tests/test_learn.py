from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies_util import mostly

from crossbar import learn, tap
from crossbar.learn import MIN_GEN_SAMPLE, MIN_PREFILL_SAMPLE, BusyMeter, RateLearner
from crossbar.tap import Usage
from crossbar.yieldpolicy import Rates, Running
from llamasim.server import timings_json


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def timings(prompt_n: int = 2_000, prompt_tps: float = 20_000.0, predicted_n: int = 500,
            gen_tps: float = 1_000.0, cache_n: int = 0) -> dict[str, Any]:
    """A `timings` object as llama-server (and llamasim) writes it for these rates."""
    return timings_json(cache_n, prompt_n, prompt_n / prompt_tps * 1e3, predicted_n,
                        (predicted_n - 1) / gen_tps * 1e3)


def test_learns_rates_and_lengths_from_timings() -> None:
    learner = RateLearner(Clock())
    learner.observe("a", "m", timings())
    assert learner.rates("a", "m") == Rates(pytest.approx(20_000.0), pytest.approx(1_000.0), 500.0, 2_000.0)


def test_moving_average() -> None:
    learner = RateLearner(Clock(), alpha=0.5)
    learner.observe("a", "m", timings(predicted_n=100))
    learner.observe("a", "m", timings(predicted_n=300))
    assert learner.rates("a", "m").reply_tokens == pytest.approx(200.0)


def test_unknown_pair_is_not_known() -> None:
    assert not RateLearner(Clock()).rates("a", "m").known


BAD: list[tuple[str, dict[str, Any]]] = [
    ("string", {"prompt_per_second": "fast"}),
    ("boolean", {"prompt_per_second": True}),
    ("negative", {"prompt_per_second": -5.0}),
    ("infinite", {"prompt_per_second": math.inf}),
    ("not a number", {"prompt_per_second": math.nan}),
    ("absurd", {"prompt_per_second": 1e12}),
    ("zero rate", {"prompt_per_second": 0.0}),
    ("short prefill measures overhead", {"prompt_n": 10}),
]


@pytest.mark.parametrize("override", [b[1] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_prefill_figures_are_not_learned(override: dict[str, Any]) -> None:
    learner = RateLearner(Clock())
    learner.observe("a", "m", {**timings(), **override})
    assert learner.rates("a", "m").prefill_tps == 0.0
    assert learner.rates("a", "m").gen_tps == pytest.approx(1_000.0)  # the rest of the reply still counts


def test_short_reply_teaches_length_not_rate() -> None:
    learner = RateLearner(Clock())
    learner.observe("a", "m", timings(predicted_n=3))
    rates = learner.rates("a", "m")
    assert (rates.gen_tps, rates.reply_tokens) == (0.0, 3.0)


def test_missing_figures_are_ignored() -> None:
    learner = RateLearner(Clock())
    learner.observe("a", "m", {})
    assert learner.rates("a", "m") == Rates(0.0, 0.0)


def test_fresh_host_borrows_the_fleet_mean_for_the_model() -> None:
    learner = RateLearner(Clock())
    learner.observe("a", "m", timings(prompt_tps=10_000.0, predicted_n=100))
    learner.observe("b", "m", timings(prompt_tps=30_000.0, predicted_n=300))
    learner.observe("c", "other", timings(prompt_tps=90_000.0))
    fresh = learner.rates("d", "m")
    assert (fresh.prefill_tps, fresh.reply_tokens) == (pytest.approx(20_000.0, rel=1e-4), 200.0)
    assert learner.rates("a", "m").prefill_tps == pytest.approx(10_000.0, rel=1e-4)  # its own, once learned


def test_conversation_reply_length_then_host_typical() -> None:
    clock = Clock()
    learner = RateLearner(clock, conversation_ttl=60.0)
    learner.observe("a", "m", timings(predicted_n=100))
    learner.observe("a", "m", timings(predicted_n=5_000), conversation="long")
    assert learner.reply_tokens("a", "m", "long") == 5_000
    assert learner.reply_tokens("a", "m", "other") == learner.rates("a", "m").reply_tokens
    clock.now += 61
    assert learner.reply_tokens("a", "m", "long") == learner.rates("a", "m").reply_tokens


def test_tables_are_bounded() -> None:
    learner = RateLearner(Clock(), max_pairs=2, max_conversations=2)
    for i in range(5):
        learner.observe(f"h{i}", "m", timings(predicted_n=100 + i), conversation=f"c{i}")
    assert learner.rates("h0", "m").reply_tokens != 100  # evicted: the mean of the hosts kept
    assert learner.rates("h4", "m").reply_tokens == 104
    assert learner.reply_tokens("h4", "m", "c0") == 104  # c0 forgotten: host typical
    assert learner.reply_tokens("h0", "m", "c4") == 104


def test_busy_meter_averages_running_requests() -> None:
    clock = Clock()
    meter = BusyMeter(clock, tau=10.0)
    assert meter.busy("a") == 0.0
    meter.start("a")
    clock.now += 10.0
    assert meter.busy("a") == pytest.approx(1 - math.exp(-1))
    meter.start("a")
    clock.now += 1000.0
    assert meter.busy("a") == pytest.approx(2.0, abs=1e-3)
    meter.end("a")
    meter.end("a")
    clock.now += 10.0
    assert meter.busy("a") == pytest.approx(2.0 * math.exp(-1))


def test_busy_meter_never_goes_negative_and_is_bounded() -> None:
    clock = Clock()
    meter = BusyMeter(clock, tau=10.0, max_hosts=2)
    meter.end("a")
    clock.now += 100
    assert meter.busy("a") == 0.0
    for name in ("b", "c", "d"):
        meter.start(name)
    clock.now += 100
    assert meter.busy("a") == 0.0 and meter.busy("b") == 0.0  # forgotten
    assert meter.busy("d") == pytest.approx(1.0, abs=1e-3)


def test_evicted_model_is_forgotten_fleet_wide() -> None:
    learner = RateLearner(Clock(), max_pairs=2)
    learner.observe("a", "m1", timings())
    learner.observe("b", "m2", timings())
    learner.observe("c", "m2", timings())
    assert not learner.rates("a", "m1").known and not learner.rates("z", "m1").known
    assert learner.rates("z", "m2").known


def test_likely_cached_is_what_each_host_last_processed_for_the_conversation() -> None:
    clock = Clock()
    learner = RateLearner(clock, conversation_ttl=60.0)
    learner.observe("a", "m", timings(prompt_n=1_000, predicted_n=200), conversation="c")
    learner.observe("b", "m", timings(prompt_n=1_500, predicted_n=300, cache_n=0), conversation="c")
    learner.observe("b", "m", timings(prompt_n=400, predicted_n=100, cache_n=1_800), conversation="c")
    assert (learner.likely_cached("c", "a"), learner.likely_cached("c", "b")) == (1_200, 2_300)
    assert learner.likely_cached("c", "z") == 0 and learner.likely_cached("other", "a") == 0
    learner.observe("b", "m", {"prompt_n": 5, "predicted_n": 7}, conversation="c")  # no cache_n
    assert learner.likely_cached("c", "b") == 2_300 and learner.reply_tokens("b", "m", "c") == 7
    clock.now += 61
    assert learner.likely_cached("c", "a") == 0


def test_host_load_assembles_the_yield_view_from_what_was_learned() -> None:
    learner = RateLearner(Clock())
    learner.observe("a", "m", timings(prompt_n=1_000, predicted_n=100), conversation="short")
    learner.observe("a", "m", timings(prompt_n=1_000, predicted_n=5_000), conversation="long")
    load = learner.host_load("a", "m", 2, [(1.5, "long"), (0.2, "new")], 3, "short")
    rates = learner.rates("a", "m")
    assert (load.name, load.slots, load.queued, load.rates) == ("a", 2, 3, rates)
    assert load.running == (Running(1.5, 5_000.0, rates.prefill_tokens),
                            Running(0.2, rates.reply_tokens, rates.prefill_tokens))
    assert load.cached_tokens == 1_100


def test_rates_from_counts_and_milliseconds_when_per_second_is_absent() -> None:
    learner = RateLearner(Clock())
    learner.observe("a", "m", {"prompt_n": 2_000, "prompt_ms": 100.0, "predicted_n": 500,
                               "predicted_ms": 250.0})
    rates = learner.rates("a", "m")
    assert (rates.prefill_tps, rates.gen_tps) == (20_000.0, 2_000.0)
    other = RateLearner(Clock())
    other.observe("b", "m", {"prompt_n": 2_000, "prompt_ms": 0.0, "predicted_n": 500, "predicted_ms": "x"})
    assert (other.rates("b", "m").prefill_tps, other.rates("b", "m").gen_tps) == (0.0, 0.0)


def test_a_forgotten_host_is_learned_afresh() -> None:
    learner = RateLearner(Clock())
    learner.observe("a", "m", timings())
    learner.observe("b", "m", timings())
    learner.forget("a")
    assert learner.rates("b", "m") == Rates(pytest.approx(20_000.0), pytest.approx(1_000.0), 500.0, 2_000.0)
    assert learner.rates("a", "m") == learner.rates("z", "m")  # no more than any host never seen


# ---------------------------------------------------------------- a reply's usage, learned directly

def _figure(plain: st.SearchStrategy[Any], *odd: Any) -> st.SearchStrategy[Any]:
    """`plain` nine times in ten, else one of `odd` (absent, or at a bound)."""
    return st.tuples(mostly(True, False), plain, st.sampled_from(odd)).map(lambda t: t[1] if t[0] else t[2])


# figures as `crossbar.tap` leaves them: whole counts and float milliseconds within its bounds
_counts = _figure(st.integers(0, 3_000), None, 0, MIN_GEN_SAMPLE - 1, MIN_PREFILL_SAMPLE - 1,
                  learn.MAX_TOKENS, learn.MAX_TOKENS + 1, tap.MAX_TOKENS)
_millis = _figure(st.floats(0.0, 5_000.0), None, 0.0, -0.0, 1e-9, tap.MAX_MILLIS)
_usages = st.builds(Usage, prompt_tokens=_counts, cached_tokens=_counts, completion_tokens=_counts,
                    predicted_ms=_millis, prompt_n=_counts, prompt_ms=_millis)
_replies = st.lists(st.tuples(st.sampled_from("ab"), st.sampled_from(["m", "n"]), _usages,
                              st.sampled_from([None, "c1", "c2", "c3"]), st.sampled_from([0.0, 1.0, 61.0])),
                    max_size=12)


def _learned(learner: RateLearner) -> str:
    """All a learner holds, types and order included."""
    return repr((list(learner._pairs.items()), learner._by_model, list(learner._conversations.items())))


@settings(max_examples=500, deadline=None)
@given(_replies)
def test_a_replys_usage_teaches_what_its_timings_object_teaches(replies: list[tuple[Any, ...]]) -> None:
    clock = Clock()
    direct, via_timings = (RateLearner(clock, conversation_ttl=60.0, max_pairs=3, max_conversations=2)
                           for _ in range(2))
    for host, model, u, conversation, wait in replies:
        clock.now += wait
        direct.observe_usage(host, model, u, conversation)
        figures = {"prompt_n": u.prompt_n, "prompt_ms": u.prompt_ms, "cache_n": u.cached_tokens,
                   "predicted_n": u.completion_tokens, "predicted_ms": u.predicted_ms}
        via_timings.observe(host, model, {k: v for k, v in figures.items() if v is not None}, conversation)
        assert _learned(direct) == _learned(via_timings)


class _Memory:
    """What a learner remembers of conversations, kept the plainest way: per conversation its last
    reply, when that was, and what each host that served it held; started afresh once older than
    the TTL; the least recently remembered forgotten beyond the bound."""

    def __init__(self, ttl: float, bound: int) -> None:
        self.ttl, self.bound = ttl, bound
        self.entries: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def remember(self, now: float, conversation: str, host: str, reply: float, held: float | None) -> None:
        entry = self.entries.get(conversation)
        if entry is None or now - entry["when"] > self.ttl:
            entry = {"held": {}}
        entry.update(reply=reply, when=now)
        if held is not None:
            entry["held"][host] = int(held)
        self.entries[conversation] = entry
        self.entries.move_to_end(conversation)
        while len(self.entries) > self.bound:
            self.entries.popitem(last=False)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 3), st.lists(st.tuples(st.sampled_from(["c1", "c2", "c3", "c4"]), st.sampled_from("ab"),
                                             st.floats(0, 1e6), st.none() | st.floats(0, 1e6),
                                             st.sampled_from([0.0, 1.0, 60.0, 61.0])), max_size=20))
def test_conversations_are_remembered_as_the_plain_model_remembers_them(
        bound: int, replies: list[tuple[str, str, float, float | None, float]]) -> None:
    clock = Clock()
    learner, model = RateLearner(clock, conversation_ttl=60.0, max_conversations=bound), _Memory(60.0, bound)
    for conversation, host, reply, held, wait in replies:
        clock.now += wait
        learner._remember(conversation, host, reply, held)
        model.remember(clock.now, conversation, host, reply, held)
        assert [(c, m.reply_tokens, m.when, m.held) for c, m in learner._conversations.items()] == [
            (c, e["reply"], e["when"], e["held"]) for c, e in model.entries.items()]
