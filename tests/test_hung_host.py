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


def silent_upstream() -> AbstractAsyncContextManager[str]:
    """Answers the poller like llama-server; takes a completion and never answers it."""
    async def complete(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(3600)

    return raw_upstream(complete)


async def test_a_silent_host_gives_a_json_502_that_its_row_records(tmp_path: Path) -> None:
    async with silent_upstream() as url, rig(tmp_path, base_url=url, first_byte_timeout="1s") as r:
        reader, writer = await connect(r.port)
        writer.write(head(Content_Length=str(len(CHAT)), Connection="close") + CHAT)
        status, headers, body = split_response(await asyncio.wait_for(reader.read(), 15))
        writer.close()
        await asyncio.sleep(1)
    rows = sqlite3.connect(tmp_path / "c.db").execute("SELECT status, err FROM requests").fetchall()
    assert status == 502
    assert len(rows) == 1
    assert rows[0][0] == 502, rows  # the client was answered 502
    assert headers.get("content-type") == "application/json", body[:200]
    assert json.loads(body)["error"]["code"] == 502


def cut_upstream(status: bytes, then: str) -> AbstractAsyncContextManager[str]:
    """Takes a completion and answers a head and part of a buffered body, then hangs ("hang") or
    drops the connection ("cut")."""
    async def complete(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
                     b"\r\n{\"choices\":[")
        await writer.drain()
        if then == "cut":
            await asyncio.sleep(0.2)
            writer.transport.abort()
        else:
            await asyncio.sleep(3600)

    return raw_upstream(complete)


@pytest.mark.parametrize("status", [b"200 OK", b"503 Service Unavailable"])
@pytest.mark.parametrize("then", ["cut", "hang"])
async def test_an_answer_that_never_becomes_whole_gives_a_json_502(tmp_path: Path, status: bytes,
                                                                   then: str) -> None:
    """Nothing of a buffered answer reaches the client before it is whole: one cut short is
    crossbar's JSON 502, as is one whose host stalls past first_byte_timeout (marked down)."""
    async with cut_upstream(status, then) as url, rig(tmp_path, base_url=url, first_byte_timeout="1s") as r:
        reader, writer = await connect(r.port)
        writer.write(head(Content_Length=str(len(CHAT)), Connection="close") + CHAT)
        got, headers, body = split_response(await asyncio.wait_for(reader.read(), 15))
        writer.close()
        await asyncio.sleep(1)
    rows = sqlite3.connect(tmp_path / "c.db").execute("SELECT status, ttfb_ms, err FROM requests").fetchall()
    assert (got, headers.get("content-type")) == (502, "application/json"), body[:300]
    assert json.loads(body)["error"]["code"] == 502
    assert len(rows) == 1 and rows[0][:2] == (502, None), rows  # the client got no byte of the host's
    if then == "hang":
        assert "no complete answer from a within 1s" in rows[0][2]
