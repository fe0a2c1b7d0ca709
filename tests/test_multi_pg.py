"""Two crossbar instances (real `mitmdump` processes) in front of one simulated fleet, sharing one real
PostgreSQL database (tests/pg.py): they agree on where each conversation lives, share pins and
drains within a second, hold `parallel` fleet-wide, and a client switching from a killed instance
to the other keeps its host.

The two instances are given opposite host weights on purpose: left alone, each would place a new
conversation on a different host, so every agreement below comes from the shared database.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
from harness import (
    MITMDUMP,
    ROOT,
    HostSpec,
    MitmdumpProcess,
    completion_count,
    conversation,
    sim_fleet,
    start_mitmdump,
    wait_until,
    write_config,
)
from pg import PgServer

from crossbar.addons.listeners import fingerprint_key
from crossbar.store import Store
from llamasim import SimConfig, SimServer

CHAT = "/v1/chat/completions"
TIMEOUT = aiohttp.ClientTimeout(total=60)
HOSTS = ("a", "b")
# instance 0 prefers host a, instance 1 host b, for a new conversation
WEIGHTS = ({"a": 4.0, "b": 1.0}, {"a": 1.0, "b": 4.0})


def instance_config(tmp_path: Path, n: int, db: str, urls: dict[str, str], parallel: int = 0,
                    **top: Any) -> Path:
    models = {"m": {"parallel": parallel}} if parallel else {"m": {}}
    hosts = {h: (url, HostSpec(models, weight=WEIGHTS[n].get(h, 1.0))) for h, url in urls.items()}
    route = {"hosts": list(urls), "default_model": "m"}
    return write_config(tmp_path / f"crossbar{n}.toml", hosts, {"r": route}, db=db, **top)


@asynccontextmanager
async def instances(configs: Sequence[Path]) -> AsyncIterator[list[MitmdumpProcess]]:
    procs: list[MitmdumpProcess] = []
    try:
        for cfg in configs:  # one after another: the first brings the schema up to date
            procs.append(start_mitmdump(cfg, ["--set", "server=false"]))
        for p in procs:
            await wait_until(lambda port=p.port: all_healthy(port), timeout=10, interval=0.1,
                             what="the first polls")
        yield procs
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(10)
    out = "".join(line for p in procs for line in p.output)
    assert "Traceback" not in out, out


@asynccontextmanager
async def fleet(names: Sequence[str] = HOSTS, **sim: Any) -> AsyncIterator[dict[str, SimServer]]:
    specs = {n: HostSpec({"m": {}}, sim=SimConfig(models=["m"], **sim)) for n in names}
    async with sim_fleet(specs) as f:
        yield {n: f[n] for n in names}


async def all_healthy(port: int) -> bool:
    return all(h["healthy"] for h in (await admin(port, "hosts")).values())


def urls(sims: dict[str, SimServer]) -> dict[str, str]:
    return {n: s.url for n, s in sims.items()}


async def chat(port: int, messages: list[dict[str, str]], stream: bool = False) -> int:
    body = {"messages": messages, "max_tokens": 4, "stream": stream}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, \
            s.post(f"http://127.0.0.1:{port}/r{CHAT}", json=body) as resp:
        answer = await resp.read()
        if resp.status != 200:
            print(f"{port}: {resp.status} {answer[:300]!r}")
        return resp.status


async def admin(port: int, path: str, body: Any = None) -> Any:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
        if body is None:
            async with s.get(f"http://127.0.0.1:{port}/_crossbar/{path}") as resp:
                assert resp.status == 200, await resp.text()
                return await resp.json(content_type=None)
        async with s.post(f"http://127.0.0.1:{port}/_crossbar/{path}", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json(content_type=None)


async def host_of_turn(port: int, messages: list[dict[str, str]], sims: dict[str, SimServer]) -> str:
    """Send one turn (nothing else running) and name the host that served it."""
    before = {n: completion_count(s) for n, s in sims.items()}
    assert await chat(port, messages) == 200
    served = [n for n, s in sims.items() if completion_count(s) > before[n]]
    assert len(served) == 1, served
    return served[0]


def request_hosts(db: str) -> dict[str, set[str]]:
    """fp → the hosts its `requests` rows name, every instance's rows together."""
    with psycopg.connect(db) as conn:
        rows = conn.execute("SELECT fp, host FROM requests WHERE status = 200").fetchall()
    out: dict[str, set[str]] = {}
    for fp, host in rows:
        out.setdefault(fp, set()).add(host)
    return out


def leases(routes: Any) -> dict[str, str]:
    return {ls["fp"]: ls["host"] for ls in routes["r"]["leases"]}


