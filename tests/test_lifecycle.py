"""A request's whole life through a real mitmdump, on the fault paths that used to route wrong:
a host that dies while requests queue for it, a lease that idles out under its own request, a
retry with no slot, the first byte of a retried answer, large answers, a hook that raises, a stale
`/slots` reading, crossbar's own errors in the metrics, misleading errors, unknown models,
template routes in metric labels, absolute-form request targets."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gzip
import json
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from accounting_util import Samples, scrape, summed
from harness import (
    HostSpec,
    conversation,
    crossbar_proxy,
    fleet_with_route,
    lease_event_rows,
    post_bytes,
    raw_http,
    recording_upstream,
    request_rows,
    sim_fleet,
    split_response,
    wait_until,
    write_config,
)
from test_hostile_limits import raw_upstream
from test_reload import reload

from llamasim import SimConfig

CHAT = "/r/v1/chat/completions"
TIMEOUT = aiohttp.ClientTimeout(total=60)


def spec(parallel: int = 1, weight: float = 1.0, **sim: Any) -> HostSpec:
    return HostSpec({"m": {"parallel": parallel}}, weight=weight, sim=SimConfig(models=["m"], **sim))


async def post(url: str, body: Any) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.post(url, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def turn(session: str, n: int, **extra: Any) -> dict[str, Any]:
    return {"messages": conversation(session, n + 1)[n], **extra}


# ---------------------------------------------------------------- a host dies under its queue


async def test_requests_queued_for_a_host_that_goes_down_move_at_once(tmp_path: Path) -> None:
    specs = {"a": spec(), "b": spec()}
    async with fleet_with_route(tmp_path, specs, first_byte_timeout="4s",
                                poll_timeout="500ms") as (fleet, proxy):
        assert (await post(proxy.url + CHAT, turn("s", 0)))[0] == 200
        assert (await request_rows(proxy))[-1].host == "a"
        fleet["a"].set(hang=True)  # accepts connections, never answers (the poller too)
        hung = asyncio.create_task(post(proxy.url + CHAT, turn("s", 1)))
        await wait_until(lambda: proxy.router.in_flight("a", "m") == 1, what="turn 2 running on a")
        t0 = time.monotonic()
        queued = asyncio.create_task(post(proxy.url + CHAT, turn("s", 2)))
        await wait_until(lambda: proxy.router.queued("a", "m") == 1, what="turn 3 queued behind it")
        status, _, body = await queued
        waited = time.monotonic() - t0
        await hung
        rows = await request_rows(proxy)
    assert status == 200, body
    assert waited < 4, "turn 3 waited for the hung slot instead of moving when a went down"
    assert rows[-1].host == "b" or rows[-2].host == "b"


# ---------------------------------------------------------------- idle counts from the end


async def test_a_lease_never_idles_out_under_its_own_request(tmp_path: Path) -> None:
    specs = {"a": spec(parallel=2, token_ms=100), "b": spec(parallel=2)}
    async with fleet_with_route(tmp_path, specs, lease_idle="1s") as (_fleet, proxy):
        status, _, _ = await post(proxy.url + CHAT, turn("s", 0, max_tokens=30))  # ~3 s on a
        assert status == 200
        assert (await post(proxy.url + CHAT, turn("s", 1, max_tokens=1)))[0] == 200
        await asyncio.sleep(2.5)  # really idle now: the sweep drops the lease
        await wait_until(lambda: proxy.router.leases.count() == 0, what="the idle sweep")
        assert (await post(proxy.url + CHAT, turn("s", 2, max_tokens=1)))[0] == 200
        rows = await request_rows(proxy)
    assert [r.decision for r in rows] == ["new", "reused", "moved:idle"]


# ---------------------------------------------------------------- a retry that cannot run


async def test_a_500_retry_without_a_slot_changes_nothing(tmp_path: Path) -> None:
    specs = {"a": spec(token_ms=100), "b": spec()}
    async with fleet_with_route(tmp_path, specs, queue_max=0) as (fleet, proxy):
        busy = asyncio.create_task(post(proxy.url + CHAT, turn("busy", 0, max_tokens=40)))  # a, ~4 s
        await wait_until(lambda: proxy.router.in_flight("a", "m") == 1, what="a busy")
        assert (await post(proxy.url + CHAT, turn("s", 0, max_tokens=1)))[0] == 200  # a is full → b
        fleet["b"].set(fail_status=500, fail_times=1)
        status, _, _ = await post(proxy.url + CHAT, turn("s", 1, max_tokens=1))
        lease = {lease.key.fp: lease.host for lease in proxy.router.leases.leases_of("r")}
        await busy
        rows = await request_rows(proxy)
        events = await lease_event_rows(proxy)
    assert status == 500  # b's own answer: the retry on a could not get a slot
    assert rows[-2].host == "b" and rows[-2].status == 500
    assert sorted(lease.values()) == ["a", "b"]
    assert not [e for e in events if e.reason in ("retried", "unhealthy")]


@pytest.mark.parametrize("retry_host", ["resets", "never answers"])
async def test_a_retry_that_fails_leaves_the_row_and_the_lease_with_the_host_that_answered(
        tmp_path: Path, retry_host: str) -> None:
    async def complete(writer: asyncio.StreamWriter) -> None:  # b takes the retry
        if retry_host == "resets":
            writer.transport.abort()
        else:
            await asyncio.sleep(3600)

    specs = {"a": spec(weight=2, fail_status=500, fail_times=1)}  # a places the new conversation
    async with sim_fleet(specs) as fleet, raw_upstream(complete) as b_url:
        hosts = {"a": (fleet["a"].url, specs["a"]), "b": (b_url, HostSpec({"m": {"parallel": 1}}))}
        cfg = write_config(tmp_path / "c.toml", hosts, {"r": {"hosts": ["a", "b"], "default_model": "m"}},
                           first_byte_timeout="1s")
        async with crossbar_proxy(cfg) as proxy:
            status, _, body = await post(proxy.url + CHAT, turn("s", 0, max_tokens=1))
            (row,) = await request_rows(proxy)
            leases = [lease.host for lease in proxy.router.leases.leases_of("r")]
            events = [(e.from_host, e.to_host, e.reason) for e in await lease_event_rows(proxy)]
            _, samples = await scrape(proxy.url)
    assert status == 500 and b"simulated failure" in body  # a's own answer reached the client
    assert (row.host, row.status, row.decision) == ("a", 500, "retried"), row
    assert row.err is not None and row.err.startswith("retry on b failed"), row.err
    if retry_host == "never answers":  # a's answer reached the client once b's first second had passed
        assert row.ttfb_ms is not None and row.ttfb_ms >= 900, row.ttfb_ms
    assert leases == ["a"] and events == [(None, "a", "new")]
    assert summed(samples, "crossbar_requests_total", host="a", status="500") == 1
    assert summed(samples, "crossbar_requests_total", host="b") == 0


async def test_a_retry_that_answers_moves_the_lease_once_it_has(tmp_path: Path) -> None:
    specs = {"a": spec(weight=2, fail_status=500, fail_times=1), "b": spec()}
    async with fleet_with_route(tmp_path, specs) as (_fleet, proxy):
        status, headers, _ = await post(proxy.url + CHAT, turn("s", 0, max_tokens=1))
        (row,) = await request_rows(proxy)
        leases = [lease.host for lease in proxy.router.leases.leases_of("r")]
        events = [(e.from_host, e.to_host, e.reason) for e in await lease_event_rows(proxy)]
    assert status == 200 and headers.get("X-Crossbar-Retried") == "1"
    assert (row.host, row.status, row.decision) == ("b", 200, "retried")
    assert leases == ["b"] and events == [(None, "a", "new"), ("a", "b", "retried")]


# ---------------------------------------------------------------- TTFB of a retried answer


async def test_ttfb_of_a_retried_request_is_when_the_client_got_its_first_byte(tmp_path: Path) -> None:
    specs = {"a": spec(fail_status=500, fail_times=1), "b": spec(token_ms=50)}
    async with fleet_with_route(tmp_path, specs) as (_fleet, proxy):
        t0 = time.monotonic()
        status, headers, _ = await post(proxy.url + CHAT, turn("s", 0, max_tokens=10))
        elapsed_ms = (time.monotonic() - t0) * 1000
        (row,) = await request_rows(proxy)
        _, samples = await scrape(proxy.url)
    assert status == 200 and headers.get("X-Crossbar-Retried") == "1"
    assert row.host == "b" and row.decision == "retried"
    assert row.ttfb_ms is not None and 400 <= row.ttfb_ms <= elapsed_ms + 50
    assert summed(samples, "crossbar_ttfb_seconds_sum", host="b") >= 0.4


# ---------------------------------------------------------------- answers are not capped


# llama-server's own key order: an embeddings reply's usage before its vectors, a completion's
# usage and timings after its choices (the cached share only in timings here)
_VECTORS = [{"embedding": [0.125] * 300_000, "index": 0, "object": "embedding"}]
_EMBED_USAGE = {"prompt_tokens": 3, "total_tokens": 3}
_CHAT_USAGE = {"completion_tokens": 9, "prompt_tokens": 3, "total_tokens": 12}
_TIMINGS = {"cache_n": 2, "prompt_n": 1, "prompt_ms": 0.5, "predicted_n": 9, "predicted_ms": 9.0}
_LONG_REPLY = [{"index": 0, "message": {"role": "assistant", "content": "x" * 2_500_000}}]
_LARGE_ANSWERS = {
    "embeddings, usage first": ("/r/v1/embeddings", {"input": "hello"},
                                {"model": "m", "object": "list", "usage": _EMBED_USAGE, "data": _VECTORS}),
    "embeddings, usage last": ("/r/v1/embeddings", {"input": "hello"},
                               {"object": "list", "data": _VECTORS, "usage": _EMBED_USAGE}),
    "chat, timings last": ("/r/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                           {"choices": _LONG_REPLY, "usage": _CHAT_USAGE, "timings": _TIMINGS}),
}


@pytest.mark.parametrize("case", list(_LARGE_ANSWERS))
async def test_a_large_answer_is_never_cut_and_keeps_its_figures(tmp_path: Path, case: str) -> None:
    path, request, answer = _LARGE_ANSWERS[case]
    big = json.dumps(answer).encode()
    async with recording_upstream(big, [b""]) as up:
        cfg = write_config(tmp_path / "c.toml", {"a": (up.url, HostSpec({"m": {}}))},
                           {"r": {"hosts": ["a"], "default_model": "m"}}, max_body="64KiB")
        async with crossbar_proxy(cfg) as proxy:
            # past the bound mitmproxy buffers an answer at: streamed through, read at its edges
            assert len(big) > proxy.router.cfg.buffered_body_max
            status, _, body = await post(proxy.url + path, request)
            (row,) = await request_rows(proxy)
    assert status == 200 and body == big
    assert row.status == 200 and row.prompt_tokens == 3
    if "chat" in case:
        assert (row.cached_tokens, row.completion_tokens) == (2, 9)


def _incompressible_chat_answer() -> bytes:
    text = base64.b64encode(random.Random(7).randbytes(2_000_000)).decode()
    return json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                       "usage": _CHAT_USAGE, "timings": _TIMINGS}).encode()


@pytest.mark.parametrize("case", ["sent chunked", "compressed"])
async def test_a_large_answer_whose_figures_cannot_be_read_counts_them(tmp_path: Path, case: str) -> None:
    # chunked: mitmproxy starts streaming it only once its buffer passes the bound, after the
    # answer's head was seen; compressed: its edges are gzip, not JSON
    answer = _incompressible_chat_answer()
    sent = gzip.compress(answer) if case == "compressed" else answer
    encoding = {"Content-Encoding": "gzip"} if case == "compressed" else {}
    async with recording_upstream(sent, [b""], encoding, chunked=case == "sent chunked") as up:
        cfg = write_config(tmp_path / "c.toml", {"a": (up.url, HostSpec({"m": {}}))},
                           {"r": {"hosts": ["a"], "default_model": "m"}}, max_body="64KiB")
        async with crossbar_proxy(cfg) as proxy:
            assert len(sent) > proxy.router.cfg.buffered_body_max
            question = {"messages": [{"role": "user", "content": "x"}]}
            async with aiohttp.ClientSession(auto_decompress=False) as session, \
                    session.post(proxy.url + CHAT, json=question) as got:
                status, body = got.status, await got.read()
            (row,) = await request_rows(proxy)
            _, samples = await scrape(proxy.url)
    assert status == 200 and body == sent
    assert row.status == 200 and row.prompt_tokens is None
    assert summed(samples, "crossbar_usage_figures_dropped_total", host="a") == 1


_STREAMED_EVENTS = (b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
                    b'data: {"choices":[{"index":0,"finish_reason":"stop","delta":{}}],'
                    b'"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}\n\n'
                    b"data: [DONE]\n\n")


@pytest.mark.parametrize("level", [0, 6])
async def test_a_compressed_event_stream_passes_unchanged_and_counts_its_figures_dropped(
        tmp_path: Path, level: int) -> None:
    # level 0: stored blocks carry the events as they are (cut anywhere by the blocks' framing):
    # never read as events, as a buffered compressed answer's bytes are never read as JSON
    sent = gzip.compress(_STREAMED_EVENTS, compresslevel=level)
    pieces = [sent[:len(sent) // 2], sent[len(sent) // 2:]]
    async with recording_upstream(b"", pieces, {"Content-Encoding": "gzip"}) as up:
        cfg = write_config(tmp_path / "c.toml", {"a": (up.url, HostSpec({"m": {}}))},
                           {"r": {"hosts": ["a"], "default_model": "m"}})
        async with crossbar_proxy(cfg) as proxy:
            question = {"messages": [{"role": "user", "content": "x"}], "stream": True}
            async with aiohttp.ClientSession(auto_decompress=False) as session, \
                    session.post(proxy.url + CHAT, json=question) as got:
                # streamed: the first piece arrives while the host holds back the rest
                first = await asyncio.wait_for(got.content.readexactly(len(pieces[0])), 5)
                up.gate.set()
                status, body = got.status, first + await got.read()
                content_type = got.headers["Content-Type"]
            (row,) = await request_rows(proxy)
            _, samples = await scrape(proxy.url)
    assert (status, content_type, body) == (200, "text/event-stream", sent)
    assert (row.status, row.err, row.prompt_tokens, row.completion_tokens) == (200, None, None, None)
    assert summed(samples, "crossbar_usage_figures_dropped_total", host="a") == 1


async def test_a_compressed_event_stream_cut_after_its_last_event_counts_its_figures_dropped(
        tmp_path: Path) -> None:
    # a plain stream cut there still has its figures read by the tap; a compressed one has none
    sent = gzip.compress(_STREAMED_EVENTS, compresslevel=0)

    async def complete(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(sent), sent))
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.transport.abort()  # before the last chunk

    async with raw_upstream(complete) as url:
        cfg = write_config(tmp_path / "c.toml", {"a": (url, HostSpec({"m": {"parallel": 1}}))},
                           {"r": {"hosts": ["a"], "default_model": "m"}})
        async with crossbar_proxy(cfg) as proxy:
            question = {"messages": [{"role": "user", "content": "x"}], "stream": True}
            got = bytearray()
            async with aiohttp.ClientSession(auto_decompress=False) as session, \
                    session.post(proxy.url + CHAT, json=question) as resp:
                with contextlib.suppress(aiohttp.ClientPayloadError):
                    async for piece in resp.content.iter_any():
                        got += piece
            await wait_until(lambda: proxy.router.in_flight("a", "m") == 0, what="the cut request ended")
            (row,) = await request_rows(proxy)
            _, samples = await scrape(proxy.url)
    assert bytes(got) == sent  # everything the host sent, and nothing that looks complete after it
    assert row.err is not None and (row.prompt_tokens, row.completion_tokens) == (None, None)
    assert summed(samples, "crossbar_usage_figures_dropped_total", host="a") == 1


@pytest.mark.parametrize("level", [0, 6])
async def test_a_compressed_event_stream_answered_by_a_retry_counts_its_figures_dropped(
        tmp_path: Path, level: int) -> None:
    # a answers 500 once; the retry on b gets the stream whole (a retry is answered whole)
    sent = gzip.compress(_STREAMED_EVENTS, compresslevel=level)
    failing = HostSpec({"m": {}}, sim=SimConfig(models=["m"], n_slots=8, fail_status=500, fail_times=1))
    async with sim_fleet({"a": failing}) as fleet, \
            recording_upstream(b"", [sent], {"Content-Encoding": "gzip"}) as up:
        up.gate.set()
        hosts = {"a": (fleet["a"].url, failing), "b": (up.url, HostSpec({"m": {}}))}
        cfg = write_config(tmp_path / "c.toml", hosts, {"r": {"hosts": ["a", "b"], "default_model": "m"}})
        async with crossbar_proxy(cfg) as proxy:
            question = {"messages": [{"role": "user", "content": "x"}], "stream": True}
            async with aiohttp.ClientSession(auto_decompress=False) as session, \
                    session.post(proxy.url + CHAT, json=question) as got:
                status, body, retried = got.status, await got.read(), got.headers.get("X-Crossbar-Retried")
            (row,) = await request_rows(proxy)
            _, samples = await scrape(proxy.url)
    assert (status, retried, body) == (200, "1", sent)
    assert (row.host, row.status, row.prompt_tokens, row.completion_tokens) == ("b", 200, None, None)
    assert summed(samples, "crossbar_usage_figures_dropped_total", host="b") == 1


async def test_a_5xx_that_grows_past_the_bound_without_a_length_is_not_retried(tmp_path: Path) -> None:
    # held back for a retry, then streamed to the client by mitmproxy once its buffer passed the
    # bound: what the client got stands, and nothing counts as a dropped figure
    error = json.dumps({"error": {"code": 500, "message": "x" * 2_000_000}}).encode()
    answer = b'{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":5,"completion_tokens":1}}'
    async with recording_upstream(error, [b""], chunked=True, status=500) as failing, \
            recording_upstream(answer, [b""]) as healthy:
        hosts = {"a": (failing.url, HostSpec({"m": {}})), "b": (healthy.url, HostSpec({"m": {}}))}
        cfg = write_config(tmp_path / "c.toml", hosts, {"r": {"hosts": ["a", "b"], "default_model": "m"}},
                           max_body="64KiB")
        async with crossbar_proxy(cfg) as proxy:
            assert len(error) > proxy.router.cfg.buffered_body_max
            status, _, body = await post(proxy.url + CHAT, {"messages": [{"role": "user", "content": "x"}]})
            (row,) = await request_rows(proxy)
            _, samples = await scrape(proxy.url)
    assert status == 500 and body == error
    assert healthy.received == [] and row.host == "a" and row.status == 500
    assert summed(samples, "crossbar_usage_figures_dropped_total") == 0


# ---------------------------------------------------------------- a hook that raises


async def test_a_hook_that_raises_never_leaks_the_slot(tmp_path: Path) -> None:
    answer = b'{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":5,"completion_tokens":1}}'
    async with sim_fleet({"a": spec(fail_status=500, fail_times=1)}) as fleet, \
            recording_upstream(answer, [b""], {"X-Note": "caf\u00e9 \u2603"}) as up:
        hosts = {"a": (fleet["a"].url, spec()), "b": (up.url, HostSpec({"m": {"parallel": 1}}))}
        cfg = write_config(tmp_path / "c.toml", hosts, {"r": {"hosts": ["a", "b"], "default_model": "m"}})
        async with crossbar_proxy(cfg) as proxy:
            status, _, body = await post(proxy.url + CHAT, turn("s", 0))
            rows = await request_rows(proxy)
            busy = {h: proxy.router.in_flight(h, "m") for h in ("a", "b")}
            live = len(proxy.router.live)
    assert status == 200 and body == answer
    assert busy == {"a": 0, "b": 0} and live == 0
    assert len(rows) == 1 and rows[0].host == "b"


# ---------------------------------------------------------------- a stale /slots reading


async def test_a_slots_reading_taken_while_our_requests_ran_is_corrected(tmp_path: Path) -> None:
    # a outweighs b even holding one request, so both go to a
    specs = {"a": spec(parallel=2, weight=2.0, n_slots=2, token_ms=60),
             "b": spec(parallel=2, weight=0.5, n_slots=2)}
    async with fleet_with_route(tmp_path, specs, poll_interval="60s") as (fleet, proxy):
        running = [asyncio.create_task(post(proxy.url + CHAT, turn(f"s{i}", 0, max_tokens=20)))
                   for i in range(2)]
        await wait_until(lambda: fleet["a"].stats.inflight.get("m", 0) == 2, what="both running on a")
        await proxy.router.poller.poll_once()  # a poll round while they run: /slots says 0 free
        await asyncio.gather(*running)
        status, _, _ = await post(proxy.url + CHAT, turn("fresh", 0, max_tokens=1))
        rows = await request_rows(proxy)
    assert status == 200
    assert [r.host for r in rows] == ["a", "a", "a"], "an idle host was still seen full"


# ---------------------------------------------------------------- crossbar's own errors, counted


async def test_crossbar_own_errors_are_counted_by_reason(tmp_path: Path) -> None:
    async with fleet_with_route(tmp_path, {"a": spec()}, max_body="1KiB") as (_fleet, proxy):
        answers = [
            await post(proxy.url + "/nope/v1/chat/completions", turn("s", 0)),
            await post(proxy.url + CHAT, {"messages": "not a list"}),
            await post(proxy.url + CHAT, {"messages": [{"role": "user", "content": "x" * 4000}]}),
        ]
        _, samples = await scrape(proxy.url)
    assert [a[0] for a in answers] == [404, 400, 413]
    for reason in ("not_found", "bad_request", "too_large"):
        assert summed(samples, "crossbar_rejected_total", reason=reason) == 1, reason


async def test_the_shutdown_503_is_counted(tmp_path: Path) -> None:
    async with fleet_with_route(tmp_path, {"a": spec()}) as (_fleet, proxy):
        proxy.addon.stopping = True  # what the first SIGTERM sets before it drains
        status, _, _ = await post(proxy.url + CHAT, turn("s", 0))
        proxy.addon.stopping = False
        _, samples = await scrape(proxy.url)
    assert status == 503
    assert summed(samples, "crossbar_rejected_total", reason="shutting_down") == 1


# ---------------------------------------------------------------- errors that said the wrong thing


async def test_a_missing_model_is_llama_servers_400(tmp_path: Path) -> None:
    async with sim_fleet({"a": spec()}) as fleet:
        cfg = write_config(tmp_path / "c.toml", {"a": (fleet["a"].url, spec())}, {"r": {"hosts": ["a"]}})
        async with crossbar_proxy(cfg) as proxy:
            status, _, body = await post(proxy.url + CHAT, {"messages": conversation("s", 1)[0]})
    assert status == 400
    assert json.loads(body) == {"error": {"code": 400, "type": "invalid_request_error",
                                          "message": "model name is missing from the request"}}


async def test_an_unknown_model_is_refused_and_never_runs(tmp_path: Path) -> None:
    """Six invented model names at once on a pinned route of a host with one slot: each is
    refused in llama-server's shape and nothing reaches the host."""
    async with sim_fleet({"a": spec(n_slots=1)}) as fleet:
        cfg = write_config(tmp_path / "c.toml", {"a": (fleet["a"].url, spec())},
                           {"r": {"hosts": ["a"], "default_model": "m", "pin": "a"}})
        async with crossbar_proxy(cfg) as proxy:
            answers = await asyncio.gather(*(post(proxy.url + CHAT, turn("s", 0, model=f"fake{i}"))
                                             for i in range(1, 7)))
            started = fleet["a"].stats.completions_started
            _, samples = await scrape(proxy.url)
    for i, (status, _, body) in enumerate(answers, 1):
        assert status == 400
        assert json.loads(body)["error"] == {"code": 400, "type": "invalid_request_error",
                                             "message": f"model 'fake{i}' not found"}
    assert started == 0
    assert not any(labels.get("model", "").startswith("fake") for (_, labels) in _label_sets(samples))


