"""The addon's hooks one by one, with mitmproxy's own test helpers (no proxy, no upstream, no poller)."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from harness import HostSpec, write_config
from mitmproxy import http
from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.test import taddons, tflow, tutils

from crossbar.addons import Runtime, make_addons
from crossbar.addons.runtime import META
from crossbar.admin import Admin
from crossbar.app import Router
from crossbar.config import load_config
from crossbar.reload import plan_reload
from crossbar.tap import WHOLE_BODY_MAX, SSETap

CHAT_BODY = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}


@dataclass
class Rig:
    addons: list[Any]
    router: Router
    tctx: Any

    async def hook(self, name: str, flow: http.HTTPFlow) -> None:
        """Every addon's `name` hook in order, as mitmproxy calls them."""
        for addon in self.addons:
            handler = getattr(addon, name, None)
            if handler is not None:
                result = handler(flow)
                if asyncio.iscoroutine(result):
                    await result

    async def request(self, flow: http.HTTPFlow) -> None:
        await asyncio.wait_for(self.hook("request", flow), 5)  # a slot wait must never hang the suite

    async def responseheaders(self, flow: http.HTTPFlow) -> None:
        await self.hook("responseheaders", flow)

    async def response(self, flow: http.HTTPFlow) -> None:
        await self.hook("response", flow)

    async def error(self, flow: http.HTTPFlow) -> None:
        await self.hook("error", flow)

    async def rows(self) -> list[Any]:
        self.router.account_finished()
        await asyncio.to_thread(self.router.store.flush)
        return await asyncio.to_thread(self.router.store.requests_since, 0)


async def host_accepts(host: str, port: int, timeout: float) -> None:
    """Stand-in for the TCP pre-flight: these hosts are never contacted (the flows are never
    sent), so the hook tests treat them as accepting connections."""
    return None


@asynccontextmanager
async def rig(tmp_path: Path, base_url: str = "http://llama-1.test:8080") -> AsyncIterator[Rig]:
    """The addon configured from a TOML in a taddons context, with a hand-built Router."""
    cfg = write_config(tmp_path / "crossbar.toml", {"a": (base_url, HostSpec({"m": {"parallel": 4}}))},
                       {"r": {"hosts": ["a"], "default_model": "m"}})
    rt = Runtime()
    addons = make_addons(rt)
    with taddons.context(Proxyserver(), *addons) as tctx:  # proxyserver owns the options crossbar sets
        tctx.configure(addons[0], crossbar_config=str(cfg))
        assert rt.cfg is not None
        assert tctx.options.connection_strategy == "lazy"
        router = Router(rt.cfg)
        router.open()
        rt.router, rt.admin = router, Admin(router)
        try:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr("crossbar.addons.failover.preflight", host_accepts)
                yield Rig(addons, router, tctx)
        finally:
            await router.close()


def make_flow(path: str, body: Any = None, method: str = "POST") -> http.HTTPFlow:
    content = b"" if body is None else json.dumps(body).encode()
    req = tutils.treq(method=method.encode(), host="placeholder", port=9, path=path.encode(),
                      headers=http.Headers(host="127.0.0.1:7777", content_type="application/json"),
                      content=content)
    flow = tflow.tflow(req=req)
    flow.client_conn.sockname = ("127.0.0.1", 7777)  # the listener the client reached (its Host)
    return flow


def sse_response() -> http.Response:
    return tutils.tresp(headers=http.Headers(content_type="text/event-stream"), content=b"")