# ---------------------------------------------------------------- leases


async def test_a_conversation_alternating_between_instances_stays_on_one_host(
        tmp_path: Path, pg_url: str) -> None:
    async with fleet() as sims:
        cfgs = [instance_config(tmp_path, n, pg_url, urls(sims)) for n in (0, 1)]
        async with instances(cfgs) as procs:
            ports = [p.port for p in procs]
            seen: dict[int, list[str]] = {}
            for session in range(6):
                turns = conversation(f"alt{session}", 4)
                for i, msgs in enumerate(turns):  # session 0 starts on instance 0, session 1 on 1, …
                    port = ports[(session + i) % 2]
                    seen.setdefault(session, []).append(await host_of_turn(port, msgs, sims))
            assert all(len(set(hosts)) == 1 for hosts in seen.values()), seen
            assert {hosts[0] for hosts in seen.values()} == {"a", "b"}  # each instance placed some
            assert leases(await admin(ports[0], "routes")) == leases(await admin(ports[1], "routes"))


async def test_two_instances_racing_on_the_same_new_conversation_never_split_it(
        tmp_path: Path, pg_url: str) -> None:
    async with fleet(n_slots=8) as sims:
        cfgs = [instance_config(tmp_path, n, pg_url, urls(sims)) for n in (0, 1)]
        async with instances(cfgs) as procs:
            ports = [p.port for p in procs]
            firsts = [conversation(f"race{i}", 1)[0] for i in range(12)]
            statuses = await asyncio.gather(*(chat(port, msgs) for msgs in firsts for port in ports))
            assert statuses == [200] * len(statuses)
            await asyncio.sleep(1.5)  # each instance's writer commits its rows within about a second
            hosts = request_hosts(pg_url)
            assert len(hosts) == 12 and all(len(h) == 1 for h in hosts.values()), hosts
            views = [leases(await admin(port, "routes")) for port in ports]
            assert views[0] == views[1] == {fp: next(iter(h)) for fp, h in hosts.items()}


# ---------------------------------------------------------------- slots


async def test_parallel_1_through_both_instances_never_runs_two_at_once_on_a_host(
        tmp_path: Path, pg_url: str) -> None:
    async with fleet(names=("a",), token_ms=40, n_slots=4) as sims:
        cfgs = [instance_config(tmp_path, n, pg_url, urls(sims), parallel=1) for n in (0, 1)]
        async with instances(cfgs) as procs:
            msgs = [conversation(f"p{i}", 1)[0] for i in range(8)]
            statuses = await asyncio.gather(*(chat(procs[i % 2].port, m, stream=i % 4 < 2)
                                              for i, m in enumerate(msgs)))
            assert statuses == [200] * 8
            assert sims["a"].stats.completions_finished == 8
            assert sims["a"].stats.max_concurrent["m"] == 1
            with psycopg.connect(pg_url) as conn:  # every slot was given back
                assert conn.execute("SELECT count(*) FROM fleet_slots").fetchone() == (0,)


# ---------------------------------------------------------------- operator actions


async def test_a_pin_and_a_drain_through_one_instance_apply_on_the_other_within_a_second(
        tmp_path: Path, pg_url: str) -> None:
    async with fleet() as sims:
        cfgs = [instance_config(tmp_path, n, pg_url, urls(sims)) for n in (0, 1, 0)]
        async with instances(cfgs[:2]) as procs:
            one, other = procs[0].port, procs[1].port

            async def pinned_on_other() -> bool:
                return (await admin(other, "routes"))["r"]["pinned"] == "a"

            async def draining_on_other(host: str, draining: bool) -> bool:
                return (await admin(other, "hosts"))[host]["draining"] is draining

            await admin(one, "routes/r", {"host": "a", "pin": True})
            await wait_until(pinned_on_other, timeout=1.0, interval=0.05, what="the pin on the other")
            # instance 1 prefers b for a new conversation: the pin sends it to a
            assert await host_of_turn(other, conversation("pinned", 1)[0], sims) == "a"
            await admin(one, "routes/r", {"pin": False})
            await wait_until(lambda: _not(pinned_on_other), timeout=1.0, interval=0.05, what="the unpin")

            await admin(one, "hosts/b", {"drain": True})
            await wait_until(lambda: draining_on_other("b", True), timeout=1.0, interval=0.05,
                             what="the drain on the other")
            assert await host_of_turn(other, conversation("drained", 1)[0], sims) == "a"
            # an instance started later learns the drain from the database
            async with instances(cfgs[2:]) as later:
                assert (await admin(later[0].port, "hosts"))["b"]["draining"] is True
            await admin(other, "hosts/b", {"drain": False})
            await wait_until(
                lambda: _hosts_draining(one, "b", False), timeout=1.0, interval=0.05, what="the undrain")


