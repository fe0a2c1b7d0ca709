"""Real clients through crossbar: the official OpenAI Python SDK, and replays of what
OpenCode (Vercel AI SDK `@ai-sdk/openai-compatible`) and Hermes (OpenAI SDK) send, kept as JSON
fixtures under `tests/fixtures/clients/` (request headers and body in those clients' shapes).

The real llama-server variant of the SDK test lives in `test_real.py`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import openai
import pytest
from harness import (
    HostSpec,
    Proxy,
    completion_count,
    crossbar_proxy,
    recording_upstream,
    request_rows,
    sim_fleet,
    single_host_config,
    sse_data,
    wait_until,
    write_config,
)

from llamasim import SimConfig, SimServer

FIXTURES = Path(__file__).parent / "fixtures" / "clients"
MODEL = "ornith-1.5-35b-a3b"
MSGS: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


ALL_FIXTURES = sorted(p.name for p in FIXTURES.glob("*.json"))


@asynccontextmanager
async def one_sim(tmp_path: Path, sim: SimConfig | None = None, parallel: int = 0,
                  **top: Any) -> AsyncIterator[tuple[SimServer, Proxy]]:
    async with sim_fleet({"a": HostSpec({MODEL: {}}, sim=sim or SimConfig(models=[MODEL]))}) as fleet:
        cfg = single_host_config(tmp_path / "c.toml", fleet["a"].url, models=(MODEL,), parallel=parallel,
                                 **top)
        async with crossbar_proxy(cfg) as proxy:
            yield fleet["a"], proxy


def sdk(proxy: Proxy, route: str = "r", **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{proxy.url}/{route}/v1", api_key="x", **kw)


# ---------------------------------------------------------------- the OpenAI Python SDK


async def test_sdk_non_streaming(tmp_path: Path) -> None:
    async with one_sim(tmp_path) as (_sim, proxy):
        client = sdk(proxy, max_retries=0)
        try:
            reply = await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5)
        finally:
            await client.close()
        rows = await request_rows(proxy)
    assert reply.choices[0].message.content and reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    assert [(r.status, r.streamed, r.completion_tokens, r.prompt_tokens) for r in rows] == [
        (200, False, 5, reply.usage.prompt_tokens)]


@pytest.mark.parametrize("include_usage", [False, True])
async def test_sdk_streaming(tmp_path: Path, include_usage: bool) -> None:
    async with one_sim(tmp_path) as (_sim, proxy):
        client = sdk(proxy, max_retries=0)
        extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if include_usage else {}
        try:
            stream = await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=7,
                                                          stream=True, **extra)
            text, finish, usage = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                usage = chunk.usage or usage
        finally:
            await client.close()
        rows = await request_rows(proxy)
    assert text and finish == "length"
    assert (usage is not None) is include_usage
    (row,) = rows
    assert row.status == 200 and row.streamed and row.completion_tokens == 7 and row.prompt_tokens


async def test_sdk_with_the_route_in_a_default_header(tmp_path: Path) -> None:
    async with one_sim(tmp_path) as (_sim, proxy):
        client = openai.AsyncOpenAI(base_url=f"{proxy.url}/v1", api_key="x", max_retries=0,
                                    default_headers={"X-Crossbar-Route": "opencode-x-42"})
        try:
            reply = await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3)
            models = await client.models.list()
        finally:
            await client.close()
        rows = await request_rows(proxy)
    assert reply.choices[0].message.content
    assert [m.id for m in models.data] == [MODEL]
    assert [r.route for r in rows] == ["opencode-x-42"]


async def test_sdk_retries_a_503_queue_full_and_honours_retry_after(tmp_path: Path) -> None:
    """One slot, no queue: a second request gets 503 + `Retry-After: 1`; the SDK waits and its
    retry succeeds once the first request has finished."""
    async with one_sim(tmp_path, SimConfig(models=[MODEL], token_ms=20), parallel=1, queue_max=0) as (
            _sim, proxy):
        client = sdk(proxy)  # the SDK's defaults: 2 retries
        try:
            # teach the limiter the hold time (the estimate starts at 10 s before anything finished)
            await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1)
            long = asyncio.create_task(client.chat.completions.create(
                model=MODEL, messages=MSGS, max_tokens=40))  # ~0.8 s holding the only slot
            await wait_until(lambda: proxy.router.in_flight("a", MODEL) == 1, what="slot taken")
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "other"}], max_tokens=2)
            second = raw.parse()
            first = await long
        finally:
            await client.close()
        rows = await request_rows(proxy)
    assert first.usage is not None and first.usage.completion_tokens == 40
    assert second.usage is not None and second.usage.completion_tokens == 2
    assert raw.retries_taken >= 1
    statuses = [r.status for r in rows]
    assert statuses.count(503) == raw.retries_taken and statuses.count(200) == 3, statuses
    rejected = [r for r in rows if r.status == 503]
    assert all(r.err and "queue full" in r.err for r in rejected)


async def test_the_503_carries_an_honest_retry_after(tmp_path: Path) -> None:
    async with one_sim(tmp_path, SimConfig(models=[MODEL], token_ms=20), parallel=1, queue_max=0) as (
            _sim, proxy), aiohttp.ClientSession() as s:
        body = {"messages": MSGS, "max_tokens": 1}
        async with s.post(f"{proxy.url}/r/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
        long = asyncio.create_task(s.post(f"{proxy.url}/r/v1/chat/completions",
                                          json={"messages": MSGS, "max_tokens": 40}))
        await wait_until(lambda: proxy.router.in_flight("a", MODEL) == 1, what="slot taken")
        async with s.post(f"{proxy.url}/r/v1/chat/completions", json=body) as resp:
            status, headers, err = resp.status, dict(resp.headers), await resp.json()
        (await long).release()
    assert status == 503 and headers["Retry-After"] == "1"
    assert err["error"]["code"] == 503 and err["error"]["type"] == "unavailable_error"


async def test_sdk_does_not_retry_a_400(tmp_path: Path) -> None:
    async with one_sim(tmp_path) as (sim, proxy):
        client = sdk(proxy)
        try:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="", messages=MSGS)
        finally:
            await client.close()
        assert completion_count(sim) == 0
    assert info.value.status_code == 400
    assert "'model' must be a non-empty string" in str(info.value)


async def test_sdk_sees_a_cut_stream_as_an_error_not_a_clean_end(tmp_path: Path) -> None:
    async with one_sim(tmp_path, SimConfig(models=[MODEL], die_after_events=3)) as (_sim, proxy):
        client = sdk(proxy, max_retries=0)
        got: list[Any] = []
        try:
            stream = await client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=50,
                                                          stream=True)
            with pytest.raises((httpx2.HTTPError, openai.APIError)):
                async for chunk in stream:
                    got.append(chunk)
        finally:
            await client.close()
        assert 0 < len(got) < 50
        assert all(c.choices[0].finish_reason is None for c in got if c.choices)
        (row,) = await request_rows(proxy)
    assert row.err and row.completion_tokens is None


# ---------------------------------------------------------------- OpenCode and Hermes replays


def client_request(fx: dict[str, Any], proxy_url: str, route: str) -> tuple[str, dict[str, str], bytes]:
    """URL, headers and body bytes the client would send, with `route` filled in."""
    headers = {k: (route if v == "ROUTE" else v) for k, v in fx["headers"].items()}
    base = f"{proxy_url}/{route}/v1" if fx["route_in"] == "path" else f"{proxy_url}/v1"
    return base + fx["path"], headers, json.dumps(fx["body"]).encode()


async def replay(proxy: Proxy, fx: dict[str, Any], route: str) -> tuple[int, dict[str, str], bytes]:
    url, headers, body = client_request(fx, proxy.url, route)
    async with aiohttp.ClientSession() as s, s.post(url, data=body, headers=headers) as resp:
        return resp.status, dict(resp.headers), await resp.read()


@pytest.mark.parametrize("name", ALL_FIXTURES)
async def test_client_fixture_replays_through_crossbar(tmp_path: Path, name: str) -> None:
    fx = fixture(name)
    async with one_sim(tmp_path) as (_sim, proxy):
        status, headers, body = await replay(proxy, fx, "opencode-shop-4711")
        rows = await request_rows(proxy)
    assert status == 200, body
    (row,) = rows
    assert row.route == "opencode-shop-4711" and row.status == 200 and row.err is None
    if fx["body"].get("stream"):
        assert headers["Content-Type"].startswith("text/event-stream")
        events = sse_data(body)
        assert events[-1] == b"[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        if fx["body"].get("stream_options", {}).get("include_usage"):
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0
        assert row.streamed
    else:
        assert json.loads(body)["usage"]["completion_tokens"] > 0
        assert not row.streamed
    assert row.prompt_tokens and row.completion_tokens  # usage read from what the client got


async def test_client_bodies_reach_the_upstream_byte_for_byte(tmp_path: Path) -> None:
    sse = [b'data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":"length"}]}\n\n',
           b"data: [DONE]\n\n"]
    async with recording_upstream(b'{"choices":[]}', sse) as up:
        up.gate.set()
        cfg = single_host_config(tmp_path / "c.toml", up.url, models=(MODEL,))
        async with crossbar_proxy(cfg) as proxy:
            sent = []
            for name in ALL_FIXTURES:
                _url, _, body = client_request(fixture(name), proxy.url, "opencode-a")
                status, _, _ = await replay(proxy, fixture(name), "opencode-a")
                assert status == 200, name
                sent.append(body)
    assert up.received == sent


async def test_opencode_turns_of_one_session_share_a_host(tmp_path: Path) -> None:
    """Turn 2 (tool call, tool result, text parts) keeps turn 1's fingerprint, so it lands on the
    same host even when another host has more room."""
    specs = {n: HostSpec({MODEL: {}}, sim=SimConfig(models=[MODEL])) for n in ("a", "b", "c")}
    async with sim_fleet(specs) as fleet:
        hosts = {n: (fleet[n].url, specs[n]) for n in specs}
        cfg = write_config(tmp_path / "c.toml", hosts, {"opencode-*": {"default_model": MODEL}})
        async with crossbar_proxy(cfg) as proxy:
            for name in ("opencode-turn1.json", "opencode-turn2.json"):
                status, _, body = await replay(proxy, fixture(name), "opencode-shop-1")
                assert status == 200, body
            status, _, _ = await replay(proxy, fixture("opencode-header-route.json"), "opencode-shop-1")
            assert status == 200
            rows = await request_rows(proxy)
    assert [r.decision for r in rows] == ["new", "reused", "new"]
    assert rows[0].host == rows[1].host and rows[0].fp == rows[1].fp != rows[2].fp
