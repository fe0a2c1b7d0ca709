"""A host that accepts a completion and never answers (first_byte_timeout 1s): the client gets
crossbar's JSON 502, not mitmproxy's HTML page, and the request's row says 502."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
from harness import split_response
from test_hostile_limits import CHAT, connect, head, raw_upstream, rig


async def one_completion(port: int, timeout: float) -> bytes:
    """One completion on a connection of its own, answered and closed; its row a second to land."""
    reader, writer = await connect(port)
    writer.write(head(Content_Length=str(len(CHAT)), Connection="close") + CHAT)
    raw = await asyncio.wait_for(reader.read(), timeout)
    writer.close()
    await asyncio.sleep(1)
    return raw


def silent_upstream() -> AbstractAsyncContextManager[str]:
    """Answers the poller like llama-server; takes a completion and never answers it."""
    async def complete(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3600)

    return raw_upstream(complete)


async def test_a_silent_host_gives_a_json_502_that_its_row_records(tmp_path: Path) -> None:
    async with silent_upstream() as url, rig(tmp_path, base_url=url, first_byte_timeout="1s") as r:
        status, headers, body = split_response(await one_completion(r.port, 15))
    rows = sqlite3.connect(tmp_path / "c.db").execute("SELECT status, err FROM requests").fetchall()
    assert status == 502
    assert len(rows) == 1
    assert rows[0][0] == 502, rows  # the client was answered 502
    assert headers.get("content-type") == "application/json", body[:200]
    assert json.loads(body)["error"]["code"] == 502


def cut_upstream(status: bytes, then: str, content_type: bytes = b"application/json",
                 ) -> AbstractAsyncContextManager[str]:
    """Takes a completion and answers a head and part of a buffered body, then hangs ("hang") or
    drops the connection ("cut")."""
    async def complete(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: 1000\r\n\r\n{\"choices\":["
                     % (status, content_type))
        await writer.drain()
        if then == "cut":
            await asyncio.sleep(0.2)
            writer.transport.abort()
        else:
            await asyncio.sleep(3600)

    return raw_upstream(complete)


@pytest.mark.parametrize(("status", "content_type"), [
    (b"200 OK", b"application/json"), (b"503 Service Unavailable", b"application/json"),
    (b"503 Service Unavailable", b"text/event-stream"),  # an error held back for a retry: buffered too
])
@pytest.mark.parametrize("then", ["cut", "hang"])
async def test_an_answer_that_never_becomes_whole_gives_a_json_502(tmp_path: Path, status: bytes,
                                                                   content_type: bytes, then: str) -> None:
    """Nothing of a buffered answer reaches the client before it is whole: one cut short is
    crossbar's JSON 502, as is one whose host stalls past first_byte_timeout (marked down)."""
    async with cut_upstream(status, then, content_type) as url, \
            rig(tmp_path, base_url=url, first_byte_timeout="1s") as r:
        got, headers, body = split_response(await one_completion(r.port, 15))
    rows = sqlite3.connect(tmp_path / "c.db").execute("SELECT status, ttfb_ms, err FROM requests").fetchall()
    assert (got, headers.get("content-type")) == (502, "application/json"), body[:300]
    assert json.loads(body)["error"]["code"] == 502
    assert len(rows) == 1 and rows[0][:2] == (502, None), rows  # the client got no byte of the host's
    if then == "hang":
        assert "no complete answer from a within 1s" in rows[0][2]


async def test_an_answer_streamed_once_it_outgrew_the_buffer_is_not_cut_by_the_deadline(
        tmp_path: Path) -> None:
    """Without a Content-Length, mitmproxy starts streaming an answer to the client once it passes
    the buffering bound (twice max_body + 1 MiB), calling no hook: its bytes are flowing, and the
    first-byte deadline must not cut it however long the rest takes."""
    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def complete(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        writer.write(chunk(b'{"pad":"' + b"x" * (4 << 20)))  # past the bound of the rig's 1 MiB max_body
        await writer.drain()
        for _ in range(12):  # the rest keeps coming, past first_byte_timeout
            await asyncio.sleep(0.3)
            writer.write(chunk(b"y" * 1000))
            await writer.drain()
        writer.write(chunk(b'"}') + b"0\r\n\r\n")
        await writer.drain()

    async with raw_upstream(complete) as url, rig(tmp_path, base_url=url, first_byte_timeout="2s") as r:
        raw = await one_completion(r.port, 20)
    rows = sqlite3.connect(tmp_path / "c.db").execute("SELECT status, err FROM requests").fetchall()
    health = sqlite3.connect(tmp_path / "c.db").execute("SELECT healthy FROM host_health").fetchall()
    assert raw.endswith(b'"}\r\n0\r\n\r\n'), raw[-100:]  # the whole answer
    assert rows == [(200, None)]
    assert (0,) not in health  # the host was never marked down
