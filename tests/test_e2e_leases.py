"""End to end: leases, placement, queueing and failover through the real proxy."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import (
    Fleet,
    HostSpec,
    Proxy,
    conversation,
    crossbar_proxy,
    fleet_with_route,
    is_error_shape,
    lease_event_rows,
    request_rows,
    sim_fleet,
    sse_data,
    wait_until,
    write_config,
)

from llamasim import SimConfig

CHAT = "/r/v1/chat/completions"
Messages = list[dict[str, str]]


def host(parallel: int = 0, weight: float = 1.0, **sim: Any) -> HostSpec:
    """Host serving model "m"; the sim gets as many slots as crossbar allows (2 when unset)."""
    models = {"m": {"parallel": parallel}} if parallel else {"m": {}}
    return HostSpec(models, weight, SimConfig(models=["m"], n_slots=parallel or 2, **sim))


setup = fleet_with_route


async def send(proxy: Proxy, messages: Messages, *, stream: bool = False,
               session: aiohttp.ClientSession | None = None) -> tuple[int, dict[str, str], bytes]:
    body = {"messages": messages, "stream": stream}
    async with AsyncExitStack() as stack:
        s = session or await stack.enter_async_context(aiohttp.ClientSession())
        async with s.post(proxy.url + CHAT, json=body) as resp:
            return resp.status, dict(resp.headers), await resp.read()


async def ok(proxy: Proxy, messages: Messages, **kw: Any) -> bytes:
    status, _, body = await send(proxy, messages, **kw)
    assert status == 200, body
    return body


async def admin(proxy: Proxy, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        if body is None and raw is None:
            async with s.get(proxy.url + "/_crossbar/" + path) as resp:
                return resp.status, await resp.json()
        data = raw if raw is not None else json.dumps(body).encode()
        async with s.post(proxy.url + "/_crossbar/" + path, data=data,
                          headers={"Content-Type": "application/json"}) as resp:
            return resp.status, await resp.json(content_type=None)


async def leases_of(proxy: Proxy) -> dict[tuple[str, str], str]:
    """(fp, model) -> host of route r, from the admin API."""
    _, routes = await admin(proxy, "routes")
    return {(lease["fp"], lease["model"]): lease["host"] for lease in routes["r"]["leases"]}


async def host_view(proxy: Proxy, name: str) -> dict[str, Any]:
    _, hosts = await admin(proxy, "hosts")
    return hosts[name]


async def last_row(proxy: Proxy) -> Any:
    return (await request_rows(proxy))[-1]


async def set_drain(proxy: Proxy, name: str, drain: bool) -> None:
    assert await admin(proxy, f"hosts/{name}", {"drain": drain}) == (200, {"ok": True})


async def wait_health(proxy: Proxy, name: str, healthy: bool) -> None:
    async def check() -> bool:
        return (await host_view(proxy, name))["healthy"] is healthy

    await wait_until(check, 10, 0.05, f"host {name} healthy={healthy}")


# ---------------------------------------------------------------- 1. stickiness


async def test_a_conversation_stays_on_its_host_while_another_has_more_room(tmp_path: Path) -> None:
    specs = {"a": host(parallel=1, weight=1), "b": host(parallel=8, weight=5)}
    async with setup(tmp_path, specs) as (fleet, proxy):
        turns = conversation("sticky", 10)
        await set_drain(proxy, "b", True)  # the first turn can only land on a
        await ok(proxy, turns[0])
        await set_drain(proxy, "b", False)
        for messages in turns[1:]:
            await ok(proxy, messages)
        await ok(proxy, conversation("newcomer", 1)[0])  # a new conversation prefers b now

        rows = await request_rows(proxy)
        assert [r.host for r in rows] == ["a"] * 10 + ["b"]
        assert [r.decision for r in rows[:10]] == ["new"] + ["reused"] * 9
        assert len({r.fp for r in rows[:10]}) == 1
        recs = fleet["a"].stats.records
        assert len(recs) == 10 and len(fleet["b"].stats.records) == 1
        for prev, cur in itertools.pairwise(recs):
            assert cur.cache_n >= prev.prompt_tokens - 1, (prev, cur)
        assert [r.cached_tokens for r in rows[1:10]] == [rec.cache_n for rec in recs[1:]]


# ---------------------------------------------------------------- 2. placement of new conversations


async def test_new_conversations_spread_by_free_slots_times_weight(tmp_path: Path) -> None:
    # free x weight, no ties anywhere in the sequence:
    #   a: 4 slots x 1.0, b: 2 x 3.1, c: 3 x 2.05 -> b c c a b a c a a
    slow = {"token_ms": 50, "default_max_tokens": 400}
    specs = {"a": host(4, 1.0, **slow), "b": host(2, 3.1, **slow), "c": host(3, 2.05, **slow)}
    expected = ["b", "c", "c", "a", "b", "a", "c", "a", "a"]
    async with setup(tmp_path, specs) as (fleet, proxy), AsyncExitStack() as stack:
        session = await stack.enter_async_context(aiohttp.ClientSession())
        placed: list[str] = []
        for i in range(len(expected)):
            before = {n: fleet[n].stats.completions_started for n in specs}
            body = {"messages": conversation(f"spread{i}", 1)[0], "stream": True}
            resp = await stack.enter_async_context(session.post(proxy.url + CHAT, json=body))
            assert resp.status == 200
            await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)  # in flight now
            (landed,) = [n for n in specs if fleet[n].stats.completions_started > before[n]]
            placed.append(landed)
        assert placed == expected
        assert {n: proxy.router.in_flight(n, "m") for n in specs} == {"a": 4, "b": 2, "c": 3}


# ---------------------------------------------------------------- 3. restart


async def test_a_restart_keeps_every_lease(tmp_path: Path) -> None:
    specs = {"a": host(2, weight=2), "b": host(2, weight=1)}
    convs = [conversation(f"restart{i}", 2) for i in range(3)]
    async with sim_fleet(specs) as fleet:
        cfg = write_config(tmp_path / "crossbar.toml", {n: (fleet[n].url, s) for n, s in specs.items()},
                           {"r": {"hosts": ["a", "b"], "default_model": "m"}})
        async with crossbar_proxy(cfg) as proxy:
            await ok(proxy, convs[0][0])
            await set_drain(proxy, "a", True)
            await ok(proxy, convs[1][0])  # lands on b
            await set_drain(proxy, "a", False)
            await ok(proxy, convs[2][0])
            before = await leases_of(proxy)
            first = [r.host for r in await request_rows(proxy)]
        assert first == ["a", "b", "a"]
        assert sorted(before.values()) == ["a", "a", "b"]

        async with crossbar_proxy(cfg) as proxy:
            assert await leases_of(proxy) == before
            for conv in convs:
                await ok(proxy, conv[1])
            rows = (await request_rows(proxy))[-3:]
            assert [r.host for r in rows] == first
            assert [r.decision for r in rows] == ["reused"] * 3


# ---------------------------------------------------------------- 4. idle expiry


async def test_an_idle_lease_expires(tmp_path: Path) -> None:
    async with setup(tmp_path, {"a": host(), "b": host()}, lease_idle="1s") as (_, proxy):
        await ok(proxy, conversation("idle", 1)[0])
        assert len(await leases_of(proxy)) == 1
        await wait_until(lambda: proxy.router.leases.count() == 0, 6, 0.05, "the lease to expire")
        assert await leases_of(proxy) == {}
        events = await lease_event_rows(proxy)
        idle = [e for e in events if e.reason == "idle"]
        assert len(idle) == 1 and idle[0].from_host == "a" and idle[0].route == "r"
        stored = await asyncio.to_thread(proxy.router.store.leases)
        assert stored == []


# ---------------------------------------------------------------- 5-7. failover and recovery


async def _move_off_refusing_host(proxy: Proxy, fleet: Fleet, turns: list[Messages], noticed_by: str,
                                  session: aiohttp.ClientSession) -> None:
    await ok(proxy, turns[0], session=session)
    fp = (await last_row(proxy)).fp
    assert (await last_row(proxy)).host == "a"
    fleet["a"].set(refuse=True)
    if noticed_by == "poller":
        await wait_health(proxy, "a", False)
    body = await ok(proxy, turns[1], stream=True, session=session)
    assert sse_data(body)[-1] == b"[DONE]"
    row = await last_row(proxy)
    assert (row.host, row.status, row.err) == ("b", 200, None)
    assert row.decision in ("retried", "moved:unhealthy")
    assert await leases_of(proxy) == {(fp, "m"): "b"}
    moves = [e for e in await lease_event_rows(proxy) if e.from_host == "a"]
    assert [(e.to_host, e.reason, e.fp) for e in moves] == [("b", "unhealthy", fp)]


@pytest.mark.parametrize("noticed_by", ["poller", "connect"])
async def test_failover_when_the_leased_host_refuses(tmp_path: Path, noticed_by: str) -> None:
    interval = "0.2s" if noticed_by == "poller" else "60s"  # "connect": the poller never sees it first
    specs = {"a": host(weight=2), "b": host(weight=1)}
    async with setup(tmp_path, specs, poll_interval=interval) as (fleet, proxy), \
            aiohttp.ClientSession() as session:
        await _move_off_refusing_host(proxy, fleet, conversation("failover", 2), noticed_by, session)
        assert (await host_view(proxy, "a"))["healthy"] is False
        assert len(fleet["b"].stats.records) == 1


async def test_recovery_does_not_move_a_lease_back(tmp_path: Path) -> None:
    specs = {"a": host(weight=2), "b": host(weight=1)}
    async with setup(tmp_path, specs) as (fleet, proxy), aiohttp.ClientSession() as session:
        turns = conversation("recover", 3)
        await _move_off_refusing_host(proxy, fleet, turns, "poller", session)
        fleet["a"].set(refuse=False)
        await wait_health(proxy, "a", True)
        rounds = proxy.router.poller.rounds
        await wait_until(lambda: proxy.router.poller.rounds >= rounds + 2, 5, what="two more poll rounds")
        await ok(proxy, turns[2], session=session)
        row = await last_row(proxy)
        assert (row.host, row.decision) == ("b", "reused")
        await ok(proxy, conversation("fresh", 1)[0])  # a takes new conversations again
        assert (await last_row(proxy)).host == "a"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("status", [500, 502, 503])
async def test_failover_on_a_5xx_answers_once_from_the_other_host(
    tmp_path: Path, status: int, stream: bool
) -> None:
    specs = {"a": host(weight=2, fail_status=status), "b": host(weight=1)}
    async with setup(tmp_path, specs, poll_interval="60s", drain_timeout="1s") as (fleet, proxy):
        code, headers, body = await send(proxy, conversation("five", 1)[0], stream=stream)
        assert code == 200, body
        if stream:
            assert headers["Content-Type"].startswith("text/event-stream")
            assert sse_data(body)[-1] == b"[DONE]"
        else:
            assert json.loads(body)["object"] == "chat.completion"
        assert fleet["a"].stats.failed_injected == 1
        assert len(fleet["b"].stats.records) == 1

        row = await last_row(proxy)
        assert (row.host, row.status, row.decision, row.streamed) == ("b", 200, "retried", stream)
        rec = fleet["b"].stats.records[-1]
        assert (row.prompt_tokens, row.completion_tokens) == (rec.prompt_tokens, rec.completion_tokens)
        assert set((await leases_of(proxy)).values()) == {"b"}
        moves = [(e.from_host, e.to_host, e.reason) for e in await lease_event_rows(proxy) if e.from_host]
        # 502/503 mark the host down at once; a 500 alone does not (a full KV answers 500), and
        # its move is recorded as a retry, not as an unhealthy host
        assert moves == [("a", "b", "retried" if status == 500 else "unhealthy")]
        assert (await host_view(proxy, "a"))["healthy"] is (status == 500)


async def test_a_client_that_leaves_during_a_5xx_retry_stops_the_retry(tmp_path: Path) -> None:
    specs = {"a": host(weight=2, fail_status=500, fail_times=1),
             "b": host(weight=1, token_ms=40, default_max_tokens=500)}
    async with setup(tmp_path, specs, poll_interval="60s") as (fleet, proxy):
        body = {"messages": conversation("leaves", 1)[0], "stream": True}
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(proxy.url + CHAT, json=body))
            await wait_until(lambda: fleet["b"].stats.inflight.get("m", 0) == 1, what="the retry on b")
            task.cancel()  # the client gives up while b generates the retried answer
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await wait_until(lambda: fleet["b"].stats.aborted == 1, timeout=10, what="b stops generating")
        await wait_until(lambda: proxy.router.in_flight("b", "m") == 0, what="the slot freed")
        row = await last_row(proxy)
        # b never answered: the row names the host that did, with its answer's status
        assert (row.host, row.status) == ("a", 500) and row.err and "client" in row.err
        assert list((await leases_of(proxy)).values()) == ["a"]  # not moved by the abandoned retry
        assert not proxy.addon.current  # nothing kept for a connection that is gone


# ---------------------------------------------------------------- 8. pin, release, drain


async def test_pin_moves_the_route_and_a_down_pin_is_a_clear_503(tmp_path: Path) -> None:
    specs = {"a": host(weight=2), "b": host(weight=1)}
    async with setup(tmp_path, specs) as (fleet, proxy):
        turns = conversation("pinned", 3)
        await ok(proxy, turns[0])
        assert (await last_row(proxy)).host == "a"

        assert await admin(proxy, "routes/r", {"host": "b", "pin": True}) == (200, {"ok": True})
        _, routes = await admin(proxy, "routes")
        assert routes["r"]["pinned"] == "b"
        await ok(proxy, turns[1])
        await ok(proxy, conversation("other", 1)[0])  # new conversations follow the pin too
        rows = (await request_rows(proxy))[-2:]
        assert [(r.host, r.decision) for r in rows] == [("b", "pinned"), ("b", "pinned")]
        assert set((await leases_of(proxy)).values()) == {"b"}
        pins = [e for e in await lease_event_rows(proxy) if e.reason == "pin"]
        assert any(e.from_host == "a" and e.to_host == "b" for e in pins)

        fleet["b"].set(refuse=True)
        await wait_health(proxy, "b", False)
        a_before = len(fleet["a"].stats.records)
        status, headers, body = await send(proxy, turns[2])
        assert status == 503
        assert headers["Content-Type"].startswith("application/json")
        assert int(headers["Retry-After"]) >= 1
        err = json.loads(body)
        assert is_error_shape(err, 503)
        assert "pinned" in err["error"]["message"] and "'b'" in err["error"]["message"]
        assert len(fleet["a"].stats.records) == a_before  # never a silent move


async def test_pinned_host_refusing_before_the_poller_notices_is_a_clear_503(tmp_path: Path) -> None:
    specs = {"a": host(weight=2), "b": host(weight=1)}
    async with setup(tmp_path, specs, poll_interval="60s") as (fleet, proxy):
        assert (await admin(proxy, "routes/r", {"host": "b", "pin": True}))[0] == 200
        await ok(proxy, conversation("pin-race", 1)[0])
        fleet["b"].set(refuse=True)
        status, headers, body = await send(proxy, conversation("pin-race", 2)[1])
        assert len(fleet["a"].stats.records) == 0
        assert status == 503 and headers["Content-Type"].startswith("application/json"), body
        assert "pinned" in json.loads(body)["error"]["message"]


async def test_release_drops_leases_and_clears_the_pin(tmp_path: Path) -> None:
    specs = {"a": host(weight=2), "b": host(weight=1)}
    async with setup(tmp_path, specs) as (_, proxy):
        for i in range(2):
            await ok(proxy, conversation(f"rel{i}", 1)[0])
        assert (await admin(proxy, "routes/r", {"host": "b", "pin": True}))[0] == 200
        await ok(proxy, conversation("rel0", 2)[1])  # its lease follows the pin
        status, reply = await admin(proxy, "routes/r", {"release": True})
        assert status == 200 and reply["ok"] is True and reply["released"] >= 1
        _, routes = await admin(proxy, "routes")
        assert routes["r"]["pinned"] == "" and routes["r"]["leases"] == []
        assert await asyncio.to_thread(proxy.router.store.flush)
        assert await asyncio.to_thread(proxy.router.store.leases) == []
        await ok(proxy, conversation("rel0", 3)[2])
        row = await last_row(proxy)
        assert (row.host, row.decision) == ("a", "new")


async def test_a_draining_host_takes_no_new_conversation_but_keeps_its_leases(tmp_path: Path) -> None:
    specs = {"a": host(weight=2), "b": host(weight=1)}
    async with setup(tmp_path, specs) as (_, proxy):
        old = conversation("old", 3)
        await ok(proxy, old[0])
        await set_drain(proxy, "a", True)
        assert (await host_view(proxy, "a"))["draining"] is True
        for i in range(3):
            await ok(proxy, conversation(f"new{i}", 1)[0])
            await ok(proxy, old[1 + i % 2])
        rows = (await request_rows(proxy))[1:]
        assert [(r.host, r.decision) for r in rows] == [("b", "new"), ("a", "reused")] * 3
        await set_drain(proxy, "a", False)
        await ok(proxy, conversation("after", 1)[0])
        assert (await last_row(proxy)).host == "a"


ADMIN_BAD: list[tuple[str, bytes, int]] = [
    ("routes/r", b"{not json", 400),
    ("routes/r", b"[1]", 400),
    ("routes/r", b'{"pin": "yes", "host": "b"}', 400),
    ("routes/r", b'{"pin": true}', 400),
    ("routes/r", b'{"pin": true, "host": 5}', 400),
    ("routes/r", b'{"bogus": 1}', 400),
    ("routes/r", b'{"pin": true, "host": "zzz"}', 404),
    ("routes/nope", b'{"pin": true, "host": "a"}', 404),
    ("routes/nope", b'{"release": true}', 404),
    ("hosts/zzz", b'{"drain": true}', 404),
    ("hosts/a", b'{"drain": "yes"}', 400),
    ("hosts/a", b"{}", 400),
    ("hosts/a", b'{"drain": true, "x": 1}', 400),
]


async def test_admin_changes_reject_bad_requests_with_json(tmp_path: Path) -> None:
    async with setup(tmp_path, {"a": host(), "b": host()}) as (_, proxy):
        for path, raw, expected in ADMIN_BAD:
            status, body = await admin(proxy, path, raw=raw)
            assert status == expected, (path, raw, body)
            assert is_error_shape(body, expected), (path, raw, body)
        _, routes = await admin(proxy, "routes")
        assert routes["r"]["pinned"] == ""
        assert (await host_view(proxy, "a"))["draining"] is False


# ---------------------------------------------------------------- 9. queueing


def _stream_body(session_name: str) -> dict[str, Any]:
    return {"messages": conversation(session_name, 1)[0], "stream": True}


async def _queued(proxy: Proxy, n: int) -> None:
    await wait_until(lambda: proxy.router.queued("a", "m") == n, 5, what=f"{n} queued")


async def test_one_slot_one_queue_place_then_503(tmp_path: Path) -> None:
    specs = {"a": host(1, token_ms=20, default_max_tokens=40)}
    specs["a"].sim.n_slots = 4  # type: ignore[union-attr]  # the host would take more at once
    async with setup(tmp_path, specs, queue_max=1) as (fleet, proxy), AsyncExitStack() as stack:
        session = await stack.enter_async_context(aiohttp.ClientSession())
        first = await stack.enter_async_context(session.post(proxy.url + CHAT, json=_stream_body("q1")))
        await first.content.readuntil(b"\n\n")

        async def second_request() -> tuple[int, bytes]:
            async with session.post(proxy.url + CHAT, json=_stream_body("q2")) as resp:
                return resp.status, await resp.read()

        second = asyncio.create_task(second_request())
        await _queued(proxy, 1)
        status, headers, body = await send(proxy, _stream_body("q3")["messages"], stream=True)
        assert status == 503
        assert headers["Content-Type"].startswith("application/json")
        assert int(headers["Retry-After"]) >= 1
        assert is_error_shape(json.loads(body), 503)

        assert sse_data(await first.read())[-1] == b"[DONE]"
        status2, body2 = await asyncio.wait_for(second, 20)
        assert status2 == 200 and sse_data(body2)[-1] == b"[DONE]"
        assert fleet["a"].stats.max_concurrent["m"] == 1
        assert fleet["a"].stats.completions_started == 2

        rows = await request_rows(proxy)
        ok_rows = [r for r in rows if r.status == 200]
        assert len(ok_rows) == 2
        assert sorted(r.queued_ms > 0 for r in ok_rows) == [False, True]


async def test_a_client_that_leaves_while_queued_frees_its_place(tmp_path: Path) -> None:
    specs = {"a": host(1, token_ms=20, default_max_tokens=300)}
    async with setup(tmp_path, specs, queue_max=1) as (fleet, proxy), AsyncExitStack() as stack:
        session = await stack.enter_async_context(aiohttp.ClientSession())
        first = await stack.enter_async_context(session.post(proxy.url + CHAT, json=_stream_body("l1")))
        await first.content.readuntil(b"\n\n")

        _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        raw = json.dumps(_stream_body("l2")).encode()
        writer.write(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
        await writer.drain()
        await _queued(proxy, 1)
        writer.close()
        await _queued(proxy, 0)
        assert fleet["a"].stats.inflight["m"] == 1  # the first stream is still running

        async def fourth_request() -> tuple[int, bytes]:
            async with session.post(proxy.url + CHAT, json=_stream_body("l4")) as resp:
                return resp.status, await resp.read()

        fourth = asyncio.create_task(fourth_request())
        await _queued(proxy, 1)
        first.close()  # let the fourth one have the slot
        status, body = await asyncio.wait_for(fourth, 20)
        assert status == 200 and sse_data(body)[-1] == b"[DONE]"
        assert fleet["a"].stats.completions_started == 2  # the one that left never reached the host


# ---------------------------------------------------------------- no host left


async def test_no_healthy_host_is_the_documented_503(tmp_path: Path) -> None:
    async with setup(tmp_path, {"a": host(), "b": host()}) as (fleet, proxy):
        for name in ("a", "b"):
            fleet[name].set(refuse=True)
            await wait_health(proxy, name, False)
        status, headers, body = await send(proxy, conversation("nobody", 1)[0])
        assert status == 503
        assert headers["Content-Type"].startswith("application/json")
        assert int(headers["Retry-After"]) >= 1
        assert json.loads(body) == {"error": "no healthy host", "woke": []}


async def test_the_only_host_refusing_before_the_poller_notices_is_a_json_error(tmp_path: Path) -> None:
    async with setup(tmp_path, {"a": host()}, poll_interval="60s") as (fleet, proxy):
        await ok(proxy, conversation("alone", 1)[0])
        fleet["a"].set(refuse=True)
        status, headers, body = await send(proxy, conversation("alone", 2)[1])
        assert status in (502, 503)
        assert headers["Content-Type"].startswith("application/json"), body
        json.loads(body)


async def test_a_pin_survives_a_restart(tmp_path: Path) -> None:
    specs = {"a": host(weight=2), "b": host(weight=1)}
    async with sim_fleet(specs) as fleet:
        cfg = write_config(tmp_path / "crossbar.toml", {n: (fleet[n].url, s) for n, s in specs.items()},
                           {"r": {"hosts": ["a", "b"], "default_model": "m"}})
        async with crossbar_proxy(cfg) as proxy:
            assert (await admin(proxy, "routes/r", {"host": "b", "pin": True}))[0] == 200
            await ok(proxy, conversation("pin-restart", 1)[0])
        async with crossbar_proxy(cfg) as proxy:
            _, routes = await admin(proxy, "routes")
            assert routes["r"]["pinned"] == "b"
            assert [lease["host"] for lease in routes["r"]["leases"]] == ["b"]
            await ok(proxy, conversation("pin-restart-2", 1)[0])
            row = await last_row(proxy)
            assert (row.host, row.decision) == ("b", "pinned")


async def test_a_host_that_never_answers_is_cut_after_first_byte_timeout(tmp_path: Path) -> None:
    async with setup(tmp_path, {"a": host()}, first_byte_timeout="1s", poll_interval="60s",
                     drain_timeout="1s") as (fleet, proxy):
        fleet["a"].set(hang=True)
        status, _, _ = await asyncio.wait_for(send(proxy, conversation("hung", 1)[0]), 15)
        assert status >= 500
        row = await last_row(proxy)
        assert row.err and "first byte" in row.err
        assert (await host_view(proxy, "a"))["healthy"] is False
        assert proxy.router.in_flight("a", "m") == 0
