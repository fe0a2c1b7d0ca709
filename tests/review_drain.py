"""Review: requests still running when `drain_timeout` ends are cut without an accounting row.

`GracefulStop.done` waits `drain_timeout`, then closes the store while the remaining exchanges are
still live; mitmproxy then cancels their connections (a CancelledError traceback per connection in
the log) and no `requests` row is ever written for them."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import aiohttp
from harness import HostSpec, start_mitmdump, write_config

from llamasim import SimConfig, SimServer


async def test_a_stream_cut_at_drain_timeout_still_writes_its_row(tmp_path: Path) -> None:
    sim = SimServer(SimConfig(models=["m"], token_ms=50.0))
    await sim.start()
    try:
        cfg = write_config(tmp_path / "c.toml", {"a": (sim.url, HostSpec({"m": {"parallel": 2}}))},
                           {"r": {"default_model": "m"}}, drain_timeout="1s")
        proxy = await asyncio.to_thread(start_mitmdump, cfg, ["--set", "server=false"])
        url = f"http://127.0.0.1:{proxy.port}/r/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 400, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
            assert r.status == 200
            await r.content.readline()
            stopping = asyncio.ensure_future(asyncio.to_thread(proxy.stop))
            try:
                async for _ in r.content:
                    pass
            except aiohttp.ClientError:
                pass
            await stopping
    finally:
        await sim.close()
    log = "".join(proxy.output)
    rows = sqlite3.connect(tmp_path / "c.db").execute("SELECT status, err FROM requests").fetchall()
    assert len(rows) == 1, rows
    assert "Traceback" not in log, log[-2000:]
