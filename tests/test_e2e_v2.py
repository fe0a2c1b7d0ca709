"""End to end: context guard, wake-on-LAN, identity, route listeners, admin listener —
through the real addon in a real mitmproxy against simulated llama-servers."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import (
    MITMDUMP,
    ROOT,
    HostSpec,
    Proxy,
    crossbar_proxy,
    lease_event_rows,
    request_rows,
    sim_fleet,
    wait_until,
    write_config,
)

from llamasim import SimConfig


async def post_json(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                    ) -> tuple[int, dict[str, str], Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers or {}) as r:
        raw = await r.read()
        try:
            data: Any = json.loads(raw)
        except ValueError:
            data = raw
        return r.status, dict(r.headers), data


def padded_chat(n_bytes: int, session: str = "s") -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": f"agent {session}"},
                         {"role": "user", "content": "q" * n_bytes}], "max_tokens": 4}


def listener_port(proxy: Proxy, host: str) -> int:
    ps = proxy.master.addons.get("proxyserver")
    return next(a[1] for a in ps.listen_addrs() if a[0] == host)


# ---------------------------------------------------------------- context guard


@asynccontextmanager
async def small_and_big(tmp_path: Path) -> AsyncIterator[tuple[Any, Proxy]]:
    """small: 2048 tokens per slot (weight 10, so new conversations go there); big: 16384."""
    specs = {
        "small": HostSpec({"m": {"parallel": 2}}, weight=10.0, sim=SimConfig(models=["m"], ctx=4096)),
        "big": HostSpec({"m": {"parallel": 2}}, sim=SimConfig(models=["m"], ctx=32768)),
    }
    async with sim_fleet(specs) as fleet:
        cfg = write_config(tmp_path / "c.toml", {n: (fleet[n].url, s) for n, s in specs.items()},
                           {"r": {"default_model": "m", "hosts": ["small", "big"]}})
        async with crossbar_proxy(cfg) as proxy:
            await wait_until(lambda: proxy.router.fleet.slot_ctx("big", "m") == 16384, what="big's ctx")
            yield fleet, proxy


async def test_guard_moves_a_prompt_that_does_not_fit_and_the_lease_follows(tmp_path: Path) -> None:
    async with small_and_big(tmp_path) as (fleet, proxy):
        status, _, _ = await post_json(f"{proxy.url}/r/v1/chat/completions", padded_chat(1000))
        assert status == 200  # fits small; teaches the estimator the model's tokens per byte
        assert fleet["small"].stats.records[-1].prompt_tokens > 1000
        grown = padded_chat(1000)  # the same conversation, grown past small's context
        grown["messages"] += [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q" * 2000}]
        status, headers, body = await post_json(f"{proxy.url}/r/v1/chat/completions", grown)
        assert status == 200, body
        assert headers["X-Crossbar-Ctx"] == "moved:small>big"
        assert fleet["big"].stats.records[-1].prompt_tokens > 3000
        rows = await request_rows(proxy)
        assert [r.host for r in rows] == ["small", "big"]
        assert rows[-1].decision == "moved:context"
        events = await lease_event_rows(proxy)
        assert any(e.reason == "context" and e.from_host == "small" and e.to_host == "big" for e in events)
        # the conversation stays on big afterwards, without another move
        status, headers, _ = await post_json(f"{proxy.url}/r/v1/chat/completions", grown)
        assert status == 200 and "X-Crossbar-Ctx" not in headers
        assert (await request_rows(proxy))[-1].host == "big"


async def test_guard_answers_400_in_llama_servers_shape_when_it_fits_nowhere(tmp_path: Path) -> None:
    async with small_and_big(tmp_path) as (fleet, proxy):
        await post_json(f"{proxy.url}/r/v1/chat/completions", padded_chat(1000))
        before = fleet["big"].stats.completions_started + fleet["small"].stats.completions_started
        # bytes/4 × 1.2 does not fit 16384 tokens either (a learned ratio alone never refuses)
        status, headers, body = await post_json(f"{proxy.url}/r/v1/chat/completions", padded_chat(70_000))
        assert status == 400
        assert headers["Content-Type"].startswith("application/json")
        err = body["error"]
        assert err["type"] == "exceed_context_size_error" and err["code"] == 400
        assert err["n_ctx"] == 16384 and err["n_prompt_tokens"] > 70_000
        after = fleet["big"].stats.completions_started + fleet["small"].stats.completions_started
        assert after == before  # nothing was forwarded


# ---------------------------------------------------------------- wake-on-LAN


class MagicPacketCatcher(asyncio.DatagramProtocol):
    def __init__(self, on_packet: Any) -> None:
        self.packets: list[bytes] = []
        self.on_packet = on_packet

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.packets.append(data)
        self.on_packet()


@asynccontextmanager
async def sleeping_host(tmp_path: Path, wait: str, wakes: bool) -> AsyncIterator[tuple[Any, Proxy, Any]]:
    specs = {"sleepy": HostSpec({"m": {"parallel": 2}}, sim=SimConfig(models=["m"], refuse=True))}
    async with sim_fleet(specs) as fleet:
        loop = asyncio.get_running_loop()
        transport, catcher = await loop.create_datagram_endpoint(
            lambda: MagicPacketCatcher(lambda: fleet["sleepy"].set(refuse=False) if wakes else None),
            local_addr=("127.0.0.1", 0))
        udp_port = transport.get_extra_info("sockname")[1]
        path = write_config(tmp_path / "c.toml", {"sleepy": (fleet["sleepy"].url, specs["sleepy"])},
                            {"r": {"default_model": "m"}})
        with path.open("a") as f:
            f.write(f'wake = {{ mac = "AA-BB-CC-DD-EE-01", broadcast = "127.0.0.1:{udp_port}", '
                    f'wait = "{wait}" }}\n')
        # the [hosts.sleepy] table is not last: rewrite so `wake` lands inside it
        text = path.read_text().splitlines()
        wake_line = text.pop()
        idx = next(i for i, line in enumerate(text) if line.startswith("models =")) + 1
        text.insert(idx, wake_line)
        path.write_text("\n".join(text) + "\n")
        try:
            async with crossbar_proxy(path) as proxy:
                await wait_until(lambda: not proxy.router.fleet.healthy("sleepy"), what="sleepy marked down")
                yield fleet, proxy, catcher
        finally:
            transport.close()


async def test_wake_on_lan_wakes_a_sleeping_host_and_the_request_succeeds(tmp_path: Path) -> None:
    async with sleeping_host(tmp_path, wait="10s", wakes=True) as (_fleet, proxy, catcher):
        status, _, body = await post_json(f"{proxy.url}/r/v1/chat/completions", padded_chat(10))
        assert status == 200, body
        assert catcher.packets == [b"\xff" * 6 + bytes.fromhex("aabbccddee01") * 16]
        assert (await request_rows(proxy))[-1].host == "sleepy"


async def test_no_host_wakes_503_names_the_hosts_tried(tmp_path: Path) -> None:
    async with sleeping_host(tmp_path, wait="1s", wakes=False) as (_fleet, proxy, catcher):
        # other flows go on while one request waits for the wake
        waiting = asyncio.create_task(post_json(f"{proxy.url}/r/v1/chat/completions", padded_chat(10)))
        await wait_until(lambda: catcher.packets, what="magic packet")
        async with aiohttp.ClientSession() as s, s.get(f"{proxy.url}/_crossbar/hosts") as r:
            assert r.status == 200
        status, headers, body = await asyncio.wait_for(waiting, 10)
        assert status == 503
        assert body == {"error": "no healthy host", "woke": ["sleepy"]}
        assert "Retry-After" in headers


# ---------------------------------------------------------------- identity


@asynccontextmanager
async def peer_routes(tmp_path: Path, identity: str) -> AsyncIterator[Proxy]:
    specs = {"a": HostSpec({"m": {}})}
    async with sim_fleet(specs) as fleet:
        cfg = write_config(tmp_path / "c.toml", {"a": (fleet["a"].url, specs["a"])},
                           {"talos-only": {"default_model": "m", "peers": ["talos"]},
                            "dixie-only": {"default_model": "m", "peers": ["dixie"]},
                            "open": {"default_model": "m"}}, identity=identity)
        async with crossbar_proxy(cfg) as proxy:
            yield proxy


@pytest.mark.parametrize(("route", "peer", "status"), [
    ("talos-only", "talos", 200),
    ("talos-only", "dixie", 403),
    ("talos-only", None, 403),
    ("open", None, 200),
])
async def test_identity_header(tmp_path: Path, route: str, peer: str | None, status: int) -> None:
    async with peer_routes(tmp_path, "header") as proxy:
        headers = {"X-Crossbar-Peer": peer} if peer else {}
        got, _, body = await post_json(f"{proxy.url}/{route}/v1/chat/completions", padded_chat(5), headers)
        assert got == status, body
        if status == 403:
            assert body["error"]["code"] == 403


def fake_tailscale(bin_dir: Path, whois: dict[str, Any] | None, version_ok: bool = True) -> None:
    """A stand-in `tailscale`: `version`, and `whois --json ADDR` answering `whois` (or failing)."""
    script = bin_dir / "tailscale"
    script.write_text(f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
if args[:1] == ["version"]:
    print("1.80.0") if {version_ok!r} else sys.exit("tailscaled is not running")
    sys.exit(0 if {version_ok!r} else 1)
if args[:2] == ["whois", "--json"]:
    answer = {json.dumps(whois)!r}
    if answer == "null":
        sys.exit("no peer found for " + args[2])
    print(answer)
    sys.exit(0)
sys.exit("unexpected: " + " ".join(args))
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)


WHOIS_TALOS = {"Node": {"Name": "talos.tail1a2b.ts.net.", "ComputedName": "talos",
                        "Hostinfo": {"Hostname": "talos"}},
               "UserProfile": {"LoginName": "kyle@github"}}


async def test_identity_tailscale_admits_the_listed_peer_only(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tailscale(tmp_path, WHOIS_TALOS)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    async with peer_routes(tmp_path, "tailscale") as proxy:
        ok, _, _ = await post_json(f"{proxy.url}/talos-only/v1/chat/completions", padded_chat(5))
        denied, _, body = await post_json(f"{proxy.url}/dixie-only/v1/chat/completions", padded_chat(5))
        assert (ok, denied) == (200, 403), body


async def test_identity_tailscale_failing_whois_is_503_not_an_open_door(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tailscale(tmp_path, None)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    async with peer_routes(tmp_path, "tailscale") as proxy:
        status, _, body = await post_json(f"{proxy.url}/talos-only/v1/chat/completions", padded_chat(5))
        assert status == 503, body
        open_status, _, _ = await post_json(f"{proxy.url}/open/v1/chat/completions", padded_chat(5))
        assert open_status == 200  # routes without peers do not depend on tailscale


@pytest.mark.parametrize("setup", ["missing", "failing"])
def test_identity_tailscale_without_a_working_binary_refuses_to_start(tmp_path: Path, setup: str) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if setup == "failing":
        fake_tailscale(bin_dir, WHOIS_TALOS, version_ok=False)
    path_dirs = [str(bin_dir), str(Path(sys.executable).parent), "/usr/bin", "/bin"]
    cfg = tmp_path / "c.toml"
    cfg.write_text('listen = "127.0.0.1:0"\nidentity = "tailscale"\n'
                   f'db = "{tmp_path / "x.db"}"\n[hosts.a]\nbase_url = "http://127.0.0.1:9"\n'
                   'models = ["m"]\n[routes.r]\npeers = ["talos"]\n')
    env = {**os.environ, "PATH": os.pathsep.join(path_dirs)}
    proc = subprocess.run([MITMDUMP, "-s", str(ROOT / "addons" / "crossbar.py"), "--set",
                           f"crossbar_config={cfg}", "--set", "server=false"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert proc.returncode != 0
    assert "tailscale" in proc.stdout + proc.stderr


# ---------------------------------------------------------------- route listeners and admin listener


@asynccontextmanager
async def boxmaker(tmp_path: Path, **top: Any) -> AsyncIterator[tuple[Any, Proxy, str]]:
    specs = {"a": HostSpec({"m": {"parallel": 1}}, sim=SimConfig(models=["m"], token_ms=30,
                                                                   default_max_tokens=20))}
    async with sim_fleet(specs) as fleet:
        cfg = write_config(tmp_path / "c.toml", {"a": (fleet["a"].url, specs["a"])},
                           {"box": {"default_model": "m", "listen": "127.0.0.2:0", "affinity": "route",
                                    "queue": False},
                            "main": {"default_model": "m"}}, **top)
        async with crossbar_proxy(cfg) as proxy:
            yield fleet, proxy, f"http://127.0.0.2:{listener_port(proxy, '127.0.0.2')}"


async def test_route_listener_is_its_route_with_the_path_unchanged(tmp_path: Path) -> None:
    async with boxmaker(tmp_path) as (fleet, proxy, box):
        status, _, _ = await post_json(f"{box}/v1/chat/completions", padded_chat(5, "one"))
        assert status == 200
        status, _, _ = await post_json(f"{box}/v1/chat/completions", padded_chat(5, "two"))
        assert status == 200
        rows = await request_rows(proxy)
        assert [(r.route, r.fp) for r in rows] == [("box", ""), ("box", "")]  # one lease for the route
        assert [lease.key.fp for lease in proxy.router.leases.leases_of("box")] == [""]
        assert fleet["a"].stats.requests.get("/v1/chat/completions") == 2


async def test_route_listener_queue_false_never_holds_or_refuses(tmp_path: Path) -> None:
    async with boxmaker(tmp_path) as (fleet, proxy, box):
        body = {**padded_chat(5), "stream": True}
        results = await asyncio.gather(*(post_json(f"{box}/v1/chat/completions", body) for _ in range(3)))
        assert [r[0] for r in results] == [200, 200, 200]  # parallel = 1, but never a 503
        assert fleet["a"].stats.max_concurrent["m"] >= 2  # the server's own slot queue held them
        assert all(r.queued_ms == 0 for r in await request_rows(proxy))


async def test_route_listener_control_calls_take_no_slot_and_write_no_row(tmp_path: Path) -> None:
    async with boxmaker(tmp_path) as (fleet, proxy, box):
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{box}/slots?model=m") as r:
                assert r.status == 200 and isinstance(await r.json(), list)
            async with s.head(f"{box}/health") as r:
                assert r.status in (200, 404, 405)  # reached the server, whatever it says to HEAD
            async with s.post(f"{box}/tokenize", json={"content": "hello"}) as r:
                assert r.status == 200 and "tokens" in await r.json()
            async with s.post(f"{box}/v1/chat/completions/control", json={"id_slot": 0}) as r:
                assert fleet["a"].stats.requests.get("/v1/chat/completions/control", 0) == 1
            async with s.get(f"{box}/slots/0?action=save") as r:
                assert r.status == 404
                assert "error" in await r.json()
            async with s.get(f"{box}/_crossbar/hosts") as r:
                assert r.status == 404
            async with s.get(f"{box}/box/v1/models") as r:
                assert r.status == 404
        assert "/slots/0" not in fleet["a"].stats.requests
        assert await request_rows(proxy) == []
        assert proxy.router.in_flight("a", "m") == 0


async def test_admin_listener_moves_the_admin_api_off_the_main_listener(tmp_path: Path) -> None:
    async with boxmaker(tmp_path, admin_listen="127.0.0.3:0") as (_fleet, proxy, _box):
        admin = f"http://127.0.0.3:{listener_port(proxy, '127.0.0.3')}"
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{proxy.url}/_crossbar/hosts") as r:
                assert r.status == 404
            async with s.get(f"{admin}/_crossbar/hosts") as r:
                assert r.status == 200 and "a" in await r.json()
            async with s.post(f"{admin}/main/v1/chat/completions", json=padded_chat(5)) as r:
                assert r.status == 404
        status, _, _ = await post_json(f"{proxy.url}/main/v1/chat/completions", padded_chat(5))
        assert status == 200


def test_identity_header_logs_a_warning_at_start(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('listen = "127.0.0.1:0"\nidentity = "header"\n'
                   f'db = "{tmp_path / "x.db"}"\n[hosts.a]\nbase_url = "http://127.0.0.1:9"\n'
                   'models = ["m"]\n[routes.r]\npeers = ["talos"]\n')
    proc = subprocess.Popen([MITMDUMP, "-s", str(ROOT / "addons" / "crossbar.py"), "--set",
                             f"crossbar_config={cfg}", "--set", "server=false"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    out: list[str] = []
    deadline = time.monotonic() + 30
    try:
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            out.append(line)
            if "serving on" in line or not line:
                break
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    assert any("X-Crossbar-Peer" in line for line in out), "".join(out)
