"""The simulator's time model: virtual-clock hosts (llamasim.timed) and the timings the HTTP
simulator reports when it is given per-token times."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from crossbar.learn import RateLearner
from llamasim import SimConfig, SimServer, chat_prompt
from llamasim.timed import ConversationCache, TimedHost, TimedRequest, TimeModel, VirtualClock


def loop_time() -> float:
    return asyncio.get_running_loop().time()


MODEL = TimeModel(prefill_tps=1_000.0, gen_tps=100.0, slots=1)


def test_clock_runs_events_in_time_then_scheduling_order() -> None:
    clock, seen = VirtualClock(), []
    clock.at(2.0, lambda: seen.append(("b", clock.now)))
    clock.at(1.0, lambda: seen.append(("a", clock.now)))
    clock.at(2.0, lambda: seen.append(("c", clock.now)))
    clock.run()
    assert seen == [("a", 1.0), ("b", 2.0), ("c", 2.0)]


def test_clock_never_goes_back_and_stops_at_until() -> None:
    clock, seen = VirtualClock(), []
    clock.at(5.0, lambda: clock.at(1.0, lambda: seen.append(clock.now)))
    clock.at(9.0, lambda: seen.append(clock.now))
    clock.run(until=6.0)
    assert seen == [5.0] and clock.now == 5.0


def serve(host: TimedHost, conversation: str, prompt: int, reply: int,
          done: list[TimedRequest]) -> TimedRequest:
    request = TimedRequest(conversation, prompt, reply, on_done=done.append)
    host.submit(request)
    return request


def test_prefill_generation_and_queueing() -> None:
    clock, done = VirtualClock(), []
    host = TimedHost("h", clock, MODEL)
    first = serve(host, "a", 1_000, 100, done)  # 1 s prefill + 1 s generation
    second = serve(host, "b", 500, 50, done)  # queued behind it (one slot)
    assert first.running and second in host.waiting
    clock.run()
    assert (first.started, first.finished) == (0.0, 2.0)
    assert (second.started, second.finished) == (2.0, 3.0)
    assert done == [first, second] and host.busy_s == 3.0


def test_slots_serve_in_parallel() -> None:
    clock, done = VirtualClock(), []
    host = TimedHost("h", clock, TimeModel(prefill_tps=1_000.0, gen_tps=100.0, slots=2))
    a, b = serve(host, "a", 1_000, 100, done), serve(host, "b", 1_000, 100, done)
    clock.run()
    assert a.finished == b.finished == 2.0


def second_turn(reply: int) -> tuple[TimedHost, TimedRequest, list[TimedRequest]]:
    """A conversation's second turn (1,500 tokens) after a first of 1,000 + 100 on an idle host."""
    clock, done = VirtualClock(), []
    host = TimedHost("h", clock, MODEL)
    serve(host, "a", 1_000, 100, done)
    clock.run()
    turn2 = serve(host, "a", 1_500, reply, done)
    clock.run()
    return host, turn2, done


def test_next_turn_reads_its_prefix_from_the_host_cache() -> None:
    host, turn2, done = second_turn(100)
    clock = host.clock
    assert (turn2.cache_n, turn2.prompt_n) == (1_100, 400)
    assert turn2.finished - turn2.started == pytest.approx(0.4 + 1.0)
    again = serve(host, "a", 1_000, 10, done)  # a shorter prompt (a retry): all but one token cached
    clock.run()
    assert again.cache_n == 999


def test_other_hosts_do_not_hold_the_conversation() -> None:
    clock, done = VirtualClock(), []
    one, two = TimedHost("one", clock, MODEL), TimedHost("two", clock, MODEL)
    serve(one, "a", 1_000, 100, done)
    clock.run()
    moved = serve(two, "a", 1_500, 100, done)
    clock.run()
    assert moved.cache_n == 0 and one.cached_tokens("a") == 1_100 and two.cached_tokens("a") == 1_600


