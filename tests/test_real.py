"""The real llama-server tier: crossbar in front of real llama.cpp b11312 processes.

Needs the lab built by `../shared/llama-lab/setup.sh` (`CROSSBAR_LLAMA_LAB`, default
`~/.cache/crossbar-llama-lab`; `./run.sh test` builds it when it is missing); every test is
skipped with the reason when it is missing, or fails with CROSSBAR_REAL_TESTS=1 (as `.ci/run`
sets). The
servers run tiny random-weight models on loopback (one token per byte, never an EOS), so the whole
tier takes well under two minutes. Every server started here is killed at teardown.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import psycopg
import pytest
from harness import (
    HostSpec,
    Proxy,
    conversation,
    crossbar_proxy,
    request_rows,
    sse_data,
    wait_until,
    write_config,
)
from test_multi_pg import instances

pytestmark = pytest.mark.real

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")  # where ./run.sh test builds it
LAB = Path(os.environ.get("CROSSBAR_LLAMA_LAB") or CACHE / "crossbar-llama-lab")
SERVER = LAB / "build" / "bin" / "llama-server"
MODEL_FILE = LAB / "models" / "tiny-a.gguf"
ROUTER_MODELS = LAB / "router-models"
MODEL = "tiny"  # the --alias of the single servers
CHAT = "/v1/chat/completions"
CTX_EXCEEDED = "Context size has been exceeded."


# ---------------------------------------------------------------- real servers


@dataclass
class LlamaServer:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _health(port: int) -> int:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.settimeout(2)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            head = s.recv(64)
        return int(head.split()[1]) if head.startswith(b"HTTP/") else 0
    except (OSError, ValueError, IndexError):
        return 0


@contextmanager
def llama_servers(log_dir: Path, arg_sets: Sequence[Sequence[str]], wait_s: float = 60) -> Iterator[
        list[LlamaServer]]:
    """Start one llama-server per argument set on free loopback ports, wait for /health 200, and
    stop every one of them when the block ends (also on failure)."""
    servers: list[LlamaServer] = []
    try:
        for args in arg_sets:
            port = free_port()
            log = log_dir / f"llama-server-{port}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    [str(SERVER), *args, "--host", "127.0.0.1", "--port", str(port), "-t", "1",
                     "--metrics", "--no-ui"],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                )
            servers.append(LlamaServer(proc, port, log))
        deadline = time.monotonic() + wait_s
        for srv in servers:
            while _health(srv.port) != 200:
                if srv.proc.poll() is not None:
                    raise AssertionError(f"llama-server exited ({srv.proc.returncode}):\n{srv.tail()}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"llama-server on {srv.port}: no /health 200 after {wait_s}s")
                time.sleep(0.05)
        yield servers
    finally:
        for srv in servers:
            srv.stop()


def single_args(*extra: str) -> list[str]:
    return ["-m", str(MODEL_FILE), "-c", "4096", "-np", "2", "--slots", "--alias", MODEL, *extra]


def router_args() -> list[str]:
    return ["--models-dir", str(ROUTER_MODELS), "--models-max", "1", "-c", "4096", "-np", "2"]


def _no_lab(reason: str) -> None:
    if os.environ.get("CROSSBAR_REAL_TESTS") == "1":
        pytest.fail(f"the real llama-server tier is required (CROSSBAR_REAL_TESTS=1): {reason}")
    pytest.skip(f"{reason}: `./run.sh test` builds the lab (or run `bash ../shared/llama-lab/setup.sh`, "
                "or set CROSSBAR_LLAMA_LAB)")


@pytest.fixture(scope="session")
def lab() -> Path:
    if not SERVER.is_file() or not os.access(SERVER, os.X_OK):
        _no_lab(f"no real llama-server at {SERVER}")
    if not MODEL_FILE.is_file() or not (ROUTER_MODELS / "tiny-a.gguf").exists():
        _no_lab(f"no tiny models under {LAB}")
    return LAB


@pytest.fixture(scope="session")
def real_pair(lab: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LlamaServer]]:
    """Two real single-model servers (alias "tiny", -c 4096 -np 2) shared by the tier."""
    with llama_servers(tmp_path_factory.mktemp("real-pair"), [single_args(), single_args()]) as servers:
        yield servers


def pair_config(path: Path, servers: Sequence[LlamaServer], **top: Any) -> Path:
    names = ["alpha", "beta", "gamma"][: len(servers)]
    hosts = {n: (s.url, HostSpec({MODEL: {}})) for n, s in zip(names, servers, strict=True)}
    routes = {"r": {"hosts": names, "default_model": MODEL},
              "opencode-*": {"hosts": names, "default_model": MODEL}}
    return write_config(path, hosts, routes, **top)


@asynccontextmanager
async def real_proxy(path: Path, servers: Sequence[LlamaServer], **top: Any) -> AsyncIterator[Proxy]:
    async with crossbar_proxy(pair_config(path, servers, **top)) as proxy:
        yield proxy


async def post(url: str, body: Any, timeout: float = 60) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s, \
            s.post(url, json=body) as resp:
        raw = await resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw


async def get(url: str) -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s, s.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json(content_type=None)


def session_id() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------- affinity and the real cache


async def test_ten_turns_stay_on_one_host_and_hit_the_servers_cache(
        real_pair: list[LlamaServer], tmp_path: Path) -> None:
    async with real_proxy(tmp_path / "c.toml", real_pair) as proxy:
        turns = conversation(session_id(), 10)
        timings: list[dict[str, Any]] = []
        for msgs in turns:
            status, body = await post(f"{proxy.url}/r{CHAT}", {"messages": msgs, "max_tokens": 8})
            assert status == 200, body
            timings.append(body["timings"])
        rows = await request_rows(proxy)
    assert len(rows) == 10
    assert len({r.host for r in rows}) == 1, [r.host for r in rows]
    assert [r.decision for r in rows] == ["new"] + ["reused"] * 9
    # the random session id in the system prompt: the first turn shares only the template's head
    assert timings[0]["cache_n"] < 20, timings[0]
    for prev, cur in itertools.pairwise(timings):
        whole_previous_prompt = prev["prompt_n"] + prev["cache_n"]
        assert cur["cache_n"] >= whole_previous_prompt, (prev, cur)  # the whole previous prompt hit
        assert cur["prompt_n"] < cur["cache_n"], cur
    # crossbar's accounting reports the server's own figures
    assert [r.cached_tokens for r in rows] == [t["cache_n"] for t in timings]
    assert [r.prompt_tokens for r in rows] == [t["prompt_n"] + t["cache_n"] for t in timings]


# ---------------------------------------------------------------- router mode


def model_states(models_body: Any) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in models_body["data"]}


async def test_router_is_never_made_to_load_and_per_model_ctx_is_learned(
        lab: Path, tmp_path: Path) -> None:
    with llama_servers(tmp_path, [router_args()]) as (router,):
        hosts = {"rt": (router.url, HostSpec({"tiny-a": {}, "tiny-b": {}}))}
        routes = {"r": {"hosts": ["rt"], "default_model": "tiny-a"}}
        cfg = write_config(tmp_path / "router.toml", hosts, routes, poll_interval="0.1s")
        async with crossbar_proxy(cfg) as proxy:
            start = proxy.router.poller.rounds
            await wait_until(lambda: proxy.router.poller.rounds >= start + 6, timeout=30, what="6 polls")
            assert model_states(await get(f"{router.url}/v1/models")) == {
                "tiny-a": "unloaded", "tiny-b": "unloaded"}
            view = (await get(f"{proxy.url}/_crossbar/hosts"))["rt"]
            assert view["router"] is True and view["loaded"] == [] and view["models"] == {}

            status, body = await post(f"{proxy.url}/r{CHAT}", {
                "model": "tiny-a", "max_tokens": 4,
                "messages": [{"role": "user", "content": "load me " + session_id()}]}, timeout=120)
            assert status == 200, body

            async def learned() -> bool:
                models = (await get(f"{proxy.url}/_crossbar/hosts"))["rt"]["models"]
                return models.get("tiny-a", {}).get("n_ctx") == 2048

            await wait_until(learned, timeout=30, interval=0.1, what="per-model n_ctx of tiny-a")
            view = (await get(f"{proxy.url}/_crossbar/hosts"))["rt"]
            assert view["loaded"] == ["tiny-a"]
            assert view["models"] == {"tiny-a": {"n_ctx": 2048, "slots": 2}}
            # more poll rounds: still nothing else loaded on the router's own account
            start = proxy.router.poller.rounds
            await wait_until(lambda: proxy.router.poller.rounds >= start + 4, timeout=30, what="4 polls")
            assert model_states(await get(f"{router.url}/v1/models")) == {
                "tiny-a": "loaded", "tiny-b": "unloaded"}


# ---------------------------------------------------------------- unified KV overflow


def overflow_turn(i: int) -> dict[str, Any]:
    """~2.5k prompt tokens (one per byte) with 1.5k tokens of generation: one fits a 4096 unified
    KV, two at once do not."""
    return {"model": MODEL, "max_tokens": 1500,
            "messages": [{"role": "user", "content": f"{i} {session_id()} " + "z" * 2450}]}


async def assert_two_at_once_overflow(srv: LlamaServer) -> None:
    direct = await asyncio.gather(*(post(f"{srv.url}{CHAT}", overflow_turn(i), 120) for i in (1, 2)))
    # measured on b11312: both concurrent turns fail, neither gets its answer
    assert [s for s, _ in direct] == [500, 500], direct
    assert all(b["error"]["message"] == CTX_EXCEEDED for _, b in direct), direct


def parallel_1_config(path: Path, srv: LlamaServer, **top: Any) -> Path:
    hosts = {"k": (srv.url, HostSpec({MODEL: {"parallel": 1}}))}
    return write_config(path, hosts, {"r": {"hosts": ["k"], "default_model": MODEL}}, **top)


async def test_unified_kv_overflow_direct_vs_through_crossbar_with_parallel_1(
        lab: Path, tmp_path: Path) -> None:
    with llama_servers(tmp_path, [single_args("-kvu")]) as (srv,):
        await assert_two_at_once_overflow(srv)
        async with crossbar_proxy(parallel_1_config(tmp_path / "kvu.toml", srv)) as proxy:
            through = await asyncio.gather(*(post(f"{proxy.url}/r{CHAT}", overflow_turn(i), 120)
                                             for i in (3, 4)))
            assert [s for s, _ in through] == [200, 200], through
            assert all(b["usage"]["completion_tokens"] == 1500 for _, b in through)
            rows = await request_rows(proxy)
        assert sorted(r.status for r in rows) == [200, 200]
        assert max(r.queued_ms for r in rows) > 0  # the second waited for the first, in crossbar


PRE_WAIT_SLACK = 1.0  # seconds from arrival to the slot wait a slow machine may take (a run takes ~5)


def served_spans(db: str) -> list[tuple[float, float, float]]:
    """(arrived, waited its slot until, ended), wall clock, of every answered `requests` row, every
    instance's rows together, in the order they got their slot. The middle figure is early by the
    time between arrival and the slot wait (reading, placement, the shared lease table's round
    trips): `queued_ms` counts the wait alone."""
    with psycopg.connect(db) as conn:
        rows = conn.execute("SELECT started, queued_ms, total_ms FROM requests WHERE status = 200"
                            ).fetchall()
    spans = [(t, t + queued / 1000, t + total / 1000) for t, queued, total in rows]
    return sorted(spans, key=lambda span: span[1])


async def test_parallel_1_through_two_instances_sharing_postgresql_keeps_the_unified_kv_from_overflowing(
        lab: Path, tmp_path: Path, pg_url: str) -> None:
    with llama_servers(tmp_path, [single_args("-kvu")]) as (srv,):
        await assert_two_at_once_overflow(srv)
        cfgs = [parallel_1_config(tmp_path / f"kvu{n}.toml", srv, db=pg_url) for n in (0, 1)]
        async with instances(cfgs) as procs:
            through = await asyncio.gather(*(post(f"http://127.0.0.1:{p.port}/r{CHAT}", overflow_turn(i), 120)
                                             for i, p in enumerate(procs, start=3)))
            assert [s for s, _ in through] == [200, 200], through
            assert all(b["usage"]["completion_tokens"] == 1500 for _, b in through)
            await wait_until(lambda: len(served_spans(pg_url)) == 2, timeout=10, interval=0.1,
                             what="both instances' rows")
        spans = served_spans(pg_url)
        (_, first_runs, first_ends), (second_arrived, second_runs, second_ends) = spans
        assert second_arrived < first_ends, spans  # they were sent together …
        # … and ran one after the other: the second waited out most of the first's run, and its own
        # run came after it (run side by side, the two would have ended together)
        assert second_runs >= first_ends - PRE_WAIT_SLACK, spans
        assert second_ends - first_ends >= 0.5 * (first_ends - first_runs), spans


# ---------------------------------------------------------------- a host dies mid-stream


@dataclass
class StreamRead:
    chunks: list[bytes]
    cut: bool
    first: asyncio.Event


async def read_stream(session: aiohttp.ClientSession, url: str, body: Any, into: StreamRead) -> None:
    try:
        async with session.post(url, json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for chunk in resp.content.iter_any():
                into.chunks.append(chunk)
                into.first.set()
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
        into.cut = True
    finally:
        into.first.set()


async def test_killing_a_host_mid_stream_cuts_only_its_stream_and_the_next_turn_fails_over(
        lab: Path, tmp_path: Path) -> None:
    with llama_servers(tmp_path, [single_args(), single_args()]) as servers:
        by_name = dict(zip(["alpha", "beta"], servers, strict=True))
        async with real_proxy(tmp_path / "kill.toml", servers) as proxy:
            conv_a, conv_b = conversation(session_id(), 2), conversation(session_id(), 1)
            body = {"stream": True, "max_tokens": 1800}
            a, b = StreamRead([], False, asyncio.Event()), StreamRead([], False, asyncio.Event())
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                task_a = asyncio.create_task(read_stream(s, f"{proxy.url}/r{CHAT}",
                                                         {**body, "messages": conv_a[0]}, a))
                await asyncio.wait_for(a.first.wait(), 60)
                busy = await get(f"{proxy.url}/_crossbar/hosts")
                victim = next(n for n in by_name if busy[n]["in_flight"])  # conversation A's host
                task_b = asyncio.create_task(read_stream(s, f"{proxy.url}/r{CHAT}",
                                                         {**body, "messages": conv_b[0]}, b))
                await asyncio.wait_for(b.first.wait(), 60)
                leases = {ls["host"] for ls in (await get(f"{proxy.url}/_crossbar/routes"))["r"]["leases"]}
                assert leases == {"alpha", "beta"}, leases  # the second conversation went to the free host
                assert not a.cut and not b.cut
                by_name[victim].proc.send_signal(signal.SIGKILL)
                await asyncio.wait_for(asyncio.gather(task_a, task_b), 90)
            assert a.cut and b"[DONE]" not in b"".join(a.chunks)  # a cut, not a clean end
            assert not b.cut and sse_data(b"".join(b.chunks))[-1] == b"[DONE]"

            status, reply = await post(f"{proxy.url}/r{CHAT}", {"messages": conv_a[1], "max_tokens": 8})
            assert status == 200, reply
            rows = await request_rows(proxy)
            survivor = next(n for n in by_name if n != victim)
            assert [r.host for r in rows].count(victim) == 1  # only the cut stream ran there
            assert rows[-1].host == survivor and rows[-1].status == 200
            assert (await get(f"{proxy.url}/_crossbar/hosts"))[victim]["healthy"] is False


# ---------------------------------------------------------------- the OpenAI SDK against the real thing


async def test_openai_sdk_streaming_and_not_through_crossbar(
        real_pair: list[LlamaServer], tmp_path: Path) -> None:
    async with real_proxy(tmp_path / "sdk.toml", real_pair) as proxy:
        client = openai.AsyncOpenAI(base_url=f"{proxy.url}/r/v1", api_key="x", max_retries=0)
        try:
            msgs: Any = [{"role": "system", "content": session_id()}, {"role": "user", "content": "hi"}]
            done = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6)
            assert done.choices[0].finish_reason == "length"
            assert done.usage is not None and done.usage.completion_tokens == 6
            stream = await client.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=6, stream=True,
                stream_options={"include_usage": True})
            text, usage, finish = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    usage = chunk.usage
            assert finish == "length" and usage is not None and usage.completion_tokens == 6
            assert text
        finally:
            await client.close()
        rows = await request_rows(proxy)
    assert [(r.status, r.streamed, r.completion_tokens) for r in rows] == [(200, False, 6), (200, True, 6)]
    assert rows[1].prompt_tokens == usage.prompt_tokens and rows[1].cached_tokens is not None


# ---------------------------------------------------------------- the context guard against the real limit


def sized_turn(content_bytes: int) -> dict[str, Any]:
    """A chat turn whose prompt is `content_bytes` + 32 tokens on the lab's tiny model."""
    text = session_id() + " " + "q" * (content_bytes - 33)
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": text}]}


async def test_a_prompt_the_server_accepts_is_not_refused_by_the_guard(
        real_pair: list[LlamaServer], tmp_path: Path) -> None:
    direct = await post(f"{real_pair[0].url}{CHAT}", sized_turn(1800))
    assert direct[0] == 200, direct  # ~1832 prompt tokens fit the 2048-token slot
    assert direct[1]["usage"]["prompt_tokens"] < 2048
    async with real_proxy(tmp_path / "guard.toml", real_pair) as proxy:
        for _ in range(3):  # teach the guard this model's tokens per byte
            status, body = await post(f"{proxy.url}/r{CHAT}", sized_turn(600))
            assert status == 200, body
        status, body = await post(f"{proxy.url}/r{CHAT}", sized_turn(1800))
    assert status == 200, body
