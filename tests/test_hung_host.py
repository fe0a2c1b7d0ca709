"""A host that accepts a completion and never answers (first_byte_timeout 1s): the client gets
crossbar's JSON 502, not mitmproxy's HTML page, and the request's row says 502."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from contextlib import AbstractAsyncContextManager
from pathlib import Path

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
