"""Reloading the configuration while crossbar serves, through a real mitmdump and simulated
llama-servers: hosts and routes come and go, weights and `parallel` change, streams in flight
finish on the host they have, stranded leases are dropped with their own reason, and every
request keeps exactly one accounting row. A bad file, or one that changes what only a restart
can, changes nothing and answers the one-line error start-up gives."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sqlite3
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import (
    ROOT,
    Fleet,
    HostSpec,
    Proxy,
    completion_count,
    crossbar_proxy,
    launch,
    lease_event_rows,
    request_rows,
    serving,
    sim_fleet,
    split_response,
    sse_data,
    start_mitmdump,
    wait_until,
    write_config,
)

from crossbar.config import ConfigError, load_config
from llamasim import SimConfig

CHAT = "/r/v1/chat/completions"
TIMEOUT = aiohttp.ClientTimeout(total=60)
ADMIN_JSON = {"Content-Type": "application/json"}
TOKEN = "reload-token-0123456789"
TOKEN_MS = 40  # per generated token: a 50-token stream runs ~2 s


def spec(weight: float = 1.0, parallel: int = 0) -> HostSpec:
    return HostSpec({"m": {"parallel": parallel} if parallel else {}}, weight=weight,
                    sim=SimConfig(models=["m"], n_slots=4, token_ms=TOKEN_MS))


def messages(conv: str, turn: int = 0) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": f"agent {conv}"}, {"role": "user", "content": f"task {conv}"}]
    for i in range(turn):
        msgs += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"more {i}"}]
    return msgs


class Setup:
    """Sims for every host that may appear, and a writer of crossbar's TOML at a fixed path."""

    def __init__(self, fleet: Fleet, path: Path):
        self.fleet, self.path = fleet, path

    def write(self, hosts: dict[str, HostSpec], routes: dict[str, dict[str, Any]] | None = None,
              **top: Any) -> Path:
        routes = routes if routes is not None else {"r": {"hosts": list(hosts), "default_model": "m"}}
        top.setdefault("db", str(self.path.with_suffix(".db")))
        return write_config(self.path, {n: (self.fleet[n].url, s) for n, s in hosts.items()}, routes, **top)


@asynccontextmanager
async def served(tmp_path: Path, hosts: dict[str, HostSpec],
                 names: tuple[str, ...] = ("alpha", "beta", "gamma"),
                 **top: Any) -> AsyncIterator[tuple[Setup, Proxy]]:
    async with sim_fleet({n: spec() for n in names}) as fleet:
        setup = Setup(fleet, tmp_path / "crossbar.toml")
        async with crossbar_proxy(setup.write(hosts, **top)) as proxy:
            yield setup, proxy


async def reload(proxy: Proxy) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, \
            s.post(f"{proxy.url}/_crossbar/reload", headers=ADMIN_JSON) as resp:
        return resp.status, await resp.json()


async def turn(port: int, conv: str, turn_no: int = 0, tokens: int = 2,
               path: str = CHAT) -> tuple[int, bytes]:
    """One streamed turn of conversation `conv`; the whole body as received."""
    body = {"messages": messages(conv, turn_no), "stream": True, "max_tokens": tokens}
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, \
            s.post(f"http://127.0.0.1:{port}{path}", json=body) as resp:
        return resp.status, await resp.read()


def complete(result: tuple[int, bytes], tokens: int) -> bool:
    status, body = result
    events = sse_data(body)
    return status == 200 and events[-1] == b"[DONE]" and len(events) >= tokens


async def in_flight(proxy: Proxy, host: str, n: int) -> None:
    await wait_until(lambda: proxy.router.limiter.host_totals(host)[0] >= n, 10,
                     what=f"{n} running on {host}")


# ------------------------------------------------------------------ hosts


async def test_an_added_host_takes_new_conversations(tmp_path: Path) -> None:
    async with served(tmp_path, {"alpha": spec()}) as (setup, proxy):
        assert complete(await turn(proxy.port, "before"), 2)
        setup.write({"alpha": spec(), "gamma": spec(weight=10)})
        status, answer = await reload(proxy)
        assert status == 200 and answer == {"ok": True, "changed": "hosts +gamma; routes ~r"}
        for i in range(3):
            assert complete(await turn(proxy.port, f"new-{i}"), 2)
        assert completion_count(setup.fleet["gamma"]) == 3
        assert {lease.host for lease in proxy.router.leases.snapshot() if lease.key.fp} == {"alpha", "gamma"}
        assert len(await request_rows(proxy)) == 4


