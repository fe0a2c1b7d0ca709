"""Hostile input: malformed and hostile requests sent as raw bytes to crossbar running as
`mitmdump -s addons/crossbar.py` (the real command) in front of a simulated llama-server.

Every case must end in a clear 4xx (JSON when crossbar made it; mitmproxy's own 400 for protocol
garbage is accepted and marked so in the table), or a correct answer; never a traceback in the
proxy's output, never a hang (every socket read is bounded), never an upstream that should not
have been contacted (the sim's request counters and a canary server's connection count show it).

The table is `CASES`: per case the accepted statuses, `json=True` where the answer must be
crossbar's own JSON error, and `reach=True` where the request is valid and may reach the sim.
`MITM_400` marks protocol garbage that mitmproxy itself rejects (its own 400, or a closed
connection) before any crossbar hook runs; that is accepted and needs no JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
import string
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from harness import (
    POLL_PATHS,
    HostSpec,
    MitmdumpProcess,
    start_mitmdump,
    write_config,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamasim import SimConfig, SimServer

CHAT = "/r/v1/chat/completions"
GOOD = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
MAX_BODY = 64 * 1024
READ_TIMEOUT = 15.0
CLOSED = 0  # the proxy closed the connection without an answer (accepted for protocol garbage)


# ---------------------------------------------------------------- the proxy under test


@dataclass
class Canary:
    """A TCP server no request may ever reach (it is not in crossbar's config)."""

    port: int = 0
    connections: int = 0


@dataclass
class Rig:
    proxy: MitmdumpProcess
    sim: SimServer
    canary: Canary
    loop: asyncio.AbstractEventLoop

    def upstream_hits(self) -> int:
        """Requests the sim got on any path crossbar's poller does not use."""
        requests = dict(self.sim.stats.requests)
        return sum(n for path, n in requests.items() if path not in POLL_PATHS)

    def log(self) -> str:
        return "".join(list(self.proxy.output))


@contextlib.contextmanager
def background_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="hostile-sims", daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("hostile")
    with background_loop() as loop:
        sim = SimServer(SimConfig(models=["m"]))
        canary = Canary()

        async def start() -> asyncio.Server:
            await sim.start()

            async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                canary.connections += 1
                writer.close()

            server = await asyncio.start_server(count, "127.0.0.1", 0)
            canary.port = server.sockets[0].getsockname()[1]
            return server

        server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
        cfg = write_config(tmp / "crossbar.toml", {"a": (sim.url, HostSpec({"m": {}}))},
                           {"r": {"hosts": ["a"], "default_model": "m"}},
                           max_body=MAX_BODY, poll_interval="1s",
                           admin_names=["crossbar"])  # the Host these raw requests send
        proxy = start_mitmdump(cfg)
        try:
            yield Rig(proxy, sim, canary, loop)
        finally:
            proxy.stop(timeout=30)

            async def stop() -> None:
                server.close()
                await sim.close()

            asyncio.run_coroutine_threadsafe(stop(), loop).result(30)


# ---------------------------------------------------------------- raw HTTP over a socket


@dataclass
class Reply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)


