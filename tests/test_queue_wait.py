"""A request whose client leaves while it is queued is recorded with the time it waited."""

from __future__ import annotations

import asyncio
import sqlite3
from contextlib import suppress
from pathlib import Path

import aiohttp
from harness import HostSpec, start_mitmdump, write_config

from llamasim import SimConfig, SimServer


async def test_a_client_that_leaves_the_queue_has_its_wait_recorded(tmp_path: Path) -> None:
    sim = SimServer(SimConfig(models=["m"], token_ms=50.0))
    await sim.start()
    try:
        cfg = write_config(tmp_path / "c.toml", {"a": (sim.url, HostSpec({"m": {"parallel": 1}}))},
                           {"r": {"default_model": "m"}}, queue_max=2)
        proxy = await asyncio.to_thread(start_mitmdump, cfg, ["--set", "server=false"])
        try:
            url = f"http://127.0.0.1:{proxy.port}/r/v1/chat/completions"
            async with aiohttp.ClientSession() as s:
                async def turn(text: str, tokens: int) -> None:
                    body = {"messages": [{"role": "user", "content": text}], "max_tokens": tokens}
                    async with s.post(url, json=body) as r:
                        await r.read()

                running = asyncio.ensure_future(turn("long", 60))
                await asyncio.sleep(0.3)
                with suppress(TimeoutError):
                    await asyncio.wait_for(turn("impatient", 2), 1.5)  # queued 1.5 s, then gone
                await running
            await asyncio.sleep(1)
        finally:
            await asyncio.to_thread(proxy.stop)
    finally:
        await sim.close()
    rows = sqlite3.connect(tmp_path / "c.db").execute(
        "SELECT queued_ms, err FROM requests WHERE err LIKE '%queued%'").fetchall()
    assert len(rows) == 1, rows
    assert rows[0][0] >= 1000, rows
