"""Review: a host that accepts a completion and never answers (first_byte_timeout 1s).

Observed: the client gets mitmproxy's HTML page `502 Bad Gateway / server closed connection`
(not crossbar's JSON error), and the request's row and `crossbar_requests_total` say status
NULL / `0` ("no answer") although the client was answered 502."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path

from harness import split_response
from test_hostile_limits import CHAT, connect, head, rig

POLL = {b"/health": b'{"status":"ok"}', b"/v1/models": b'{"data":[{"id":"m"}]}',
        b"/props": b'{"total_slots":1,"default_generation_settings":{"n_ctx":4096}}', b"/slots": b"[]"}


@asynccontextmanager
async def silent_upstream() -> AsyncIterator[str]:
    """Answers the poller like llama-server; takes a completion and never answers it."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with suppress(Exception):
            while True:
                request_head = await reader.readuntil(b"\r\n\r\n")
                line = request_head.split(b"\r\n", 1)[0]
                length = next((int(h.split(b":")[1]) for h in request_head.split(b"\r\n")
                               if h.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if line.startswith(b"POST"):
                    await asyncio.sleep(3600)
                body = POLL.get(line.split(b" ")[1].split(b"?")[0], b"{}")
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


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
