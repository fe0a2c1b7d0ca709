"""Sessions the client names, end to end: the requests OpenCode 1.18.33 sent for a new session
(recorded with their headers in `fixtures/clients/opencode-1.18.33-first-turn.jsonl`: the title
request, then the main request, both with `x-session-affinity` and `x-session-id`) replayed through
the real addon in a real mitmproxy to three simulated llama-servers.

The replays change only `max_tokens` (the recording asked for 32000, which the simulated server
would generate) and the route in the path; headers and messages are as recorded.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from harness import (
    Fleet,
    HostSpec,
    Proxy,
    completion_count,
    crossbar_proxy,
    is_error_shape,
    lease_event_rows,
    request_rows,
    sim_fleet,
    wait_until,
    write_config,
)

from crossbar.request import fingerprint
from crossbar.session import MAX_SESSION_ID, session_fp
from llamasim import SimConfig

RECORDING = Path(__file__).parent / "fixtures" / "clients" / "opencode-1.18.33-first-turn.jsonl"
MODEL = "tiny"  # as recorded
ROUTE = "opencode-shop"
HOSTS = ("a", "b", "c")
NOT_REPLAYED = frozenset({"host", "content-length", "connection", "accept-encoding"})  # set per connection


def recorded() -> tuple[dict[str, Any], dict[str, Any]]:
    title, main = (json.loads(line) for line in RECORDING.read_text().splitlines() if line.strip())
    return title, main


TITLE, MAIN = recorded()
SESSION = dict(TITLE["headers"])["x-session-id"]


def replayed(record: Mapping[str, Any], *, session: str | None = SESSION, max_tokens: int = 4,
             messages: list[Any] | None = None) -> tuple[dict[str, str], dict[str, Any]]:
    """Headers and body of a recorded request; `session` replaces the session id (None: drop the
    session headers), `messages` the messages."""
    headers = {k: v for k, v in record["headers"] if k.lower() not in NOT_REPLAYED}
    for name in ("x-session-affinity", "x-session-id"):
        if session is None:
            headers.pop(name)
        else:
            headers[name] = session
    body = {**record["body"], "max_tokens": max_tokens}
    if messages is not None:
        body["messages"] = messages
    return headers, body


def compacted(messages: list[Any]) -> list[Any]:
    """What OpenCode sends after compacting: the first user message rewritten to a summary."""
    out = [dict(m) for m in messages]
    first_user = next(m for m in out if m["role"] == "user")
    first_user["content"] = "Summary of the conversation so far: the user asked to say hello."
    return out


@asynccontextmanager
async def three_hosts(tmp_path: Path, token_ms: float = 0.0) -> AsyncIterator[tuple[Fleet, Proxy]]:
    """Three simulated hosts of two slots each behind the template route `opencode-*`."""
    sim = SimConfig(models=[MODEL], ctx=1 << 20, token_ms=token_ms)
    specs = {name: HostSpec({MODEL: {"parallel": 2}}, sim=sim) for name in HOSTS}
    async with sim_fleet(specs) as fleet:
        hosts = {name: (fleet[name].url, specs[name]) for name in HOSTS}
        cfg = write_config(tmp_path / "crossbar.toml", hosts,
                           {"opencode-*": {"hosts": list(HOSTS), "default_model": MODEL}})
        async with crossbar_proxy(cfg) as proxy:
            yield fleet, proxy


async def get_json(proxy: Proxy, path: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(proxy.url + path) as resp:
        assert resp.status == 200
        return await resp.json()


async def send(proxy: Proxy, headers: Mapping[str, str], body: Mapping[str, Any],
               path: str = f"/{ROUTE}/v1/chat/completions") -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json=body, headers=headers) as resp:
        return resp.status, await resp.read()


async def turn(proxy: Proxy, record: Mapping[str, Any], **kw: Any) -> None:
    status, body = await send(proxy, *replayed(record, **kw))
    assert status == 200, body


def free(proxy: Proxy, host: str) -> int:
    r = proxy.router
    return r.fleet.free_slots(host, MODEL, r.in_flight(host, MODEL))


async def test_title_and_main_request_of_a_session_share_its_lease(tmp_path: Path) -> None:
    async with three_hosts(tmp_path) as (_, proxy):
        await turn(proxy, TITLE)
        await turn(proxy, MAIN)
        rows = await request_rows(proxy)
        events = await lease_event_rows(proxy)
        routes = await get_json(proxy, "/_crossbar/routes")
    key = session_fp(SESSION)
    assert [(r.fp, r.decision) for r in rows] == [(key, "new"), (key, "reused")]
    assert rows[0].host == rows[1].host
    assert [(e.fp, e.reason) for e in events] == [(key, "new")]  # one lease for the whole session
    (lease,) = routes[ROUTE]["leases"]
    assert lease["key"] == "session" and lease["fp"] == key and lease["host"] == rows[0].host
    assert SESSION not in json.dumps(routes)  # the id itself is never shown or stored


async def test_a_compacted_turn_stays_on_the_sessions_host_while_others_have_more_room(
        tmp_path: Path) -> None:
    """After a compaction the first user message is new, so the body fingerprint is new; the
    session header keeps the turn on its host although another host has more free slots."""
    async with three_hosts(tmp_path, token_ms=5) as (_, proxy):
        await turn(proxy, TITLE)
        await turn(proxy, MAIN)
        (home,) = {r.host for r in await request_rows(proxy)}
        busy = asyncio.create_task(turn(proxy, MAIN, max_tokens=400))  # ~2 s on the session's host
        await wait_until(lambda: free(proxy, home) < min(free(proxy, h) for h in HOSTS if h != home),
                         what="the session's host has the fewest free slots")
        await turn(proxy, MAIN, messages=compacted(MAIN["body"]["messages"]))
        await busy
        rows = await request_rows(proxy)
    compacted_row = rows[-2] if rows[-1].completion_tokens == 400 else rows[-1]
    assert compacted_row.completion_tokens == 4
    assert compacted_row.host == home and compacted_row.decision == "reused"
    assert {r.fp for r in rows} == {session_fp(SESSION)}


async def test_a_second_session_on_the_route_is_placed_by_load(tmp_path: Path) -> None:
    async with three_hosts(tmp_path, token_ms=5) as (_, proxy):
        await turn(proxy, TITLE)
        (home,) = {r.host for r in await request_rows(proxy)}
        busy = asyncio.create_task(turn(proxy, MAIN, max_tokens=400))
        await wait_until(lambda: free(proxy, home) < min(free(proxy, h) for h in HOSTS if h != home),
                         what="the first session's host has the fewest free slots")
        other = "ses_0000000000000OtherSession"
        await turn(proxy, TITLE, session=other)
        await turn(proxy, MAIN, session=other)
        await busy
        rows = await request_rows(proxy)
    second = [r for r in rows if r.fp == session_fp(other)]
    assert [r.decision for r in second] == ["new", "reused"]
    assert second[0].host == second[1].host != home


async def test_without_the_headers_the_body_fingerprint_is_the_key(tmp_path: Path) -> None:
    async with three_hosts(tmp_path) as (_, proxy):
        await turn(proxy, MAIN)  # a session, to show the two kinds side by side
        await turn(proxy, MAIN, session=None)
        await turn(proxy, MAIN, session=None)
        await turn(proxy, TITLE, session=None)
        rows = await request_rows(proxy)
        routes = await get_json(proxy, "/_crossbar/routes")
        events = await get_json(proxy, "/_crossbar/events?limit=10")
        key = proxy.addon.fp_key
    main_fp = fingerprint(MAIN["body"]["messages"], key)
    title_fp = fingerprint(TITLE["body"]["messages"], key)
    assert [(r.fp, r.decision) for r in rows] == [
        (session_fp(SESSION), "new"), (main_fp, "new"), (main_fp, "reused"), (title_fp, "new")]
    assert sorted(lease["key"] for lease in routes[ROUTE]["leases"]) == [
        "fingerprint", "fingerprint", "session"]
    assert sorted(e["key"] for e in events) == ["fingerprint", "fingerprint", "session"]


async def test_a_route_can_name_other_session_headers_or_none(tmp_path: Path) -> None:
    sim = SimConfig(models=[MODEL], ctx=1 << 20)
    spec = HostSpec({MODEL: {"parallel": 2}}, sim=sim)
    async with sim_fleet({"a": spec}) as fleet:
        routes = {"own": {"default_model": MODEL, "session_headers": ["x-opencode-session"]},
                  "off": {"default_model": MODEL, "session_headers": []}}
        cfg = write_config(tmp_path / "crossbar.toml", {"a": (fleet["a"].url, spec)}, routes)
        async with crossbar_proxy(cfg) as proxy:
            headers, body = replayed(MAIN)
            for route in ("own", "off"):
                status, _ = await send(proxy, headers, body, f"/{route}/v1/chat/completions")
                assert status == 200
                status, _ = await send(proxy, {**headers, "x-opencode-session": "ses_x"}, body,
                                       f"/{route}/v1/chat/completions")
                assert status == 200
            rows = await request_rows(proxy)
            key = proxy.addon.fp_key
    main_fp = fingerprint(MAIN["body"]["messages"], key)
    assert [(r.route, r.fp) for r in rows] == [
        ("own", main_fp), ("own", session_fp("ses_x")), ("off", main_fp), ("off", main_fp)]


@pytest.mark.parametrize(
    ("session", "problem"),
    [
        ("s" * (MAX_SESSION_ID + 1), f"at most {MAX_SESSION_ID}"),
        ("s" * 16_000, f"at most {MAX_SESSION_ID}"),
        ("ses with spaces", "only letters, digits"),
        ("ses_<b>", "only letters, digits"),
        ("ses_a,ses_b", "only letters, digits"),
    ],
)
async def test_a_bad_session_id_is_a_json_400_that_changes_nothing(tmp_path: Path, session: str,
                                                                   problem: str) -> None:
    async with three_hosts(tmp_path) as (fleet, proxy):
        status, raw = await send(proxy, *replayed(MAIN, session=session))
        sent = sum(completion_count(sim) for sim in fleet.sims.values())
        leases = proxy.router.leases.count()
        rows = await request_rows(proxy)
        events = await lease_event_rows(proxy)
        metrics = proxy.router.metrics.exposition().decode()
    body = json.loads(raw)
    assert status == 400 and is_error_shape(body, 400), body
    assert body["error"]["message"].startswith("session header x-session-affinity: ")
    assert problem in body["error"]["message"] and session not in body["error"]["message"]
    assert sent == 0 and leases == 0 and rows == [] and events == []
    assert 'crossbar_rejected_total{reason="session_id"} 1.0' in metrics


async def test_an_unset_route_variable_gets_a_404_that_says_so(tmp_path: Path) -> None:
    """OpenCode fills `{env:CROSSBAR_ROUTE}` with "" when the variable is unset."""
    async with three_hosts(tmp_path) as (_, proxy):
        status, raw = await send(proxy, *replayed(MAIN), path="//v1/chat/completions")
    body = json.loads(raw)
    assert status == 404 and is_error_shape(body, 404)
    assert "empty route name" in body["error"]["message"] and "variable" in body["error"]["message"]