async def test_an_added_host_is_polled_at_once(tmp_path: Path) -> None:
    async with served(tmp_path, {"alpha": spec()}, poll_interval="60s") as (setup, proxy):
        dead = HostSpec({"m": {}}, weight=10)
        nowhere = f"http://127.0.0.1:{free_port()}"
        hosts = {"alpha": (setup.fleet["alpha"].url, spec()), "dead": (nowhere, dead)}
        write_config(setup.path, hosts, {"r": {"hosts": ["alpha", "dead"], "default_model": "m"}},
                     db=str(setup.path.with_suffix(".db")), poll_interval="60s")
        assert (await reload(proxy))[0] == 200
        assert not proxy.router.fleet.healthy("dead")  # known before the next round, 60 s away
        assert complete(await turn(proxy.port, "n"), 2)
        assert [r.host for r in await request_rows(proxy)] == ["alpha"]


async def test_a_removed_host_finishes_its_streams_and_its_leases_move_at_their_next_turn(
        tmp_path: Path) -> None:
    async with served(tmp_path, {"alpha": spec(), "beta": spec()}) as (setup, proxy):
        first = [asyncio.create_task(turn(proxy.port, f"c{i}", tokens=50)) for i in range(4)]
        await in_flight(proxy, "alpha", 1)
        await in_flight(proxy, "beta", 1)
        on_beta = {lease.key for lease in proxy.router.leases.snapshot() if lease.host == "beta"}
        assert on_beta

        setup.write({"alpha": spec()})
        status, answer = await reload(proxy)
        assert status == 200, answer
        assert answer["changed"].startswith("hosts -beta; routes ~r")
        assert f"{len(on_beta)} lease(s) dropped" in answer["changed"]
        assert proxy.router.limiter.host_totals("beta")[0] >= 1  # still streaming on the removed host
        assert all(complete(r, 50) for r in await asyncio.gather(*first))

        events = await lease_event_rows(proxy)
        dropped = [e for e in events if e.reason == "host_removed"]
        assert {(e.route, e.fp, e.model) for e in dropped} == {(k.route, k.fp, k.model) for k in on_beta}
        assert all(e.from_host == "beta" and e.to_host is None for e in dropped)

        beta_before = completion_count(setup.fleet["beta"])
        for i in range(4):  # every conversation's next turn, on the host that is left
            assert complete(await turn(proxy.port, f"c{i}", turn_no=1), 2)
        assert completion_count(setup.fleet["beta"]) == beta_before
        assert {lease.host for lease in proxy.router.leases.snapshot()} == {"alpha"}
        replaced = [e for e in await lease_event_rows(proxy) if e.reason == "new" and e.to_host == "alpha"]
        assert {(e.route, e.fp) for e in dropped} <= {(e.route, e.fp) for e in replaced}
        assert len(await request_rows(proxy)) == 8
        # the removed host is forgotten once nothing holds it
        await wait_until(lambda: "beta" not in proxy.router.fleet.state, 5, what="beta forgotten")


async def test_a_request_queued_on_a_removed_host_still_runs_there(tmp_path: Path) -> None:
    async with served(tmp_path, {"alpha": spec(parallel=1)}) as (setup, proxy):
        running = asyncio.create_task(turn(proxy.port, "running", tokens=40))
        await in_flight(proxy, "alpha", 1)
        queued = asyncio.create_task(turn(proxy.port, "queued", tokens=2))
        await wait_until(lambda: proxy.router.limiter.queued("alpha", "") == 1, 5, what="one queued")
        setup.write({"beta": spec()})
        status, answer = await reload(proxy)
        assert status == 200 and answer["changed"].startswith("hosts +beta -alpha")
        assert complete(await running, 40) and complete(await queued, 2)
        assert completion_count(setup.fleet["alpha"]) == 2 and completion_count(setup.fleet["beta"]) == 0
        assert sorted(r.host for r in await request_rows(proxy)) == ["alpha", "alpha"]
        assert complete(await turn(proxy.port, "queued", turn_no=1), 2)
        assert completion_count(setup.fleet["beta"]) == 1


