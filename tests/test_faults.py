"""Faults: hosts that refuse, fail, hang or die mid-stream; crossbar itself killed with
SIGKILL under traffic; a database that is locked, read-only or on a full disk.

Failover of a lease on refuse / 5xx is in `test_e2e_leases.py`; this file covers what happens
around it: nothing left to fail over to, statuses that must (not) mark a host down, bounded waits
on a silent host, slots freed after a cut, and the store's failure modes seen from the outside.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import (
    HostSpec,
    Proxy,
    committed,
    completion_count,
    conversation,
    crossbar_proxy,
    request_rows,
    sim_fleet,
    sse_data,
    start_mitmdump,
    wait_until,
    write_config,
)
from prometheus_client.parser import text_string_to_metric_families

from llamasim import SimConfig

CHAT = "/v1/chat/completions"
MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
TIMEOUT = aiohttp.ClientTimeout(total=30)


def two_hosts(tmp_path: Path, urls: dict[str, str], parallel: int = 0, **top: Any) -> Path:
    models = {"m": {"parallel": parallel}} if parallel else {"m": {}}
    hosts = {name: (url, HostSpec(models)) for name, url in urls.items()}
    route = {"hosts": list(urls), "default_model": "m"}
    return write_config(tmp_path / "crossbar.toml", hosts, {"r": route}, **top)


@asynccontextmanager
async def fleet_and_proxy(tmp_path: Path, names: tuple[str, ...] = ("a", "b"),
                          sim: dict[str, Any] | None = None, parallel: int = 0,
                          **top: Any) -> AsyncIterator[tuple[Any, Proxy]]:
    specs = {n: HostSpec({"m": {}}, sim=SimConfig(models=["m"], **(sim or {}))) for n in names}
    async with sim_fleet(specs) as fleet:
        cfg = two_hosts(tmp_path, {n: fleet[n].url for n in names}, parallel, **top)
        async with crossbar_proxy(cfg) as proxy:
            yield fleet, proxy


async def post(url: str, body: Any) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.post(url, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.read()


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json(content_type=None)


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(f"{url}/_crossbar/metrics") as resp:
        text = await resp.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"no metric {name}")


# ---------------------------------------------------------------- hosts that refuse


async def test_every_host_refusing_is_a_prompt_json_503(tmp_path: Path) -> None:
    async with fleet_and_proxy(tmp_path) as (fleet, proxy):
        for name in ("a", "b"):
            fleet[name].set(refuse=True)
        await wait_until(lambda: not any(proxy.router.fleet.healthy(n) for n in "ab"), timeout=10,
                         what="both hosts unhealthy")
        t0 = time.monotonic()
        status, headers, body = await post(f"{proxy.url}/r{CHAT}", {"messages": MSGS})
        waited = time.monotonic() - t0
    assert status == 503, body
    assert headers["Content-Type"].startswith("application/json") and int(headers["Retry-After"]) >= 1
    assert b'"no healthy host"' in body
    assert waited < 10


async def test_every_host_refusing_before_the_poller_notices_is_a_prompt_error(tmp_path: Path) -> None:
    """The poller has not seen it yet (60 s interval): the pre-flight finds `a` down, moves the
    request to `b`, which refuses too. The client gets an error at once, not a hang."""
    async with fleet_and_proxy(tmp_path, poll_interval="60s") as (fleet, proxy):
        for name in ("a", "b"):
            fleet[name].set(refuse=True)
        t0 = time.monotonic()
        status, _headers, body = await post(f"{proxy.url}/r{CHAT}", {"messages": MSGS})
        waited = time.monotonic() - t0
        rows = await request_rows(proxy)
        healthy = {n: proxy.router.fleet.healthy(n) for n in "ab"}
    assert status in (502, 503), (status, body)
    assert waited < 15
    assert healthy == {"a": False, "b": False}
    (row,) = rows
    assert row.status in (None, 502, 503) and row.err


@pytest.mark.parametrize("names", [("a",), ("a", "b")])
async def test_no_host_left_before_the_poller_notices_is_crossbars_json_503(
        tmp_path: Path, names: tuple[str, ...]) -> None:
    async with fleet_and_proxy(tmp_path, names=names, poll_interval="60s") as (fleet, proxy):
        for name in names:
            fleet[name].set(refuse=True)
        status, headers, body = await post(f"{proxy.url}/r{CHAT}", {"messages": MSGS})
    assert (status, headers.get("Content-Type")) == (503, "application/json"), (status, headers, body)
    assert json.loads(body)["error"] == "no healthy host" and int(headers["Retry-After"]) >= 1


# ---------------------------------------------------------------- 5xx on the only candidate


@pytest.mark.parametrize(("status", "marks_down"), [(500, False), (502, True), (503, True), (504, True)])
async def test_a_5xx_with_nowhere_to_retry_reaches_the_client(
        tmp_path: Path, status: int, marks_down: bool) -> None:
    async with fleet_and_proxy(tmp_path, names=("a",), sim={"fail_status": status, "fail_times": 1},
                               poll_interval="60s") as (_fleet, proxy):
        got, _, body = await post(f"{proxy.url}/r{CHAT}", {"messages": MSGS})
        healthy = proxy.router.fleet.healthy("a")
        rows = await request_rows(proxy)
    assert got == status, body
    assert b"simulated failure" in body  # the host's own answer, passed through
    assert healthy is not marks_down  # a 500 alone (llama-server's KV overflow) keeps the host
    (row,) = rows
    assert row.status == status and row.err


# ---------------------------------------------------------------- hosts that hang


async def test_a_host_that_never_answers_is_cut_after_first_byte_timeout(tmp_path: Path) -> None:
    async with fleet_and_proxy(tmp_path, names=("a",), first_byte_timeout="1s",
                               poll_interval="60s") as (fleet, proxy):
        fleet["a"].set(hang=True)
        t0 = time.monotonic()
        status, _, body = await post(f"{proxy.url}/r{CHAT}", {"messages": MSGS, "stream": True})
        waited = time.monotonic() - t0
        healthy = proxy.router.fleet.healthy("a")
        in_flight = proxy.router.in_flight("a", "m")
        rows = await request_rows(proxy)
    assert status == 502, body
    assert 0.9 < waited < 15
    assert not healthy and in_flight == 0
    (row,) = rows
    assert row.err and "no first byte" in row.err and row.ttfb_ms is None


async def test_a_hanging_host_fails_its_poll_and_new_conversations_go_elsewhere(tmp_path: Path) -> None:
    async with fleet_and_proxy(tmp_path, poll_interval="0.2s", poll_timeout="1s") as (fleet, proxy):
        fleet["a"].set(hang=True)
        await wait_until(lambda: not proxy.router.fleet.healthy("a"), timeout=15, what="a unhealthy")
        hosts = await get_json(f"{proxy.url}/_crossbar/hosts")
        assert "timed out" in hosts["a"]["last_err"]
        for i in range(3):
            msgs = [{"role": "user", "content": f"conversation {i}"}]
            status, _, body = await post(f"{proxy.url}/r{CHAT}", {"messages": msgs})
            assert status == 200, body
        rows = await request_rows(proxy)
        fleet["a"].set(hang=False)
    assert {r.host for r in rows} == {"b"}


# ---------------------------------------------------------------- a host dying mid-stream


async def test_a_stream_cut_mid_way_frees_its_slot_and_the_next_turn_runs_at_once(tmp_path: Path) -> None:
    async with fleet_and_proxy(tmp_path, names=("a",), sim={"die_after_events": 3}, parallel=1) as (
            fleet, proxy):
        turns = conversation("cut", 2)
        first = {"messages": turns[0], "stream": True, "max_tokens": 50}
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s, \
                s.post(f"{proxy.url}/r{CHAT}", json=first) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
        await wait_until(lambda: proxy.router.in_flight("a", "m") == 0, what="slot freed")
        fleet["a"].set(die_after_events=0)
        status, _, body = await post(f"{proxy.url}/r{CHAT}", {"messages": turns[1], "stream": True})
        rows = await request_rows(proxy)
    assert status == 200 and sse_data(body)[-1] == b"[DONE]"
    cut, ok = rows
    assert cut.err and cut.status == 200 and cut.completion_tokens is None
    assert ok.err is None and ok.queued_ms == 0 and ok.host == cut.host == "a" and ok.decision == "reused"


# ---------------------------------------------------------------- crossbar killed with SIGKILL


@dataclass
class Turn:
    session: int
    start: float
    end: float = 0.0
    ok: bool = False


@dataclass
class Traffic:
    turns: list[Turn] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)


async def converse(port: int, session: int, traffic: Traffic, first_turn_only: bool = False) -> None:
    """One conversation's turns, one after another, until stopped or crossbar goes away."""
    msgs = conversation(f"k{session}", 10)  # replayed in a cycle: the prompt stays well inside a slot
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        for i in range(1000):
            turn_msgs = msgs[i % len(msgs)]
            if traffic.stop.is_set():
                return
            turn = Turn(session, time.time())
            traffic.turns.append(turn)
            try:
                body = {"messages": turn_msgs, "max_tokens": 4, "stream": i % 2 == 0}
                async with s.post(f"http://127.0.0.1:{port}/r{CHAT}", json=body) as resp:
                    data = await resp.read()
                    turn.ok = resp.status == 200 and (not body["stream"] or data.endswith(b"[DONE]\n\n"))
            except (aiohttp.ClientError, OSError):
                turn.ok = False
            turn.end = time.time()
            if not turn.ok or first_turn_only:
                return
            await asyncio.sleep(0.02)


