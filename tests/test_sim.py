"""Behaviour of the simulated llama-server: caching, slots, context limits, router mode, faults."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from samples_util import sse_events

from llamasim import PromptCache, SimConfig, SimServer, chat_prompt, common_prefix

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as s:
        yield s


def chat(content: str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}],
            "max_tokens": max_tokens, **extra}


async def post(http: aiohttp.ClientSession, sim: SimServer, body: dict[str, Any],
               path: str = "/v1/chat/completions") -> tuple[int, Any]:
    async with http.post(sim.url + path, json=body) as resp:
        text = await resp.text()
        if resp.content_type == "text/event-stream":
            return resp.status, sse_events(text)
        return resp.status, json.loads(text)


async def get(http: aiohttp.ClientSession, sim: SimServer, path: str) -> tuple[int, Any]:
    async with http.get(sim.url + path) as resp:
        return resp.status, await resp.json(content_type=None)


def test_chat_prompt_token_formula() -> None:
    parts = [{"type": "text", "text": "hi"}]
    messages = [{"role": "system", "content": "sé"}, {"role": "user", "content": parts}]
    expected = (6 + 3 + 4) + (4 + 2 + 4) + 11
    assert len(chat_prompt(messages)) == expected


@given(st.binary(max_size=600), st.binary(max_size=600), st.binary(max_size=600))
def test_common_prefix_matches_naive(head: bytes, tail_a: bytes, tail_b: bytes) -> None:
    a, b = head + tail_a, head + tail_b
    naive = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    assert common_prefix(a, b) == naive


def test_prompt_cache_lru_and_prefix_subsumption() -> None:
    cache = PromptCache()
    cache.put(b"abc", 10)
    cache.put(b"abcdef", 10)  # replaces its own prefix
    assert cache.tokens == 6 and cache.best(b"abcx") == (3, b"abcdef")
    cache.put(b"zzzzz", 10)  # evicts the least recently used entry
    assert cache.tokens == 5 and cache.best(b"abc") == (0, b"")


async def test_cache_grows_with_conversation(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimConfig(models=["m"])) as sim:
        _, first = await post(http, sim, chat("first question", 6))
        reply = first["choices"][0]["message"]["content"]
        turn2 = {"messages": [{"role": "system", "content": "be brief"},
                              {"role": "user", "content": "first question"},
                              {"role": "assistant", "content": reply},
                              {"role": "user", "content": "second"}], "max_tokens": 4}
        _, second = await post(http, sim, turn2)
        assert second["timings"]["cache_n"] == first["usage"]["prompt_tokens"] + len(reply)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == second["timings"]["cache_n"]
        t = second["timings"]
        assert second["usage"]["prompt_tokens"] == t["prompt_n"] + t["cache_n"]
        _, again = await post(http, sim, turn2)
        n = again["usage"]["prompt_tokens"]
        assert (again["timings"]["cache_n"], again["timings"]["prompt_n"]) == (n - 1, 1)
        assert [(r.prompt_tokens, r.cache_n) for r in sim.stats.records][2] == (n, n - 1)


@pytest.mark.parametrize(("ram", "cached"), [(1 << 30, True), (0, False)])
async def test_host_ram_cache_restores_overwritten_prompt(http: aiohttp.ClientSession, ram: int,
                                                          cached: bool) -> None:
    async with SimServer(SimConfig(models=["m"], n_slots=1, cache_ram_tokens=ram)) as sim:
        a = {"messages": [{"role": "user", "content": "A" * 300}], "max_tokens": 2}
        b = {"messages": [{"role": "user", "content": "B" * 300}], "max_tokens": 2}
        await post(http, sim, a)
        await post(http, sim, b)
        _, again = await post(http, sim, a)
        n = again["usage"]["prompt_tokens"]
        assert (again["timings"]["cache_n"] == n - 1) is cached
        if not cached:
            assert again["timings"]["cache_n"] < 10


async def test_one_slot_queues_second_request(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimConfig(models=["m"], n_slots=1, token_ms=10)) as sim:
        t0 = time.monotonic()

        async def timed(text: str) -> float:
            await post(http, sim, chat(text, 10))
            return time.monotonic() - t0

        tasks = [asyncio.create_task(timed("one")), asyncio.create_task(timed("two"))]
        await asyncio.sleep(0.03)
        status, health = await get(http, sim, "/health")
        _, slots = await get(http, sim, "/slots")
        async with http.get(sim.url + "/metrics") as resp:
            metrics_text = await resp.text()
        done = sorted(await asyncio.gather(*tasks))
        assert (status, health) == (200, {"status": "ok"})
        assert [s["is_processing"] for s in slots] == [True]
        assert "llamacpp:requests_deferred 1" in metrics_text
        assert done[1] - done[0] >= 0.08  # the second waited for the first
        assert sim.stats.max_concurrent == {"m": 2}
        assert sim.stats.completions_started == sim.stats.completions_finished == 2


async def test_overflow_limits_and_generation_stop(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimConfig(models=["m"], n_slots=2, ctx=128)) as sim:
        fits = {"prompt": "x" * 63, "max_tokens": 100}
        status, body = await post(http, sim, fits, "/v1/completions")
        assert status == 200 and body["usage"]["completion_tokens"] == 1
        assert body["choices"][0]["finish_reason"] == "length" and body["object"] == "text_completion"
        status, body = await post(http, sim, {"prompt": "x" * 64}, "/v1/completions")
        assert status == 400 and body["error"]["n_ctx"] == 64 and body["error"]["n_prompt_tokens"] == 64


async def test_unified_kv_overflow_only_when_concurrent(http: aiohttp.ClientSession) -> None:
    cfg = SimConfig(models=["m"], n_slots=2, ctx=4096, kvu=True, prompt_ms_per_token=0.02)
    async with SimServer(cfg) as sim:
        big = [chat("a" * 2500, 1500), chat("b" * 2500, 1500, stream=True)]
        (s1, b1), (s2, b2) = await asyncio.gather(*(post(http, sim, b) for b in big))
        assert (s1, b1) == (500, {"error": {"code": 500, "message": "Context size has been exceeded.",
                                            "type": "server_error"}})
        assert s2 == 200 and b2[-1] == {"error": b1["error"]} and "[DONE]" not in b2
        for body in big:
            status, reply = await post(http, sim, {**body, "stream": False})
            assert status == 200 and reply["usage"]["completion_tokens"] == 1500


async def test_router_polling_never_loads(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimConfig(models=["a", "b"], router=True, models_max=1, load_s=0.05)) as sim:
        for _ in range(3):
            for path in ("/v1/models", "/models", "/health", "/props", "/slots", "/metrics"):
                await get(http, sim, path)
            await get(http, sim, "/props?model=a&autoload=false")
        assert sim.stats.loads == {}
        status, _ = await get(http, sim, "/props?model=a")
        assert status == 200 and sim.stats.loads == {"a": 1}
        _, models = await get(http, sim, "/v1/models")
        assert {m["id"]: m["status"]["value"] for m in models["data"]} == {"a": "loaded", "b": "unloaded"}
        status, reply = await post(http, sim, {**chat("hi"), "model": "b"})
        assert status == 200 and reply["model"] == "b"
        _, models = await get(http, sim, "/v1/models")
        assert {m["id"]: m["status"]["value"] for m in models["data"]} == {"a": "unloaded", "b": "loaded"}
        assert sim.stats.loads == {"a": 1, "b": 1}
        status, _ = await post(http, sim, {"model": "a"}, "/models/load")
        _, models = await get(http, sim, "/v1/models")
        assert status == 200 and models["data"][0]["status"]["value"] == "loading"
        assert "meta" not in models["data"][0]


async def test_router_waits_for_busy_model_before_evicting(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimConfig(models=["a", "b"], router=True, models_max=1, token_ms=5)) as sim:
        slow = asyncio.create_task(post(http, sim, {**chat("hi", 20), "model": "a"}))
        await asyncio.sleep(0.03)
        status, _ = await post(http, sim, {**chat("hi"), "model": "b"})
        assert slow.done() and (await slow)[0] == 200
        assert status == 200 and sim.stats.loads == {"a": 1, "b": 1}


async def test_refuse_then_recover_same_port(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimConfig(models=["m"])) as sim:
        port = sim.port
        sim.set(refuse=True)
        with pytest.raises(aiohttp.ClientConnectorError):
            await get(http, sim, "/health")
        sim.set(refuse=False)
        assert sim.port == port and (await get(http, sim, "/health"))[0] == 200


async def test_fail_status_times(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimConfig(models=["m"], fail_status=503, fail_times=2)) as sim:
        codes = [(await post(http, sim, chat("x")))[0] for _ in range(3)]
        assert codes == [503, 503, 200]
        sim.set(fail_status=500)
        status, body = await post(http, sim, chat("x"))
        assert status == 500 and body["error"]["type"] == "server_error"


async def test_die_after_events_cuts_the_body(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimConfig(models=["m"], die_after_events=3)) as sim:
        body = chat("x", 10, stream=True)
        async with http.post(sim.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        assert (sim.stats.aborted, sim.stats.cut, sim.stats.completions_finished) == (0, 1, 1)


async def test_hang_times_out_then_clears(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimConfig(models=["m"], hang=True)) as sim:
        with pytest.raises(asyncio.TimeoutError):
            async with http.get(sim.url + "/health", timeout=aiohttp.ClientTimeout(total=0.2)):
                pass
        sim.set(hang=False)
        assert (await get(http, sim, "/health"))[0] == 200


async def test_health_status_knob(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimConfig(models=["m"], health_status=503)) as sim:
        status, body = await get(http, sim, "/health")
        assert status == 503
        assert body == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_and_frees_slot(http: aiohttp.ClientSession, stream: bool) -> None:
    async with SimServer(SimConfig(models=["m"], n_slots=1, token_ms=5)) as sim:
        body = chat("x", 2000, stream=stream)
        if stream:
            async with http.post(sim.url + "/v1/chat/completions", json=body) as resp:
                await resp.content.readline()
        else:
            task = asyncio.create_task(post(http, sim, body))
            await asyncio.sleep(0.05)
            task.cancel()
        for _ in range(100):
            if sim.stats.aborted:
                break
            await asyncio.sleep(0.01)
        assert sim.stats.aborted == 1
        _, slots = await get(http, sim, "/slots")
        assert slots[0]["is_processing"] is False
        status, _ = await post(http, sim, chat("y", 2))
        assert status == 200 and sim.stats.records[0].completion_tokens < 100


async def test_control_api(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimConfig(models=["m"])) as sim:
        async with http.post(sim.url + "/_sim/config", json={"fail_status": 502, "fail_times": 1}) as resp:
            assert resp.status == 200
        assert (await post(http, sim, chat("x")))[0] == 502
        await post(http, sim, chat("x"))
        _, stats = await get(http, sim, "/_sim/stats")
        assert stats["requests"]["/v1/chat/completions"] == 2 and stats["failed_injected"] == 1
        assert stats["records"][0]["prompt_tokens"] > 0
        async with http.post(sim.url + "/_sim/config", json={"nope": 1}) as resp:
            assert resp.status == 400


async def test_embeddings_shape(http: aiohttp.ClientSession) -> None:
    async with SimServer(SimConfig(models=["m"])) as sim:
        status, body = await post(http, sim, {"input": ["ab", "cde"]}, "/v1/embeddings")
        assert status == 200 and body["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
        assert [d["index"] for d in body["data"]] == [0, 1] and len(body["data"][0]["embedding"]) == 64


def test_cli_starts_and_stops() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "llamasim", "--port", "0", "--model", "m"],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("sim llama-server listening on http://127.0.0.1:") and "(models: m)" in line
    finally:
        proc.terminate()
        code = proc.wait(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()
    assert code == 0