async def test_request_rewrites_the_upstream_and_strips_the_route(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        f = make_flow("/r/v1/chat/completions?a=1&b=two", CHAT_BODY)
        await r.request(f)
        assert f.response is None  # forwarded, not answered
        assert (f.request.scheme, f.request.host, f.request.port) == ("http", "llama-1.test", 8080)
        assert f.request.path == "/v1/chat/completions"  # parameters crossbar does not document are dropped
        assert f.request.content == json.dumps(CHAT_BODY).encode()  # body untouched
        assert r.router.in_flight("a", "m") == 1
        ex = f.metadata[META]
        assert (ex.host, ex.key.route, ex.key.model, ex.decision) == ("a", "r", "m", "new")
        await r.response(f)
        assert r.router.in_flight("a", "m") == 0


async def test_a_reload_during_the_pre_flight_sends_the_request_where_it_moved_the_host(
        tmp_path: Path) -> None:
    """The pre-flight awaits a connection; a reload meanwhile may give the host a new address.
    The request goes to that one (checked again when mitmproxy connects), never to the old."""
    async with rig(tmp_path) as r:
        hosts = {"a": ("http://llama-2.test:9090", HostSpec({"m": {"parallel": 4}}))}
        routes = {"r": {"hosts": ["a"], "default_model": "m"}}
        moved = load_config(write_config(tmp_path / "moved.toml", hosts, routes, db=str(r.router.cfg.db)))
        checked: list[tuple[str, int]] = []

        async def reload_while_connecting(host: str, port: int, timeout: float) -> None:
            checked.append((host, port))
            r.router.reconfigure(moved, plan_reload(r.router.cfg, moved))

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("crossbar.addons.failover.preflight", reload_while_connecting)
            f = make_flow("/r/v1/chat/completions", CHAT_BODY)
            await r.request(f)
        assert checked == [("llama-1.test", 8080)]
        assert (f.request.host, f.request.port) == ("llama-2.test", 9090)


async def test_request_keeps_the_hosts_base_path(tmp_path: Path) -> None:
    async with rig(tmp_path, "https://llama-2.test:8443/llm") as r:
        f = make_flow("/r/v1/chat/completions", CHAT_BODY)
        await r.request(f)
        assert (f.request.scheme, f.request.host, f.request.port) == ("https", "llama-2.test", 8443)
        assert f.request.path == "/llm/v1/chat/completions"
        await r.response(f)


async def test_unknown_route_is_a_json_short_circuit(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        f = make_flow("/nope/v1/chat/completions", CHAT_BODY)
        await r.request(f)
        assert f.response is not None and f.response.status_code == 404
        assert f.response.headers["content-type"] == "application/json"
        err = json.loads(f.response.content or b"")["error"]
        assert err["code"] == 404 and err["type"] and "nope" in err["message"]
        assert f.request.host == "placeholder"  # never rewritten towards a host
        assert r.router.in_flight("a", "m") == 0


async def test_responseheaders_tees_sse_but_not_json(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        sse = make_flow("/r/v1/chat/completions", {**CHAT_BODY, "stream": True})
        await r.request(sse)
        sse.response = sse_response()
        await r.responseheaders(sse)
        assert isinstance(sse.response.stream, SSETap)

        plain = make_flow("/r/v1/chat/completions", CHAT_BODY)
        await r.request(plain)
        plain.response = tutils.tresp(headers=http.Headers(content_type="application/json"))
        await r.responseheaders(plain)
        assert not plain.response.stream
        for f in (sse, plain):
            await r.response(f)


async def test_a_full_cycle_writes_one_row_with_the_usage(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        f = make_flow("/r/v1/chat/completions", CHAT_BODY)
        await r.request(f)
        reply = {"usage": {"prompt_tokens": 12, "completion_tokens": 3},
                 "timings": {"cache_n": 10, "prompt_n": 2, "predicted_n": 3}}
        f.response = tutils.tresp(headers=http.Headers(content_type="application/json"),
                                  content=json.dumps(reply).encode())
        await r.responseheaders(f)
        await r.response(f)
        (row,) = await r.rows()
        assert (row.host, row.status, row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (
            "a", 200, 12, 10, 3)


async def test_response_then_error_write_exactly_one_row(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        f = make_flow("/r/v1/chat/completions", CHAT_BODY)
        await r.request(f)
        f.response = sse_response()
        await r.responseheaders(f)
        await r.response(f)
        f.error = tflow.terr("Client disconnected.")
        await r.error(f)
        await r.response(f)
        rows = await r.rows()
        assert len(rows) == 1 and rows[0].status == 200
        assert rows[0].err is None  # the row is what the exchange held when it ended
        assert r.router.in_flight("a", "m") == 0
        assert not r.router.live


async def test_error_alone_writes_one_row_and_frees_the_slot(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        f = make_flow("/r/v1/chat/completions", {**CHAT_BODY, "stream": True})
        await r.request(f)
        f.error = tflow.terr("HTTP/1 protocol error: peer closed connection")
        await r.error(f)
        await r.error(f)
        (row,) = await r.rows()
        assert row.err and "peer closed" in row.err and row.streamed is True
        assert r.router.in_flight("a", "m") == 0


async def test_admin_is_answered_without_an_upstream(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        f = make_flow("/_crossbar/hosts", method="GET")
        await r.request(f)
        assert f.response is not None and f.response.status_code == 200
        assert f.request.host == "placeholder"
        hosts = json.loads(f.response.content or b"")
        assert set(hosts) == {"a"} and hosts["a"]["healthy"] is True
        assert META not in f.metadata
        await r.response(f)  # later hooks leave an admin answer alone
        assert await r.rows() == []


async def test_a_bug_in_routing_is_a_json_500_not_a_flow_to_the_placeholder(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        async def broken(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("a bug")

        r.router.lease = broken  # type: ignore[method-assign]
        f = make_flow("/r/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
        await r.request(f)
        assert f.response is not None and f.response.status_code == 500
        assert json.loads(f.response.content)["error"]["type"] == "server_error"
        assert f.request.host == "placeholder"  # never rewritten
        await r.error(f)  # what mitmproxy would report for a flow it could not send
        assert r.router.fleet.healthy("a")  # the host is not blamed for crossbar's bug
        assert r.router.in_flight("a", "m") == 0


async def test_admin_failure_is_a_json_500(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        def broken(*args: Any) -> None:
            raise RuntimeError("database gone")

        r.router.store.usage = broken  # type: ignore[method-assign]
        f = make_flow("/_crossbar/usage", method="GET")
        await r.request(f)
        assert f.response is not None and f.response.status_code == 500
        assert json.loads(f.response.content)["error"]["code"] == 500


async def test_a_compressed_answer_whose_decoding_fails_counts_no_usage(tmp_path: Path) -> None:
    """The worker thread that decodes a compressed answer fails: the request ends without usage,
    and the still-compressed bytes are never read as a plain answer (a stored gzip block carries
    the JSON as it is)."""
    # large enough to be read at its edges, where a stored block shows the JSON's tail as it is
    text = "x" * (WHOLE_BODY_MAX + 1)
    reply = json.dumps({"choices": [{"message": {"content": text}}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 3}}).encode()

    def fails(*args: Any) -> Any:
        raise RuntimeError("the decoding thread failed")

    async with rig(tmp_path) as r:
        f = make_flow("/r/v1/chat/completions", CHAT_BODY)
        await r.request(f)
        headers = http.Headers(content_type="application/json", content_encoding="gzip")
        f.response = tutils.tresp(headers=headers, content=b"")
        f.response.raw_content = gzip.compress(reply, compresslevel=0)
        await r.responseheaders(f)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("crossbar.addons.account.usage_of_encoded", fails)
            with pytest.raises(RuntimeError):
                await r.response(f)
        rows = await r.rows()
        assert len(rows) == 1 and rows[0].prompt_tokens is None and rows[0].completion_tokens is None
        assert r.router.in_flight("a", "m") == 0