def lease_set(routes: Any) -> set[tuple[str, str, str]]:
    return {(ls["fp"], ls["model"], ls["host"]) for ls in routes["r"]["leases"]}


def db_rows(db: Path) -> list[sqlite3.Row]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute("SELECT * FROM requests ORDER BY id").fetchall()
    finally:
        conn.close()


async def test_kill_9_under_traffic_then_restart_keeps_leases_and_committed_rows(tmp_path: Path) -> None:
    specs = {n: HostSpec({"m": {}}, sim=SimConfig(models=["m"], token_ms=2)) for n in ("a", "b")}
    async with sim_fleet(specs) as fleet:
        cfg = two_hosts(tmp_path, {n: fleet[n].url for n in specs})
        db = cfg.with_suffix(".db")
        proc = start_mitmdump(cfg)
        restarted = None
        try:
            first = Traffic()
            await asyncio.gather(*(converse(proc.port, i, first, first_turn_only=True) for i in range(8)))
            assert all(t.ok for t in first.turns)
            await asyncio.sleep(1.5)  # the background writer commits within about a second
            before = lease_set(await get_json(f"http://127.0.0.1:{proc.port}/_crossbar/routes"))
            assert len(before) == 8 and {h for _, _, h in before} == {"a", "b"}

            traffic = Traffic()
            workers = [asyncio.create_task(converse(proc.port, i, traffic)) for i in range(8)]
            await asyncio.sleep(3)
            killed_at = time.time()
            proc.proc.send_signal(signal.SIGKILL)
            assert proc.proc.wait(10) == -signal.SIGKILL
            traffic.stop.set()
            await asyncio.wait_for(asyncio.gather(*workers), 30)

            restarted = start_mitmdump(cfg)
            after = lease_set(await get_json(f"http://127.0.0.1:{restarted.port}/_crossbar/routes"))
            assert after == before  # every lease back, none reshuffled
            again = Traffic()
            await asyncio.gather(*(converse(restarted.port, i, again, first_turn_only=True)
                                   for i in range(8)))
            assert all(t.ok for t in again.turns)
            assert restarted.stop() == 0
        finally:
            for p in (proc, restarted):
                if p is not None and p.proc.poll() is None:
                    p.proc.kill()
                    p.proc.wait(10)
        out = "".join(proc.output) + "".join(restarted.output if restarted else [])
        assert "Traceback" not in out, out

    rows = db_rows(db)
    completed = [t for t in first.turns + traffic.turns if t.ok]
    assert len(traffic.turns) > 16  # real traffic was running when the kill came
    settled = [t for t in completed if t.end < killed_at - 1.0]
    before_kill = [r for r in rows if r["started"] < killed_at]
    assert len(settled) <= len(before_kill) <= len(first.turns) + len(traffic.turns)
    assert all(r["status"] == 200 and r["err"] is None for r in before_kill if r["started"] < killed_at - 1.5)
    after_restart = [r for r in rows if r["started"] > killed_at]
    assert len(after_restart) == 8 and {r["decision"] for r in after_restart} == {"reused"}
    fp_host = {fp: host for fp, _, host in before}
    assert all(fp_host[r["fp"]] == r["host"] for r in after_restart)


