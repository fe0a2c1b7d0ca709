"""Connection, head and body exhaustion, through the real command (`mitmdump -s addons/crossbar.py`)
with raw sockets: half-sent heads, idle connections, too many connections from one peer, bodies
over max_body (declared and chunked), oversized request heads, and an upstream that answers with a
giant response head."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from h11 import LocalProtocolError
from h11._events import EndOfMessage
from h11._readers import ChunkedReader
from h11._receivebuffer import ReceiveBuffer
from harness import HostSpec, MitmdumpProcess, split_response, start_mitmdump, write_config
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy.net.http.http1 import expected_http_body_size, read_request_head
from mitmproxy.net.http.validate import validate_headers

from crossbar.limits import (
    ChunkCounter,
    ClientReader,
    Refusal,
    RequestFramer,
    ResponseHeadFramer,
    _head_end,
    body_framing,
    has_folded_line,
)
from llamasim import SimConfig, SimServer

MAX_BODY = 1024 * 1024
CHUNK_64K = b"%x\r\n%s\r\n" % (64 * 1024, b"x" * 64 * 1024)
CHAT = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
LIMITS = {"max_body": "1MiB", "max_head": "64KiB", "head_timeout": "1s", "idle_timeout": "2s",
          "body_timeout": "1s", "max_connections_per_peer": 8}


@dataclass
class Rig:
    proxy: MitmdumpProcess
    sim: SimServer

    @property
    def port(self) -> int:
        return self.proxy.port

    def log(self) -> str:
        return "".join(self.proxy.output)


@asynccontextmanager
async def rig(tmp_path: Path, base_url: str | None = None, **top: Any) -> AsyncIterator[Rig]:
    sim = SimServer(SimConfig(models=["m"]))
    await sim.start()
    try:
        cfg = write_config(tmp_path / "c.toml", {"a": (base_url or sim.url, HostSpec({"m": {}}))},
                           {"r": {"default_model": "m"}}, **{**LIMITS, **top})
        proxy = await asyncio.to_thread(start_mitmdump, cfg)
        try:
            yield Rig(proxy, sim)
        finally:
            await asyncio.to_thread(proxy.stop)
    finally:
        await sim.close()


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def head(method: str = "POST", path: str = "/r/v1/chat/completions", **headers: str) -> bytes:
    fields = {"Host": "127.0.0.1", "Content-Type": "application/json", **headers}
    lines = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in fields.items())
    return f"{method} {path} HTTP/1.1\r\n{lines}\r\n".encode()


async def answer(reader: asyncio.StreamReader, timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    """One response read to the end of the connection (every answer here closes it)."""
    return split_response(await asyncio.wait_for(reader.read(), timeout))


def assert_json_error(status: int, headers: dict[str, str], body: bytes, code: int) -> None:
    assert status == code, body[:300]
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == code


async def chat_ok(port: int) -> None:
    reader, writer = await connect(port)
    writer.write(head(Content_Length=str(len(CHAT)), Connection="close") + CHAT)
    status, _, body = await answer(reader)
    writer.close()
    assert status == 200, body


async def test_half_sent_heads_are_closed_with_408_and_others_are_served(tmp_path: Path) -> None:
    async with rig(tmp_path, max_connections_per_peer=64) as r:
        slow = [await connect(r.port) for _ in range(40)]
        for _, writer in slow:
            writer.write(b"POST /r/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1")
        silent = [await connect(r.port) for _ in range(5)]  # never send a byte
        await chat_ok(r.port)
        started = time.monotonic()
        for reader, _ in slow:
            assert_json_error(*await answer(reader), 408)
        for reader, _ in silent:
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed without a word
        assert time.monotonic() - started < 8
        await chat_ok(r.port)
        assert "Traceback" not in r.log()


async def test_an_idle_kept_alive_connection_is_closed_after_idle_timeout(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        reader, writer = await connect(r.port)
        writer.write(head(Content_Length=str(len(CHAT))) + CHAT)
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert first.startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        with suppress(ConnectionError):
            while await asyncio.wait_for(reader.read(65536), 10):
                pass
        assert 1.0 < time.monotonic() - started < 8  # the rest of the answer, then idle_timeout


async def test_connections_per_peer_are_capped(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        held = [await connect(r.port) for _ in range(8)]
        for _, writer in held:
            writer.write(b"G")  # a head begun, so each one is surely accepted and counted
        await asyncio.sleep(0.3)
        reader, writer = await connect(r.port)
        status, headers, body = await answer(reader)
        assert_json_error(status, headers, body, 503)
        assert headers["retry-after"] == "5"
        for _, w in held:
            w.close()
        await asyncio.sleep(0.5)
        await chat_ok(r.port)


async def test_a_declared_body_over_max_body_is_refused_before_it_is_sent(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        reader, writer = await connect(r.port)
        writer.write(head(Content_Length=str(MAX_BODY + 1)))  # and not one byte of the body
        assert_json_error(*await answer(reader, timeout=5), 413)
        reader, writer = await connect(r.port)
        writer.write(head(Content_Length=str(10 ** 12)))
        assert_json_error(*await answer(reader, timeout=5), 413)


async def test_a_stalled_request_body_is_a_json_408_and_a_slow_steady_one_is_served(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        reader, writer = await connect(r.port)
        writer.write(head(Content_Length="1000") + b"{")  # then nothing
        started = time.monotonic()
        assert_json_error(*await answer(reader, timeout=10), 408)
        assert time.monotonic() - started < 5
        reader, writer = await connect(r.port)
        writer.write(head(Content_Length=str(len(CHAT)), Connection="close"))
        for i in range(0, len(CHAT), 12):  # 2.5 s in all, never pausing for body_timeout
            await asyncio.sleep(0.5)
            writer.write(CHAT[i:i + 12])
        status, _, body = await answer(reader)
        assert status == 200, body
        reader, writer = await connect(r.port)
        writer.write(head("GET", "/_crossbar/metrics", Connection="close"))
        assert b'crossbar_rejected_total{reason="body_timeout"} 1.0' in (await answer(reader))[2]


async def test_a_chunked_body_is_cut_at_max_body_with_the_same_json_413(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        reader, writer = await connect(r.port)
        # one chunk past max_body, then silence: only the count can answer 413 (waiting for the
        # rest of the body would end in body_timeout's 408)
        writer.write(head(Transfer_Encoding="chunked") + CHUNK_64K * (MAX_BODY // (64 * 1024) + 1))
        assert_json_error(*await answer(reader), 413)
        writer.close()
        await chat_ok(r.port)


async def test_a_chunked_body_that_never_stops_coming_is_answered_413_while_it_comes(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        reader, writer = await connect(r.port)
        writer.write(head(Transfer_Encoding="chunked"))
        cap, sent = 400 * MAX_BODY, 0
        with suppress(ConnectionError):
            async with asyncio.timeout(20):  # a proxy that stops reading without answering fails here
                while sent < cap and not reader._buffer and not reader.at_eof():
                    writer.write(CHUNK_64K)
                    await writer.drain()
                    await asyncio.sleep(0)  # lets the answer in: drain never yields while the proxy keeps up
                    sent += len(CHUNK_64K)
        assert sent < cap
        assert_json_error(*await answer(reader), 413)
        await chat_ok(r.port)


async def test_a_folded_header_is_a_json_400_and_does_not_lift_max_head(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        reader, writer = await connect(r.port)
        writer.write(b"GET /_crossbar/hosts HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: b\r\n"
                     b" Transfer-Encoding: chunked\r\n\r\n")
        writer.write(b"GET /_crossbar/hosts HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nX-Big: "
                     + b"a" * (3 << 20) + b"\r\n\r\n")
        with suppress(ConnectionError):
            await writer.drain()
        assert_json_error(*await answer(reader, 15), 400)
        writer.close()
        await chat_ok(r.port)


async def test_a_refusal_never_overtakes_the_answer_to_an_earlier_pipelined_request(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        reader, writer = await connect(r.port)
        chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}).encode()
        writer.write(head(Content_Length=str(len(chat))) + chat
                     + head(X_Pad="a" * 200_000, Content_Length=str(len(CHAT))) + CHAT)
        with suppress(ConnectionError):
            await writer.drain()
        data = await asyncio.wait_for(reader.read(), 15)
        writer.close()
        first, _, rest = data.partition(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 200"), data[:300]
        assert b"HTTP/1.1 431" in rest and b'"choices"' in rest.split(b"HTTP/1.1 431")[0], data[:600]


async def test_an_oversized_request_head_is_431(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        reader, writer = await connect(r.port)
        writer.write(head(X_Pad="a" * 200_000, Content_Length=str(len(CHAT))) + CHAT)
        assert_json_error(*await answer(reader), 431)
        reader, writer = await connect(r.port)
        writer.write(b"GET /r/health HTTP/1.1\r\n" + b"X-Pad: a\r\n" * 20_000)  # never ends
        assert_json_error(*await answer(reader), 431)


# ---------------------------------------------------------------- a hostile upstream


@asynccontextmanager
async def raw_upstream(complete: Callable[[asyncio.StreamWriter], Awaitable[None]]) -> AsyncIterator[str]:
    """Answers the poller like llama-server; `complete` writes the answer to each completion."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request_head = await reader.readuntil(b"\r\n\r\n")
                line = request_head.split(b"\r\n", 1)[0]
                length = next((int(h.split(b":")[1]) for h in request_head.split(b"\r\n")
                               if h.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if line.startswith(b"POST"):
                    await complete(writer)
                    continue
                path = line.split(b" ")[1]
                body = {b"/health": b'{"status":"ok"}', b"/v1/models": b'{"data":[{"id":"m"}]}',
                        b"/props": b'{"total_slots":1,"default_generation_settings":{"n_ctx":4096}}'
                        }.get(path, b'{"error":"nf"}')
                status = b"200 OK" if path in (b"/health", b"/v1/models", b"/props") else b"404 Not Found"
                writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


def giant_head_upstream(head_bytes: int) -> AbstractAsyncContextManager[str]:
    """Answers a completion with a `head_bytes` header."""
    async def complete(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
        for _ in range(head_bytes // 65536):
            writer.write(b"X-Big: " + b"a" * 65526 + b"\r\n")
            await writer.drain()
        writer.write(b"Content-Length: 2\r\n\r\n{}")
        await writer.drain()

    return raw_upstream(complete)


async def test_a_giant_response_head_is_crossbars_502_and_marks_the_host(tmp_path: Path) -> None:
    async with giant_head_upstream(8 * 1024 * 1024) as url, rig(tmp_path, base_url=url) as r:
        reader, writer = await connect(r.port)
        writer.write(head(Content_Length=str(len(CHAT)), Connection="close") + CHAT)
        status, headers, body = await answer(reader, timeout=20)
        assert_json_error(status, headers, body, 502)
        assert b"X-Big" not in body and "x-big" not in headers
        reader, writer = await connect(r.port)
        writer.write(head("GET", "/_crossbar/hosts", Connection="close"))
        status, _, body = await answer(reader)
        assert status == 200
        hosts = json.loads(body)
        assert hosts["a"]["healthy"] is False
        reader, writer = await connect(r.port)
        writer.write(head("GET", "/_crossbar/metrics", Connection="close"))
        _, _, body = await answer(reader)
        assert b'crossbar_rejected_total{reason="upstream_head_too_large"} 1.0' in body


# ---------------------------------------------------------------- the pure framing, as tables


@pytest.mark.parametrize(("head_bytes", "framing"), [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", ("head", 0)),
    (b"POST / HTTP/1.1\r\nContent-Length: 12\r\n\r\n", ("length", 12)),
    (b"POST / HTTP/1.1\r\ncontent-length: 0\r\n\r\n", ("head", 0)),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", ("chunked", 0)),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip , chunked\r\n\r\n", ("chunked", 0)),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n", ("bad", 0)),
    (b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", ("bad", 0)),
    (b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n", ("bad", 0)),
    (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", ("bad", 0)),
    (b"POST / HTTP/1.1\r\nContent-Length: 05\r\n\r\n", ("bad", 0)),
    (b"POST / HTTP/1.1\r\nContent-Length: +5\r\n\r\n", ("bad", 0)),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", ("bad", 0)),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked, chunked\r\n\r\n", ("bad", 0)),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", ("bad", 0)),
    (b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", ("bad", 0)),
])
def test_body_framing(head_bytes: bytes, framing: tuple[str, int]) -> None:
    assert body_framing(head_bytes) == framing


def mitmproxy_framing(head: bytes) -> tuple[str, int] | None:
    """How mitmproxy itself frames the body of a request with this head: its reading of the head
    (lines split as its h11 buffer splits them), the body size it expects, and its check of the
    framing fields against request smuggling ("bad": it answers 400). None: it refuses the head
    for another reason (its request line or a header name), where crossbar's framing is moot."""
    lines = [line[:-1] if line.endswith(b"\r") else line for line in head.split(b"\n")[:-2]]
    try:
        request = read_request_head(lines)
    except ValueError:
        return None
    if not all(_HEADER_NAME.fullmatch(name) for name, _ in request.headers.fields):
        return None
    try:
        validate_headers(request)
        size = expected_http_body_size(request)
    except ValueError:
        return "bad", 0
    if size is None:
        return "chunked", 0
    return ("length", size) if size else ("head", 0)


_HEADER_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9a-zA-Z]+")  # mitmproxy's, RFC 9110's token


_FIELD_NAMES = st.sampled_from([
    b"Content-Length", b"content-length", b"CONTENT-LENGTH", b"Transfer-Encoding", b"transfer-encoding",
    b"X-Content-Length", b"Content-Lengthx", b"Host", b"te",
])
_SPACE = st.text(alphabet=" \t\r\x0b\x0c\x1c", max_size=2).map(str.encode)
_VALUES = st.sampled_from([
    b"5", b"0", b"12", b"-1", b"5 ", b" 6", b"chunked", b"gzip, chunked", b"CHUNKED", b"x", b"", b"007",
    b"1:2", b"+5", b"5, 5", b"identity", b"chunked, chunked", b"gzip", b"chunked\x0b",
])
_FIRST_LINES = st.sampled_from([b"POST / HTTP/1.1", b"POST /content-length:5 HTTP/1.1", b"Content-Length: 9",
                                b"POST / HTTP/1.0", b"POST  /  HTTP/1.1"])
_EOLS = st.sampled_from([b"\r\n", b"\n"])


@st.composite
def framing_heads(draw: st.DrawFn) -> bytes:
    fields = draw(st.lists(st.tuples(_EOLS, _SPACE, _FIELD_NAMES, _SPACE, _VALUES), max_size=5))
    lines = b"".join(eol + lead + name + pad + b":" + value for eol, lead, name, pad, value in fields)
    return draw(_FIRST_LINES) + lines + draw(st.sampled_from([b"\r\n\r\n", b"\n\n"]))


@given(framing_heads() | st.binary(max_size=120))
@settings(max_examples=2000, deadline=None)
def test_body_framing_frames_every_head_mitmproxy_takes_as_mitmproxy_does(head_bytes: bytes) -> None:
    """Where mitmproxy takes a head, crossbar counts the same body; where mitmproxy refuses its
    framing fields, crossbar refuses them first (its JSON 400, not mitmproxy's HTML)."""
    if has_folded_line(head_bytes) or _head_end(head_bytes) != len(head_bytes):
        return  # refused before its framing is read, or not one head
    expected = mitmproxy_framing(head_bytes)
    if expected is not None:
        assert body_framing(head_bytes) == expected


def feed_bytewise(framer: RequestFramer, data: bytes) -> tuple[bytes, Any]:
    out = b""
    for i in range(len(data)):
        got, refusal = framer.feed(data[i:i + 1])
        out += got
        if refusal:
            return out, refusal
    return out, None


def test_request_framer_holds_back_heads_and_passes_bodies_and_pipelined_requests() -> None:
    one = b"POST /a HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"
    chunked = b"POST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3;x=1\r\nabc\r\n0\r\n\r\n"
    get = b"GET /c HTTP/1.1\r\n\r\n"
    stream = b"\r\n" + one + chunked + get
    for feed in (lambda f, d: f.feed(d), feed_bytewise):
        framer = RequestFramer(max_head=1024, max_body=100)
        out, refusal = feed(framer, stream)
        assert refusal is None and out == one + chunked + get
        assert framer.state == "head" and not framer.head_started
    framer = RequestFramer(max_head=1024, max_body=100)
    assert framer.feed(b"GET /c HTTP/1.1\r\nHo") == (b"", None) and framer.head_started


@pytest.mark.parametrize(("data", "status"), [
    (b"GET / HTTP/1.1\r\nX: " + b"a" * 2000, 431),
    (b"GET / HTTP/1.1\r\nX: " + b"a" * 2000 + b"\r\n\r\n", 431),
    (b"POST / HTTP/1.1\r\nContent-Length: 101\r\n\r\n", 413),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n40\r\n" + b"x" * 64 + b"\r\n40\r\n", 413),
    (b"GET / HTTP/1.1\r\nX-A: b\r\n Transfer-Encoding: chunked\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nX-A: b\r\n\tContent-Length: 1000000\r\n\r\n", 400),
    (b"GET / HTTP/1.1\nX-A: b\n Content-Length: 10\n\n", 400),
    (b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello", 400),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nT: 1\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3;" + b"x" * 5000 + b"\r\nabc\r\n0\r\n\r\n", 400),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400),
])
def test_request_framer_refusals(data: bytes, status: int) -> None:
    for feed in (lambda f, d: f.feed(d), feed_bytewise):
        _, refusal = feed(RequestFramer(max_head=1024, max_body=100), data)
        assert refusal is not None and refusal.status == status


@pytest.mark.parametrize(("length", "status"), [
    (b"9" * 5000, 413), (b"1" + b"0" * 18, 413),
    (b"0" * 5000 + b"101", 400), (b"0" * 5000, 400),  # leading zeros: mitmproxy refuses them
])
def test_a_content_length_of_many_digits_is_refused(length: bytes, status: int) -> None:
    data = b"POST / HTTP/1.1\r\nContent-Length: " + length + b"\r\n\r\n"
    for feed in (lambda f, d: f.feed(d), feed_bytewise):
        _, refusal = feed(RequestFramer(max_head=64 * 1024, max_body=100), data)
        assert refusal is not None and refusal.status == status


def folded(header: bytes) -> bytes:
    return b"GET /_crossbar/hosts HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: b\r\n " + header + b"\r\n\r\n"


@pytest.mark.parametrize("header", [b"Transfer-Encoding: chunked", b"Content-Length: 1000000"])
def test_a_folded_header_never_frames_a_body_mitmproxy_would_not_read(header: bytes) -> None:
    """mitmproxy joins a folded line onto the header before it (so it reads no body here); the
    framer must never take it for a header of its own, or the limits stop holding for what follows."""
    lines = folded(header).split(b"\r\n")[:-2]
    assert not {"content-length", "transfer-encoding"} & set(read_request_head(lines).headers.keys())
    framer = RequestFramer(max_head=64 * 1024, max_body=32 << 20)
    out, refusal = framer.feed(folded(header))
    assert out == b"" and refusal is not None and refusal.status == 400
    assert json.loads(refusal.response().split(b"\r\n\r\n", 1)[1])["error"]["code"] == 400


class FeedReader:
    def __init__(self, *pieces: bytes):
        self.pieces = list(pieces)

    async def read(self, n: int = -1) -> bytes:
        if not self.pieces:
            await asyncio.sleep(3600)
        return self.pieces.pop(0)


class ListWriter:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    async def drain(self) -> None:
        pass


async def test_a_refusal_waits_for_the_answers_to_the_requests_passed_on_before_it() -> None:
    first = b"POST /a HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"
    big = b"GET /b HTTP/1.1\r\nX: " + b"a" * 2000
    writer = ListWriter()
    reader = ClientReader(FeedReader(first + big[:500], big[500:], b""), writer,
                          RequestFramer(max_head=1024, max_body=100), 10, 10, 10, lambda _: None)
    assert await reader.read() == first
    refusing = asyncio.ensure_future(reader.read())
    await asyncio.sleep(0.05)
    assert not refusing.done() and writer.written == []  # the answer to /a is still due
    reader.answer_written()
    assert await asyncio.wait_for(refusing, 5) == b""
    assert writer.written[0].startswith(b"HTTP/1.1 431")


def test_what_a_read_brings_whole_passes_on_uncopied() -> None:
    """A head and body in one read go on as the very bytes read: a 64 KiB read is not copied
    (nor its body scanned for a head's end) on the way to mitmproxy."""
    head = b"POST /a HTTP/1.1\r\nContent-Length: 70000\r\n\r\n"
    first = head + b"\n\n" * 32000
    framer = RequestFramer(max_head=64 * 1024, max_body=1 << 20)
    out, refusal = framer.feed(first)
    assert out is first and refusal is None and framer.in_body
    rest = b"x" * (70000 - 64000) + b"GET /b HTTP/1.1\r\n\r\n"
    out, refusal = framer.feed(rest)
    assert out is rest and refusal is None and framer.whole == 2
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 70000\r\n\r\n" + b"\n\n" * 32000
    assert ResponseHeadFramer(max_head=64 * 1024).feed(answer) == (answer, False)


@pytest.mark.parametrize(("data", "end"), [
    (b"GET / HTTP/1.1\nHost: x\n\nbody\r\n\r\n", 24),  # a bare-LF head before a CRLF blank line
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\nbody\n\n", 27),
    (b"GET / HTTP/1.1\r\nHost: x\n\r\nbody", 26),
    (b"GET / HTTP/1.1\r\nHost: x\r\n", -1),
])
def test_head_end(data: bytes, end: int) -> None:
    assert _head_end(data) == end
    assert _head_end(bytearray(b"zz" + data), 2) == (end + 2 if end >= 0 else -1)


def head_end_plainly(buf: bytes) -> int:
    """`_head_end` written plainly: past the first blank line that starts earliest, of any form."""
    for i in range(len(buf)):
        for blank in (b"\r\n\r\n", b"\n\n", b"\n\r\n"):
            if buf.startswith(blank, i):
                return i + len(blank)
    return -1


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from([b"\r", b"\n", b"\r\n", b"a", b": ", b"\r\n\r\n"]), max_size=12)
       .map(b"".join), st.integers(0, 3))
def test_head_end_finds_the_blank_line_a_plain_scan_finds(buf: bytes, start: int) -> None:
    assert _head_end(buf) == head_end_plainly(buf)
    padded = b"zzz"[:start] + buf
    assert _head_end(padded, start) == (-1 if head_end_plainly(buf) < 0 else head_end_plainly(buf) + start)


def head_plainly(data: bytes) -> int:
    """The head's length, as far as a plain scan sees one (else all of `data`)."""
    end = head_end_plainly(data)
    return end if end >= 0 else len(data)


class GeneralFramer(RequestFramer):
    """The framer without its one-whole-request shortcut: what the shortcut must agree with."""

    def _one_whole_request(self, data: bytes) -> bool:
        return False


_REQUEST_LINES = st.sampled_from([b"POST /v1/chat/completions HTTP/1.1", b"GET / HTTP/1.1", b"", b"\r\n"])
_HEAD_FIELDS = st.sampled_from([b"Host: x", b"Content-Type: application/json", b" folded: y",
                                b"Transfer-Encoding: chunked", b"X-Content-Length: 3", b"content-length: 3"])


@st.composite
def one_read(draw: st.DrawFn) -> bytes:
    """What one read may bring: a request (or part of one, or more than one), mostly the usual."""
    eol = draw(st.sampled_from([b"\r\n", b"\r\n", b"\n"]))
    body = draw(st.binary(max_size=30) | st.sampled_from([b"", b"x" * 12]))
    length = draw(st.sampled_from([len(body), len(body), len(body) + 1, max(0, len(body) - 1), 0, 200]))
    framing = b"Content-Length: %d" % length
    fields = draw(st.lists(_HEAD_FIELDS, max_size=3)) + draw(st.sampled_from([[framing], [], [framing] * 2]))
    head = draw(_REQUEST_LINES) + b"".join(eol + field for field in fields) + eol + eol
    data = head + body + draw(st.sampled_from([b"", b"", b"GET / HTTP/1.1\r\n\r\n", b"\r\n"]))
    return data[:draw(st.integers(1, len(data)))] if draw(st.booleans()) else data


@settings(max_examples=3000, deadline=None)
@given(one_read(), st.integers(-6, 6) | st.just(1024), st.sampled_from([10, 100]), st.binary(max_size=40))
def test_the_one_whole_request_shortcut_frames_as_the_general_path_does(
        data: bytes, head_room: int, max_body: int, more: bytes) -> None:
    max_head = max(1, head_plainly(data) + head_room)  # the limit mostly near the head's own length
    fast, general = RequestFramer(max_head, max_body), GeneralFramer(max_head, max_body)
    for piece in (data, more):  # and what the next read brings is framed alike too
        got, want = fast.feed(piece), general.feed(piece)
        assert (bytes(got[0]), got[1]) == (bytes(want[0]), want[1])
        assert (fast.state, fast.heads, fast.whole, fast.head_started, fast._remaining) == \
            (general.state, general.heads, general.whole, general.head_started, general._remaining)
        if got[1] is not None:
            return


@settings(max_examples=200, deadline=None)
@given(heads=st.lists(st.sampled_from([b"\r\n", b"\n"]), min_size=1, max_size=4),
       bodies=st.lists(st.binary(max_size=40), min_size=4, max_size=4),
       cuts=st.lists(st.integers(0, 400), max_size=6))
def test_a_pipelined_stream_passes_on_whole_however_it_is_cut(heads: list[bytes], bodies: list[bytes],
                                                             cuts: list[int]) -> None:
    stream = b"".join(b"POST /%d HTTP/1.1%sContent-Length: %d%s%s%s" % (i, nl, len(body), nl, nl, body)
                      for i, (nl, body) in enumerate(zip(heads, bodies, strict=False)))
    framer, out = RequestFramer(max_head=1024, max_body=100), b""
    points = sorted({min(cut, len(stream)) for cut in cuts} | {0, len(stream)})
    for a, b in itertools.pairwise(points):
        got, refusal = framer.feed(stream[a:b])
        assert refusal is None
        out += got
    assert out == stream and framer.whole == len(heads) and not framer.head_started


class TimerCount:
    """Counts the timers a running loop is asked for."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.count = loop, 0
        self.call_at, self.call_later = loop.call_at, loop.call_later

    def __enter__(self) -> TimerCount:
        def call_at(*args: Any, **kw: Any) -> asyncio.TimerHandle:
            self.count += 1
            return self.call_at(*args, **kw)

        def call_later(*args: Any, **kw: Any) -> asyncio.TimerHandle:
            self.count += 1
            return self.call_later(*args, **kw)

        self.loop.call_at, self.loop.call_later = call_at, call_later  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.loop.call_at, self.loop.call_later


async def test_a_body_read_chunk_by_chunk_costs_one_timer_not_one_per_chunk() -> None:
    body = asyncio.StreamReader()
    reader = ClientReader(body, ListWriter(), RequestFramer(max_head=1024, max_body=1 << 30), 10, 10, 10,
                          lambda _: None)
    body.feed_data(b"POST /a HTTP/1.1\r\nContent-Length: 10000000\r\n\r\n")
    with TimerCount(asyncio.get_running_loop()) as timers:
        await reader.read(65536)
        for _ in range(100):  # each chunk moves the body deadline on
            body.feed_data(b"x" * 1000)
            assert await reader.read(65536) == b"x" * 1000
    assert timers.count <= 1


async def test_a_stalled_body_times_out_and_the_client_is_answered() -> None:
    refusals: list[Refusal] = []
    writer = ListWriter()
    reader = ClientReader(FeedReader(b"POST /a HTTP/1.1\r\nContent-Length: 10\r\n\r\n", b"12"), writer,
                          RequestFramer(max_head=1024, max_body=100), 10, 10, 0.2, refusals.append)
    assert (await reader.read()).endswith(b"\r\n\r\n")
    assert await reader.read() == b"12"
    started = time.monotonic()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    assert 0.15 < time.monotonic() - started < 3
    assert [r.status for r in refusals] == [408] and writer.written[0].startswith(b"HTTP/1.1 408")


async def test_cancelling_a_waiting_read_is_not_taken_for_a_timeout() -> None:
    reader = ClientReader(FeedReader(), ListWriter(), RequestFramer(max_head=1024, max_body=100),
                          0.05, 10, 10,
                          lambda _: None)
    waiting = asyncio.ensure_future(reader.read())
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not reader.closed  # the head deadline had not passed: nothing was refused
    assert reader._timer is None  # nor does a timer keep the connection's reader alive


async def test_a_deadline_times_out_a_read_on_a_task_cancelled_once_before() -> None:
    """The timer's own cancellation is told apart from the task's earlier ones, as `asyncio.timeout`
    does: a task that once swallowed a cancellation still gets its 408."""
    refusals: list[Refusal] = []
    reader = ClientReader(FeedReader(b"GET / HTTP/1.1\r\n"), ListWriter(),
                          RequestFramer(max_head=1024, max_body=100), 0.2, 10, 10, refusals.append)

    async def once_cancelled_then_read() -> bytes:
        with suppress(asyncio.CancelledError):
            await asyncio.sleep(10)
        assert await reader.read() == b""
        return await reader.read()

    task = asyncio.ensure_future(once_cancelled_then_read())
    await asyncio.sleep(0.01)
    task.cancel()
    assert await asyncio.wait_for(task, 5) == b""
    assert [r.status for r in refusals] == [408]


def test_tls_and_http2_are_refused() -> None:
    tls, h2 = b"\x16\x03\x01\x02\x00", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    for data in (tls + b"\x00" * 5000, h2 + b"\x00" * 5000):
        out, refusal = RequestFramer(max_head=1024, max_body=100).feed(data)
        assert out == b"" and refusal is not None and refusal.status == 400


_GET = b"GET /r/health HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.mark.parametrize("cut", range(1, 18))
@pytest.mark.parametrize("before", [b"", b"\r\n", _GET])
def test_an_http2_preface_in_pieces_is_refused(cut: int, before: bytes) -> None:
    # its first read a prefix of the preface (or blank lines, which the framer skips, or a request
    # before it): held back as an unfinished request line, it reached mitmproxy whole once the
    # rest arrived, and mitmproxy closes the connection on it without an answer
    stream = before + b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00" * 64
    framer = RequestFramer(max_head=1024, max_body=100)
    passed = b""
    for piece in (stream[:len(before) + cut], stream[len(before) + cut:]):
        out, refusal = framer.feed(piece)
        passed += out
        if refusal is not None:
            break
    assert passed == before.lstrip() and refusal is not None and refusal.status == 400


def test_an_http2_preface_alone_in_a_read_after_a_request_is_refused() -> None:
    framer = RequestFramer(max_head=1024, max_body=100)
    assert framer.feed(_GET) == (_GET, None)
    out, refusal = framer.feed(b"PRI * HTTP/2.0\r\n\r\n")
    assert out == b"" and refusal is not None and refusal.status == 400


@pytest.mark.parametrize(("body", "verdict"), [
    (b"3\r\nabc\r\n3\r\ndef\r\n0\r\n\r\n", (21, "done")),
    (b"3;name=value \r\nabc\r\n0\r\n\n", (24, "done")),  # an extension, blanks; a bare LF at the end
    (b"3\r\nabc\r\n4\r\ndefg", (11, "over")),  # at the size line that passes the limit
    (b"zz\r\n", (4, "malformed")),
    (b"0x3\r\nabc\r\n0\r\n\r\n", (5, "malformed")),  # Python's int() takes it; mitmproxy does not
    (b" 3\r\nabc\r\n0\r\n\r\n", (4, "malformed")),
    (b"3\nabc\r\n0\r\n\r\n", (2, "malformed")),  # mitmproxy's chunk lines end with CRLF
    (b"3\r\nabcXY\r\n0\r\n\r\n", (13, "malformed")),  # the data is not followed by its CRLF
    (b"3\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n", (28, "trailer")),
    (b"3\r\nabc\r\n0\r\n \r\n\r\n", (16, "trailer")),
    (b"3;" + b"e" * 5000 + b"\r\nabc\r\n0\r\n\r\n", (5021, "malformed")),
])
def test_chunk_counter_reads_chunks_as_mitmproxy_does(body: bytes, verdict: tuple[int, str]) -> None:
    """Counted whole, and a byte at a time; its data against the limit, never the framing."""
    assert ChunkCounter(limit=6).feed(body, 0)[1] == verdict[1]
    counter, fed, last = ChunkCounter(limit=6), 0, ""
    for i in range(len(body)):
        used, last = counter.feed(body[i:i + 1], 0)
        fed += used
        if last:
            break
    assert last == verdict[1]
    if verdict[1] in ("done", "over"):
        assert fed == verdict[0]


_CHUNK_PIECES = st.sampled_from([b"3\r\nabc\r\n", b"1;x=y\r\nz\r\n", b"A\r\n0123456789\r\n", b"0\r\n",
                                 b"\r\n", b"\n", b"X-T: 1\r\n", b"abc", b"3 \r\n", b"g\r\n", b"\r"])


@given(st.lists(_CHUNK_PIECES, max_size=8).map(b"".join))
@settings(max_examples=1000, deadline=None)
def test_chunk_counter_ends_a_body_where_mitmproxy_does(body: bytes) -> None:
    """mitmproxy reads a chunked request with h11's reader: wherever that reader ends the body
    without trailer fields, crossbar's counter ends it at the same byte; wherever it fails, or
    reads trailer fields (which mitmproxy then cannot handle), the counter refuses the body; while
    that reader waits for more, so does the counter, unless the line being read already has a bare
    LF (h11 would fail it at its CRLF) or a trailer field began."""
    counter = ChunkCounter(limit=1 << 20)
    used, verdict = counter.feed(body, 0)
    buf, reader, outcome = ReceiveBuffer(), ChunkedReader(), "more"
    buf += body
    try:
        while outcome == "more":
            event = reader(buf)
            if event is None:
                break
            if isinstance(event, EndOfMessage):
                outcome = "trailer" if event.headers else "done"
    except LocalProtocolError:
        outcome = "error"
    if outcome == "done":
        assert (verdict, used) == ("done", len(body) - len(buf))
    elif outcome in ("trailer", "error"):
        assert verdict in ("malformed", "trailer")
    elif verdict == "over":  # a chunk that passes the limit is refused at its size line
        assert counter.total > counter.limit
    elif verdict == "trailer":  # h11 reads the trailer section to its end before it says so
        assert reader._reading_trailer
    elif verdict:  # h11 still waits for a chunk line's CRLF, in a line that has a bare LF already
        assert verdict == "malformed" and b"\n" in bytes(buf)
    else:
        assert used == len(body)


def test_response_head_framer() -> None:
    framer = ResponseHeadFramer(max_head=64)
    assert framer.feed(b"HTTP/1.1 200 OK\r\nA: b") == (b"", False)
    assert framer.feed(b"\r\n\r\nbody") == (b"HTTP/1.1 200 OK\r\nA: b\r\n\r\nbody", False)
    assert framer.feed(b"more body with \r\n\r\n inside") == (b"more body with \r\n\r\n inside", False)
    framer.expect_head()
    assert framer.feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\n") == (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\n", False)
    framer.expect_head()
    assert framer.feed(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 100) == (b"", True)


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")
async def test_memory_returns_after_unfinished_uploads(tmp_path: Path) -> None:
    """Eight uploads of 30 of their declared 32 MiB, then the clients leave: crossbar's memory
    goes back near where it started (bounds are generous: this is not a benchmark)."""
    async with rig(tmp_path, max_body="32MiB") as r:
        pid = r.proxy.proc.pid
        base = rss_mib(pid)
        writers = []
        for _ in range(8):
            _, writer = await connect(r.port)
            writer.write(head(Content_Length=str(32 * 1024 * 1024)))
            for _ in range(30):
                writer.write(b"x" * 1024 * 1024)
                await writer.drain()
            writers.append(writer)
        await asyncio.sleep(0.5)
        peak = rss_mib(pid)
        assert peak - base > 150  # the buffers really were held
        for writer in writers:
            writer.close()
        deadline = time.monotonic() + 10
        while rss_mib(pid) - base > 60 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert rss_mib(pid) - base <= 60, (base, peak, rss_mib(pid))


def chunked_chat(body: bytes, extension: bytes = b"", trailer: bytes = b"") -> bytes:
    return (head(Transfer_Encoding="chunked") + b"%x" % len(body) + extension + b"\r\n" + body
            + b"\r\n0\r\n" + trailer + b"\r\n")


FRAMING_REFUSALS = {
    # mitmproxy crashed on it ("HTTP trailers are not implemented yet") and left the client hanging
    "a chunked body with a trailer field": chunked_chat(CHAT, trailer=b"X-Trailer: 1\r\n"),
    # h11 takes a chunk extension of any length: past one read it stopped crossbar's framing, and
    # what the connection sent next (heads, bodies) passed beneath every limit
    "a chunk extension over 4 KiB": chunked_chat(CHAT, extension=b";ext=" + b"a" * 100_000)
    + head("GET", "/r/health", X_Big="a" * 200_000),
    "a chunk extension past max_body": chunked_chat(CHAT, extension=b";ext=" + b"a" * (3 * MAX_BODY)),
    "a chunk size Python reads and mitmproxy does not":
        head(Transfer_Encoding="chunked") + b"0x3\r\nabc\r\n0\r\n\r\n",
    # framing mitmproxy refuses with its HTML page: crossbar's JSON now
    "two different Content-Lengths":
        head(Content_Length="2").replace(b"\r\n\r\n", b"\r\nContent-Length: 3\r\n\r\n") + b"{}",
    "a Content-Length with a leading zero": head(Content_Length="02") + b"{}",
    "Content-Length beside Transfer-Encoding":
        head(Content_Length="5", Transfer_Encoding="chunked") + b"0\r\n\r\n",
    "chunked twice": head(Transfer_Encoding="chunked, chunked") + b"0\r\n\r\n",
    "a TLS client hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 500,
    "an HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
}


async def test_framing_mitmproxy_would_misread_or_refuse_is_crossbars_json_400(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        for name, data in FRAMING_REFUSALS.items():
            reader, writer = await connect(r.port)
            writer.write(data)
            with suppress(ConnectionError):
                await writer.drain()
            status, headers, body = await answer(reader)
            writer.close()
            assert status == 400, (name, body[:300])
            assert_json_error(status, headers, body, 400)
        with pytest.raises((ssl.SSLError, ConnectionError)):  # a TLS client: no handshake, plain HTTP
            tls = ssl.create_default_context()
            tls.check_hostname, tls.verify_mode = False, ssl.CERT_NONE
            await asyncio.wait_for(asyncio.open_connection("127.0.0.1", r.port, ssl=tls), 10)
        await chat_ok(r.port)
        reader, writer = await connect(r.port)
        writer.write(head("GET", "/_crossbar/metrics", Connection="close"))
        _, _, body = await answer(reader)
        refused = len(FRAMING_REFUSALS) + 1
        assert f'crossbar_rejected_total{{reason="bad_request"}} {refused}.0'.encode() in body
        assert r.sim.stats.completions_started == 1  # the good chat only
        log = r.log()
        assert "Traceback" not in log and "has crashed" not in log and "('127.0.0.1', 1)" not in log


async def test_an_http2_preface_in_pieces_or_after_a_request_is_crossbars_json_400(tmp_path: Path) -> None:
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + SETTINGS
    async with rig(tmp_path) as r:
        for pieces in ([preface[:5], preface[5:]], [b"\r\n", preface], [head("GET", "/r/health"), preface]):
            reader, writer = await connect(r.port)
            for piece in pieces:
                writer.write(piece)
                with suppress(ConnectionError):
                    await writer.drain()
                await asyncio.sleep(0.05)
            raw = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            if len(pieces) == 2 and pieces[0].startswith(b"GET"):  # its answer first, then the refusal
                status, headers, _ = split_response(raw)
                assert status == 200
                raw = raw[raw.index(b"\r\n\r\n") + 4 + int(headers["content-length"]):]
            assert_json_error(*split_response(raw), 400)
        await chat_ok(r.port)
        assert "Traceback" not in r.log()


async def test_a_valid_chunked_chat_with_an_extension_is_served(tmp_path: Path) -> None:
    async with rig(tmp_path) as r:
        reader, writer = await connect(r.port)
        request = chunked_chat(CHAT, extension=b";name=value")
        writer.write(request.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1))
        status, _, body = await answer(reader)
        assert status == 200, body[:300]
