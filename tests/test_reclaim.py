from __future__ import annotations

import asyncio
import gc
import json
import threading
from pathlib import Path

from harness import crossbar_proxy, recording_upstream, single_host_config, wait_until

from crossbar.reclaim import Reclaimer, collector_paused


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_abandoned_bodies_fold_into_one_collection() -> None:
    clock = FakeClock()
    runs: list[float] = []
    reclaimer = Reclaimer(delay=0.01, min_interval=5.0, collect=lambda: runs.append(clock.now),
                          clock=clock)
    for _ in range(8):
        reclaimer.soon()
    await asyncio.sleep(0.05)
    assert runs == [100.0]
    clock.now = 101.0  # within min_interval of the last collection: wait for the rest of it
    reclaimer.soon()
    pending = reclaimer._pending
    assert pending is not None and pending.when() - asyncio.get_running_loop().time() > 3
    reclaimer.cancel()
    assert runs == [100.0]


async def test_an_upload_cut_short_schedules_a_collection(tmp_path: Path) -> None:
    async with (recording_upstream(b"{}", [b""]) as up,
                crossbar_proxy(single_host_config(tmp_path / "c.toml", up.url)) as proxy):
        proxy.addon.reclaimer.delay = 0.01
        body = json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]}).encode()
        _, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"POST /r/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body[:-1])
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.transport.abort()
        await wait_until(lambda: proxy.addon.reclaimer.collections == 1, what="a collection")
        assert up.received == []


async def test_a_large_answer_schedules_a_collection(tmp_path: Path) -> None:
    answer = json.dumps({"choices": [], "data": "x" * (3 << 20)}).encode()
    async with (recording_upstream(answer, [b""]) as up,
                crossbar_proxy(single_host_config(tmp_path / "c.toml", up.url)) as proxy):
        proxy.addon.reclaimer.delay = 0.01
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"POST /r/v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert len(await reader.read()) > len(answer)
        writer.close()
        await wait_until(lambda: proxy.addon.reclaimer.collections == 1, what="a collection")


def test_the_collector_resumes_when_the_last_of_nested_and_concurrent_pauses_ends() -> None:
    assert gc.isenabled()
    entered, release = threading.Barrier(2), threading.Event()

    def other() -> None:
        with collector_paused():
            entered.wait()
            release.wait()

    thread = threading.Thread(target=other)
    thread.start()
    try:
        with collector_paused():
            entered.wait()
            with collector_paused():
                assert not gc.isenabled()
            assert not gc.isenabled()
        assert not gc.isenabled()  # the other thread's pause goes on
    finally:
        release.set()
        thread.join()
    assert gc.isenabled()


def test_a_pause_begun_with_the_collector_off_leaves_it_off() -> None:
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
