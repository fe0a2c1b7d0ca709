"""The TCP pre-flight that checks a host accepts a connection before a request is sent to it."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from crossbar.upstream import preflight


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
