"""Under mitmweb, crossbar keeps the web UI's flow list bounded (`mitmweb_keep_flows`): mitmweb
stores every flow and has no cap of its own.

The master here is mitmweb's own `WebMaster` with every addon it has (the `view` store included),
loading `addons/crossbar.py` as a script exactly like `mitmweb -s addons/crossbar.py`; only the web
UI's HTTP listener is left out, since nothing here browses it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from accounting_util import send_turn
from harness import ROOT, HostSpec, conversation, sim_fleet, single_host_config, wait_until
from mitmproxy import master, options
from mitmproxy.addons.view import View
from mitmproxy.test import taddons, tflow
from mitmproxy.tools.web.master import WebMaster

from crossbar.flowcap import FlowCap

KEEP = 10


class WebMasterWithoutUI(WebMaster):
    async def running(self) -> None:
        await master.Master.running(self)  # skip WebMaster.running: the tornado UI listener


@asynccontextmanager
async def mitmweb(config: Path) -> AsyncIterator[tuple[WebMaster, str]]:
    m = WebMasterWithoutUI(options.Options(server=False), with_termlog=False)
    m.options.update_defer(scripts=[str(ROOT / "addons" / "crossbar.py")], crossbar_config=str(config))
    task = asyncio.create_task(m.run())
    proxyserver = m.addons.get("proxyserver")
    try:
        # started = crossbar listens and every addon's `running` hook has run (the script's come
        # before tlsconfig's, whose request hook fails until its own `running` has set it up)
        tls = m.addons.get("tlsconfig")
        await wait_until(lambda: task.done() or (proxyserver.listen_addrs() and tls.certstore is not None),
                         20, 0.02, "crossbar to listen")
        if task.done():
            task.result()
        yield m, f"http://127.0.0.1:{proxyserver.listen_addrs()[0][1]}"
    finally:
        m.shutdown()
        await asyncio.wait_for(task, 10)


async def test_mitmweb_flow_list_stays_within_mitmweb_keep_flows(tmp_path: Path) -> None:
    async with sim_fleet({"a": HostSpec({"m": {}})}) as fleet:
        cfg = single_host_config(tmp_path / "crossbar.toml", fleet["a"].url, mitmweb_keep_flows=KEEP)
        async with mitmweb(cfg) as (web, url), aiohttp.ClientSession() as s:
            view = web.addons.get("view")
            assert isinstance(view, View)
            seen = 0
            for i, messages in enumerate(conversation("web", 12)):
                await send_turn(s, url, "r", messages, stream=bool(i % 2))
                async with s.get(url + "/_crossbar/hosts") as resp:  # admin calls are flows too
                    assert resp.status == 200
                seen += 2
                assert view.store_count() <= KEEP + 1  # at most the one still being answered
            await wait_until(lambda: view.store_count() <= KEEP, 5, 0.02, "the last trim")
            assert seen > 2 * KEEP
            paths = [f.request.path for f in view]
            assert paths[-1] == "/_crossbar/hosts" and "/v1/chat/completions" in paths  # newest kept


def test_the_store_is_found_when_crossbar_loads_not_only_once_it_runs() -> None:
    """Start-up may fail before the last part's `running` (a bad configuration, a busy port):
    the cap must hold all the same."""
    view, cap = View(), FlowCap(lambda: 2)
    with taddons.context(view) as tctx:
        tctx.master.addons.add(cap)  # mitmproxy calls `load`; `running` never comes
        view.add([tflow.tflow(resp=True, live=False) for _ in range(5)])
        cap.response(tflow.tflow(resp=True))
        assert view.store_count() == 2