class Conn:
    """A raw client connection that reads whole HTTP/1.x answers, every read bounded."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT)
        self.buf = b""
        self.eof = False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def send(self, data: bytes, half_close: bool = False) -> None:
        with contextlib.suppress(OSError):  # the proxy may answer and close before reading it all
            self.sock.sendall(data)
            if half_close:
                self.sock.shutdown(socket.SHUT_WR)

    def _more(self) -> bool:
        if self.eof:
            return False
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        except TimeoutError as exc:
            raise AssertionError(f"no answer within {READ_TIMEOUT}s (a hang)") from exc
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._more():
                raise AssertionError("connection closed in the middle of a body")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            if not self._more():
                raise AssertionError("connection closed in the middle of a chunked body")
        line, _, self.buf = self.buf.partition(b"\r\n")
        return line

    def reply(self) -> Reply:
        """The next answer (1xx skipped), or CLOSED when the connection ends first."""
        while True:
            while b"\r\n\r\n" not in self.buf:
                if not self._more():
                    return Reply(CLOSED)
            head, _, self.buf = self.buf.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            status = int(lines[0].split()[1])
            headers: dict[str, str] = {}
            for line in lines[1:]:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
            if 100 <= status < 200:
                continue
            if headers.get("transfer-encoding", "").lower() == "chunked":
                body = b""
                while size := int(self._line().split(b";")[0], 16):
                    body += self._take(size)
                    self._take(2)
                while self._line():  # trailers up to the empty line
                    pass
            elif "content-length" in headers:
                body = self._take(int(headers["content-length"]))
            else:
                while self._more():
                    pass
                body, self.buf = self.buf, b""
            return Reply(status, headers, body)


def exchange(port: int, data: bytes, answers: int = 1, half_close: bool = False) -> list[Reply]:
    conn = Conn(port)
    try:
        conn.send(data, half_close)
        return [conn.reply() for _ in range(answers)]
    finally:
        conn.close()


def req(method: str, target: str | bytes, body: bytes = b"", headers: dict[str, Any] | None = None,
        version: str = "HTTP/1.1", host: bool = True, length: bool = True) -> bytes:
    t = target if isinstance(target, bytes) else target.encode()
    head = [method.encode() + b" " + t + b" " + version.encode()]
    if host:
        head.append(b"Host: crossbar")
    if length and (body or method in ("POST", "PUT")):
        head.append(b"Content-Length: %d" % len(body))
    if method == "POST":
        head.append(b"Content-Type: application/json")
    for k, v in (headers or {}).items():
        head.append(k.encode() + b": " + (v if isinstance(v, bytes) else str(v).encode()))
    head.append(b"Connection: close")
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def nested(depth: int) -> bytes:
    return b'{"messages":' + b"[" * depth + b"]" * depth + b"}"


# ---------------------------------------------------------------- the table


@dataclass
class Case:
    name: str
    data: bytes | Callable[[Rig], bytes]
    statuses: tuple[int, ...]  # accepted statuses (CLOSED: no answer, connection closed)
    json: bool = False  # the answer must be crossbar's own JSON error
    reach: bool = False  # the sim may see a completion request
    answers: int = 1
    half_close: bool = False
    check: Callable[[list[Reply]], None] | None = None


def is_chat_answer(replies: list[Reply]) -> None:
    assert replies[-1].json()["choices"][0]["message"]["content"], replies[-1].body


def not_admin(replies: list[Reply]) -> None:
    for r in replies:
        assert b'"base_url"' not in r.body and b'"healthy"' not in r.body, r.body


MITM_400 = (400, CLOSED)  # mitmproxy's own answer to protocol garbage, or a closed connection

CASES: list[Case] = [
    # -- bodies
    Case("bad JSON", req("POST", CHAT, b'{"messages": ['), (400,), json=True),
    Case("body is a JSON array", req("POST", CHAT, b"[1,2]"), (400,), json=True),
    Case("messages is a string", req("POST", CHAT, b'{"messages":"hi"}'), (400,), json=True),
    Case("model is a number", req("POST", CHAT, b'{"model":7,"messages":[]}'), (400,), json=True),
    Case("stream is a string", req("POST", CHAT, b'{"stream":"yes","messages":[]}'), (400,), json=True),
    Case("message role is missing", req("POST", CHAT, b'{"messages":[{"content":"x"}]}'), (400,), json=True),
    Case("content part text is a number",
         req("POST", CHAT, b'{"messages":[{"role":"user","content":[{"type":"text","text":1}]}]}'),
         (400,), json=True),
    Case("empty body", req("POST", CHAT, b"", headers={"Content-Length": 0}, length=False), (400,),
         json=True),
    Case("NaN is not JSON", req("POST", CHAT, b'{"messages":[],"temperature":NaN}'), (400,), json=True),
    Case("non-UTF-8 body", req("POST", CHAT, b'{"messages":[{"role":"user","content":"\xff\xfe"}]}'),
         (400,), json=True),
    Case("10k nested arrays", req("POST", CHAT, nested(10_000)), (400,), json=True),
    Case("100k nested arrays", req("POST", CHAT, nested(100_000)), (400, 413), json=True),
    Case("a 20k-digit number", req("POST", CHAT, b'{"messages":[],"n":' + b"9" * 20_000 + b"}"),
         (400,), json=True),
    Case("body over max_body", req("POST", CHAT, b'{"messages":[],"pad":"' + b"x" * (2 * MAX_BODY) + b'"}'),
         (413,), json=True),
    Case("body over mitmproxy's hard limit",
         req("POST", CHAT, b'{"pad":"' + b"x" * (4 << 20) + b'"}'), (413, 400, CLOSED)),
    Case("gzip-compressed body", req("POST", CHAT, gzip.compress(GOOD), headers={"Content-Encoding": "gzip"}),
         (400, 415), json=True),
    # -- paths
    Case("%2e%2e path", req("GET", "/%2e%2e/_crossbar/hosts"), (404,), json=True, check=not_admin),
    Case("dot-dot out of a route", req("GET", "/r/../_crossbar/hosts"), (404,), json=True, check=not_admin),
    Case("empty route segment", req("GET", "//_crossbar/hosts"), (404,), json=True, check=not_admin),
    Case("encoded slash in the route", req("POST", "/r%2Fv1/chat/completions", GOOD), (404,), json=True),
    Case("NUL in the path", req("POST", "/r/v1/chat/completions%00", GOOD), (404,), json=True),
    Case("raw non-UTF-8 path", req("POST", b"/r\xff/v1/chat/completions", GOOD), (400, 404, CLOSED)),
    Case("UTF-8 route name", req("POST", "/ü/v1/chat/completions".encode(), GOOD), (404,), json=True),
    Case("route name of 300 characters", req("POST", "/" + "r" * 300 + "/v1/chat/completions", GOOD),
         (404,), json=True),
    Case("100 KB path", req("GET", "/r/" + "a" * 100_000), (404, 414, 400, 431, CLOSED)),
    Case("admin path climbing into a route", req("POST", "/_crossbar/../r/v1/chat/completions", GOOD),
         (404,), json=True),
    Case("query tricks pass as a query", req("GET", "/r/health?x=/../_crossbar/hosts"), (200,),
         check=not_admin),
    # -- methods
    Case("TRACE", req("TRACE", CHAT), (404, 405), json=True),
    Case("PUT", req("PUT", CHAT, GOOD), (404,), json=True),
    Case("DELETE on admin", req("DELETE", "/_crossbar/hosts"), (405,), json=True),
    Case("GET on a POST path", req("GET", CHAT), (404,), json=True),
    Case("OPTIONS *", req("OPTIONS", "*"), (400, 404, CLOSED)),
    Case("CONNECT to the canary", lambda rig: req("CONNECT", f"127.0.0.1:{rig.canary.port}"),
         (400, 403, 404, 405, 502, CLOSED)),
    Case("absolute-form target at the canary",
         lambda rig: req("POST", f"http://127.0.0.1:{rig.canary.port}{CHAT}", GOOD),
         (200, 400, 404, CLOSED), reach=True),
    # -- headers
    Case("100 KB header", req("GET", "/r/health", headers={"X-Big": "a" * 100_000}), (400, 431, CLOSED)),
    Case("2000 headers", req("GET", "/r/health", headers={f"X-H{i}": "v" for i in range(2000)}),
         (200, 400, 431, CLOSED)),
    Case("CRLF in X-Crossbar-Route is just another header",
         req("POST", "/v1/chat/completions", GOOD, headers={"X-Crossbar-Route": b"r\r\nX-Evil: 1"}),
         (200,), reach=True, check=is_chat_answer),
    # mitmproxy keeps a bare CR inside the value: an unknown route, quoted with the CR escaped
    Case("bare CR in X-Crossbar-Route", req("POST", "/v1/chat/completions", GOOD,
                                            headers={"X-Crossbar-Route": b"r\rX-Evil: 1"}), (404,),
         json=True),
    # mitmproxy ends a header line at a bare LF (RFC 9112 permits it): route "r" plus a harmless header
    Case("bare LF in X-Crossbar-Route", req("POST", "/v1/chat/completions", GOOD,
                                            headers={"X-Crossbar-Route": b"r\nX-Evil: 1"}), (200,),
         reach=True, check=is_chat_answer),
    Case("non-UTF-8 X-Crossbar-Route", req("POST", "/v1/chat/completions", GOOD,
                                           headers={"X-Crossbar-Route": b"r\xff"}), (404,), json=True),
    Case("X-Crossbar-Route pointing at admin", req("GET", "/health",
                                                   headers={"X-Crossbar-Route": "_crossbar"}),
         (404,), json=True, check=not_admin),
    Case("NUL in a header name", req("GET", "/r/health", headers={"X-A\0b": "1"}), MITM_400),
    Case("missing Host", req("POST", CHAT, GOOD, host=False), (200, 400), reach=True),
    Case("two different Content-Lengths", req("POST", CHAT, GOOD, headers={"Content-Length": 3}), (400,),
         json=True),
    Case("Content-Length and chunked together",
         req("POST", CHAT, b"5\r\nhello\r\n0\r\n\r\n", headers={"Transfer-Encoding": "chunked"}),
         (400,), json=True),
    Case("chunk size is not hex",
         req("POST", CHAT, b"zz\r\n" + GOOD + b"\r\n0\r\n\r\n", headers={"Transfer-Encoding": "chunked"},
             length=False), (400,), json=True),
    Case("chunk size larger than the data, then EOF",
         req("POST", CHAT, b"ffff\r\n" + GOOD, headers={"Transfer-Encoding": "chunked"}, length=False),
         MITM_400, half_close=True),
    Case("valid chunked body", req("POST", CHAT, b"%x\r\n" % len(GOOD) + GOOD + b"\r\n0\r\n\r\n",
                                   headers={"Transfer-Encoding": "chunked"}, length=False),
         (200,), reach=True, check=is_chat_answer),
    Case("Content-Length beyond the body, then EOF",
         req("POST", CHAT, GOOD, headers={"Content-Length": len(GOOD) + 100}, length=False),
         MITM_400, half_close=True),
    Case("Content-Length short of the body (the rest is garbage)",
         req("POST", CHAT, GOOD + b"GARBAGE", headers={"Content-Length": len(GOOD)}, length=False),
         (200,), reach=True, check=is_chat_answer),
    Case("garbage request line", b"GARBAGE\r\n\r\n", MITM_400),
    Case("binary noise", bytes(range(256)) * 4 + b"\r\n\r\n", MITM_400),
    Case("binary noise, then EOF", bytes(range(256)) * 4, MITM_400, half_close=True),
    # -- protocol versions and connection reuse
    Case("HTTP/1.0 GET without Host", req("GET", "/r/health", version="HTTP/1.0", host=False), (200,)),
    Case("HTTP/1.0 POST", req("POST", CHAT, GOOD, version="HTTP/1.0"), (200,), reach=True,
         check=is_chat_answer),
    Case("pipelined health + chat",
         req("GET", "/r/health").replace(b"Connection: close\r\n", b"") + req("POST", CHAT, GOOD),
         (200,), reach=True, answers=2, check=is_chat_answer),
    Case("pipelined bad JSON then good",
         req("POST", CHAT, b"{").replace(b"Connection: close\r\n", b"") + req("POST", CHAT, GOOD),
         (400, 200), reach=True, answers=2, check=is_chat_answer),
    Case("HTTP/2 preface on a plain socket", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", (400,), json=True),
    Case("Expect: 100-continue", req("POST", CHAT, GOOD, headers={"Expect": "100-continue"}), (200,),
         reach=True, check=is_chat_answer),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_request(rig: Rig, case: Case) -> None:
    data = case.data(rig) if callable(case.data) else case.data
    hits, canary = rig.upstream_hits(), rig.canary.connections
    replies = exchange(rig.proxy.port, data, case.answers, case.half_close)
    for reply in replies:
        assert reply.status in case.statuses, (reply.status, reply.body[:300])
        assert reply.status == CLOSED or reply.status < 500, reply.body[:300]
    if case.json:
        (reply,) = replies
        assert reply.headers.get("content-type", "").startswith("application/json"), reply.headers
        err = reply.json()["error"]
        assert err["code"] == reply.status and err["message"], err
        assert reply.headers.get("server") != "llama.cpp"
    if case.check:
        case.check(replies)
    if not case.reach:
        assert rig.upstream_hits() == hits, "a rejected request reached the upstream"
    assert rig.canary.connections == canary, "a request reached a host crossbar does not know"
    assert rig.proxy.proc.poll() is None, "crossbar died"
    log = rig.log()
    assert "Traceback" not in log and "Addon error" not in log, log[-3000:]


def test_the_proxy_still_answers_after_the_table(rig: Rig) -> None:
    (reply,) = exchange(rig.proxy.port, req("POST", CHAT, GOOD))
    assert reply.status == 200
    is_chat_answer([reply])


# ---------------------------------------------------------------- property-based, through the proxy


ROUTE_ALPHABET = string.ascii_letters + string.digits + "._-*/%?#:@!$&'()+,;= ~\\\"<>[]{}|^`\t"
KEYS = ["model", "messages", "stream", "stream_options", "include_usage", "role", "content", "type",
        "text", "prompt", "input", "max_tokens"]
json_leaf = (st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=False)
             | st.text(max_size=20))
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=5),
                                                               inner, max_size=5),
    max_leaves=25,
)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "x"])},
                                optional={"content": json_value})
chat_body = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["m", "", 3, None]) | st.text(max_size=8),
    "messages": st.lists(message | json_value, max_size=4) | json_value,
    "stream": st.booleans() | json_value,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_value}) | json_value,
    "max_tokens": st.integers(1, 3),
})


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(route=st.text(ROUTE_ALPHABET, min_size=0, max_size=12), in_header=st.booleans(),
       body=chat_body | json_value, raw_tail=st.binary(max_size=8))
def test_fuzzed_route_and_body_through_the_proxy(rig: Rig, route: str, in_header: bool, body: Any,
                                                 raw_tail: bytes) -> None:
    payload = json.dumps(body).encode() + (raw_tail if raw_tail[:1] == b"\xff" else b"")
    if in_header:
        target, headers = "/v1/chat/completions", {"X-Crossbar-Route": route.replace("\t", " ").strip()}
    else:
        target, headers = "/" + route.replace(" ", "%20").replace("\t", "%09").replace("#", "%23") \
            + "/v1/chat/completions", {}
    hits = rig.upstream_hits()
    (reply,) = exchange(rig.proxy.port, req("POST", target, payload, headers=headers))
    assert reply.status != CLOSED and reply.status < 500, (reply.status, reply.body[:300])
    from_upstream = reply.headers.get("server") == "llama.cpp"
    if not from_upstream:
        assert reply.status in (200, 400, 404, 413), reply.body[:300]
        if reply.status >= 400:
            assert reply.headers["content-type"].startswith("application/json")
            assert reply.json()["error"], reply.body[:300]
            assert rig.upstream_hits() == hits, "a request crossbar rejected reached the upstream"
    log = rig.log()
    assert "Traceback" not in log and "Addon error" not in log, log[-3000:]
