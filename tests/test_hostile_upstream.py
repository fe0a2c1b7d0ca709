"""Hostile hosts: an upstream that lies about usage, or sends absurd response heads, must not shut
a model off, corrupt accounting or exhaust the process. Real HTTP through the real addon in a real
mitmproxy, in front of a malicious stand-in llama-server."""

from __future__ import annotations

import asyncio
import gzip
import json
import time
import urllib.request
import zlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from accounting_util import scrape, summed
from harness import (
    HostSpec,
    Proxy,
    crossbar_proxy,
    recording_upstream,
    request_rows,
    sim_fleet,
    single_host_config,
    write_config,
)
from test_hostile_limits import CHAT as LIMITS_CHAT
from test_hostile_limits import connect, head, raw_upstream, rig

from llamasim import SimConfig

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


# ---------------------------------------------------------------- a compressed answer


def gzip_bomb(decoded_mib: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    mib = b"a" * (1 << 20)
    parts = [packer.compress(b'{"x":"')] + [packer.compress(mib) for _ in range(decoded_mib)]
    return b"".join([*parts, packer.compress(b'"}'), packer.flush()])


async def test_usage_is_read_from_a_gzip_answer_that_reaches_the_client_unchanged(tmp_path: Path) -> None:
    reply = gzip.compress(lying_reply(prompt_tokens=5, completion_tokens=2))
    async with (recording_upstream(reply, [b""], {"Content-Encoding": "gzip"}) as up,
                crossbar_proxy(single_host_config(tmp_path / "c.toml", up.url)) as proxy):
        async with (aiohttp.ClientSession(auto_decompress=False) as s,
                    s.post(proxy.url + CHAT, json=small_chat(10)) as r):
            assert r.status == 200 and r.headers["Content-Encoding"] == "gzip"
            assert await r.read() == reply
        row = (await request_rows(proxy))[0]
    assert (row.prompt_tokens, row.completion_tokens) == (5, 2)


def gzip_upstream(payload: bytes) -> AbstractAsyncContextManager[str]:
    """Answers a completion with `payload` as a gzip-encoded JSON body."""
    async def complete(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        await writer.drain()

    return raw_upstream(complete)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_a_gzip_bomb_is_not_decoded_whole_on_the_event_loop(tmp_path: Path) -> None:
    """1 MiB on the wire, 1 GiB decoded: crossbar reads usage within its bound, off the loop,
    and the client still gets the answer as sent (a real mitmdump process, measured)."""
    payload = await asyncio.to_thread(gzip_bomb, 1024)
    async with gzip_upstream(payload) as url, rig(tmp_path, base_url=url) as r:
        before = rss_mib(r.proxy.proc.pid)
        reader, writer = await connect(r.port)
        writer.write(head(Content_Length=str(len(LIMITS_CHAT)), Connection="close") + LIMITS_CHAT)
        answer = asyncio.ensure_future(asyncio.wait_for(reader.read(), 60))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{r.port}/_crossbar/hosts", timeout=30).read())
        stalled = time.monotonic() - started
        got = await answer
        writer.close()
        grown = rss_mib(r.proxy.proc.pid) - before
        await asyncio.sleep(0.5)
        metrics = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{r.port}/_crossbar/metrics", timeout=30).read())
    assert got.endswith(payload)
    assert grown < 256, f"crossbar grew by {grown:.0f} MiB for a {len(payload) >> 10} KiB answer"
    assert stalled < 2, f"an admin call waited {stalled:.1f}s behind the decoding"
    assert b'crossbar_usage_figures_dropped_total{host="a"} 1.0' in metrics


# ---------------------------------------------------------------- a retried answer


async def test_a_retried_answer_over_the_bound_is_crossbars_502(tmp_path: Path) -> None:
    big = json.dumps({"data": [{"embedding": [0.125] * 300_000}]}).encode()  # over 2 x 64 KiB + 1 MiB
    assert len(big) > 2 << 20
    # a has more free slots (so takes the request) and fails it once; b answers the retry
    failing = HostSpec({"m": {}}, sim=SimConfig(models=["m"], n_slots=8, fail_status=500, fail_times=1))
    async with sim_fleet({"a": failing}) as fleet, recording_upstream(big, [b""]) as up:
        hosts = {"a": (fleet["a"].url, failing), "b": (up.url, HostSpec({"m": {}}))}
        routes = {"r": {"hosts": ["a", "b"], "default_model": "m"}}
        cfg = write_config(tmp_path / "c.toml", hosts, routes, max_body="64KiB")
        async with crossbar_proxy(cfg) as proxy:
            status, body = await post(proxy, CHAT, small_chat(10))
            async with aiohttp.ClientSession() as s, s.get(proxy.url + "/_crossbar/metrics") as r:
                text = await r.text()
    assert status == 502 and body["error"]["type"] == "bad_gateway", body
    assert "retried answer is over" in body["error"]["message"]
    assert 'crossbar_rejected_total{reason="upstream_too_large"} 1.0' in text


# ---------------------------------------------------------------- answers crossbar streams through


def sse_head(content_type: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n" % content_type


def sse_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@asynccontextmanager
async def behind_raw_host(tmp_path: Path, complete: Any) -> AsyncIterator[Proxy]:
    """One host whose every completion answer `complete(writer)` writes byte for byte."""
    async with raw_upstream(complete) as url:
        cfg = write_config(tmp_path / "c.toml", {"a": (url, HostSpec({"m": {"parallel": 1}}))},
                           {"r": {"hosts": ["a"], "default_model": "m"}})
        async with crossbar_proxy(cfg) as proxy:
            yield proxy


STREAMED = {"messages": [{"role": "user", "content": "hi"}], "stream": True}


async def test_a_figure_too_large_for_a_float_does_not_stop_the_stream(tmp_path: Path) -> None:
    events = [b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n',
              b'data: {"choices":[{"finish_reason":"stop","delta":{}}],"timings":{"predicted_n":1,'
              b'"predicted_ms":1' + b"0" * 400 + b"}}\n\n",  # orjson refuses it; json reads a Python int
              b"data: [DONE]\n\n"]

    async def complete(writer: asyncio.StreamWriter) -> None:
        writer.write(sse_head(b"text/event-stream"))
        writer.write(b"".join(map(sse_chunk, events)) + b"0\r\n\r\n")
        await writer.drain()

    async with behind_raw_host(tmp_path, complete) as proxy:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s, \
                s.post(proxy.url + CHAT, json=STREAMED) as resp:
            got = await resp.read()
        (row,) = await request_rows(proxy)
        _, samples = await scrape(proxy.url)
    dropped = summed(samples, "crossbar_usage_figures_dropped_total", host="a")
    assert got == b"".join(events)  # the whole stream, unchanged
    assert (row.status, row.err, row.completion_tokens) == (200, None, 1)
    assert dropped == 1  # the time was out of range


async def test_an_event_stream_named_in_capitals_is_streamed(tmp_path: Path) -> None:
    first = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
    more = asyncio.Event()

    async def complete(writer: asyncio.StreamWriter) -> None:
        writer.write(sse_head(b"Text/Event-Stream"))
        writer.write(sse_chunk(first))
        await writer.drain()
        await more.wait()
        writer.write(sse_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    async with behind_raw_host(tmp_path, complete) as proxy, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s, \
            s.post(proxy.url + CHAT, json=STREAMED) as resp:
        got = await asyncio.wait_for(resp.content.readline(), 5)  # before the host sends the rest
        more.set()
        await resp.read()
    assert got == first.rstrip(b"\n") + b"\n"
