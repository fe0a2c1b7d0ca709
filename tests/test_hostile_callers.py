"""Hostile callers against the admin API and identity: cross-site requests, DNS rebinding, missing
tokens, spoofed tailscale names. Raw HTTP over real sockets to the real addon in a real mitmproxy."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from harness import HostSpec, Proxy, crossbar_proxy, raw_http, sim_fleet, split_response, write_config
from test_e2e_v2 import WHOIS_TALOS, fake_tailscale

from crossbar.admin import usage_table
from crossbar.admin_access import AdminPolicy, host_of, refusal
from crossbar.config import ConfigError, parse_address

TOKEN = "s3cret-admin-token-0123456789"
DRAIN = b'{"drain":true}'


def request(port: int, method: str, path: str, body: bytes = b"", **headers: str) -> bytes:
    fields = {"Host": f"127.0.0.1:{port}", "Connection": "close", **headers}
    if method == "POST":
        fields["Content-Length"] = str(len(body))
    head = [f"{method} {path} HTTP/1.1"] + [f"{k.replace('_', '-')}: {v}" for k, v in fields.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def call(proxy: Proxy, method: str, path: str, body: bytes = b"", **headers: str) -> tuple[int, Any]:
    status, _, raw = split_response(await raw_http(proxy.port, request(proxy.port, method, path, body,
                                                                       **headers)))
    return status, raw if not raw.startswith((b"{", b"[")) else json.loads(raw)


@asynccontextmanager
async def admin_fleet(tmp_path: Path, **top: Any) -> AsyncIterator[Proxy]:
    spec = HostSpec({"m": {}})
    async with sim_fleet({"a": spec}) as fleet:
        routes: dict[str, Any] = {"r": {"default_model": "m"}}
        if "identity" in top:
            routes["talos-only"] = {"default_model": "m", "peers": ["talos"]}
        cfg = write_config(tmp_path / "c.toml", {"a": (fleet["a"].url, spec)}, routes, **top)
        async with crossbar_proxy(cfg) as proxy:
            yield proxy


JSON = "application/json"


@pytest.mark.parametrize(("what", "headers"), [
    ("a form's text/plain body", {"Content-Type": "text/plain"}),
    ("no content type", {}),
    ("a foreign Origin", {"Content-Type": JSON, "Origin": "http://evil.example"}),
    ("an opaque Origin", {"Content-Type": JSON, "Origin": "null"}),
    ("a cross-site fetch", {"Content-Type": JSON, "Sec-Fetch-Site": "cross-site"}),
    ("a same-site fetch from another port", {"Content-Type": JSON, "Sec-Fetch-Site": "same-site"}),
    ("a rebinding page's Host", {"Content-Type": JSON, "Host": "evil.example:7777"}),
])
async def test_cross_site_changes_are_refused_and_change_nothing(tmp_path: Path, what: str,
                                                                 headers: dict[str, str]) -> None:
    async with admin_fleet(tmp_path) as proxy:
        status, body = await call(proxy, "POST", "/_crossbar/hosts/a", DRAIN, **headers)
        assert status in (403, 415), (what, body)
        assert body["error"]["code"] == status
        assert not proxy.router.fleet.draining("a")
        status, _ = await call(proxy, "POST", "/_crossbar/routes/r", b'{"release":true}', **headers)
        assert status in (403, 415)


async def test_same_origin_json_changes_pass(tmp_path: Path) -> None:
    async with admin_fleet(tmp_path) as proxy:
        status, body = await call(proxy, "POST", "/_crossbar/hosts/a", DRAIN, Content_Type=JSON,
                                  Origin=f"http://127.0.0.1:{proxy.port}", Sec_Fetch_Site="same-origin")
        assert (status, body) == (200, {"ok": True})
        assert proxy.router.fleet.draining("a")
        status, _ = await call(proxy, "POST", "/_crossbar/hosts/a", b'{"drain":false}',
                               Content_Type="application/json; charset=utf-8", Host=f"localhost:{proxy.port}")
        assert status == 200 and not proxy.router.fleet.draining("a")


@pytest.mark.parametrize("path", ["/_crossbar/routes", "/_crossbar/usage", "/_crossbar/hosts",
                                  "/_crossbar/events", "/_crossbar/metrics", "/_crossbar/"])
async def test_reads_refuse_a_foreign_host(tmp_path: Path, path: str) -> None:
    async with admin_fleet(tmp_path, admin_names=["crossbar.tail1a2b.ts.net"]) as proxy:
        status, _ = await call(proxy, "GET", path, Host=f"rebind.evil.example:{proxy.port}")
        assert status == 403
        status, _ = await call(proxy, "GET", path, Host=f"crossbar.tail1a2b.ts.net.:{proxy.port}")
        assert status == 200


async def test_admin_token(tmp_path: Path) -> None:
    async with admin_fleet(tmp_path, admin_token=TOKEN) as proxy:
        status, body = await call(proxy, "GET", "/_crossbar/routes")
        assert status == 401 and body["error"]["type"] == "authentication_error"
        status, _ = await call(proxy, "GET", "/_crossbar/routes", Authorization="Bearer wrong-token")
        assert status == 401
        status, _ = await call(proxy, "POST", "/_crossbar/hosts/a", DRAIN, Content_Type=JSON)
        assert status == 401 and not proxy.router.fleet.draining("a")
        status, _ = await call(proxy, "GET", "/_crossbar/routes", Authorization=f"Bearer {TOKEN}")
        assert status == 200
        status, _ = await call(proxy, "POST", "/_crossbar/hosts/a", DRAIN, Content_Type=JSON,
                               Authorization=f"Bearer {TOKEN}")
        assert status == 200 and proxy.router.fleet.draining("a")
        status, page = await call(proxy, "GET", "/_crossbar/")  # the page itself holds no data
        assert status == 200 and b"<html" in page


async def raw_admin_change(proxy: Proxy, *head: bytes) -> tuple[int, dict[str, str], bytes]:
    """A drain of host a with these head lines, in bytes as a client may send them."""
    raw = (b"POST /_crossbar/hosts/a HTTP/1.1\r\n" + b"".join(line + b"\r\n" for line in head)
           + b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
           % len(DRAIN) + DRAIN)
    return split_response(await raw_http(proxy.port, raw))


@pytest.mark.parametrize(("what", "head", "top", "status"), [
    ("a Host port of non-ASCII digits", ("Host: 127.0.0.1:²".encode(), b"Origin: http://127.0.0.1"), {}, 403),
    ("a token that is not UTF-8", (b"Host: 127.0.0.1", b"Authorization: Bearer \xff\xfe-not-it"),
     {"admin_token": TOKEN}, 401),
])
async def test_odd_bytes_in_admin_heads_get_a_json_refusal(tmp_path: Path, what: str, head: tuple[bytes, ...],
                                                           top: dict[str, Any], status: int) -> None:
    async with admin_fleet(tmp_path, **top) as proxy:
        got, headers, body = await raw_admin_change(proxy, *head)
        assert (got, headers.get("content-type")) == (status, JSON), (what, got, body[:300])
        assert not proxy.router.fleet.draining("a")


async def test_admin_peers(tmp_path: Path) -> None:
    async with admin_fleet(tmp_path, identity="header", admin_peers=["talos"]) as proxy:
        status, _ = await call(proxy, "GET", "/_crossbar/hosts", X_Crossbar_Peer="dixie")
        assert status == 403
        status, _ = await call(proxy, "GET", "/_crossbar/hosts")
        assert status == 403
        status, _ = await call(proxy, "GET", "/_crossbar/hosts", X_Crossbar_Peer="talos")
        assert status == 200


async def test_a_node_calling_itself_talos_is_not_talos(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    spoof = {"Node": {"Name": "evil.tail1a2b.ts.net.", "ComputedName": "talos",
                      "Hostinfo": {"Hostname": "talos"}},
             "UserProfile": {"LoginName": "mallory@github"}}
    fake_tailscale(tmp_path, spoof)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    async with admin_fleet(tmp_path, identity="tailscale", admin_peers=["talos"]) as proxy:
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
        status, _ = await call(proxy, "POST", "/talos-only/v1/chat/completions", body, Content_Type=JSON)
        assert status == 403
        status, _ = await call(proxy, "GET", "/_crossbar/hosts")
        assert status == 403


async def test_the_real_talos_is_admitted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tailscale(tmp_path, WHOIS_TALOS)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    async with admin_fleet(tmp_path, identity="tailscale", admin_peers=["talos"]) as proxy:
        status, _ = await call(proxy, "GET", "/_crossbar/hosts")
        assert status == 200


async def test_the_usage_table_escapes_control_characters(tmp_path: Path) -> None:
    async with admin_fleet(tmp_path) as proxy:
        proxy.router.store.record_request({
            "route": "r", "fp": "", "model": "m\x1b]0;pwned\x07\x1b[2J\r\nfake", "host": "a",
            "started": 1e9 * 2, "queued_ms": 0, "ttfb_ms": 1, "total_ms": 1, "status": 200,
            "streamed": False, "prompt_tokens": 1, "cached_tokens": 0, "completion_tokens": 1,
            "err": None, "decision": "new",
        })
        status, text = await call(proxy, "GET", "/_crossbar/usage?by=model&since=1970-01-01T00:00:00Z",
                                  Accept="text/plain")
        assert status == 200
        assert not any(c < 0x20 and c != 0x0A for c in text)
        assert b"m\\x1b]0;pwned\\x07\\x1b[2J\\r\\nfake" in text
        assert text.count(b"\n") == 2  # the head and one row


# ---------------------------------------------------------------- the pure decision, as a table

POLICY = AdminPolicy(frozenset({"crossbar.ts.net", "100.64.0.1"}), "", ())
TOKEN_POLICY = AdminPolicy(frozenset(), TOKEN, ())
PEER_POLICY = AdminPolicy(frozenset(), "", ("talos",))


@pytest.mark.parametrize(("method", "path", "headers", "local", "caller", "policy", "status"), [
    ("GET", "/_crossbar/hosts", {"host": "127.0.0.1:7777"}, "127.0.0.1", None, POLICY, None),
    ("GET", "/_crossbar/hosts", {}, "127.0.0.1", None, POLICY, None),  # not a browser
    ("GET", "/_crossbar/hosts", {"host": "localhost:7777"}, "127.0.0.1", None, POLICY, None),
    ("GET", "/_crossbar/hosts", {"host": "localhost:7777"}, "100.64.0.1", None, POLICY, 403),
    ("GET", "/_crossbar/hosts", {"host": "[::1]:7777"}, "::1", None, POLICY, None),
    ("GET", "/_crossbar/hosts", {"host": "127.0.0.1"}, "::ffff:127.0.0.1", None, POLICY, None),
    ("GET", "/_crossbar/hosts", {"host": "Crossbar.TS.net.:7777"}, "100.64.0.2", None, POLICY, None),
    ("GET", "/_crossbar/hosts", {"host": "evil.example"}, "127.0.0.1", None, POLICY, 403),
    ("GET", "/_crossbar/hosts", {"host": "127.0.0.1.evil.example"}, "127.0.0.1", None, POLICY, 403),
    ("POST", "/_crossbar/hosts/a", {"content-type": "text/plain"}, "127.0.0.1", None, POLICY, 415),
    ("POST", "/_crossbar/hosts/a", {"content-type": JSON, "origin": "http://100.64.0.1:7777"},
     "127.0.0.1", None, POLICY, None),
    ("POST", "/_crossbar/hosts/a", {"content-type": JSON, "origin": "http://evil.example"},
     "127.0.0.1", None, POLICY, 403),
    ("POST", "/_crossbar/hosts/a", {"content-type": JSON, "sec-fetch-site": "none"}, "127.0.0.1", None,
     POLICY, None),
    # same origin means the listener the client addressed: its host and its port
    ("POST", "/_crossbar/hosts/a", {"content-type": JSON, "host": "127.0.0.1:7777",
                                    "origin": "http://127.0.0.1:7777"}, "127.0.0.1", None, POLICY, None),
    ("POST", "/_crossbar/hosts/a", {"content-type": JSON, "host": "127.0.0.1:7777",
                                    "origin": "http://127.0.0.1:9999"}, "127.0.0.1", None, POLICY, 403),
    ("POST", "/_crossbar/hosts/a", {"content-type": JSON, "host": "[::1]:7777",
                                    "origin": "http://[::1]:7777"}, "::1", None, POLICY, None),
    ("POST", "/_crossbar/hosts/a", {"content-type": JSON, "host": "localhost",
                                    "origin": "http://localhost"}, "127.0.0.1", None, POLICY, None),
    ("GET", "/_crossbar/hosts", {}, "127.0.0.1", None, TOKEN_POLICY, 401),
    ("GET", "/_crossbar/hosts", {"authorization": f"bearer {TOKEN}"}, "127.0.0.1", None, TOKEN_POLICY, None),
    ("GET", "/_crossbar/hosts", {"authorization": f"Basic {TOKEN}"}, "127.0.0.1", None, TOKEN_POLICY, 401),
    ("GET", "/_crossbar/", {}, "127.0.0.1", None, TOKEN_POLICY, None),
    ("GET", "/_crossbar?x=1", {}, "127.0.0.1", None, TOKEN_POLICY, None),
    ("GET", "/_crossbar/hosts", {}, "127.0.0.1", frozenset({"talos"}), PEER_POLICY, None),
    ("GET", "/_crossbar/hosts", {}, "127.0.0.1", frozenset({"dixie"}), PEER_POLICY, 403),
    ("GET", "/_crossbar/hosts", {}, "127.0.0.1", frozenset(), PEER_POLICY, 403),
])
def test_refusal(method: str, path: str, headers: dict[str, str], local: str, caller: frozenset[str] | None,
                 policy: AdminPolicy, status: int | None) -> None:
    got = refusal(method, path, headers, local, caller, policy)
    assert (got.status if got else None) == status


@pytest.mark.parametrize(("header", "host"), [
    ("127.0.0.1:7777", "127.0.0.1"), ("[::1]:7777", "::1"), ("[::ffff:127.0.0.1]", "127.0.0.1"),
    ("Box.Example.:80", "box.example"), ("box", "box"),
])
def test_host_of(header: str, host: str) -> None:
    assert host_of(header) == host


def test_usage_table_escapes_every_control_character() -> None:
    rows = [{"key": "".join(map(chr, range(0x20))) + "\x7f\x9b", "requests": 1}]
    table = usage_table(rows)
    assert all(ch == "\n" or ch.isprintable() for ch in table)


# ---------------------------------------------------------------- listen addresses


@pytest.mark.parametrize("text", ["[::ffff:0.0.0.0]:7777", "[::]:7777", "0.0.0.0:7777", ":7777",
                                  "[0:0:0:0:0:ffff:0:0]:7777"])
def test_every_spelling_of_the_any_address_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="listens on every address"):
        parse_address(text, "listen", allow_any=False)
    parse_address(text, "listen", allow_any=True)


def test_a_name_resolving_to_the_any_address_is_refused() -> None:
    with pytest.raises(ConfigError, match="listens on every address"):
        parse_address("everywhere.example:7777", "listen", False, resolve=lambda host: ["127.0.0.1", "::"])
    tailnet = parse_address("box.example:7777", "listen", False, resolve=lambda host: ["100.64.0.1"])
    assert tailnet.port == 7777
    assert parse_address("unresolvable.invalid:7777", "listen", False, resolve=lambda host: []).port == 7777


async def test_crossbar_listens_on_ipv6_loopback(tmp_path: Path) -> None:
    async with admin_fleet(tmp_path, listen="[::1]:0") as proxy:
        reader, writer = await asyncio.open_connection("::1", proxy.port)
        writer.write(f"GET /_crossbar/hosts HTTP/1.1\r\nHost: [::1]:{proxy.port}\r\nConnection: close\r\n\r\n"
                     .encode())
        raw = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        status, _, body = split_response(raw)
        assert status == 200 and "a" in json.loads(body)
        chat = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
        reader, writer = await asyncio.open_connection("::1", proxy.port)
        writer.write(request(proxy.port, "POST", "/r/v1/chat/completions", chat, Content_Type=JSON))
        status, _, _ = split_response(await asyncio.wait_for(reader.read(), 10))
        writer.close()
        assert status == 200


def test_the_systemd_unit_limits_files_and_descriptors() -> None:
    """The unit creates files for the service user only and raises the descriptor limit."""
    unit = (Path(__file__).resolve().parent.parent / "deploy" / "crossbar.service").read_text()
    lines = [line for line in unit.splitlines() if "=" in line and not line.startswith("#")]
    settings = dict(line.split("=", 1) for line in lines)
    assert settings["UMask"] == "0077"
    assert int(settings["LimitNOFILE"]) >= 65536