# ---------------------------------------------------------------- a database that cannot be written


LOCKER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=10)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
conn.close()
"""


@contextmanager
def exclusive_lock(db: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holds `BEGIN EXCLUSIVE` on the database until the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", LOCKER, str(db)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        if proc.poll() is None:
            assert proc.stdin is not None
            with contextlib.suppress(OSError):
                proc.stdin.write("\n")
                proc.stdin.flush()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


async def serve_while_broken(proxy: Proxy, n: int) -> None:
    for i in range(n):
        msgs = [{"role": "user", "content": f"while the store is broken {i}"}]
        status, _, body = await post(f"{proxy.url}/r{CHAT}", {"messages": msgs, "stream": i % 2 == 0})
        assert status == 200, body


async def rows_land(proxy: Proxy, n: int) -> list[Any]:
    store = proxy.router.store

    async def landed() -> bool:
        await asyncio.to_thread(store.flush, 2.0)
        return len(await asyncio.to_thread(store.requests_since, 0)) >= n

    await wait_until(landed, timeout=30, interval=0.2, what=f"{n} rows committed")
    return await asyncio.to_thread(store.requests_since, 0)


@contextmanager
def immutable(*paths: Path) -> Iterator[None]:
    """`chattr +i`: even root cannot write the files (SQLite answers "disk I/O error")."""
    done: list[Path] = []
    try:
        for p in paths:
            r = subprocess.run(["chattr", "+i", str(p)], capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"cannot make {p} read-only with chattr here: {r.stderr.strip()}")
            done.append(p)
        yield
    finally:
        for p in done:
            subprocess.run(["chattr", "-i", str(p)], check=False)


def locked(db: Path) -> AbstractContextManager[None]:
    return exclusive_lock(db)


def read_only(db: Path) -> AbstractContextManager[None]:
    if shutil.which("chattr") is None:
        pytest.skip("needs chattr to make the database read-only")
    # the -shm file stays writable: it is memory-mapped, and an immutable one is a SIGBUS
    return immutable(db, db.with_name(db.name + "-wal"))


@pytest.mark.parametrize("fault", [locked, read_only], ids=["locked-by-another-process", "read-only"])
async def test_a_failing_database_never_stops_proxying(
        tmp_path: Path, fault: Callable[[Path], AbstractContextManager[None]]) -> None:
    async with fleet_and_proxy(tmp_path, names=("a",), poll_interval="60s") as (fleet, proxy):
        db = Path(proxy.router.cfg.db)
        await committed(proxy)
        with fault(db):
            await serve_while_broken(proxy, 4)
            await wait_until(lambda: proxy.router.store.errors > 0, timeout=20, what="a failed write")
            assert await metric(proxy.url, "crossbar_store_errors_total") >= 1
            assert completion_count(fleet["a"]) == 4
        rows = await rows_land(proxy, 4)
    assert sorted(r.status for r in rows) == [200] * 4


@contextmanager
def tiny_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {r.stderr.strip()}")
    try:
        yield where
    finally:
        for _ in range(50):
            if subprocess.run(["umount", str(where)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            subprocess.run(["umount", "-l", str(where)], check=False)


def fill(directory: Path) -> Path:
    """Write a file until the file system is full."""
    filler = directory / "filler"
    # unbuffered: ENOSPC comes from write() inside the suppress, never from close()
    with filler.open("wb", buffering=0) as f, contextlib.suppress(OSError):
        for _ in range(100_000):
            f.write(b"\0" * 4096)
    return filler


async def test_a_full_disk(tmp_path: Path) -> None:
    with tiny_tmpfs(tmp_path / "disk", "2m") as disk:
        async with fleet_and_proxy(tmp_path, names=("a",), poll_interval="60s",
                                   db=str(disk / "crossbar.db")) as (fleet, proxy):
            await committed(proxy)
            filler = fill(disk)
            try:
                await serve_while_broken(proxy, 6)
                await wait_until(lambda: proxy.router.store.errors > 0, timeout=20, what="a failed write")
                assert await metric(proxy.url, "crossbar_store_errors_total") >= 1
                assert completion_count(fleet["a"]) == 6
            finally:
                filler.unlink()
            rows = await rows_land(proxy, 6)
    assert sorted(r.status for r in rows) == [200] * 6
