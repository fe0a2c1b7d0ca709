"""A host whose poll answers crossbar cannot read (an alias that is not a string, JSON nested past
the parser) costs that host its poll and nothing more: crossbar starts, the other hosts are polled,
and a reload that adds such a host is applied whole, its listeners opened."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import aiohttp
from harness import HostSpec, crossbar_proxy, sim_fleet, start_mitmdump, write_config
from test_hosts import answering
from test_reload import free_port

from llamasim import SimConfig

UNHASHABLE_ALIAS = json.dumps({"data": [{"id": "m", "aliases": [{"x": 1}]}]}).encode()
ADMIN_JSON = {"Content-Type": "application/json"}
SIM = HostSpec({"m": {}}, sim=SimConfig(models=["m"]))


def lying_host(models_answer: bytes) -> AbstractAsyncContextManager[str]:
    """A stand-in llama-server, sane but for its `/v1/models` answer."""
    return answering({"/health": b'{"status":"ok"}', "/v1/models": models_answer, "/slots": b"[]",
                      "/props": b'{"total_slots":4,"default_generation_settings":{"n_ctx":4096}}'})


def still_running_after(config: Path, seconds: float) -> str:
    """Start `mitmdump -s addons/crossbar.py` as run.sh does; "running" when it still runs after
    `seconds`, else what it printed."""
    proc = start_mitmdump(config)
    try:
        time.sleep(seconds)
        if proc.proc.poll() is not None:
            return f"exited {proc.proc.returncode}: {''.join(proc.output)[-800:]}"
        return "running"
    finally:
        proc.stop()


async def test_crossbar_starts_and_serves_beside_a_host_whose_poll_answer_it_cannot_read(
        tmp_path: Path) -> None:
    async with sim_fleet({"good": SIM}) as fleet, lying_host(UNHASHABLE_ALIAS) as liar:
        config = write_config(tmp_path / "c.toml", {"good": (fleet["good"].url, SIM),
                                                    "liar": (liar, HostSpec({"m": {}}))},
                              {"r": {"hosts": ["good", "liar"], "default_model": "m"}})
        # an error logged while mitmproxy starts makes it exit: the first poll round runs then
        assert await asyncio.to_thread(still_running_after, config, 2.0) == "running"


async def test_a_reload_that_adds_such_a_host_is_applied_whole(tmp_path: Path) -> None:
    async with sim_fleet({"good": SIM}) as fleet, lying_host(UNHASHABLE_ALIAS) as liar:
        path, db = tmp_path / "c.toml", str(tmp_path / "c.db")
        write_config(path, {"good": (fleet["good"].url, SIM)},
                     {"r": {"hosts": ["good"], "default_model": "m"}}, db=db)
        async with crossbar_proxy(path) as proxy:
            port = free_port()
            write_config(path, {"good": (fleet["good"].url, SIM), "liar": (liar, HostSpec({"m": {}}))},
                         {"r": {"hosts": ["good"], "default_model": "m"},
                          "side": {"hosts": ["liar"], "default_model": "m", "listen": f"127.0.0.1:{port}"}},
                         db=db)
            async with aiohttp.ClientSession() as s, s.post(f"{proxy.url}/_crossbar/reload",
                                                            headers=ADMIN_JSON) as resp:
                status, answer = resp.status, await resp.json()
            assert status == 200, answer
            assert "liar" in proxy.addon.cfg.hosts
            _, writer = await asyncio.open_connection("127.0.0.1", port)  # the new route's listener
            writer.close()
            await writer.wait_closed()
