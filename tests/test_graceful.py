"""Graceful stop, through the real command (`mitmdump -s addons/crossbar.py`): a stream in
flight at SIGTERM finishes with its `[DONE]`, new requests on open connections get a 503, the
process exits 0 and the stream's accounting row is in the database; a second SIGTERM during a long
drain exits at once.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from harness import (
    HostSpec,
    MitmdumpProcess,
    post_bytes,
    sim_fleet,
    split_response,
    sse_data,
    start_mitmdump,
    write_config,
)

from llamasim import SimConfig, SimServer

CHAT = "/r/v1/chat/completions"
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a long answer, please"}]
TIMEOUT = aiohttp.ClientTimeout(total=60)


@asynccontextmanager
async def served(tmp_path: Path, token_ms: float, **top: Any) -> AsyncIterator[
        tuple[SimServer, MitmdumpProcess, Path]]:
    async with sim_fleet({"a": HostSpec({"m": {}}, sim=SimConfig(models=["m"], token_ms=token_ms))}) as fleet:
        cfg = write_config(tmp_path / "crossbar.toml", {"a": (fleet["a"].url, HostSpec({"m": {}}))},
                           {"r": {"hosts": ["a"], "default_model": "m"}}, **top)
        proc = start_mitmdump(cfg)
        try:
            yield fleet["a"], proc, cfg
        finally:
            if proc.proc.poll() is None:
                proc.proc.kill()
                proc.proc.wait(10)


async def wait_exit(proc: MitmdumpProcess, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while proc.proc.poll() is None:
        assert time.monotonic() < deadline, f"crossbar did not exit within {timeout}s"
        await asyncio.sleep(0.05)
    return proc.proc.returncode


async def send_on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> tuple[
        int, dict[str, str], bytes]:
    """One request on an open keep-alive connection; reads one Content-Length answer."""
    writer.write(data)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    status, headers, _ = split_response(head)
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), 30)
    return status, headers, body


async def test_sigterm_lets_the_stream_finish_refuses_new_requests_and_keeps_the_row(tmp_path: Path) -> None:
    async with served(tmp_path, token_ms=40, drain_timeout="60s") as (_sim, proc, cfg):
        port = proc.port
        # a keep-alive connection that is open before the stop
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        small = json.dumps({"messages": MSGS, "max_tokens": 1}).encode()
        status, _, _ = await send_on(reader, writer, post_bytes(CHAT, small, close=False))
        assert status == 200

        chunks: list[bytes] = []
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
            body = {"messages": MSGS, "stream": True, "max_tokens": 60}  # ~2.4 s of generation
            async with s.post(f"http://127.0.0.1:{port}{CHAT}", json=body) as resp:
                assert resp.status == 200
                chunks.append(await resp.content.readany())
                proc.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                assert proc.proc.poll() is None  # draining, not gone
                # a new request on the already open connection: a clear 503
                status, headers, err = await send_on(reader, writer, post_bytes(CHAT, small, close=False))
                assert status == 503, err
                assert json.loads(err)["error"]["code"] == 503 and int(headers["retry-after"]) >= 1
                async for chunk in resp.content.iter_any():
                    chunks.append(chunk)
        writer.close()
        events = sse_data(b"".join(chunks))
        assert events[-1] == b"[DONE]"
        assert await wait_exit(proc, 30) == 0
        log = "".join(proc.output)
        assert "Traceback" not in log, log

        db = cfg.with_suffix(".db")
        conn = sqlite3.connect(db)
        try:
            rows = conn.execute("SELECT status, streamed, completion_tokens, err FROM requests "
                                "ORDER BY id").fetchall()
        finally:
            conn.close()
        assert (200, 1, 60, None) in rows

        # and a restarted crossbar reports it
        again = start_mitmdump(cfg)
        try:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s, \
                    s.get(f"http://127.0.0.1:{again.port}/_crossbar/usage?since=1h&by=route") as resp:
                usage = await resp.json()
        finally:
            assert again.stop() == 0
    (route,) = usage
    assert route["key"] == "r" and route["requests"] == 2 and route["completion_tokens"] == 61


async def test_a_second_sigterm_during_a_long_drain_exits_at_once(tmp_path: Path) -> None:
    body = {"messages": MSGS, "stream": True, "max_tokens": 500}  # ~100 s of generation
    async with served(tmp_path, token_ms=200, drain_timeout="120s") as (_sim, proc, _), \
            aiohttp.ClientSession(timeout=TIMEOUT) as s, \
            s.post(f"http://127.0.0.1:{proc.port}{CHAT}", json=body) as resp:
        assert resp.status == 200
        await resp.content.readany()
        proc.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(1.0)
        assert proc.proc.poll() is None  # the first signal waits for the stream
        t0 = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        await wait_exit(proc, 10)
        assert time.monotonic() - t0 < 10
    assert "second signal" in "".join(proc.output)
