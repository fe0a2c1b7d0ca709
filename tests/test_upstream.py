"""crossbar's own upstream traffic: the TCP pre-flight that checks a host accepts a connection, and
pointing a request at its host."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from mitmproxy import http
from mitmproxy.test import tutils

from crossbar.upstream import point_at, preflight


async def _listening(host: str = "127.0.0.1") -> asyncio.Server:
    return await asyncio.start_server(lambda r, w: w.close(), host, 0)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


async def test_a_listening_host_accepts() -> None:
    server = await _listening()
    async with server:
        port = server.sockets[0].getsockname()[1]
        assert await preflight("127.0.0.1", port, 2.0) is None
        assert await preflight("localhost", port, 2.0) is None  # a name is resolved first


async def test_a_refused_connection_says_why() -> None:
    why = await preflight("127.0.0.1", _closed_port(), 2.0)
    assert why is not None and ("111" in why or "refused" in why.lower())


async def test_an_unresolvable_name_says_why() -> None:
    why = await preflight("no-such-host.invalid", 80, 2.0)
    assert why  # the resolver's own message


async def test_a_connection_not_made_in_time_is_a_timeout() -> None:
    assert await preflight("127.0.0.1", _closed_port(), 0.0) == "connect timed out after 0s"


async def test_an_ipv6_literal_is_connected_as_such() -> None:
    try:
        server = await _listening("::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    async with server:
        port = server.sockets[0].getsockname()[1]
        assert await preflight("::1", port, 2.0) is None
        assert await preflight("[::1]", port, 2.0) is None


async def test_no_socket_is_left_open() -> None:
    server = await _listening()
    async with server:
        port = server.sockets[0].getsockname()[1]
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(50):
            await preflight("127.0.0.1", port, 2.0)
            await preflight("127.0.0.1", _closed_port(), 2.0)
        assert len(os.listdir("/proc/self/fd")) <= before + 2


def _by_setters(r: http.Request, scheme: str, host: str, port: int, path: str) -> None:
    r.scheme = scheme  # mitmproxy's own way, one property at a time
    r.host, r.port = host, port
    r.path = path
    r.authority = ""


@pytest.mark.parametrize("scheme, host, port", [
    ("http", "10.0.0.5", 8080), ("http", "llama-1.lan", 80), ("https", "llama-1.lan", 443),
    ("https", "llama-1.lan", 8443), ("http", "::1", 8080), ("http", "bücher.example", 8080),
])
@pytest.mark.parametrize("host_fields", [
    [], [(b"Host", b"127.0.0.1:7777")], [(b"HOST", b"a:1")],
    [(b"accept", b"*/*"), (b"host", b"a:1"), (b"x-one", b"1"), (b"Host", b"b:2"), (b"x-two", b"2"),
     (b"hOsT", b"c")],
    [(b"x-host", b"not it"), (b"hosts", b"nor this"), (b"host", b"")],
])
@pytest.mark.parametrize("authority", [b"", b"client.example:7777"])
def test_point_at_does_what_mitmproxys_setters_do(scheme: str, host: str, port: int,
                                                 host_fields: list[tuple[bytes, bytes]],
                                                 authority: bytes) -> None:
    def request() -> http.Request:
        headers = http.Headers(host_fields)
        r = tutils.treq(host="127.0.0.1", port=7777, path=b"/r/v1/chat/completions?x=1", headers=headers)
        r.data.authority = authority
        return r

    ours, theirs = request(), request()
    point_at(ours, scheme, host, port, "/base/v1/chat/completions")
    _by_setters(theirs, scheme, host, port, "/base/v1/chat/completions")
    if ":" in host and theirs.host_header is not None:  # mitmproxy's setters leave an IPv6 Host bare
        theirs.host_header = f"[{host}]:{port}"
    assert ours.data.get_state() == theirs.data.get_state()
    assert ours.headers.fields == theirs.headers.fields  # field order and the names' case too
    assert ours.url == theirs.url


@pytest.mark.parametrize("address, port, host_value", [
    ("::1", 8080, b"[::1]:8080"), ("::1", 80, b"[::1]"), ("fe80::1", 9, b"[fe80::1]:9"),
    ("fe80::1%eth0", 8080, b"[fe80::1]:8080"),  # a zone means something only where it connects
])
def test_an_ipv6_host_is_named_in_brackets(address: str, port: int, host_value: bytes) -> None:
    # unbracketed, "::1:8080" reads as the address ::1:8080 on the default port
    r = tutils.treq(host="127.0.0.1", port=7777, headers=http.Headers([(b"Host", b"client:7777")]))
    point_at(r, "http", address, port, "/v1/models")
    assert r.headers.fields == ((b"Host", host_value),)
    assert (r.host, r.port) == (address, port)