async def test_new_weights_steer_new_conversations(tmp_path: Path) -> None:
    async with served(tmp_path, {"alpha": spec(weight=10), "beta": spec()}) as (setup, proxy):
        assert complete(await turn(proxy.port, "w0"), 2)
        assert completion_count(setup.fleet["alpha"]) == 1
        setup.write({"alpha": spec(), "beta": spec(weight=10)})
        status, answer = await reload(proxy)
        assert (status, answer["changed"]) == (200, "hosts ~alpha ~beta")
        for i in range(1, 4):
            assert complete(await turn(proxy.port, f"w{i}"), 2)
        assert completion_count(setup.fleet["beta"]) == 3
        assert complete(await turn(proxy.port, "w0", turn_no=1), 2)  # its lease stays where it is
        assert completion_count(setup.fleet["alpha"]) == 2
        assert proxy.router.fleet.state["alpha"].polled  # learned state kept for hosts that stay


async def test_a_lowered_parallel_lets_running_streams_finish_and_holds_new_ones(tmp_path: Path) -> None:
    async with served(tmp_path, {"alpha": spec(parallel=2)}) as (setup, proxy):
        short = asyncio.create_task(turn(proxy.port, "short", tokens=25))
        long = asyncio.create_task(turn(proxy.port, "long", tokens=75))
        await in_flight(proxy, "alpha", 2)
        setup.write({"alpha": spec(parallel=1)})
        assert (await reload(proxy))[0] == 200
        held = asyncio.create_task(turn(proxy.port, "held", tokens=2))
        await wait_until(lambda: proxy.router.limiter.queued("alpha", "") == 1, 5, what="held queued")
        assert complete(await short, 25)
        await asyncio.sleep(0.2)
        assert not held.done() and proxy.router.limiter.queued("alpha", "") == 1  # one still runs
        assert complete(await long, 75)
        assert complete(await held, 2)
        rows = await request_rows(proxy)
        assert len(rows) == 3 and max(r.queued_ms for r in rows) > 0


# ------------------------------------------------------------------ routes and listeners