async def _not(predicate: Any) -> bool:
    return not await predicate()


async def _hosts_draining(port: int, host: str, draining: bool) -> bool:
    return (await admin(port, "hosts"))[host]["draining"] is draining


# ---------------------------------------------------------------- an instance killed


async def test_clients_switching_from_an_instance_killed_with_sigkill_keep_their_hosts(
        tmp_path: Path, pg_url: str) -> None:
    async with fleet(token_ms=2, n_slots=8, ctx=65536) as sims:
        cfgs = [instance_config(tmp_path, n, pg_url, urls(sims)) for n in (0, 1)]
        async with instances(cfgs) as procs:
            ports = [procs[0].port]  # every client starts on instance 0 …
            killed = asyncio.Event()
            results: dict[int, list[int]] = {}

            async def client(session: int) -> None:
                turns = conversation(f"kill{session}", 6)  # replayed in a cycle: it fits a slot
                for i in range(500):
                    msgs = turns[i % len(turns)]
                    port = procs[1].port if killed.is_set() else ports[0]
                    try:
                        status = await chat(port, msgs, stream=i % 2 == 0)
                    except (aiohttp.ClientError, OSError):
                        status = 0  # … and switches to instance 1 when it fails
                    results.setdefault(session, []).append(status)
                    if killed.is_set() and sum(1 for s in results[session][-3:] if s == 200) == 3:
                        return
                    await asyncio.sleep(0.02)

            clients = [asyncio.create_task(client(i)) for i in range(6)]
            await asyncio.sleep(2.0)
            procs[0].proc.send_signal(signal.SIGKILL)
            assert procs[0].proc.wait(10) == -signal.SIGKILL
            killed.set()
            await asyncio.wait_for(asyncio.gather(*clients), 60)
            assert all(r[-3:] == [200, 200, 200] for r in results.values()), results
            await asyncio.sleep(1.5)  # instance 1's writer commits its rows
            hosts = request_hosts(pg_url)
            assert len(hosts) == 6
            assert all(len(h) == 1 for h in hosts.values()), hosts  # no conversation moved


# ---------------------------------------------------------------- the fingerprint secret


def test_every_instance_reads_the_one_secret_the_database_holds(pg_url: str, tmp_path: Path) -> None:
    stores = [Store(pg_url), Store(pg_url)]
    try:
        for store in stores:
            store.open()
        keys = [fingerprint_key(pg_url, store) for store in stores]
    finally:
        for store in stores:
            store.close()
    assert keys[0] == keys[1] and len(keys[0]) == 32
    assert list(tmp_path.iterdir()) == [] and not list(Path.cwd().glob("postgresql*"))


# ---------------------------------------------------------------- the database unreachable


