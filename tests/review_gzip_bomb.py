"""Review: a host's `Content-Encoding: gzip` answer is decoded whole, in memory, on the event loop.

`Account._read_answer` reads usage through `flow.response.content` (mitmproxy decodes the whole
body); `_holds_large_body` and the streaming bound look only at the encoded size. A 1.5 MB gzip
reply (1.5 GiB decoded) took crossbar from ~140 MB to ~1.7 GB resident and stalled every other
request (even `/_crossbar/hosts`) for ~8 s on the review machine."""

from __future__ import annotations

import asyncio
import time
import urllib.request
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path

from review_hung_host import POLL
from test_hostile_limits import CHAT, connect, head, rig

DECODED_MIB = 1024


def bomb() -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    mib = b"a" * (1 << 20)
    parts = [c.compress(b'{"x":"')] + [c.compress(mib) for _ in range(DECODED_MIB)]
    parts += [c.compress(b'"}'), c.flush()]
    return b"".join(parts)


@asynccontextmanager
async def gzip_upstream(payload: bytes) -> AsyncIterator[str]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with suppress(Exception):
            while True:
                request_head = await reader.readuntil(b"\r\n\r\n")
                line = request_head.split(b"\r\n", 1)[0]
                length = next((int(h.split(b":")[1]) for h in request_head.split(b"\r\n")
                               if h.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if line.startswith(b"POST"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Encoding: gzip\r\n"
                                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
                else:
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


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_a_gzip_answer_is_not_decoded_whole_on_the_event_loop(tmp_path: Path) -> None:
    payload = await asyncio.to_thread(bomb)
    async with gzip_upstream(payload) as url, rig(tmp_path, base_url=url) as r:
        before = rss_mib(r.proxy.proc.pid)
        reader, writer = await connect(r.port)
        writer.write(head(Content_Length=str(len(CHAT)), Connection="close") + CHAT)
        answer = asyncio.ensure_future(asyncio.wait_for(reader.read(), 60))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{r.port}/_crossbar/hosts", timeout=30).read())
        stalled = time.monotonic() - started
        await answer
        writer.close()
        grown = rss_mib(r.proxy.proc.pid) - before
    assert grown < 256, f"crossbar grew by {grown:.0f} MiB for a {len(payload) >> 10} KiB answer"
    assert stalled < 2, f"an admin call waited {stalled:.1f}s behind the decoding"
