"""The simulated llama-server answers in the real server's shapes (compared with recorded samples)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from samples_util import SAMPLES, load, metric_names, shape_diff, sse_events

from llamasim import SimConfig, SimServer

pytestmark = pytest.mark.skipif(not SAMPLES.is_dir(), reason=f"llama-lab samples not found at {SAMPLES}")

CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


@pytest.fixture
async def single() -> AsyncIterator[SimServer]:
    async with SimServer(SimConfig(models=["models/tiny-a.gguf"], ctx=4096, n_slots=2)) as sim:
        yield sim


@pytest.fixture
async def router() -> AsyncIterator[SimServer]:
    async with SimServer(SimConfig(models=["tiny-a", "tiny-b"], router=True, ctx=4096, n_slots=2)) as sim:
        yield sim


async def fetch(http: aiohttp.ClientSession, method: str, url: str,
                body: dict[str, Any] | None = None) -> tuple[int, dict[str, str], str]:
    async with http.request(method, url, json=body) as resp:
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.text()


def assert_like(sample_name: str, status: int, headers: dict[str, str], sim_body: Any,
                real_body: Any = None, order: bool = True) -> None:
    sample = load(sample_name)
    assert status == sample.status, sample_name
    assert headers["server"] == sample.headers["server"] == "llama.cpp"
    assert headers["content-type"] == sample.headers["content-type"]
    real = sample.json() if real_body is None else real_body
    assert shape_diff(sim_body, real, order=order) == [], sample_name


async def check_json(http: aiohttp.ClientSession, sample_name: str, method: str, url: str,
                     body: dict[str, Any] | None = None) -> Any:
    status, headers, text = await fetch(http, method, url, body)
    parsed = json.loads(text)
    assert_like(sample_name, status, headers, parsed)
    return parsed


async def test_single_simple_endpoints(http: aiohttp.ClientSession, single: SimServer) -> None:
    u = single.url
    await check_json(http, "single/get_health.txt", "GET", f"{u}/health")
    await check_json(http, "single/get_v1_models.txt", "GET", f"{u}/v1/models")
    await check_json(http, "single/get_models.txt", "GET", f"{u}/models")
    props = await check_json(http, "single/get_props.txt", "GET", f"{u}/props")
    assert props["default_generation_settings"]["n_ctx"] == 2048 and props["total_slots"] == 2
    await check_json(http, "single/tokenize.txt", "POST", f"{u}/tokenize", {"content": "Hello world ~~ x"})


async def test_single_slots_fresh_used_and_busy(http: aiohttp.ClientSession, single: SimServer) -> None:
    real = load("single/get_slots.txt").json()
    status, headers, text = await fetch(http, "GET", f"{single.url}/slots")
    fresh = json.loads(text)
    assert status == 200 and headers["content-type"] == "application/json; charset=utf-8"
    assert [shape_diff(s, real[0]) for s in fresh] == [[], []]
    await fetch(http, "POST", f"{single.url}/v1/chat/completions", CHAT)
    used = json.loads((await fetch(http, "GET", f"{single.url}/slots"))[2])
    assert sorted(len(s) for s in used) == [4, 10]
    assert [shape_diff(s, real[0] if len(s) == 4 else real[1]) for s in used] == [[], []]
    single.set(token_ms=20)
    task = asyncio.create_task(fetch(http, "POST", f"{single.url}/v1/chat/completions",
                                     {**CHAT, "max_tokens": 30}))
    await asyncio.sleep(0.15)
    busy = json.loads((await fetch(http, "GET", f"{single.url}/slots"))[2])
    await task
    busy_real = load("single-med/slots_busy.txt").json()[0]
    running = [s for s in busy if s["is_processing"]]
    assert len(running) == 1 and shape_diff(running[0], busy_real) == []
    assert running[0]["next_token"][0]["has_next_token"] is True


async def test_single_chat_nonstream(http: aiohttp.ClientSession, single: SimServer) -> None:
    body = await check_json(http, "single/chat_nonstream.txt", "POST",
                            f"{single.url}/v1/chat/completions", CHAT)
    assert body["model"] == "models/tiny-a.gguf" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8 == len(body["choices"][0]["message"]["content"])


async def test_single_chat_stream_chunks(http: aiohttp.ClientSession, single: SimServer) -> None:
    real = load("single/chat_stream.txt").events()
    status, headers, text = await fetch(http, "POST", f"{single.url}/v1/chat/completions",
                                        {**CHAT, "stream": True})
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert headers["server"] == "llama.cpp" and headers.get("transfer-encoding") == "chunked"
    sim = sse_events(text)
    assert sim[-1] == "[DONE]" and len(sim) == 1 + 8 + 1 + 1
    assert shape_diff(sim[0], real[0]) == []  # role chunk
    assert [d for ev in sim[1:9] for d in shape_diff(ev, real[1])] == []  # content chunks
    assert shape_diff(sim[9], real[-2]) == []  # finish chunk with timings
    assert "timings" in sim[9]


async def test_single_chat_stream_include_usage(http: aiohttp.ClientSession, single: SimServer) -> None:
    real = load("single/chat_stream_usage.txt").events()
    _, _, text = await fetch(http, "POST", f"{single.url}/v1/chat/completions",
                             {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    sim = sse_events(text)
    assert shape_diff(sim[-3], real[-3]) == [] and "timings" not in sim[-3]
    assert shape_diff(sim[-2], real[-2]) == [] and sim[-2]["choices"] == []


@pytest.mark.parametrize("stream", [False, True])
async def test_single_overflow_body_exact(http: aiohttp.ClientSession, single: SimServer,
                                          stream: bool) -> None:
    sample = load(f"single/overflow_{'stream' if stream else 'nonstream'}.txt")
    body = {"messages": [{"role": "user", "content": "x" * 3000}], "stream": stream}
    status, headers, text = await fetch(http, "POST", f"{single.url}/v1/chat/completions", body)
    assert (status, headers["content-type"]) == (400, "application/json; charset=utf-8")
    assert json.loads(text) == sample.json()


async def test_single_metrics_and_native(http: aiohttp.ClientSession, single: SimServer) -> None:
    sample = load("single/get_metrics.txt")
    status, headers, text = await fetch(http, "GET", f"{single.url}/metrics")
    assert status == 200 and headers["content-type"] == sample.headers["content-type"]
    assert metric_names(text) == metric_names(sample.body)
    assert [ln for ln in text.splitlines() if ln.startswith("#")] == \
        [ln for ln in sample.body.splitlines() if ln.startswith("#")]
    await check_json(http, "single/completion_native.txt", "POST", f"{single.url}/completion",
                     {"prompt": "Hello", "n_predict": 8})


async def test_router_models_props_and_errors(http: aiohttp.ClientSession, router: SimServer) -> None:
    u = router.url
    await check_json(http, "router/get_v1_models_nomodel.txt", "GET", f"{u}/v1/models")
    await check_json(http, "router/get_health_nomodel.txt", "GET", f"{u}/health")
    await check_json(http, "router/get_props_nomodel.txt", "GET", f"{u}/props")
    await check_json(http, "router/get_props_model_unloaded_noautoload.txt", "GET",
                     f"{u}/props?model=tiny-a&autoload=false")
    await check_json(http, "router/get_slots_nomodel.txt", "GET", f"{u}/slots")
    await check_json(http, "router/get_metrics_nomodel.txt", "GET", f"{u}/metrics")
    await check_json(http, "router/chat_no_model.txt", "POST", f"{u}/v1/chat/completions", CHAT)
    body = await check_json(http, "router/chat_unknown_model.txt", "POST", f"{u}/v1/chat/completions",
                            {**CHAT, "model": "no-such-model"})
    assert body == load("router/chat_unknown_model.txt").json()
    assert router.stats.loads == {}
    await check_json(http, "router/get_props_model0.txt", "GET", f"{u}/props?model=tiny-a")
    models = await check_json(http, "router/v1_models_after_model0.txt", "GET", f"{u}/v1/models")
    assert [m["status"]["value"] for m in models["data"]] == ["loaded", "unloaded"]
    await fetch(http, "POST", f"{u}/v1/chat/completions", {**CHAT, "model": "tiny-a"})
    status, headers, text = await fetch(http, "GET", f"{u}/slots?model=tiny-a")
    real = load("router/get_slots_model0.txt").json()
    assert status == 200 and headers["content-type"] == "application/json; charset=utf-8"
    assert [shape_diff(s, real[0] if len(s) == 4 else real[1]) for s in json.loads(text)] == [[], []]
    assert router.stats.loads == {"tiny-a": 1}


async def test_router_chat_load_unload(http: aiohttp.ClientSession, router: SimServer) -> None:
    u = router.url
    body = await check_json(http, "router/chat_model0_first.txt", "POST", f"{u}/v1/chat/completions",
                            {**CHAT, "model": "tiny-a"})
    assert body["model"] == "tiny-a"
    real = load("router/chat_model0_stream_usage.txt").events()
    _, _, text = await fetch(http, "POST", f"{u}/v1/chat/completions",
                             {**CHAT, "model": "tiny-a", "stream": True,
                              "stream_options": {"include_usage": True}})
    sim = sse_events(text)
    assert [shape_diff(a, b) for a, b in zip(sim[-3:-1], real[-3:-1], strict=True)] == [[], []]
    await check_json(http, "router/models_load.txt", "POST", f"{u}/models/load", {"model": "tiny-b"})
    await check_json(http, "router/models_unload.txt", "POST", f"{u}/models/unload", {"model": "tiny-b"})
    status, _, text = await fetch(http, "GET", f"{u}/metrics?model=tiny-a")
    assert status == 200 and metric_names(text) == metric_names(load("router/get_metrics_model0.txt").body)