class Cable:
    """A TCP forwarder between the instances and PostgreSQL that the test can cut (every connection
    reset, new ones refused) and mend (on the same port). It runs on a loop of its own: starting an
    instance blocks the test's loop while the instance connects through it."""

    def __init__(self, target_port: int) -> None:
        self.target_port, self.port = target_port, 0
        self.server: asyncio.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def mend(self) -> None:
        self._run(self._mend())

    def cut(self) -> None:
        self._run(self._cut())

    def close(self) -> None:
        self.cut()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def _mend(self) -> None:
        self.server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _cut(self) -> None:
        if self.server is None:
            return
        self.server.close()
        self.server = None
        for w in list(self.writers):
            w.transport.abort()
        self.writers.clear()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.writers |= {writer, up_writer}
        await asyncio.gather(self._copy(reader, up_writer), self._copy(up_reader, writer))

    async def _copy(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            dst.transport.abort()
            self.writers.discard(dst)


async def metric(port: int, name: str) -> float:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, \
            s.get(f"http://127.0.0.1:{port}/_crossbar/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


async def test_with_the_database_cut_off_both_serve_from_memory_and_agree_again_when_it_returns(
        tmp_path: Path, pg_server: PgServer, pg_url: str) -> None:
    cable = Cable(pg_server.port)
    cable.mend()
    try:
        await _cut_off_and_back(tmp_path, pg_url, pg_server, cable)
    finally:
        cable.close()


async def _cut_off_and_back(tmp_path: Path, pg_url: str, pg_server: PgServer, cable: Cable) -> None:
    via_cable = pg_url.replace(f":{pg_server.port}/", f":{cable.port}/")
    async with fleet() as sims:
        cfgs = [instance_config(tmp_path, n, via_cable, urls(sims)) for n in (0, 1)]
        async with instances(cfgs) as procs:
            ports = [p.port for p in procs]
            known = conversation("known", 3)
            home = await host_of_turn(ports[0], known[0], sims)
            await asyncio.sleep(1.5)  # committed, and announced to instance 1
            cable.cut()

            # a conversation instance 1 learned about keeps its host; new ones are placed locally
            assert await host_of_turn(ports[1], known[1], sims) == home
            fresh = conversation("fresh", 3)
            during = [await host_of_turn(port, fresh[0], sims) for port in ports]
            assert during == ["a", "b"]  # split while they cannot talk (each instance's own choice)
            assert await metric(ports[1], "crossbar_shared_errors_total") >= 1

            cable.mend()

            async def agreed() -> bool:
                views = [leases(await admin(port, "routes")) for port in ports]
                return views[0] == views[1] and len(views[0]) == 2
            await wait_until(agreed, timeout=20, interval=0.2, what="the instances agreeing again")
            after = [await host_of_turn(port, fresh[1], sims) for port in ports]
            assert after[0] == after[1]
            assert await host_of_turn(ports[1], known[2], sims) == home

            async def every_row_landed() -> bool:
                return sum(len(h) for h in request_hosts(pg_url).values()) >= 2 and len(
                    _rows(pg_url)) == 7
            await wait_until(every_row_landed, timeout=20, interval=0.2, what="the queued rows")


def _rows(db: str) -> list[Any]:
    with psycopg.connect(db) as conn:
        return conn.execute("SELECT fp, host FROM requests").fetchall()


async def test_a_fleet_slot_refused_or_abandoned_gives_the_local_slot_back(
        tmp_path: Path, pg_url: str) -> None:
    async with fleet(names=("a",), token_ms=300) as sims:
        hosts = {"a": (sims["a"].url, HostSpec({"m": {"parallel": 1}}))}
        routes = {"r": {"hosts": ["a"], "default_model": "m"},
                  "nq": {"hosts": ["a"], "default_model": "m", "queue": False}}
        cfgs = [write_config(tmp_path / f"c{n}.toml", hosts, routes, db=pg_url) for n in (0, 1)]
        async with instances(cfgs) as procs:
            one, other = procs[0].port, procs[1].port
            long = asyncio.create_task(chat(one, conversation("long", 1)[0]))
            await wait_until(lambda: sims["a"].stats.inflight.get("m", 0) == 1, timeout=10,
                             what="the first request running")
            body = {"messages": conversation("nq", 1)[0], "max_tokens": 4}
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s:
                async with s.post(f"http://127.0.0.1:{other}/nq{CHAT}", json=body) as resp:
                    assert resp.status == 503 and "Retry-After" in resp.headers  # no queueing: at once
                    assert (await resp.json())["error"]["type"]
                with contextlib.suppress(TimeoutError):  # a client that leaves while it waits
                    async with asyncio.timeout(0.5):
                        await s.post(f"http://127.0.0.1:{other}/r{CHAT}", json=body)
            assert await long == 200
            await wait_until(lambda: _in_flight(other, 0), timeout=5, interval=0.1,
                             what="the other instance's local slot given back")
            assert await chat(other, conversation("after", 1)[0]) == 200
            assert sims["a"].stats.max_concurrent["m"] == 1
            with psycopg.connect(pg_url) as conn:
                assert conn.execute("SELECT count(*) FROM fleet_slots").fetchone() == (0,)


async def _in_flight(port: int, n: int) -> bool:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, \
            s.get(f"http://127.0.0.1:{port}/_crossbar/metrics") as resp:
        text = await resp.text()
    return f'crossbar_in_flight{{host="a",model="m"}} {float(n)}' in text


def test_a_database_unreachable_at_start_up_is_one_clear_line_and_an_exit(tmp_path: Path) -> None:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    db = f"postgresql://crossbar:hunter2@127.0.0.1:{port}/crossbar"
    cfg = write_config(tmp_path / "c.toml", {"a": ("http://127.0.0.1:9", HostSpec({"m": {}}))},
                       {"r": {"hosts": ["a"], "default_model": "m"}}, db=db)
    run = subprocess.run([MITMDUMP, "-s", str(ROOT / "addons" / "crossbar.py"), "--set", "server=false",
                          "--set", f"crossbar_config={cfg}"], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    label = f"postgresql+psycopg://crossbar:***@127.0.0.1:{port}/crossbar"
    assert f"crossbar: store: cannot open database {label}" in out, out
    assert "hunter2" not in out and "Traceback" not in out
