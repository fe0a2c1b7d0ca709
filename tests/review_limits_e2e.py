"""Review: hostile clients that the connection limits do not bound (real mitmdump, llamasim)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from test_hostile_limits import connect, head, rig


async def test_a_stalled_request_body_is_not_held_forever(tmp_path: Path) -> None:
    """head_timeout 1s, idle_timeout 2s: a client that sends a complete head and one byte of a
    declared 1000-byte body, then nothing, still holds its connection (and its share of
    max_connections_per_peer) 10 s later; nothing bounds the time a body may take."""
    async with rig(tmp_path) as r:
        reader, writer = await connect(r.port)
        writer.write(head(Content_Length="1000") + b"{")
        started = time.monotonic()
        try:
            data = await asyncio.wait_for(reader.read(), 10)
        except TimeoutError:
            data = None
        writer.close()
        assert data is not None, f"connection still open after {time.monotonic() - started:.0f}s"


async def test_a_folded_header_does_not_lift_max_head(tmp_path: Path) -> None:
    """A folded `Transfer-Encoding: chunked` (mitmproxy joins it into the previous header and
    reads no body) puts the framer in PASS: the next head of 3 MiB is served, not refused 431."""
    async with rig(tmp_path) as r:
        reader, writer = await connect(r.port)
        writer.write(b"GET /_crossbar/hosts HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: b\r\n"
                     b" Transfer-Encoding: chunked\r\n\r\n")
        first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert first.startswith(b"HTTP/1.1 200")
        writer.write(b"GET /_crossbar/hosts HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nX-Big: "
                     + b"a" * (3 << 20) + b"\r\n\r\n")
        rest = await asyncio.wait_for(reader.read(), 15)
        writer.close()
        assert b"HTTP/1.1 431" in rest, rest[:200]
