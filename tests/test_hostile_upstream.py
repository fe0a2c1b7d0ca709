"""Hostile hosts: an upstream that lies about usage, or sends absurd response heads, must not shut
a model off, corrupt accounting or exhaust the process. Real HTTP through the real addon in a real
mitmproxy, in front of a malicious stand-in llama-server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from harness import Proxy, crossbar_proxy, recording_upstream, request_rows, single_host_config

CHAT = "/r/v1/chat/completions"


def lying_reply(**usage: Any) -> bytes:
    return json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                    "finish_reason": "stop"}], "usage": usage}).encode()


def small_chat(n_bytes: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "q" * n_bytes}], "max_tokens": 4}


async def post(proxy: Proxy, path: str, body: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json=body) as r:
        raw = await r.read()
        return r.status, json.loads(raw) if raw.startswith(b"{") else raw


@asynccontextmanager
async def behind_liar(tmp_path: Path, reply: bytes) -> AsyncIterator[Proxy]:
    """One host that answers every completion with `reply` (its /props: n_ctx 4096, 4 slots)."""
    async with (recording_upstream(reply, [b""]) as up,
                crossbar_proxy(single_host_config(tmp_path / "c.toml", up.url)) as proxy):
        yield proxy


async def test_a_host_reporting_a_billion_prompt_tokens_does_not_shut_the_model_off(tmp_path: Path) -> None:
    async with behind_liar(tmp_path, lying_reply(prompt_tokens=1e9, completion_tokens=1)) as proxy:
        status, _ = await post(proxy, CHAT, small_chat(600))
        assert status == 200
        for _ in range(2):
            status, body = await post(proxy, CHAT, small_chat(500))  # ~150 tokens: fits 1024 per slot
            assert status == 200, body


async def test_an_embeddings_call_with_token_arrays_does_not_teach_the_guard(tmp_path: Path) -> None:
    async with behind_liar(tmp_path, lying_reply(prompt_tokens=90256, total_tokens=90256)) as proxy:
        # a token array the per-slot context holds (each id counts as a token), and a host that
        # reports 90256 prompt tokens for it
        status, _ = await post(proxy, "/r/v1/embeddings", {"input": ["x" * 256, [0] * 150]})
        assert status == 200
        status, body = await post(proxy, CHAT, small_chat(500))
        assert status == 200, body


async def test_absurd_usage_figures_are_stored_as_unknown_and_counted(tmp_path: Path) -> None:
    reply = lying_reply(prompt_tokens=2**70, completion_tokens=1e308,
                        prompt_tokens_details={"cached_tokens": 5})
    async with behind_liar(tmp_path, reply) as proxy:
        status, _ = await post(proxy, CHAT, small_chat(10))
        assert status == 200
        rows = await request_rows(proxy)
        assert len(rows) == 1
        assert (rows[0].prompt_tokens, rows[0].cached_tokens, rows[0].completion_tokens) == (None, 5, None)
        async with aiohttp.ClientSession() as s, s.get(proxy.url + "/_crossbar/metrics") as r:
            text = await r.text()
        assert 'crossbar_usage_figures_dropped_total{host="a"} 2.0' in text
        assert 'type="prompt"' not in text and 'type="completion"' not in text
        async with aiohttp.ClientSession() as s, s.get(proxy.url + "/_crossbar/usage") as r:
            assert r.status == 200
            assert (await r.json())[0]["requests"] == 1


async def test_a_cached_count_larger_than_the_prompt_is_not_believed(tmp_path: Path) -> None:
    reply = lying_reply(prompt_tokens=10, completion_tokens=3, prompt_tokens_details={"cached_tokens": 11})
    async with behind_liar(tmp_path, reply) as proxy:
        await post(proxy, CHAT, small_chat(10))
        await asyncio.sleep(0)
        row = (await request_rows(proxy))[0]
        assert (row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (10, None, 3)
