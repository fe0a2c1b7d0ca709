from __future__ import annotations

import math
from typing import Any

import pytest

from crossbar.learn import BusyMeter, RateLearner
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
