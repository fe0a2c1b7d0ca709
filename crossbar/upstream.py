"""crossbar's own part in reaching a host: the TCP pre-flight before a new connection, pointing
the request at its host, and the one retry after a 5xx (which mitmproxy cannot re-send itself)."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
from collections.abc import Iterable
from typing import Any

import aiohttp
from mitmproxy import http
from mitmproxy.net.http import url

# hop-by-hop headers (RFC 9110 §7.6.1) plus those the client library sets itself
_DROP = frozenset({
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
    "host", "content-length",
})


async def preflight(host: str, port: int, timeout: float) -> str | None:
    """Open and close one TCP connection; None when the host accepts, else why not.

    A bare socket, not a stream: nothing is read or written, and the transport, protocol and
    close handshake of `asyncio.open_connection` cost about twice as much on the request path."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            addresses = await _addresses(loop, host, port)
            error: OSError | None = None
            for family, address in addresses:
                try:
                    await _connect(loop, family, address)
                    return None
                except OSError as exc:
                    error = exc
            raise error or OSError(f"no address for {host}")
    except TimeoutError:
        return f"connect timed out after {timeout:g}s"
    except OSError as exc:
        return str(exc) or type(exc).__name__


Address = tuple[int, tuple[Any, ...]]  # (socket family, socket address)


async def _addresses(loop: asyncio.AbstractEventLoop, host: str, port: int) -> list[Address]:
    """(family, socket address) to try in order: a literal address as it is, a name resolved."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return [(family, address) for family, _, _, _, address in infos]
    if ip.version == 6:
        return [(socket.AF_INET6, (str(ip), port, 0, 0))]
    return [(socket.AF_INET, (str(ip), port))]


async def _connect(loop: asyncio.AbstractEventLoop, family: int, address: tuple[Any, ...]) -> None:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, address)
    finally:
        sock.close()


def point_at(request: http.Request, scheme: str, host: str, port: int, path: str) -> None:
    """Send `request` to scheme://host:port in origin-form with `path`: what setting mitmproxy's
    `scheme`, `host`, `port`, `path` and `authority` in turn does (the Host header, when there is
    one, names the host, its port shown unless it is the scheme's default), set once instead of
    once per property."""
    data = request.data
    data.scheme = scheme.encode()
    data.host = host
    data.port = port
    data.path = path.encode("utf-8", "surrogateescape")
    data.authority = b""
    fields = data.headers.fields
    hosts = [at for at, (name, _) in enumerate(fields) if name.lower() == b"host"]
    if hosts:  # `headers["Host"] = ...` in one pass, without mitmproxy's per-field Python calls
        data.headers.fields = _host_set(fields, hosts, _host_value(scheme, host, port))


Fields = tuple[tuple[bytes, bytes], ...]


@functools.lru_cache(maxsize=256)
def _host_value(scheme: str, host: str, port: int) -> bytes:
    """The Host header's value for a host, encoded as mitmproxy's `Headers` stores it. An IPv6
    address is written in brackets (`[::1]:8080`), as a URI's authority needs it to be: mitmproxy's
    `hostport` leaves it bare, which a server cannot tell apart from a port. A zone (`%eth0`) is
    left out: it means something only on the machine that connects."""
    if ":" in host and not host.startswith("["):
        host = f"[{host.partition('%')[0]}]"
    return url.hostport(scheme, host, port).encode("utf-8", "surrogateescape")


def _host_set(fields: Fields, hosts: list[int], value: bytes) -> Fields:
    """`fields` with the first Host field's value replaced (its name as the client wrote it) and
    the other Host fields (at `hosts`) gone: what `Headers.__setitem__` does."""
    first = hosts[0]
    rest = fields[first + 1:]
    if len(hosts) > 1:
        rest = tuple(field for field in rest if field[0].lower() != b"host")
    return (*fields[:first], (fields[first][0], value), *rest)


def forward_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers if k.lower() not in _DROP]


class AnswerTooLarge(Exception):
    """The retried answer is longer than the caller allows."""


async def resend(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    headers: list[tuple[str, str]],
    body: bytes,
    connect_timeout: float,
    first_byte_timeout: float,
    max_answer: int,
) -> tuple[int, list[tuple[str, str]], bytes]:
    """Send the request again to another host and read the whole answer, at most `max_answer`
    bytes of it as received (else AnswerTooLarge), all of it within `first_byte_timeout` (the
    client gets none of it before it is whole; else TimeoutError), the connection within
    `connect_timeout`."""
    timeout = aiohttp.ClientTimeout(total=first_byte_timeout, sock_connect=connect_timeout)
    async with session.request(
        method, url, headers=headers, data=body, timeout=timeout, auto_decompress=False
    ) as resp:
        payload = bytearray()
        async for piece in resp.content.iter_any():
            payload += piece
            if len(payload) > max_answer:
                raise AnswerTooLarge(f"the retried answer is over {max_answer} bytes")
        kept = [(k, v) for k, v in resp.headers.items() if k.lower() not in _DROP]
        return resp.status, kept, bytes(payload)
