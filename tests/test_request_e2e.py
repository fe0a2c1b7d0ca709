"""Request parsing over real HTTP: crossbar in a real mitmproxy in front of a recording upstream.

Model names are bounded and printable, only documented query parameters reach the upstream, the
prompt estimate counts tools, tool calls and token arrays, fingerprints are keyed with the
install's secret (stable across restarts), and a large body is parsed off the event loop.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import stat
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import (
    Proxy,
    RecordingUpstream,
    crossbar_proxy,
    is_error_shape,
    recording_upstream,
    request_rows,
    single_host_config,
)

from crossbar import request as req

REPLY = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1}}).encode()
CHAT = "/r/v1/chat/completions"


@asynccontextmanager
async def _proxied(tmp_path: Path) -> AsyncIterator[tuple[RecordingUpstream, Proxy]]:
    async with (recording_upstream(REPLY, [b""]) as up,
                crossbar_proxy(single_host_config(tmp_path / "c.toml", up.url)) as proxy):
        yield up, proxy


async def _post(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


async def _get(url: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json(content_type=None)


@pytest.mark.parametrize("model", ["m" * 10_000, "evil\x1b]0;pwned\x07", "a\nb"])
async def test_unbounded_or_unprintable_model_is_400_and_writes_nothing(tmp_path: Path, model: str) -> None:
    async with _proxied(tmp_path) as (up, proxy):
        status, body = await _post(proxy.url + CHAT, {"model": model, "messages": [
            {"role": "user", "content": "hi"}]})
        get_status, get_body = await _get(proxy.url + "/r/props?model=" + "m" * 300)
        rows = await request_rows(proxy)
        leases = proxy.router.leases.count()
    assert status == 400 and is_error_shape(body, 400), body
    assert get_status == 400 and is_error_shape(get_body, 400), get_body
    assert up.received == [] and rows == [] and leases == 0


async def test_only_documented_query_parameters_reach_the_upstream(tmp_path: Path) -> None:
    async with _proxied(tmp_path) as (up, proxy):
        status, _ = await _get(proxy.url + "/r/props?model=m&autoload=true&x=1")
        status_plain, _ = await _get(proxy.url + "/r/props?autoload=true")
    assert status == status_plain == 200
    client = [t for t in up.targets if "model=m" in t or "autoload=true" in t]
    assert client == ["/props?model=m&autoload=false"], up.targets
    assert not any("autoload=true" in t or "x=1" in t for t in up.targets)


async def test_tools_count_toward_the_context_guard(tmp_path: Path) -> None:
    # the upstream's slots hold 4096 tokens; 40 KB of tool definitions cannot fit
    tools = [{"type": "function", "function": {"name": f"tool{i}", "description": "d" * 400,
                                               "parameters": {"type": "object"}}} for i in range(100)]
    async with _proxied(tmp_path) as (up, proxy):
        status, body = await _post(proxy.url + CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                                      "tools": tools})
    assert status == 400 and body["error"]["type"] == "exceed_context_size_error", body
    assert up.received == []


async def test_token_arrays_count_toward_the_context_guard(tmp_path: Path) -> None:
    async with _proxied(tmp_path) as (up, proxy):
        status, body = await _post(proxy.url + "/r/v1/embeddings", {"input": ["x" * 256, [0] * 30000]})
    assert status == 400 and body["error"]["type"] == "exceed_context_size_error", body
    assert up.received == []


async def test_fingerprints_are_keyed_and_stable_across_restart(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    fps = []
    async with recording_upstream(REPLY, [b""]) as up:
        cfg = single_host_config(tmp_path / "c.toml", up.url)
        for _ in range(2):  # a restart reads the same secret back
            async with crossbar_proxy(cfg) as proxy:
                status, _ = await _post(proxy.url + CHAT, {"messages": messages})
                assert status == 200
                fps.append((await request_rows(proxy))[-1].fp)
    secret = tmp_path / "c.db.secret"  # beside the database
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    key = bytes.fromhex(secret.read_text().strip())
    plain = hashlib.sha256(b"crossbar-fp-1\0system:8:be briefuser:5:hello").hexdigest()
    keyed = hmac.new(key, b"crossbar-fp-2\0system:8:be briefuser:5:hello", hashlib.sha256).hexdigest()
    assert fps == [keyed, keyed] != [plain, plain]


async def test_a_large_body_is_parsed_off_the_event_loop(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[tuple[int, int]] = []
    load = req._load_object

    def spy(raw: bytes, *args: Any) -> dict[str, Any]:
        threads.append((len(raw), threading.get_ident()))
        return load(raw, *args)

    monkeypatch.setattr(req, "_load_object", spy)
    small = {"messages": [{"role": "user", "content": "hi"}]}
    # large, yet a short prompt (the upstream's slots hold 4096 tokens)
    large = {**small, "logit_bias": {str(token): -100 for token in range(200_000)}}
    async with recording_upstream(REPLY, [b""]) as up:
        cfg = single_host_config(tmp_path / "c.toml", up.url, max_body="8MiB")
        async with crossbar_proxy(cfg) as proxy:
            loop_thread = threading.get_ident()
            assert (await _post(proxy.url + CHAT, small))[0] == 200
            async with aiohttp.ClientSession() as s, s.post(proxy.url + CHAT, json=large) as r:
                await r.read()  # the recording upstream refuses bodies over 1 MiB: only the peek matters
    (small_len, small_thread), (large_len, large_thread) = threads
    assert small_len < 1000 and large_len > 2 * 1024 * 1024
    assert small_thread == loop_thread != large_thread
