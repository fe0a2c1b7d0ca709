"""One request without a user message (an embeddings call, a /v1/completions prompt, a chat with
only a system message) creates the route's key-less lease; new conversations follow it only while
its host has a free slot, so they never all stack on one host while another sits idle."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import aiohttp
from harness import HostSpec, start_mitmdump, write_config

from llamasim import SimConfig, SimServer


async def test_an_embeddings_call_does_not_stack_every_new_session_on_one_host(tmp_path: Path) -> None:
    sims = [SimServer(SimConfig(models=["m"], token_ms=40.0)) for _ in range(2)]
    for sim in sims:
        await sim.start()
    try:
        hosts = {name: (sim.url, HostSpec({"m": {"parallel": 1}}))
                 for name, sim in zip("ab", sims, strict=True)}
        cfg = write_config(tmp_path / "c.toml", hosts, {"r": {"default_model": "m"}}, queue_max=2)
        proxy = await asyncio.to_thread(start_mitmdump, cfg, ["--set", "server=false"])
        try:
            base = f"http://127.0.0.1:{proxy.port}/r/v1"
            async with aiohttp.ClientSession() as s:
                async with s.post(f"{base}/embeddings", json={"input": "hello"}) as r:
                    assert r.status == 200

                async def turn(i: int) -> int:
                    body = {"messages": [{"role": "user", "content": f"conversation {i}"}], "max_tokens": 20}
                    async with s.post(f"{base}/chat/completions", json=body,
                                      headers={"x-session-id": f"ses_{i}"}) as r:
                        await r.read()
                        return r.status

                statuses = await asyncio.gather(*(turn(i) for i in range(4)))
            await asyncio.sleep(1)
        finally:
            await asyncio.to_thread(proxy.stop)
    finally:
        for sim in sims:
            await sim.close()
    rows = sqlite3.connect(tmp_path / "c.db").execute(
        "SELECT host, decision FROM requests WHERE fp LIKE 's:%'").fetchall()
    assert statuses == [200] * 4, (statuses, rows)
    assert {host for host, _ in rows} == {"a", "b"}, rows
