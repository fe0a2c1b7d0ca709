"""Accounting you can ask questions of: `GET /_crossbar/usage` (shapes, `since`, `by`
including `decision`, per-host uptime), retention roll-ups while traffic flows, and nothing lost
when many sessions run at once."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from accounting_util import Told, host, scrape, send_turn, summed, total
from harness import (
    Fleet,
    HostSpec,
    Proxy,
    committed,
    conversation,
    crossbar_proxy,
    is_error_shape,
    sim_fleet,
    wait_until,
    write_config,
)

from crossbar.admin import parse_since, usage_table
from crossbar.errors import CrossbarError
from crossbar.store import Store

USAGE_KEYS = ["key", "requests", "errors", "busy_ms", "queued_ms", "prompt_tokens", "cached_tokens",
              "completion_tokens"]
T0 = 1_780_000_000.0  # 2026-05-28, a fixed instant for the store-level tests
DAY = 86400.0


@asynccontextmanager
async def setup(tmp_path: Path, specs: Mapping[str, HostSpec], routes: tuple[str, ...] = ("r",),
                **top: Any) -> AsyncIterator[tuple[Fleet, Proxy]]:
    """Sims for `specs` and crossbar with `routes`, each over every host."""
    async with sim_fleet(specs) as fleet:
        cfg = write_config(tmp_path / "crossbar.toml", {n: (fleet[n].url, s) for n, s in specs.items()},
                           {r: {"hosts": list(specs), "default_model": "m"} for r in routes}, **top)
        async with crossbar_proxy(cfg) as proxy:
            yield fleet, proxy


async def usage(proxy: Proxy, query: str = "", accept: str = "application/json") -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s, s.get(
        f"{proxy.url}/_crossbar/usage{query}", headers={"Accept": accept}
    ) as resp:
        text = await resp.text()
        if resp.headers["Content-Type"].startswith("application/json"):
            return resp.status, json.loads(text)
        return resp.status, text


async def usage_rows(proxy: Proxy, by: str, since: str = "24h") -> dict[str, dict[str, Any]]:
    await committed(proxy)
    status, rows = await usage(proxy, f"?by={by}&since={since}")
    assert status == 200, rows
    return {row["key"]: row for row in rows}


def told_of(row: Mapping[str, Any]) -> Told:
    return Told(row["prompt_tokens"], row["cached_tokens"], row["completion_tokens"])


# ---------------------------------------------------------------- the endpoint


async def test_usage_shapes_since_and_by(tmp_path: Path) -> None:
    async with setup(tmp_path, {"a": host(), "b": host()}) as (_, proxy):
        async with aiohttp.ClientSession() as s:
            told = [await send_turn(s, proxy.url, "r", m) for m in conversation("shape", 3)]
        await committed(proxy)

        status, rows = await usage(proxy)  # defaults: by=route, since=24h
        assert status == 200 and [list(row) for row in rows] == [USAGE_KEYS]
        assert rows[0]["key"] == "r" and rows[0]["requests"] == 3 and rows[0]["errors"] == 0
        assert told_of(rows[0]) == total(told)

        hour_ago = (datetime.now(UTC) - timedelta(hours=1)).replace(microsecond=0)
        for since in ("7d", "90m", "1h30m", hour_ago.strftime("%Y-%m-%dT%H:%M:%SZ"),
                      hour_ago.isoformat().replace("+00:00", "%2B00:00"),
                      hour_ago.isoformat()):  # an unescaped "+" arrives as a space
            status, rows = await usage(proxy, f"?since={since}")
            assert (status, rows[0]["requests"]) == (200, 3), since
        future = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        assert await usage(proxy, f"?since={future}") == (200, [])

        models = await usage_rows(proxy, "model")
        assert list(models) == ["m"] and models["m"]["requests"] == 3
        hosts = await usage_rows(proxy, "host")
        assert set(hosts) == {"a", "b"}  # b served nothing but was polled: a zero row with uptime
        assert all(list(row) == [*USAGE_KEYS, "uptime"] for row in hosts.values())
        served = [h for h, row in hosts.items() if row["requests"]]
        assert len(served) == 1 and hosts[served[0]]["requests"] == 3
        assert hosts["a"]["uptime"] == 1.0 and hosts["b"]["uptime"] == 1.0
        decisions = await usage_rows(proxy, "decision")
        assert {k: v["requests"] for k, v in decisions.items()} == {"new": 1, "reused": 2}
        assert decisions["reused"]["cached_tokens"] > 0 and not decisions["new"]["cached_tokens"]

        status, table = await usage(proxy, "?by=route", accept="text/plain")
        lines = table.splitlines()
        assert status == 200 and lines[0].split() == ["key", "requests", "errors", "busy_ms", "queued_ms",
                                                      "prompt", "cached", "completion", "cache_hit"]
        cells = lines[1].split()
        assert cells[0] == "r" and cells[1] == "3"
        assert cells[-1] == f"{total(told).cached / total(told).prompt:.2f}"
        status, table = await usage(proxy, "?by=host", accept="text/plain")
        assert table.splitlines()[0].split()[-2:] == ["cache_hit", "uptime"]


@pytest.mark.parametrize("query", ["?since=yesterday", "?since=24", "?since=2026-11-30T00:00:00",
                                   "?since=", "?by=fp", "?by=ROUTE", "?by=route&since=-1h"])
async def test_bad_usage_queries_are_400_json(tmp_path: Path, query: str) -> None:
    async with setup(tmp_path, {"a": host()}) as (_, proxy):
        status, body = await usage(proxy, query)
    assert status == 400 and is_error_shape(body, 400), body
    assert ("since" if "since" in query else "by") in body["error"]["message"]


async def test_uptime_is_the_share_of_healthy_polls(tmp_path: Path) -> None:
    async with setup(tmp_path, {"a": host(), "b": host()}) as (fleet, proxy):
        fleet["b"].set(health_status=503)
        await wait_until(lambda: not proxy.router.fleet.healthy("b"), 10, 0.02, "b to be marked down")
        rounds = proxy.router.poller.rounds
        await wait_until(lambda: proxy.router.poller.rounds >= rounds + 3, 10, 0.02, "three more polls")
        hosts = await usage_rows(proxy, "host")
    assert hosts["a"]["uptime"] == 1.0
    assert 0.0 <= hosts["b"]["uptime"] < 1.0
    assert hosts["b"]["requests"] == 0


def test_parse_since_and_the_table() -> None:
    now = T0
    assert parse_since("24h", now) == now - DAY
    assert parse_since("2026-05-28T00:00:00Z", now) == datetime(2026, 5, 28, tzinfo=UTC).timestamp()
    assert parse_since("2026-05-28T02:00:00 02:00", now) == datetime(2026, 5, 28, tzinfo=UTC).timestamp()
    assert parse_since("100000000d", now) == 0.0  # never before the epoch, never an overflow
    with pytest.raises(CrossbarError):
        parse_since("2026-05-28", now)  # no time zone
    rows = [{"key": "r", "requests": 2, "errors": 0, "busy_ms": 5, "queued_ms": 0, "prompt_tokens": 0,
             "cached_tokens": 0, "completion_tokens": 0}]
    assert usage_table(rows).splitlines()[1].split()[-1] == "-"  # no prompt tokens: no ratio


# ---------------------------------------------------------------- the store: decision and retention


def fill(store: Store) -> None:
    rows = [("r1", "a", "new", T0, 100, 0), ("r1", "a", "reused", T0 + 1, 100, 90),
            ("r1", "b", "moved:unhealthy", T0 + 2, 120, 0), ("r2", None, None, T0 + 3, None, None),
            ("r2", "a", "reused", T0 - DAY, 80, 70)]
    for route, host_, decision, started, prompt, cached in rows:
        store.record_request({"route": route, "fp": "f", "model": "m", "host": host_, "started": started,
                              "queued_ms": 1, "total_ms": 10, "status": 200 if host_ else None,
                              "streamed": False, "prompt_tokens": prompt, "cached_tokens": cached,
                              "completion_tokens": 5 if prompt else None, "decision": decision})
    assert store.flush()


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = Store(str(tmp_path / "acc.db"))
    s.open()
    s.start()
    yield s
    s.close()


def test_usage_by_decision_survives_the_rollup(store: Store) -> None:
    fill(store)
    before = {by: store.usage(0, by) for by in ("route", "model", "host", "decision")}
    decisions = {r["key"]: (r["requests"], r["cached_tokens"]) for r in before["decision"]}
    assert decisions == {"": (1, 0), "moved:unhealthy": (1, 0), "new": (1, 0), "reused": (2, 160)}
    assert store.rollup(T0 + 10) == 5
    assert store.requests_since(0) == []
    assert {by: store.usage(0, by) for by in before} == before


def test_rollup_prunes_old_health_observations(store: Store) -> None:
    for ts in (T0 - DAY, T0 - 1, T0 + 1):
        store.record_health(ts, "a", True, ["m"])
    assert store.flush()
    store.rollup(T0)
    assert store.host_uptime(0) == {"a": 1.0}
    rows = sqlite3.connect(store.path).execute("SELECT COUNT(*) FROM host_health").fetchone()
    assert rows == (1,)


def test_an_old_requests_daily_gains_the_decision_column(tmp_path: Path) -> None:
    """A database written before `decision` joined the daily key opens and keeps its totals."""
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE requests_daily (day VARCHAR NOT NULL, route VARCHAR NOT NULL, "
                   "model VARCHAR NOT NULL, host VARCHAR NOT NULL, requests INTEGER NOT NULL, "
                   "errors INTEGER NOT NULL, busy_ms INTEGER NOT NULL, queued_ms INTEGER NOT NULL, "
                   "prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, "
                   "completion_tokens INTEGER NOT NULL, PRIMARY KEY (day, route, model, host))")
        db.execute("INSERT INTO requests_daily VALUES "
                   "('2026-05-27', 'r', 'm', 'a', 4, 1, 40, 0, 400, 300, 20)")
    store = Store(str(path))
    store.open()
    store.start()
    try:
        assert store.usage(0, "decision") == [{"key": "", "requests": 4, "errors": 1, "busy_ms": 40,
                                               "queued_ms": 0, "prompt_tokens": 400,
                                               "cached_tokens": 300, "completion_tokens": 20}]
        fill(store)
        store.rollup(T0 + 10)
        assert {r["key"]: r["requests"] for r in store.usage(0, "route")} == {"r": 4, "r1": 3, "r2": 2}
    finally:
        store.close()


def rolled_up_requests(path: str) -> int:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT COALESCE(SUM(requests), 0) FROM requests_daily").fetchone()[0]


async def test_retention_rolls_rows_up_in_the_background_while_traffic_flows(tmp_path: Path) -> None:
    """retention = 2s: the router schedules a roll-up every second; rows leave `requests` for
    `requests_daily` while requests keep flowing (none waits on it), and usage totals stay what
    the clients were told."""
    async with setup(tmp_path, {"a": host(), "b": host()}, retention="2s") as (_, proxy):
        store = proxy.router.store
        told: list[Told] = []
        give_up = time.monotonic() + 30
        rolled_at: int | None = None
        async with aiohttp.ClientSession() as s:
            while rolled_at is None or len(told) < rolled_at + 5:  # keep going past a roll-up
                i, started = len(told), time.monotonic()
                messages = conversation(f"ret{i % 4}", 1 + i // 4)[i // 4]
                told.append(await send_turn(s, proxy.url, "r", messages, stream=bool(i % 2)))
                assert time.monotonic() - started < 5  # generous: never held behind the database
                if rolled_at is None and await asyncio.to_thread(rolled_up_requests, store.path):
                    rolled_at = len(told)
                assert time.monotonic() < give_up, "no roll-up within 30 s"
                await asyncio.sleep(0.05)

        async def all_rolled_up() -> bool:
            await asyncio.to_thread(store.flush)
            return not await asyncio.to_thread(store.requests_since, 0)

        await wait_until(all_rolled_up, 10, 0.2, "every request row to be rolled up")
        routes = await usage_rows(proxy, "route")
        decisions = await usage_rows(proxy, "decision")
    assert routes["r"]["requests"] == len(told) and routes["r"]["errors"] == 0
    assert told_of(routes["r"]) == total(told)
    assert {k: v["requests"] for k, v in decisions.items()} == {"new": 4, "reused": len(told) - 4}
    assert rolled_up_requests(store.path) == len(told)


# ---------------------------------------------------------------- many sessions at once


async def test_twenty_sessions_five_turns_concurrently_nothing_lost(tmp_path: Path) -> None:
    sessions, turns = 20, 5
    specs = {"a": host(parallel=2, token_ms=1.0), "b": host(parallel=2, token_ms=1.0),
             "c": host(parallel=2, token_ms=1.0)}
    async with setup(tmp_path, specs, routes=("even", "odd"), queue_max=64) as (_, proxy):

        async def session(s: aiohttp.ClientSession, i: int) -> list[Told]:
            route = "odd" if i % 2 else "even"
            return [await send_turn(s, proxy.url, route, messages, stream=(i + t) % 3 != 0,
                                    include_usage=(i + t) % 3 == 1)
                    for t, messages in enumerate(conversation(f"load{i}", turns))]

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            told = await asyncio.gather(*(session(s, i) for i in range(sessions)))
        routes = await usage_rows(proxy, "route")
        hosts = await usage_rows(proxy, "host")
        decisions = await usage_rows(proxy, "decision")
        _, metrics = await scrape(proxy.url)

    for route, parity in (("even", 0), ("odd", 1)):
        mine = [t for i, answers in enumerate(told) if i % 2 == parity for t in answers]
        assert routes[route]["requests"] == len(mine) == sessions // 2 * turns
        assert routes[route]["errors"] == 0
        assert told_of(routes[route]) == total(mine), route
    everything = total(t for answers in told for t in answers)
    assert everything.cached > 0
    assert total(told_of(row) for row in hosts.values()) == everything
    assert sum(row["requests"] for row in hosts.values()) == sessions * turns
    # a turn queued on its full host may yield to another (short contexts are cheap to re-prefill),
    # a session's first turn too
    placed = {k: v["requests"] for k, v in decisions.items()}
    new, yielded = placed.pop("new"), placed.pop("moved:yield", 0)
    assert sessions - yielded <= new <= sessions
    assert new + placed.pop("reused") + yielded == sessions * turns
    assert placed == {}
    assert summed(metrics, "crossbar_requests_total", status="200") == sessions * turns
    for kind, figure in (("prompt", everything.prompt), ("cached", everything.cached),
                         ("completion", everything.completion)):
        assert summed(metrics, "crossbar_tokens_total", type=kind) == figure, kind
