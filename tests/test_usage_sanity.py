"""A generation time too short for its tokens (`predicted_ms: 5e-324`) is not believed: it would
make tokens/s infinite and turn `crossbar_generation_tokens_per_second_sum{host}` into +Inf for
good. It is dropped and counted in `crossbar_usage_figures_dropped_total`."""

from __future__ import annotations

import asyncio
import math
import urllib.request
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from test_hostile_limits import CHAT, connect, head, raw_upstream, rig

from crossbar.tap import usage_from_body

ABSURD = (b'{"choices":[{"message":{"content":"x"}}],"usage":{"prompt_tokens":5,"completion_tokens":5},'
          b'"timings":{"predicted_n":5,"predicted_ms":5e-324}}')


def test_tokens_per_second_is_a_finite_figure_or_none() -> None:
    usage = usage_from_body(ABSURD)
    assert usage is not None
    tps = usage.tokens_per_second
    assert tps is None or (math.isfinite(tps) and tps < 1e7), tps


def absurd_upstream() -> AbstractAsyncContextManager[str]:
    async def complete(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(ABSURD), ABSURD))
        await writer.drain()

    return raw_upstream(complete)


async def test_one_absurd_reply_does_not_make_the_tps_histogram_infinite(tmp_path: Path) -> None:
    async with absurd_upstream() as url, rig(tmp_path, base_url=url) as r:
        reader, writer = await connect(r.port)
        writer.write(head(Content_Length=str(len(CHAT)), Connection="close") + CHAT)
        assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.1 200")
        writer.close()
        text = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{r.port}/_crossbar/metrics", timeout=5).read())
    lines = text.decode().splitlines()
    sums = [line for line in lines if line.startswith("crossbar_generation_tokens_per_second_sum")]
    assert all(math.isfinite(float(line.rsplit(" ", 1)[1])) for line in sums), sums
    dropped = [line for line in lines if line.startswith("crossbar_usage_figures_dropped_total{")]
    assert dropped and float(dropped[0].rsplit(" ", 1)[1]) >= 1, dropped