def test_cache_size_knob_evicts_least_recently_used() -> None:
    cache = ConversationCache(limit=1_000)
    cache.keep("a", 400)
    cache.keep("b", 400)
    assert cache.cached("a") == 400  # a is now the most recent
    cache.keep("c", 400)
    assert (cache.peek("a"), cache.peek("b"), cache.peek("c"), cache.tokens) == (400, 0, 400, 800)
    cache.keep("a", 2_000)  # larger than the whole cache: not kept
    assert cache.peek("a") == 0 and cache.tokens == 400


def test_no_cache_ram() -> None:
    clock, done = VirtualClock(), []
    host = TimedHost("h", clock, TimeModel(prefill_tps=1_000.0, gen_tps=100.0, cache_tokens=0))
    serve(host, "a", 1_000, 100, done)
    clock.run()
    assert serve(host, "a", 1_500, 100, done).cache_n == 0


def test_withdraw_only_a_queued_request() -> None:
    clock, done = VirtualClock(), []
    host = TimedHost("h", clock, MODEL)
    running, queued = serve(host, "a", 1_000, 100, done), serve(host, "b", 1_000, 100, done)
    assert not host.withdraw(running)
    assert host.withdraw(queued) and not host.waiting
    clock.run()
    assert done == [running]


def test_timings_match_the_model_and_teach_the_learner_its_rates() -> None:
    host, turn2, _ = second_turn(200)
    clock = host.clock
    t = host.timings(turn2)
    assert (t["cache_n"], t["prompt_n"], t["predicted_n"]) == (1_100, 400, 200)
    assert (t["prompt_ms"], t["predicted_ms"]) == (400.0, 2_000.0)
    learner = RateLearner(lambda: clock.now)
    learner.observe("h", "m", t)
    rates = learner.rates("h", "m")
    assert rates.prefill_tps == pytest.approx(1_000.0)
    assert rates.gen_tps == pytest.approx(100.0, rel=0.01)  # llama-server divides by n - 1 tokens


def test_time_model_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        TimeModel(prefill_tps=0.0)
    with pytest.raises(ValueError):
        TimeModel(slots=0)


async def test_http_sim_reports_timings_of_its_time_model() -> None:
    cfg = SimConfig(models=["m"], ctx=8192, n_slots=1, prompt_ms_per_token=0.05, token_ms=2.0)
    body = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 20}
    async with (SimServer(cfg) as sim, aiohttp.ClientSession() as http,
                http.post(sim.url + "/v1/chat/completions", json=body) as resp):
        reply = await resp.json()
    t = reply["timings"]
    assert t["prompt_ms"] == pytest.approx(t["prompt_n"] * 0.05)
    assert t["prompt_per_second"] == pytest.approx(20_000.0)
    assert (t["predicted_n"], t["predicted_ms"]) == (20, pytest.approx(40.0))


async def test_http_sim_queues_like_the_virtual_model() -> None:
    """Two requests on one slot: the virtual model's finish times match the HTTP simulator's
    (real sleeps; generous bounds for a shared machine)."""
    cfg = SimConfig(models=["m"], ctx=8192, n_slots=1, prompt_ms_per_token=0.1, token_ms=4.0)
    bodies: list[dict[str, Any]] = [{"messages": [{"role": "user", "content": c * 1_000}], "max_tokens": 50}
                                    for c in "ab"]
    clock, done = VirtualClock(), []
    rates = TimeModel(prefill_tps=1e3 / cfg.prompt_ms_per_token, gen_tps=1e3 / cfg.token_ms)
    host = TimedHost("h", clock, rates)
    for c, body in zip("ab", bodies, strict=True):
        serve(host, c, len(chat_prompt(body["messages"])), 50, done)
    clock.run()
    async with SimServer(cfg) as sim, aiohttp.ClientSession() as http:
        t0 = loop_time()

        async def finish(body: dict[str, Any]) -> float:
            async with http.post(sim.url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
            return loop_time() - t0

        measured = await asyncio.gather(*(finish(b) for b in bodies))
    predicted = [r.finished for r in done]
    assert predicted == pytest.approx([0.3019, 0.6038])  # 1,019 prompt tokens at 0.1 ms + 50 at 4 ms
    first, second = sorted(measured)
    assert first >= predicted[0] * 0.95 and second >= predicted[1] * 0.95  # queued, not in parallel
    assert second <= predicted[1] + 1.5