async def send_on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  data: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request on an open keep-alive connection; reads one Content-Length answer."""
    writer.write(data)
    await writer.drain()
    status, headers, _ = split_response(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30))
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), 30)
    return status, headers, body


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_route_with_its_own_listener_opens_and_closes_without_touching_the_others(
        tmp_path: Path) -> None:
    async with served(tmp_path, {"alpha": spec(), "beta": spec()}) as (setup, proxy):
        hosts = {"alpha": spec(), "beta": spec()}
        main = asyncio.create_task(turn(proxy.port, "main", tokens=60))
        await in_flight(proxy, "alpha", 1)
        port = free_port()
        side = {"hosts": ["beta"], "default_model": "m", "listen": f"127.0.0.1:{port}"}
        setup.write(hosts, {"r": {"hosts": ["alpha", "beta"], "default_model": "m"}, "side": side})
        status, answer = await reload(proxy)
        assert (status, answer["changed"]) == (200, "routes +side; listeners")
        assert complete(await turn(port, "agent", path="/v1/chat/completions"), 2)
        assert completion_count(setup.fleet["beta"]) == 1
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # kept alive across the removal
        models = b"GET /v1/models HTTP/1.1\r\nHost: crossbar\r\n\r\n"
        assert (await send_on(reader, writer, models))[0] == 200

        setup.write(hosts, {"r": {"hosts": ["alpha", "beta"], "default_model": "m"}})
        status, answer = await reload(proxy)
        assert (status, answer["changed"]) == (200, "routes -side; listeners; 1 lease(s) dropped")
        with pytest.raises(aiohttp.ClientConnectionError):
            await turn(port, "agent", turn_no=1, path="/v1/chat/completions")
        status, _, body = await send_on(reader, writer, models)  # its route is gone: a clear 404
        assert status == 404 and "no longer configured" in json.loads(body)["error"]["message"]
        writer.close()
        assert complete(await main, 60)  # the main listener's stream ran through both reloads
        assert complete(await turn(proxy.port, "after"), 2)
        side_events = [e.reason for e in await lease_event_rows(proxy) if e.route == "side"]
        assert side_events == ["new", "route_changed"]


async def test_a_route_listener_on_a_taken_port_is_reported_and_the_rest_applies(tmp_path: Path) -> None:
    async with served(tmp_path, {"alpha": spec()}) as (setup, proxy):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            side = {"hosts": ["alpha"], "default_model": "m", "listen": f"127.0.0.1:{port}"}
            setup.write({"alpha": spec(weight=2)}, {"r": {"hosts": ["alpha"], "default_model": "m"},
                                                    "side": side})
            status, answer = await reload(proxy)
        assert status == 500 and f"could not listen on reverse:http://127.0.0.1:1@127.0.0.1:{port}" in (
            answer["error"]["message"])
        assert proxy.router.cfg.hosts["alpha"].weight == 2 and "side" in proxy.router.cfg.routes
        assert complete(await turn(proxy.port, "main"), 2)


async def test_a_route_losing_a_host_drops_only_the_leases_there(tmp_path: Path) -> None:
    async with served(tmp_path, {"alpha": spec(), "beta": spec()}) as (setup, proxy):
        await asyncio.gather(*(turn(proxy.port, f"k{i}") for i in range(4)))
        before = {lease.key: lease.host for lease in proxy.router.leases.snapshot()}
        assert set(before.values()) == {"alpha", "beta"}
        setup.write({"alpha": spec(), "beta": spec()}, {"r": {"hosts": ["alpha"], "default_model": "m"}})
        status, answer = await reload(proxy)
        assert status == 200 and answer["changed"].startswith("routes ~r")
        after = {lease.key: lease.host for lease in proxy.router.leases.snapshot()}
        assert after == {k: h for k, h in before.items() if h == "alpha"}
        reasons = [e.reason for e in await lease_event_rows(proxy) if e.from_host == "beta"]
        assert reasons and set(reasons) == {"route_changed"}


# ------------------------------------------------------------------ refusals


async def test_a_bad_file_changes_nothing_and_answers_the_start_up_error(tmp_path: Path) -> None:
    async with served(tmp_path, {"alpha": spec()}) as (setup, proxy):
        running = proxy.router.cfg
        setup.write({"alpha": spec(), "beta": spec()}, surprise=1)
        with pytest.raises(ConfigError) as startup:
            load_config(setup.path)
        status, answer = await reload(proxy)
        assert status == 400
        assert answer["error"]["message"] == str(startup.value) and "surprise" in str(startup.value)
        assert proxy.router.cfg is running and proxy.addon.cfg is running
        assert list(proxy.router.fleet.state) == ["alpha"]
        assert complete(await turn(proxy.port, "still"), 2)


@pytest.mark.parametrize(("key", "value"), [("db", "other.db"), ("listen", "127.0.0.1:1")])
async def test_a_restart_only_key_is_refused_naming_it(tmp_path: Path, key: str, value: str) -> None:
    async with served(tmp_path, {"alpha": spec()}) as (setup, proxy):
        running = proxy.router.cfg
        new_value = str(tmp_path / value) if key == "db" else value
        setup.write({"alpha": spec(), "beta": spec()}, **{key: new_value})
        status, answer = await reload(proxy)
        assert status == 400 and answer["error"]["message"].startswith(f"{key}: ")
        assert "restart" in answer["error"]["message"]
        assert proxy.router.cfg is running


async def test_reload_is_a_protected_admin_call(tmp_path: Path) -> None:
    async with served(tmp_path, {"alpha": spec()}, admin_token=TOKEN) as (_setup, proxy), \
            aiohttp.ClientSession(timeout=TIMEOUT) as s:
        url = f"{proxy.url}/_crossbar/reload"
        async with s.post(url, data=b"{}") as resp:  # a form-like POST
            assert resp.status == 415
        async with s.post(url, headers=ADMIN_JSON) as resp:
            assert resp.status == 401
        async with s.post(url, headers={**ADMIN_JSON, "Origin": "http://evil.example",
                                        "Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 403
        async with s.get(url, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 405
        async with s.post(url, headers={**ADMIN_JSON, "Authorization": f"Bearer {TOKEN}"}) as resp:
            assert resp.status == 200 and await resp.json() == {"ok": True, "changed": "no change"}


# ------------------------------------------------------------------ under load


async def test_reloads_during_twenty_streams_lose_no_request_and_no_row(tmp_path: Path) -> None:
    async with served(tmp_path, {"alpha": spec(), "beta": spec()}) as (setup, proxy):
        streams = [asyncio.create_task(turn(proxy.port, f"s{i}", tokens=40)) for i in range(20)]
        await wait_until(lambda: len(proxy.router.live) == 20, 10, what="20 streams admitted")
        setup.write({"alpha": spec(), "beta": spec(), "gamma": spec(weight=5)}, queue_max=32)
        assert (await reload(proxy))[0] == 200
        setup.write({"alpha": spec(parallel=1), "gamma": spec()})
        assert (await reload(proxy))[0] == 200
        results = await asyncio.gather(*streams)
        assert all(complete(r, 40) for r in results)
        assert not proxy.router.live
        rows = await request_rows(proxy)
        assert len(rows) == 20 and all(r.status == 200 and r.completion_tokens == 40 for r in rows)


# ------------------------------------------------------------------ the real command


def rows_in(db: Path) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(db)
    try:
        query = "SELECT route, host, status, completion_tokens FROM requests ORDER BY id"
        return conn.execute(query).fetchall()
    finally:
        conn.close()


async def test_sighup_reloads_and_touching_the_entry_file_does_not_load_a_second_router(
        tmp_path: Path) -> None:
    async with sim_fleet({n: spec() for n in ("alpha", "beta")}) as fleet:
        setup = Setup(fleet, tmp_path / "crossbar.toml")
        setup.write({"alpha": spec()})
        proc = start_mitmdump(setup.path, ["--set", "server=false"])  # no default listener on :8080
        try:
            log = lambda: "".join(proc.output)  # noqa: E731
            streams = [asyncio.create_task(turn(proc.port, f"h{i}", tokens=50)) for i in range(4)]
            await asyncio.sleep(0.5)

            entry = ROOT / "addons" / "crossbar.py"
            os.utime(entry)  # what a `git pull` does to it
            setup.write({"alpha": spec(), "beta": spec(weight=10)},
                        {"r": {"hosts": ["alpha", "beta"], "default_model": "m"},
                         "new": {"hosts": ["beta"], "default_model": "m"}})
            proc.proc.send_signal(signal.SIGHUP)
            await wait_until(lambda: "configuration reloaded" in log(), 10, what="the reload")
            assert complete(await turn(proc.port, "fresh", path="/new/v1/chat/completions"), 2)
            assert completion_count(fleet["beta"]) == 1

            bad = setup.path.read_text().replace("[routes.\"new\"]", "[routes.\"new\"]\nsurprise = 1")
            setup.path.write_text(bad)
            with pytest.raises(ConfigError) as startup:
                load_config(setup.path)
            proc.proc.send_signal(signal.SIGHUP)
            await wait_until(lambda: "reload refused" in log(), 10, what="the refusal")
            assert f"crossbar config: {startup.value}\n" in log()

            assert all(complete(r, 50) for r in await asyncio.gather(*streams))
            await asyncio.sleep(1.5)  # mitmproxy checks the entry file every second
            assert log().count("Loading script") == 1, log()
            assert "on change is off" in log()
            assert complete(await turn(proc.port, "fresh", turn_no=1, path="/new/v1/chat/completions"), 2)
        finally:
            code = proc.stop()
        assert code == 0 and "Traceback" not in log(), log()
    rows = rows_in(setup.path.with_suffix(".db"))
    assert len(rows) == 6 and all(status == 200 for _, _, status, _ in rows)
    assert sorted(r[0] for r in rows) == ["new", "new", "r", "r", "r", "r"]


FAKE_TAILSCALE = """#!/bin/sh
# `tailscale version` at start-up: the SIGHUP of a `systemctl reload` lands while crossbar starts
if [ "$1" = version ]; then kill -HUP "$PPID"; sleep 0.3; echo 1.0-test; fi
"""


async def test_a_sighup_during_start_up_is_applied_once_crossbar_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before crossbar's `running` a SIGHUP took Python's default action and ended the process,
    which systemd counts as a clean stop (no restart): `systemctl reload` right after `start`
    left the service dead."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "tailscale").write_text(FAKE_TAILSCALE)
    (bindir / "tailscale").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    async with sim_fleet({"alpha": spec()}) as fleet:
        setup = Setup(fleet, tmp_path / "crossbar.toml")
        setup.write({"alpha": spec()}, identity="tailscale")
        proc = start_mitmdump(setup.path)
        try:
            log = lambda: "".join(proc.output)  # noqa: E731
            await wait_until(lambda: "configuration reloaded" in log(), 10, what="the reload")
            assert "a SIGHUP came while crossbar started" in log()
            assert complete(await turn(proc.port, "after", tokens=2), 2)
        finally:
            code = proc.stop()
        assert code == 0 and "Traceback" not in log(), log()


def test_run_sh_survives_a_sighup_before_crossbar_is_loaded(tmp_path: Path) -> None:
    """The launcher's own start-up and Python's imports come before crossbar is loaded: a SIGHUP
    there is ignored (the configuration is read after it anyway), later ones reload."""
    nobody = f"http://127.0.0.1:{free_port()}"  # a host that is down: start-up does not wait for it
    config = write_config(tmp_path / "crossbar.toml", {"alpha": (nobody, spec())},
                          {"r": {"hosts": ["alpha"], "default_model": "m"}})
    proc = launch([str(ROOT / "run.sh"), str(config), "--set", "flow_detail=0"])
    try:
        time.sleep(0.3)  # in run.sh, or in Python's imports: long before crossbar is loaded
        proc.send_signal(signal.SIGHUP)
        started = serving(proc)
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "configuration reloaded" not in "".join(started.output) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "configuration reloaded" in "".join(started.output)
        assert started.stop() == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def test_a_listener_that_could_not_open_is_opened_by_the_next_reload(tmp_path: Path) -> None:
    """A route's `listen` on a taken port: that reload answers 500. Once the port is free, the
    same file reloaded again opens it (it answered 200 "no change" and left it closed)."""
    async with served(tmp_path, {"alpha": spec()}) as (setup, proxy):
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        side = {"hosts": ["alpha"], "default_model": "m", "listen": f"127.0.0.1:{port}"}
        setup.write({"alpha": spec()}, {"r": {"hosts": ["alpha"], "default_model": "m"}, "side": side})
        status, answer = await reload(proxy)
        assert status == 500 and str(port) in answer["error"]["message"], answer
        taken.close()  # the operator frees the port and reloads again
        status, answer = await reload(proxy)
        assert status == 200, answer
        assert complete(await turn(port, "agent", path="/v1/chat/completions"), 2)
        status, answer = await reload(proxy)  # and nothing changes after that
        assert (status, answer["changed"]) == (200, "no change"), answer
        assert complete(await turn(port, "agent", turn_no=1, path="/v1/chat/completions"), 2)


def chat_bytes(pad: int, **headers: str) -> bytes:
    chat = {"messages": messages("kept"), "max_tokens": 2, "metadata": {"pad": "x" * pad}}
    body = json.dumps(chat).encode()
    extra = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in headers.items())
    return (f"POST {CHAT} HTTP/1.1\r\nHost: crossbar\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def test_reloaded_limits_reach_connections_kept_open_across_the_reload(tmp_path: Path) -> None:
    """Agents keep their connections open: a raised max_body, a lowered max_head applied only to
    connections opened after the reload (each connection kept the limits it was opened with)."""
    async with served(tmp_path, {"alpha": spec()}, max_body="1KiB") as (setup, proxy):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            assert (await send_on(reader, writer, chat_bytes(100)))[0] == 200
            setup.write({"alpha": spec()}, max_body="8KiB", max_head="4KiB")
            status, answer = await reload(proxy)
            assert status == 200 and "max_body" in answer["changed"], answer
            status, _, body = await send_on(reader, writer, chat_bytes(2000))
            assert status == 200, body[:300]
            status, _, body = await send_on(reader, writer, chat_bytes(10, X_Pad="y" * 5000))
            assert status == 431 and b"max_head" in body, body[:300]
        finally:
            writer.close()


async def test_a_reload_leaves_the_limits_of_a_request_under_way_alone(tmp_path: Path) -> None:
    async with served(tmp_path, {"alpha": spec()}, max_head="16KiB") as (setup, proxy):
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        try:
            request = chat_bytes(10, X_Pad="y" * 6000)
            head_end = request.index(b"\r\n\r\n")
            writer.write(request[:head_end - 10])  # most of the head: the request has begun
            await writer.drain()
            await asyncio.sleep(0.3)
            setup.write({"alpha": spec()}, max_head="4KiB")
            status, answer = await reload(proxy)
            assert status == 200 and "max_head" in answer["changed"], answer
            status, _, body = await send_on(reader, writer, request[head_end - 10:])
            assert status == 200, (status, body[:300])
            status, _, body = await send_on(reader, writer, request)  # the next one: the new limit
            assert status == 431, (status, body[:300])
        finally:
            writer.close()


def test_a_sighup_while_crossbar_stops_is_ignored(tmp_path: Path) -> None:
    """The event loop gave SIGHUP back its default action when it closed: a `systemctl reload`
    during a stop ended the process by the signal (exit -1, not 0)."""
    nobody = f"http://127.0.0.1:{free_port()}"
    config = write_config(tmp_path / "crossbar.toml", {"alpha": (nobody, spec())},
                          {"r": {"hosts": ["alpha"], "default_model": "m"}})
    proc = start_mitmdump(config)
    proc.proc.send_signal(signal.SIGTERM)
    while proc.proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.proc.send_signal(signal.SIGHUP)
        time.sleep(0.002)
    assert proc.proc.wait() == 0, "".join(proc.output)[-1500:]
