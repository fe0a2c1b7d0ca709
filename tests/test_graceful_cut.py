"""Requests still running when `drain_timeout` ends (a stream, and one queued behind it) are cut
the way a leaving client would be, and each still writes its accounting row before the store
closes; nothing in the log is a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

import aiohttp
from harness import HostSpec, start_mitmdump, write_config

from llamasim import SimConfig, SimServer


async def test_a_stream_cut_at_drain_timeout_still_writes_its_row(tmp_path: Path) -> None:
    sim = SimServer(SimConfig(models=["m"], token_ms=50.0))
    await sim.start()
    try:
        cfg = write_config(tmp_path / "c.toml", {"a": (sim.url, HostSpec({"m": {"parallel": 1}}))},
                           {"r": {"default_model": "m"}}, drain_timeout="1s")
        proxy = await asyncio.to_thread(start_mitmdump, cfg, ["--set", "server=false"])
        url = f"http://127.0.0.1:{proxy.port}/r/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 400, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
            assert r.status == 200
            await r.content.readline()
            queued = asyncio.ensure_future(s.post(url, json=body))
            await asyncio.sleep(0.5)
            stopping = asyncio.ensure_future(asyncio.to_thread(proxy.stop))
            try:
                async for _ in r.content:
                    pass
            except aiohttp.ClientError:
                pass
            await stopping
            with contextlib.suppress(aiohttp.ClientError):
                (await queued).close()
    finally:
        await sim.close()
    log = "".join(proxy.output)
    rows = sqlite3.connect(tmp_path / "c.db").execute("SELECT status, err FROM requests").fetchall()
    assert len(rows) == 2, rows
    assert all(err for _, err in rows), rows
    assert "Traceback" not in log, log[-2000:]
