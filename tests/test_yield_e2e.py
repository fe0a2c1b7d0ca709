"""Lease yield through a real mitmproxy and time-modelled simulated hosts: a turn queued behind a
long generation on its home host moves to an idle host (decision, event and counter say so), and
an evenly loaded fleet never moves anything."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
from accounting_util import scrape, summed
from harness import HostSpec, conversation, fleet_with_route, lease_event_rows, request_rows, wait_until

from crossbar.session import session_fp
from llamasim import SimConfig

CHAT = "/r/v1/chat/completions"
TIMEOUT = aiohttp.ClientTimeout(total=60)
# 20k prompt tokens/s and 1k generated tokens/s, one slot, a context room for long prompts
TIMED = {"n_slots": 1, "ctx": 65_536, "prompt_ms_per_token": 0.05, "token_ms": 1.0}


def timed_host(weight: float = 1.0) -> HostSpec:
    return HostSpec({"m": {"parallel": 1}}, weight=weight, sim=SimConfig(models=["m"], **TIMED))


async def post(url: str, body: dict[str, Any]) -> int:
    """One turn, its session named in `X-Session-Id` (the row's key is then `session_fp(session)`)."""
    headers = {"X-Session-Id": body.pop("session")}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.post(url, json=body, headers=headers) as resp:
        await resp.read()
        return resp.status


def turn(session: str, n: int, max_tokens: int, pad: int) -> dict[str, Any]:
    return {"messages": conversation(session, n + 1, pad=pad)[n], "max_tokens": max_tokens,
            "session": session}


async def test_a_turn_queued_behind_a_long_generation_yields_to_an_idle_host(tmp_path: Path) -> None:
    # b weighs less, so while a has a free slot every new conversation goes to a
    specs = {"a": timed_host(), "b": timed_host(weight=0.3)}
    async with fleet_with_route(tmp_path, specs) as (fleet, proxy):
        url = proxy.url + CHAT
        assert await post(url, turn("long", 0, max_tokens=2500, pad=2000)) == 200  # teaches its reply length
        assert await post(url, turn("short", 0, max_tokens=20, pad=4000)) == 200
        generating = asyncio.create_task(post(url, turn("long", 1, max_tokens=2500, pad=2000)))
        await wait_until(lambda: fleet["a"].stats.inflight.get("m", 0) == 1, what="the long turn running")
        assert await post(url, turn("short", 1, max_tokens=20, pad=4000)) == 200
        short_done = asyncio.get_running_loop().time()
        assert await generating == 200
        long_done = asyncio.get_running_loop().time()
        rows = await request_rows(proxy)
        events = await lease_event_rows(proxy)
        _, samples = await scrape(proxy.url)
    assert [(r.host, r.decision) for r in rows] == [  # in the order they ended
        ("a", "new"), ("a", "new"), ("b", "moved:yield"), ("a", "reused")]
    moves = [(e.from_host, e.to_host, e.reason) for e in events if e.reason == "yield"]
    assert moves == [("a", "b", "yield")]
    assert summed(samples, "crossbar_lease_moves_total", reason="yield") == 1
    assert short_done < long_done, "the moved turn did not wait for the long generation"


async def test_a_queued_turn_yields_when_a_slot_frees_elsewhere(tmp_path: Path) -> None:
    specs = {"a": timed_host(), "b": timed_host()}
    async with fleet_with_route(tmp_path, specs) as (fleet, proxy):
        url = proxy.url + CHAT
        running = lambda host: fleet[host].stats.inflight.get("m", 0) == 1  # noqa: E731
        assert await post(url, turn("x", 0, max_tokens=2500, pad=2000)) == 200  # on a, a long reply
        z0 = asyncio.create_task(post(url, turn("z", 0, max_tokens=2500, pad=2000)))  # on b, the same
        await wait_until(lambda: running("b"), what="z on b")
        assert await post(url, turn("y", 0, max_tokens=20, pad=4000)) == 200  # a is free: on a
        assert await z0 == 200
        x1 = asyncio.create_task(post(url, turn("x", 1, max_tokens=2500, pad=2000)))
        z1 = asyncio.create_task(post(url, turn("z", 1, max_tokens=300, pad=2000)))  # shorter than feared
        await wait_until(lambda: running("a") and running("b"), what="x on a and z on b")
        # on arrival both hosts look busy for ~2.5 s: y waits on a; once z ends, b is free
        assert await post(url, turn("y", 1, max_tokens=20, pad=4000)) == 200
        x1_running = not x1.done()
        assert await x1 == 200 and await z1 == 200
        rows = await request_rows(proxy)
    assert x1_running, "the queued turn waited for the long generation"
    assert [(r.host, r.decision) for r in rows if r.fp == session_fp("y")] == [
        ("a", "new"), ("b", "moved:yield")]


async def test_even_load_never_yields(tmp_path: Path) -> None:
    # long contexts and short replies: a turn waits a fraction of what re-prefilling would cost
    specs = {"a": timed_host(), "b": timed_host()}
    async with fleet_with_route(tmp_path, specs) as (_fleet, proxy):
        url = proxy.url + CHAT

        async def session(name: str) -> list[int]:
            return [await post(url, turn(name, n, max_tokens=40, pad=8000)) for n in range(4)]

        answers = await asyncio.gather(*(session(f"s{i}") for i in range(4)))
        rows = await request_rows(proxy)
        events = await lease_event_rows(proxy)
        _, samples = await scrape(proxy.url)
    assert all(status == 200 for statuses in answers for status in statuses)
    assert len(rows) == 16
    assert {r.decision for r in rows} == {"new", "reused"}
    assert {e.reason for e in events} == {"new"}
    assert summed(samples, "crossbar_lease_moves_total", reason="yield") == 0


async def test_a_retried_request_counts_as_running_once_on_the_host_that_answered(tmp_path: Path) -> None:
    specs = {"a": HostSpec({"m": {"parallel": 1}}, sim=SimConfig(models=["m"], fail_status=500, fail_times=1,
                                                                 **TIMED)),
             "b": timed_host()}
    async with fleet_with_route(tmp_path, specs) as (_fleet, proxy):
        assert await post(proxy.url + CHAT, turn("s", 0, max_tokens=20, pad=100)) == 200
        rows = await request_rows(proxy)
        router = proxy.router
        running = {host: state.running for host, state in router.meter._hosts.items()}
        assert router._upstream == {}  # nothing is left running anywhere
    assert [(r.host, r.decision) for r in rows] == [("b", "retried")]
    assert running == {"a": 0, "b": 0}
    assert router.learner.rates("b", "m").gen_tps == 1000.0  # learned from the answer's timings
