"""The dashboard at `GET /_crossbar/`: one self-contained page, rendered by a real headless
Chromium against a real crossbar in front of simulated llama-servers.

Browser tests skip when Chromium is absent, unless CROSSBAR_BROWSER_TESTS=1 (as `.ci/run` sets),
which makes its absence a failure.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import HostSpec, Proxy, committed, conversation, crossbar_proxy, sim_fleet, write_config

from crossbar.session import session_fp
from llamasim import SimConfig

XSS_MODEL = '<img src=x id="xss" onerror="document.title=1">'
HOSTS = {"alpha-box": "m", "beta-box": "m", "gamma-box": XSS_MODEL}
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--no-default-browser-check",
    "--disable-dev-shm-usage", "--mute-audio", "--hide-scrollbars",
)


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    if os.environ.get("CROSSBAR_BROWSER_TESTS") == "1":
        pytest.fail("CROSSBAR_BROWSER_TESTS=1 but Chromium is not installed (apt-get install chromium)")
    pytest.skip("Chromium is not installed; set CROSSBAR_BROWSER_TESTS=1 to require these tests")


@pytest.fixture(autouse=True)
def chromium_temp_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Chromium keeps a profile's lock socket (and, with `--disable-dev-shm-usage`, its shared
    memory) in a directory of its own under TMPDIR, which a killed Chromium leaves behind. Each
    test gives the processes it starts a TMPDIR of their own, short (a socket's path has about a
    hundred bytes) and removed afterwards; nothing may be left in the system's temp dir."""
    system = Path(tempfile.gettempdir())
    before = set(system.glob("org.chromium.Chromium.*"))
    scratch = Path(tempfile.mkdtemp(prefix="crossbar-chromium-"))
    monkeypatch.setenv("TMPDIR", str(scratch))
    try:
        yield
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    left = set(system.glob("org.chromium.Chromium.*")) - before
    assert not left, f"chromium left {sorted(map(str, left))} behind"


async def stop_chromium(proc: asyncio.subprocess.Process) -> None:
    """Let Chromium shut down (it removes its lock files then); kill it only if it will not."""
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
    await proc.wait()


async def run_chromium(url: str, profile: Path, *extra: str, budget_ms: int = 3000) -> str:
    """Load `url`, let its scripts run for `budget_ms` of virtual time, return stdout."""
    proc = await asyncio.create_subprocess_exec(
        chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
        *extra, url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 90)
    except TimeoutError:
        await stop_chromium(proc)
        raise
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode()


async def rendered_dom(proxy: Proxy, tmp_path: Path) -> str:
    """The dashboard's DOM after its first refresh (a fresh load each call)."""
    return await run_chromium(proxy.url + "/_crossbar/", tmp_path / "profile", "--dump-dom")


class Tables(HTMLParser):
    """Rows of every <table id=…> in a DOM dump: [(tr attributes, [cell texts])]."""

    def __init__(self, dom: str):
        super().__init__()
        self.tables: dict[str, list[tuple[dict[str, str], list[str]]]] = {}
        self._table = ""
        self._cells: list[str] | None = None
        self._in_cell = False
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "table":
            self._table = a.get("id", "")
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self._cells = []
            self.tables[self._table].append((a, self._cells))
        elif tag in ("td", "th") and self._cells is not None:
            self._cells.append("")
            self._in_cell = True

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th"):
            self._in_cell = False
        elif tag == "table":
            self._table, self._cells = "", None

    def handle_data(self, data: str) -> None:
        if self._in_cell and self._cells:
            self._cells[-1] += data

    def rows(self, table: str, attr: str) -> dict[str, list[str]]:
        """Data rows (those carrying `data-<attr>`) keyed by that attribute."""
        return {a[f"data-{attr}"]: cells for a, cells in self.tables.get(table, []) if f"data-{attr}" in a}