def _label_sets(samples: Samples) -> list[tuple[str, dict[str, str]]]:
    return [(name, dict(labels)) for (name, labels) in samples]


async def test_a_single_server_shares_its_slots_across_model_names(tmp_path: Path) -> None:
    """A host that is not a router, listed with two names: both count against its one slot."""
    async with sim_fleet({"a": spec(n_slots=2, token_ms=50)}) as fleet:
        host = HostSpec({"m": {"parallel": 1}, "alias": {"parallel": 1}})
        cfg = write_config(tmp_path / "c.toml", {"a": (fleet["a"].url, host)},
                           {"r": {"hosts": ["a"], "default_model": "m"}})
        async with crossbar_proxy(cfg) as proxy:
            answers = await asyncio.gather(
                post(proxy.url + CHAT, turn("s1", 0, model="m", max_tokens=10)),
                post(proxy.url + CHAT, turn("s2", 0, model="alias", max_tokens=10)))
            peak = max(fleet["a"].stats.max_concurrent.values())
    assert [a[0] for a in answers] == [200, 200]
    assert peak == 1


async def test_the_context_error_names_the_routes_own_hosts(tmp_path: Path) -> None:
    """The 400 reports the largest per-slot context among the route's hosts that serve the
    model (a `ctx` override included), not the largest anywhere; /_crossbar/hosts shows it."""
    specs = {"small": spec(parallel=2, ctx=8192), "big": spec(parallel=2, ctx=65536)}
    async with sim_fleet(specs) as fleet:
        hosts = {"small": (fleet["small"].url, HostSpec({"m": {"parallel": 2, "ctx": 3000}})),
                 "big": (fleet["big"].url, specs["big"])}
        routes = {"r": {"hosts": ["small"], "default_model": "m"},
                  "all": {"hosts": ["small", "big"], "default_model": "m"}}
        cfg = write_config(tmp_path / "c.toml", hosts, routes)
        async with crossbar_proxy(cfg) as proxy:
            await wait_until(lambda: proxy.router.fleet.slot_ctx("big", "m") == 32768, what="big polled")
            prompt = {"messages": [{"role": "user", "content": "w" * 20_000}]}
            status, _, body = await post(proxy.url + CHAT, prompt)
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s, \
                    s.get(proxy.url + "/_crossbar/hosts") as resp:
                hosts_view = await resp.json()
    assert status == 400
    err = json.loads(body)["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 3000
    assert hosts_view["small"]["ctx"] == {"m": 3000}
    assert hosts_view["big"]["ctx"] == {"m": 32768}


# ---------------------------------------------------------------- bounded labels and views


async def test_template_routes_are_labelled_by_their_template(tmp_path: Path) -> None:
    async with sim_fleet({"a": spec(parallel=2)}) as fleet:
        cfg = write_config(tmp_path / "c.toml", {"a": (fleet["a"].url, spec(parallel=2))},
                           {"opencode-*": {"hosts": ["a"], "default_model": "m"}})
        async with crossbar_proxy(cfg) as proxy:
            for name in ("opencode-1", "opencode-2", "opencode-3"):
                assert (await post(f"{proxy.url}/{name}/v1/chat/completions", turn(name, 0)))[0] == 200
            _, samples = await scrape(proxy.url)
    routes = {labels["route"] for name, labels in _label_sets(samples) if "route" in labels}
    assert routes == {"opencode-*"}


async def test_the_routes_view_is_summarised(tmp_path: Path) -> None:
    async with fleet_with_route(tmp_path, {"a": spec(parallel=4)}) as (_fleet, proxy):
        for i in range(60):
            proxy.router.leases.apply(*_fake_lease(i))
        async with aiohttp.ClientSession(timeout=TIMEOUT) as s, \
                s.get(proxy.url + "/_crossbar/routes") as resp:
            view = await resp.json()
    r = view["r"]
    assert r["lease_count"] == 60 and r["hosts_leases"] == {"a": 60}
    assert len(r["leases"]) == 50
    assert r["leases"][0]["fp"] == "fp59"  # most recently used first


def _fake_lease(i: int) -> tuple[Any, Any, float]:
    from crossbar.lease import Key
    from crossbar.placement import Change, LeaseChange

    return Key("r", f"fp{i}", "m"), LeaseChange(Change.CREATE, "a"), 1000.0 + i


# ---------------------------------------------------------------- absolute-form targets


@asynccontextmanager
async def request_line_recorder() -> AsyncIterator[tuple[int, list[bytes]]]:
    """A bare HTTP/1.1 upstream that records each request line and answers like llama-server."""
    lines: list[bytes] = []
    answers = {b"/health": b'{"status":"ok"}', b"/v1/models": b'{"data":[{"id":"m"}]}',
               b"/props": b'{"total_slots":1,"default_generation_settings":{"n_ctx":4096}}'}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                first, *fields = head.split(b"\r\n")
                length = next((int(f.split(b":", 1)[1]) for f in fields
                               if f.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                target = first.split(b" ")[1]
                if first.startswith(b"POST"):
                    lines.append(first)
                body = answers.get(target, b'{"choices":[],"usage":{"prompt_tokens":1}}')
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], lines
    finally:
        server.close()


async def test_an_absolute_form_request_reaches_the_host_in_origin_form(tmp_path: Path) -> None:
    async with request_line_recorder() as (port, lines):
        cfg = write_config(tmp_path / "c.toml", {"a": (f"http://127.0.0.1:{port}", HostSpec({"m": {}}))},
                           {"r": {"hosts": ["a"], "default_model": "m"}})
        async with crossbar_proxy(cfg) as proxy:
            body = json.dumps(turn("s", 0)).encode()
            raw = await raw_http(proxy.port, post_bytes("http://foreign.example/r/v1/chat/completions", body))
    status, _, _ = split_response(raw)
    assert status == 200
    assert lines == [b"POST /v1/chat/completions HTTP/1.1"]



async def test_a_full_route_evicts_its_oldest_idle_lease_and_counts_it(tmp_path: Path) -> None:
    async with fleet_with_route(tmp_path, {"a": spec(parallel=2)}) as (_fleet, proxy):
        proxy.router.leases.max_per_route = 3  # the same bound as in production, made small
        for i in range(5):
            assert (await post(proxy.url + CHAT, turn(f"s{i}", 0, max_tokens=1)))[0] == 200
        fps = [lease.key.fp for lease in proxy.router.leases.leases_of("r")]
        _, samples = await scrape(proxy.url)
        rows = await request_rows(proxy)
    assert len(fps) == 3 and fps == [r.fp for r in rows[:1:-1]]  # the three most recent stay
    assert summed(samples, "crossbar_lease_moves_total", reason="evicted") == 2


async def test_the_first_byte_timer_names_the_host_it_was_armed_for() -> None:
    """A request moved after its timer was armed (a refused server_connect, then a queue) must
    not have the old timer blame its new host."""
    from crossbar.config import RouteConf
    from crossbar.deadlines import Deadlines
    from crossbar.exchange import Exchange
    from crossbar.lease import Key

    fired: list[str] = []
    ex = Exchange(route=RouteConf("r", ("a", "b")), key=Key("r", "", "m"), path="/v1/chat/completions",
                  completion=True, host="a")
    deadlines = Deadlines(tick=0.01)
    ex.arm_deadline(deadlines, 0.05, fired.append)
    ex.host = "b"  # moved: re-armed when it is sent again
    ex.arm_deadline(deadlines, 0.05, fired.append)
    await asyncio.sleep(0.2)
    assert fired == ["b"]


async def test_a_retried_answer_not_whole_within_first_byte_timeout_is_given_up(tmp_path: Path) -> None:
    """A retried answer is buffered whole before the client gets a byte of it: a retry host that
    trickled one (a token every 0.25 s) kept the client waiting past `first_byte_timeout` without
    any bound (each read reset the timer)."""
    specs = {"a": spec(weight=2, fail_status=500, fail_times=1), "b": spec(token_ms=250)}
    async with sim_fleet(specs) as fleet:
        cfg = write_config(tmp_path / "c.toml", {n: (fleet[n].url, s) for n, s in specs.items()},
                           {"r": {"hosts": ["a", "b"], "default_model": "m"}}, first_byte_timeout="1s")
        async with crossbar_proxy(cfg) as proxy:
            started = time.monotonic()
            status, _, body = await post(proxy.url + CHAT, turn("s", 0, max_tokens=16, stream=True))
            waited = time.monotonic() - started
            (row,) = await request_rows(proxy)
    assert waited < 3, f"the client waited {waited:.1f}s (first_byte_timeout 1s)"
    assert status == 500 and b"simulated failure" in body  # a's own answer, once b's second had passed
    assert (row.host, row.status) == ("a", 500), row
    assert row.err == "retry on b failed: no complete answer within 1s (first_byte_timeout)", row.err


async def leased_hosts(proxy: Any) -> set[str]:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(proxy.url + "/_crossbar/routes") as resp:
        return set((await resp.json())["r"]["hosts_leases"])


async def test_a_retry_onto_a_host_a_reload_removed_leaves_the_lease_alone(tmp_path: Path) -> None:
    """A reload drops the leases on the hosts it removes; a retry running on such a host when
    the reload came moved the lease there afterwards (a lease on a host that no longer exists)."""
    specs = {"a": spec(weight=2, fail_status=500, fail_times=1), "b": spec(token_ms=100)}
    async with sim_fleet(specs) as fleet:
        path = tmp_path / "crossbar.toml"
        both = {n: (fleet[n].url, s) for n, s in specs.items()}
        cfg = write_config(path, both, {"r": {"hosts": ["a", "b"], "default_model": "m"}})
        async with crossbar_proxy(cfg) as proxy:
            first = asyncio.create_task(post(proxy.url + CHAT, turn("s", 0, max_tokens=20)))  # b: ~2 s
            await wait_until(lambda: proxy.router.in_flight("b", "m") == 1, 10, what="the retry on b")
            write_config(path, {"a": both["a"]}, {"r": {"hosts": ["a"], "default_model": "m"}})
            status, answer = await reload(proxy)
            assert status == 200, answer
            got, headers, _ = await first
            assert got == 200 and headers.get("X-Crossbar-Retried") == "1"  # b's answer, as it ran there
            assert await leased_hosts(proxy) <= {"a"}


async def test_a_failover_queued_on_a_host_a_reload_removes_leaves_the_lease_alone(tmp_path: Path) -> None:
    specs = {"a": spec(), "b": spec(weight=2, token_ms=100)}
    async with sim_fleet(specs) as fleet:
        path = tmp_path / "crossbar.toml"
        both = {n: (fleet[n].url, s) for n, s in specs.items()}
        cfg = write_config(path, both, {"r": {"hosts": ["a", "b"], "default_model": "m"}},
                           poll_interval="30s")
        async with crossbar_proxy(cfg) as proxy:
            busy = asyncio.create_task(post(proxy.url + CHAT, turn("busy", 0, max_tokens=25)))  # b, ~2.5 s
            await wait_until(lambda: proxy.router.in_flight("b", "m") == 1, 10, what="b busy")
            assert (await post(proxy.url + CHAT, turn("s", 0, max_tokens=1)))[0] == 200  # b full: on a
            fleet["a"].set(refuse=True)
            second = asyncio.create_task(post(proxy.url + CHAT, turn("s", 1, max_tokens=1)))
            await wait_until(lambda: proxy.router.queued("b", "m") == 1, 10, what="s queued on b")
            write_config(path, {"a": both["a"]}, {"r": {"hosts": ["a"], "default_model": "m"}},
                         poll_interval="30s")
            status, answer = await reload(proxy)
            assert status == 200, answer
            await busy
            got, _, _ = await second
            rows = await request_rows(proxy)
            assert got == 200 and rows[-1].host == "b"  # it finished on the host it queued for
            assert "b" not in await leased_hosts(proxy)


async def test_a_client_that_leaves_while_its_host_wakes_ends_at_once(tmp_path: Path) -> None:
    """The request outlived its client for the whole wake `wait`, then was written as a 503 no
    one received and counted as a `no_host` refusal."""
    async with sim_fleet({"a": spec(refuse=True)}) as fleet:
        cfg = write_config(tmp_path / "crossbar.toml", {"a": (fleet["a"].url, spec())},
                           {"r": {"hosts": ["a"], "default_model": "m"}})
        cfg.write_text(cfg.read_text().replace(
            '[hosts."a"]\n',
            '[hosts."a"]\nwake = { mac = "aa:bb:cc:dd:ee:ff", broadcast = "127.0.0.1:9", wait = "4s" }\n'))
        async with crossbar_proxy(cfg) as proxy:
            await wait_until(lambda: not proxy.router.fleet.healthy("a"), 5, what="a down")
            started = time.monotonic()
            with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s, \
                        s.post(proxy.url + CHAT, json=turn("s", 0, max_tokens=1)) as resp:
                    await resp.read()
            await wait_until(lambda: proxy.router.waker.sent >= 1, 2, what="the wake packet")
            await wait_until(lambda: not proxy.router.live, 10, what="the request to end")
            ended_after = time.monotonic() - started
            (row,) = await request_rows(proxy)
            _, samples = await scrape(proxy.url)
    assert ended_after < 2, f"the request outlived its client by {ended_after - 0.5:.1f}s"
    assert row.err == "client left while a host woke", (row.status, row.err)
    assert summed(samples, "crossbar_rejected_total", reason="no_host") == 0