@asynccontextmanager
async def dashboard_fleet(tmp_path: Path, **top: Any) -> AsyncIterator[Proxy]:
    specs = {name: HostSpec({model: {}}, sim=SimConfig(models=[model])) for name, model in HOSTS.items()}
    async with sim_fleet(specs) as fleet:
        hosts = {name: (fleet[name].url, specs[name]) for name in HOSTS}
        routes = {
            "webapp": {"hosts": ["alpha-box", "beta-box"], "default_model": "m"},
            "odd": {"hosts": ["gamma-box"], "default_model": XSS_MODEL},
        }
        cfg = write_config(tmp_path / "crossbar.toml", hosts, routes, **top)
        async with crossbar_proxy(cfg) as proxy:
            yield proxy


async def chat(proxy: Proxy, route: str, messages: list[dict[str, str]],
               headers: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(
        f"{proxy.url}/{route}/v1/chat/completions", json={"messages": messages, **extra}, headers=headers
    ) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


class DevToolsPage:
    """Runtime.evaluate on one page over the Chrome DevTools protocol."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.next_id = 0

    async def evaluate(self, expression: str) -> Any:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": "Runtime.evaluate",
                                 "params": {"expression": expression, "returnByValue": True}})
        while True:
            msg = await asyncio.wait_for(self.ws.receive_json(), 30)
            if msg.get("id") == self.next_id:
                result = msg["result"]
                assert "exceptionDetails" not in result, result
                return result["result"].get("value")


async def devtools_port(profile: Path, proc: asyncio.subprocess.Process) -> int:
    """Chromium writes the port it picked for --remote-debugging-port=0 into DevToolsActivePort."""
    marker = profile / "DevToolsActivePort"
    for _ in range(600):
        if marker.exists() and marker.read_text().strip():
            return int(marker.read_text().split()[0])
        assert proc.returncode is None, "chromium exited before opening its DevTools port"
        await asyncio.sleep(0.05)
    raise AssertionError("chromium did not open its DevTools port within 30 s")


@asynccontextmanager
async def devtools_page(url: str, tmp_path: Path) -> AsyncIterator[DevToolsPage]:
    profile = tmp_path / "devtools-profile"
    profile.mkdir()
    proc = await asyncio.create_subprocess_exec(
        chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
        "--remote-debugging-address=127.0.0.1", url,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        port = await devtools_port(profile, proc)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{port}/json/list") as resp:
                targets = await resp.json()
            target = next(t for t in targets if t["type"] == "page")
            async with s.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                yield DevToolsPage(ws)
    finally:
        await stop_chromium(proc)


async def wait_for_value(page: DevToolsPage, expression: str, ok: Any, timeout: float = 20) -> Any:
    """Evaluate until `ok(value)`; the page refreshes itself every 2 s."""
    deadline = asyncio.get_running_loop().time() + timeout
    value = None
    while asyncio.get_running_loop().time() < deadline:
        value = await page.evaluate(expression)
        if ok(value):
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"{expression} is still {value!r} after {timeout} s")


# ---------------------------------------------------------------- the page itself (no browser)


async def test_the_page_is_self_contained_and_locked_down(tmp_path: Path) -> None:
    async with dashboard_fleet(tmp_path) as proxy, aiohttp.ClientSession() as s:
        for path in ("/_crossbar/", "/_crossbar"):
            async with s.get(proxy.url + path) as resp:
                assert resp.status == 200
                page = await resp.text()
                assert resp.headers["Content-Type"].startswith("text/html")
                assert resp.headers["Cache-Control"] == "no-store"
                csp = resp.headers["Content-Security-Policy"]
                assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    for external in ("http://", "https://", "<link", " src=", "@import", "innerHTML", "outerHTML",
                     "insertAdjacentHTML", "document.write", "eval("):
        assert external not in page, external
    for source in ("/_crossbar/", '"hosts"', '"routes"', "usage?by=route&since=24h", "events?limit=20"):
        assert source in page, source


# ---------------------------------------------------------------- in a real browser


async def test_dashboard_shows_hosts_then_leases_and_usage_after_traffic(tmp_path: Path) -> None:
    chromium()
    async with dashboard_fleet(tmp_path) as proxy:
        before = Tables(await rendered_dom(proxy, tmp_path))
        hosts = before.rows("hosts", "host")
        assert set(hosts) == set(HOSTS)
        assert "up" in hosts["alpha-box"][1] and "m" in hosts["alpha-box"][2]
        assert before.rows("leases", "route") == {} and before.rows("usage", "usage") == {}

        for turn in conversation("dash", 3):
            await chat(proxy, "webapp", turn)
        await chat(proxy, "odd", conversation("xss", 1)[0])
        await chat(proxy, "webapp", conversation("named", 1)[0], headers={"x-session-id": "ses_dash"})
        await committed(proxy)

        dom = await rendered_dom(proxy, tmp_path)
        after = Tables(dom)
        lease, named = sorted(proxy.router.leases.leases_of("webapp"), key=lambda x: x.key.fp)  # hash < "s:…"
        leases = after.rows("leases", "fp")
        assert leases[lease.key.fp][:3] == ["webapp", "m", lease.host]
        assert leases[lease.key.fp][3:5] == ["fingerprint", lease.key.fp[:10]]
        assert named.key.fp == session_fp("ses_dash")
        assert leases[named.key.fp][3:5] == ["session", named.key.fp[2:12]]
        assert "ses_dash" not in dom
        usage = after.rows("usage", "usage")
        assert usage["webapp"][1] == "4" and usage["odd"][1] == "1"
        assert usage["webapp"][6].endswith("%")  # cache hit of the later turns
        assert "new" in after.rows("events", "event")

        # a model name with markup is shown as text, never parsed
        assert XSS_MODEL in [cells[1] for cells in leases.values()]
        assert '<img src="x" id="xss"' not in dom and "&lt;img src=x" in dom
        assert "<title>crossbar</title>" in dom  # its onerror never ran


async def test_dashboard_updates_itself_without_a_reload(tmp_path: Path) -> None:
    """One page load, driven over the DevTools protocol: traffic after the page has rendered shows
    up in it by itself, within a few of its 2-second refreshes."""
    chromium()
    async with dashboard_fleet(tmp_path) as proxy, devtools_page(proxy.url + "/_crossbar/", tmp_path) as page:
        hosts = "document.querySelectorAll('#hosts tr[data-host]').length"
        await wait_for_value(page, hosts, lambda n: n == len(HOSTS))
        leases = "[...document.querySelectorAll('#leases tr[data-route]')].map(r => r.dataset.route)"
        assert await page.evaluate(leases) == []
        await chat(proxy, "webapp", conversation("live", 1)[0])
        await wait_for_value(page, leases, lambda routes: routes == ["webapp"])
        usage = "document.querySelector('#usage tr[data-usage=webapp] td:nth-child(2)')?.textContent"
        await wait_for_value(page, usage, lambda n: n == "1")
        assert await page.evaluate("document.getElementById('status').className") == ""


async def test_screenshot(tmp_path: Path) -> None:
    """Renders at a desktop size without error (the picture is for a human: see CROSSBAR_SHOT)."""
    chromium()
    shot = Path(os.environ.get("CROSSBAR_SHOT", tmp_path / "dashboard.png"))
    async with dashboard_fleet(tmp_path) as proxy:
        for i in range(3):
            for turn in conversation(f"shot{i}", 2):
                await chat(proxy, "webapp", turn)
        await committed(proxy)
        await run_chromium(proxy.url + "/_crossbar/", tmp_path / "profile", f"--screenshot={shot}",
                           "--window-size=1280,900")
    assert shot.stat().st_size > 10_000


TOKEN = "dashboard-test-token-0123456789"


async def test_dashboard_works_behind_admin_token_and_admin_peers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every admin protection on (token, peers by tailscale identity, Host check), the page
    opened as /_crossbar/#token=… renders; without the token it says how to open it."""
    from test_e2e_v2 import WHOIS_TALOS, fake_tailscale

    chromium()
    fake_tailscale(tmp_path, WHOIS_TALOS)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    async with dashboard_fleet(tmp_path, admin_token=TOKEN, identity="tailscale",
                               admin_peers=["talos"]) as proxy:
        dom = await run_chromium(f"{proxy.url}/_crossbar/#token={TOKEN}", tmp_path / "p1", "--dump-dom")
        assert set(Tables(dom).rows("hosts", "host")) == set(HOSTS)
        dom = await run_chromium(f"{proxy.url}/_crossbar/", tmp_path / "p2", "--dump-dom")
        assert Tables(dom).rows("hosts", "host") == {}
        assert "open this page as /_crossbar/#token=" in dom
