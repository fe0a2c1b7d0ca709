"""crossbar benchmark: overhead, decision cost and cache affinity, side by side in one run.

    .venv/bin/python bench/bench.py [--quick] [--real] [--only overhead|decision|affinity|pressure]
                                    [--out FILE.json]

1. overhead  - TTFB and per-SSE-event delay: direct to a simulated llama-server, through a bare
               `mitmdump` reverse proxy, and through crossbar (all three are subprocesses), at
               4 KiB, 256 KiB and 1 MiB chat bodies, requests interleaved round-robin. Bare
               mitmdump streams responses and gets the mitmproxy options crossbar sets for itself.
2. decision  - crossbar's request-path work (route, body peek, lease, slot, upstream rewrite)
               in-process at 1,000 live leases and 3 hosts, beside bare mitmdump's own cost; the
               lease views of the admin API at 20,000 leases.
3. affinity  - 12 conversations x 20 growing turns on 3 simulated hosts: share of prompt tokens
               served from cache through crossbar, round-robin, and ideal.
4. pressure  - requests per second (16 keep-alive clients), a neighbour stream's largest gap while
               one client sends a max_body chat of small messages and another receives a 20 MiB
               answer, and RSS after eight aborted max_body uploads; crossbar beside bare mitmdump.

`--real` runs overhead and affinity against real llama.cpp `llama-server` processes (the tiny
random-weight models of ../shared/llama-lab, found in $CROSSBAR_LLAMA_LAB, default
~/.cache/crossbar-llama-lab) instead of the simulator: overhead at 4 KiB and 16 KiB bodies with
TTFB and stream span (first event -> `[DONE]`; the real server stamps no events), affinity with
the default host prompt cache and with `--cache-ram 0`. The decision section is in-process and
engine-independent, so `--real` skips it unless `--only decision` asks for it.

Targets are reported as PASS/MISS, never asserted: the exit code is 0 unless something crashed.
Loopback only; every process this script starts is stopped by it (also on Ctrl-C and SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import datetime as dt
import hashlib
import inspect
import itertools
import json
import math
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiohttp
from mitmproxy import http
from mitmproxy import version as mitmproxy_version
from mitmproxy.test import tflow, tutils

from crossbar import request as req
from crossbar.addons import Runtime, make_addons
from crossbar.addons.listeners import mitmproxy_options
from crossbar.addons.runtime import META
from crossbar.admin import Admin
from crossbar.app import Router
from crossbar.config import Config, load_config, parse_config
from crossbar.exchange import Exchange
from crossbar.lease import Key
from llamasim import SimConfig, SimServer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PYTHON = sys.executable
MITMDUMP = str(Path(sys.executable).with_name("mitmdump"))
LOOPBACK = "127.0.0.1"
MODEL = "bench-model"
CHAT = "/v1/chat/completions"
KIB = 1024
SIZES = {"4 KiB": 4 * KIB, "256 KiB": 256 * KIB, "1 MiB": 1024 * KIB}
FILLER = ("The quick brown fox jumps over the lazy dog while the agent reads the repository, "
          "plans a change, runs the tests and explains what it found. ")

TTFB_TARGET = 1.10  # crossbar's TTFB (p50 and p99) <= 1.10 x bare mitmdump's
EVENT_ADDED_TARGET_MS = 0.05  # crossbar's per-event delay p50 - bare mitmdump's
DECISION_TARGET = 0.15  # crossbar's decision cost <= 15 % of bare mitmdump's own per-request cost
AFFINITY_TARGET = 0.98  # crossbar's cached share >= 0.98 x ideal
THINK_MAX_S = 0.03  # affinity: pause before each turn, uniform in [0, THINK_MAX_S]
AFFINITY_MAX_TOKENS = 8  # affinity: tokens generated per turn (the tiny real model never stops early)
REAL_SIZES = {"4 KiB": 4 * KIB, "16 KiB": 16 * KIB}  # the tiny model reads one token per byte
REAL_OVERHEAD_CTX = 65536  # -c of the overhead server: 2 slots x 32k tokens, room for 16 KiB bodies
# flash attention (auto = on for CPU) makes each token ~5x slower at 16k tokens of context on this
# model (16 KiB body: 290 ms vs 60 ms per reply); a shorter server time keeps its jitter from burying
# the proxies' added milliseconds. Affinity keeps the server default.
REAL_OVERHEAD_ARGS = ("-fa", "off")


@dataclass(frozen=True)
class Plan:
    """How much work each section does (`--quick` shrinks it to a smoke run)."""

    # measured requests per target and body size: of 100, p99 is the second worst and one stray
    # request moved a ratio by 0.1 (4 KiB: 1.12 in one run, 1.02 over 300 rounds the same hour)
    overhead_n: int = 300
    overhead_warmup: int = 3
    token_ms: float = 10.0
    max_tokens: int = 10
    decision_n: dict[str, int] = field(default_factory=lambda: {"4 KiB": 3000, "1 MiB": 200})
    leases: int = 1000
    conversations: int = 12
    turns: int = 20
    in_flight: int = 5
    rps_windows: int = 60  # rounds; each a window of every process of each kind (12 were too few
    # here: one run's pair ratios spanned 0.60 to 1.55)
    rps_window_s: float = 0.5
    rps_processes: int = 2  # of each proxy: one process's rate depends on its luck (hash seed, layout)
    stall_rounds: int = 5  # per proxy, interleaved; each a quiet and a loaded neighbour stream


QUICK = Plan(overhead_n=15, overhead_warmup=2, decision_n={"4 KiB": 300, "1 MiB": 30},
             conversations=6, turns=8, in_flight=3, rps_windows=2, rps_window_s=1.0, rps_processes=1,
             stall_rounds=2)
# token_ms: the real server's own pace, not set; 100 requests per cell keep the run near 3 minutes
REAL = Plan(overhead_n=100, max_tokens=16, token_ms=math.nan)
REAL_QUICK = Plan(overhead_n=15, overhead_warmup=2, max_tokens=16, token_ms=math.nan,
                  decision_n={"4 KiB": 300, "1 MiB": 30}, conversations=6, turns=8, in_flight=3)


@dataclass
class Lab:
    """A real llama.cpp `llama-server` build and the tiny model it serves (`--real`)."""

    server: Path
    model: Path
    build: str = ""  # "b11312", from the first server's /props

    @classmethod
    def find(cls) -> Lab:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        root = Path(os.environ.get("CROSSBAR_LLAMA_LAB") or cache / "crossbar-llama-lab")
        lab = cls(root / "build" / "bin" / "llama-server", root / "models" / "tiny-a.gguf")
        for path in (lab.server, lab.model):
            if not path.is_file():
                raise SystemExit(f"--real: no {path} (build it with ../shared/llama-lab/setup.sh "
                                 "or point CROSSBAR_LLAMA_LAB at its directory)")
        return lab

    @property
    def heading(self) -> str:
        return f"real llama-server {self.build or '(unknown build)'}"


# ---------------------------------------------------------------------------- small helpers


def now_ns() -> int:
    return time.monotonic_ns()


def pct(values: Sequence[float], q: float) -> float:
    """Percentile with linear interpolation between closest ranks; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def fmt(value: float | int | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def markdown(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def filler(n: int) -> str:
    return (FILLER * (n // len(FILLER) + 1))[:n]


def section(title: str, table: str, notes: Sequence[str] = ()) -> None:
    print(f"\n### {title}\n\n{table}\n", flush=True)
    for note in notes:
        print(note, flush=True)


# ---------------------------------------------------------------------------- processes

LIVE: list[subprocess.Popen[bytes]] = []


@atexit.register
def _reap() -> None:
    """Last resort (a crash between start and stop): kill what is still running."""
    for proc in LIVE:
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


def _sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds like Ctrl-C, so every `finally` stops its process


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


def spawn(name: str, cmd: Sequence[str], logdir: Path) -> Proc:
    log = logdir / f"{name}.log"
    # no PYTHONPATH: with the project root on it, addons/crossbar.py imports itself as `crossbar`
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 cwd=ROOT, env=env, start_new_session=True)
    LIVE.append(popen)
    return Proc(name, popen, log)


async def stop(proc: Proc, timeout: float = 10.0) -> None:
    """SIGTERM (mitmdump runs its `done` hooks), then SIGKILL after `timeout`."""
    popen = proc.popen
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while popen.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if popen.poll() is None:
            popen.kill()
            popen.wait(5)
    with contextlib.suppress(ValueError):
        LIVE.remove(popen)


async def wait_ready(proc: Proc, port: int, path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        if await get_status(port, path) == 200:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{proc.name} not ready on :{port}{path} after {timeout:g}s:\n{proc.tail()}")


@contextlib.asynccontextmanager
async def running(name: str, cmd: Sequence[str], logdir: Path, port: int, ready_path: str,
                  ready_timeout: float = 30.0) -> AsyncIterator[Proc]:
    proc = spawn(name, cmd, logdir)
    try:
        await wait_ready(proc, port, ready_path, ready_timeout)
        yield proc
    finally:
        await stop(proc)


def sim_cmd(port: int, token_ms: float, max_tokens: int, slots: int = 2) -> list[str]:
    """The stamped simulated llama-server (slot cache only: no host-RAM cache work per request)."""
    return [PYTHON, str(ROOT / "bench" / "stamped_sim.py"), "--host", LOOPBACK, "--port", str(port),
            "--model", MODEL, "--slots", str(slots), "--ctx", str(8 * 1024 * 1024),
            "--token-ms", str(token_ms),
            "--prompt-ms", "0", "--cache-ram-tokens", "0", "--max-tokens", str(max_tokens)]


def llama_cmd(lab: Lab, port: int, ctx: int, extra: Sequence[str] = ()) -> list[str]:
    """A real llama-server: 2 slots, one thread (the other core is left to the proxies)."""
    return [str(lab.server), "-m", str(lab.model), "--host", LOOPBACK, "--port", str(port),
            "-c", str(ctx), "-np", "2", "-t", "1", "--metrics", "--slots", "--no-ui", "--alias", MODEL,
            *extra]


async def llama_props(lab: Lab, port: int) -> dict[str, Any]:
    """The server's /props; notes its build (b11312-0c1e570 -> b11312) in `lab`."""
    async with aiohttp.ClientSession() as session, session.get(f"http://{LOOPBACK}:{port}/props") as resp:
        props: dict[str, Any] = await resp.json(content_type=None)
    lab.build = lab.build or str(props.get("build_info", "")).split("-")[0]
    return props


LOG_OPTIONS = ("--set", "flow_detail=0", "--set", "termlog_verbosity=warn")  # both proxies log alike


def bare_mitmdump_cmd(listeners: dict[int, int], crossbar_config: Path) -> list[str]:
    """Bare mitmdump, one reverse listener per {port: upstream port}, with an addon that only
    streams responses (it reads each request body whole before forwarding, as crossbar must)
    and the mitmproxy options crossbar sets for itself under `crossbar_config`."""
    modes = [arg for port, upstream in listeners.items()
             for arg in ("--mode", f"reverse:http://{LOOPBACK}:{upstream}@{LOOPBACK}:{port}")]
    options = mitmproxy_options(load_config(crossbar_config))
    return [MITMDUMP, *modes, "-s", str(ROOT / "bench" / "stream_responses.py"), *LOG_OPTIONS,
            *(arg for name, value in options.items() for arg in ("--set", option_arg(name, value)))]


def option_arg(name: str, value: object) -> str:
    """`name=value` as mitmproxy's `--set` parses it (booleans are `true`/`false`)."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"{name}={text}"


def crossbar_cmd(config: Path, tree: Path = ROOT) -> list[str]:
    """crossbar from `tree` (this checkout, or another one run from this virtualenv)."""
    return [MITMDUMP, "-s", str(tree / "addons" / "crossbar.py"), "--set", f"crossbar_config={config}",
            "--set", "server=false", *LOG_OPTIONS]


def toml_str(value: str) -> str:
    return json.dumps(value)


def write_crossbar_toml(path: Path, port: int, db: Path, hosts: dict[str, int], route: str,
                        poll_interval: str, parallel: int,
                        own_routes: dict[str, tuple[str, int]] | None = None) -> Path:
    """Route `route` over `hosts`; `own_routes` adds {route: (host, parallel)} routes of one host
    each (that host is left out of `route`)."""
    own_routes = own_routes or {}
    own_hosts = {host for host, _ in own_routes.values()}
    host_parallel = {host: n for host, n in own_routes.values()}
    lines = [f"listen = {toml_str(f'{LOOPBACK}:{port}')}", f"db = {toml_str(str(db))}",
             f"poll_interval = {toml_str(poll_interval)}", 'poll_timeout = "2s"', ""]
    for name, host_port in hosts.items():
        lines += [f"[hosts.{name}]", f"base_url = {toml_str(f'http://{LOOPBACK}:{host_port}')}",
                  f"models = {{ {toml_str(MODEL)} = {{ parallel = {host_parallel.get(name, parallel)} }} }}",
                  ""]
    shared = [name for name in hosts if name not in own_hosts]
    lines += [f"[routes.{route}]", f"default_model = {toml_str(MODEL)}", f"hosts = {json.dumps(shared)}", ""]
    for name, (host, _) in own_routes.items():
        lines += [f"[routes.{name}]", f"default_model = {toml_str(MODEL)}", f"hosts = {json.dumps([host])}",
                  ""]
    path.write_text("\n".join(lines))
    return path


# ---------------------------------------------------------------------------- raw HTTP/1.1 client


async def get_status(port: int, path: str) -> int:
    """Status of one GET on a fresh connection; 0 when it fails."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(LOOPBACK, port), 2)
    except (OSError, TimeoutError):
        return 0
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {LOOPBACK}\r\nConnection: close\r\n\r\n".encode())
        line = await asyncio.wait_for(reader.readline(), 5)
        return int(line.split()[1]) if line.startswith(b"HTTP/") else 0
    except (OSError, TimeoutError, ValueError, IndexError):
        return 0
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@dataclass
class Streamed:
    status: int
    ttfb_ns: int  # request start -> first response body byte
    events: list[tuple[int, int | None]]  # (arrival ns, the sim's write stamp ns or None)


def stamp_of(event: bytes) -> int | None:
    at = event.rfind(b'"bench_ns":')
    if at < 0:
        return None
    digits = bytearray()
    for byte in event[at + 11:]:
        if not 48 <= byte <= 57:
            break
        digits.append(byte)
    return int(digits) if digits else None


class SSEClock:
    """Splits a body into SSE events and notes when each one was complete."""

    def __init__(self) -> None:
        self.buf = b""
        self.events: list[tuple[int, int | None]] = []

    def feed(self, data: bytes, at: int) -> None:
        *complete, self.buf = (self.buf + data).split(b"\n\n")
        for event in complete:
            if event.startswith(b"data:"):
                self.events.append((at, stamp_of(event)))


class Conn:
    """One keep-alive HTTP/1.1 client connection (reopened if the server closes it)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        # llama-server closes the connection after every streamed reply (though it says keep-alive):
        # once seen, each request opens a new connection, inside its TTFB, as a direct client must
        self.closes_after_reply = False
        self.opened = 0  # connections opened so far

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
        self.reader = self.writer = None

    async def post_stream(self, path: str, body: bytes, timeout: float = 60.0) -> Streamed:
        return await asyncio.wait_for(self._post(path, body), timeout)

    async def _post(self, path: str, body: bytes) -> Streamed:
        if self.closes_after_reply:
            await self.close()
        head = (f"POST {path} HTTP/1.1\r\nHost: {LOOPBACK}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Accept: */*\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        t0 = now_ns()
        reused = self.writer is not None
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(LOOPBACK, self.port)
            self.opened += 1
        assert self.reader is not None and self.writer is not None
        try:
            self.writer.write(head + body)
            await self.writer.drain()
            status, headers = await read_head(self.reader)
        except (asyncio.IncompleteReadError, ConnectionError):
            if not reused:
                raise
            await self.close()  # the server closed it after the last reply: again, on a new one
            self.closes_after_reply = True
            return await self._post(path, body)
        clock = SSEClock()
        first = 0
        async for chunk in body_chunks(self.reader, headers):
            at = now_ns()
            first = first or at
            clock.feed(chunk, at)
        if "close" in headers.get("connection", "").lower() or not is_framed(headers):
            await self.close()
        return Streamed(status, (first or now_ns()) - t0, clock.events)


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers


def is_framed(headers: dict[str, str]) -> bool:
    return "chunked" in headers.get("transfer-encoding", "").lower() or "content-length" in headers


async def body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailers
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif "content-length" in headers:
        length = int(headers["content-length"])
        if length:
            yield await reader.readexactly(length)
    else:
        while data := await reader.read(65536):
            yield data


# ---------------------------------------------------------------------------- 1. overhead


@dataclass
class Target:
    name: str
    port: int
    path: str
    conn: Conn


@dataclass
class Cell:
    """Samples of one target at one body size."""

    ttfb_ms: list[float] = field(default_factory=list)
    delay_ms: list[float] = field(default_factory=list)  # arrival - the sim's stamp, every event
    gap_dev_ms: list[float] = field(default_factory=list)  # |inter-event gap - token_ms|
    span_ms: list[float] = field(default_factory=list)  # first event -> last event (`[DONE]`)
    batched: int = 0  # token events read together with the one before (token_ms apart at the source)
    tokens: int = 0
    errors: int = 0

    def add(self, got: Streamed, token_ms: float) -> None:
        if got.status != 200 or not got.events:
            self.errors += 1
            return
        self.ttfb_ms.append(got.ttfb_ns / 1e6)
        self.span_ms.append((got.events[-1][0] - got.events[0][0]) / 1e6)
        self.delay_ms += [(at - stamp) / 1e6 for at, stamp in got.events if stamp is not None]
        arrivals = [at for at, stamp in got.events if stamp is not None]
        # the first token renders two events back to back; gaps between tokens start after it
        tokens = arrivals[1:-1]
        self.gap_dev_ms += [abs((b - a) / 1e6 - token_ms) for a, b in itertools.pairwise(tokens)]
        self.tokens += len(tokens)
        self.batched += sum(1 for a, b in itertools.pairwise(tokens) if a == b)

    def summary(self) -> dict[str, Any]:
        return {"n": len(self.ttfb_ms), "errors": self.errors,
                "ttfb_p50_ms": pct(self.ttfb_ms, 50), "ttfb_p99_ms": pct(self.ttfb_ms, 99),
                "event_delay_p50_ms": pct(self.delay_ms, 50), "event_delay_p99_ms": pct(self.delay_ms, 99),
                "events": len(self.delay_ms),
                "gap_dev_p50_ms": pct(self.gap_dev_ms, 50), "gap_dev_p99_ms": pct(self.gap_dev_ms, 99),
                "span_p50_ms": pct(self.span_ms, 50), "span_p99_ms": pct(self.span_ms, 99),
                "token_events": self.tokens, "batched_events": self.batched}


def chat_body_template(size: int, max_tokens: int, stream: bool = True) -> Callable[[int], bytes]:
    """Bodies of exactly `size` bytes: one conversation (the same padded system and first user
    message, so one fingerprint and a warm slot cache) whose last user message counts up."""
    messages = [{"role": "system", "content": "@PAD@"},
                {"role": "user", "content": "Read the document above and wait for questions."},
                {"role": "assistant", "content": "Done. Ask away."},
                {"role": "user", "content": "Question @NUM@: what does section 2 say?"}]
    text = json.dumps({"model": MODEL, "messages": messages, "stream": stream, "max_tokens": max_tokens})
    pad = size - (len(text) - len("@PAD@")) - (8 - len("@NUM@"))
    if pad < 0:
        raise ValueError(f"body size {size} is too small")
    head, tail = text.replace("@PAD@", filler(pad)).encode().split(b"@NUM@")
    return lambda i: head + b"%08d" % i + tail


async def overhead_size(targets: Sequence[Target], size: int, plan: Plan) -> dict[str, Cell]:
    template = chat_body_template(size, plan.max_tokens)
    number = itertools.count()

    def body() -> bytes:
        # every request's own number, so each finds the same cached prefix: a real server would
        # skip all prompt work for a target that repeats the previous target's body
        return template(next(number))

    cells = {t.name: Cell() for t in targets}
    for _ in range(plan.overhead_warmup):
        for t in targets:
            await t.conn.post_stream(t.path, body())
    for _ in range(plan.overhead_n):
        for t in targets:  # round-robin: drift hits every target alike
            cells[t.name].add(await t.conn.post_stream(t.path, body()), plan.token_ms)
    return cells


def overhead_rows(size_name: str, cells: dict[str, Cell], real: bool,
                  ) -> tuple[list[list[str]], dict[str, Any]]:
    """Table rows and figures of one body size. Per-event columns: the delay against the
    simulator's stamps, or (`real`: no stamps) the stream span and what each target added to it."""
    s = {name: cell.summary() for name, cell in cells.items()}
    d = s["direct"]
    rows, out = [], {"targets": s}
    for name, v in s.items():
        for what in ("ttfb", "span"):
            for q in ("p50", "p99"):
                v[f"added_{what}_{q}_ms"] = v[f"{what}_{q}_ms"] - d[f"{what}_{q}_ms"]

        def added(key: str, v: dict[str, Any] = v, name: str = name) -> str:
            return "-" if name == "direct" else fmt(v[key])

        per_event = ([fmt(v["span_p50_ms"]), fmt(v["span_p99_ms"]), added("added_span_p50_ms"),
                      added("added_span_p99_ms")] if real
                     else [fmt(v["event_delay_p50_ms"], 3), fmt(v["event_delay_p99_ms"], 3)])
        rows.append([size_name, name, fmt(v["ttfb_p50_ms"]), fmt(v["ttfb_p99_ms"]),
                     added("added_ttfb_p50_ms"), added("added_ttfb_p99_ms"), *per_event,
                     str(v["n"]) + (f" ({v['errors']} err)" if v["errors"] else "")])
    x, base = s["crossbar"], s["mitmdump"]
    out["ratios"] = {
        "ttfb_p50": ratio(x["ttfb_p50_ms"], base["ttfb_p50_ms"]),
        "ttfb_p99": ratio(x["ttfb_p99_ms"], base["ttfb_p99_ms"]),
        "added_ttfb_p50": ratio(x["added_ttfb_p50_ms"], base["added_ttfb_p50_ms"]),
        "added_ttfb_p99": ratio(x["added_ttfb_p99_ms"], base["added_ttfb_p99_ms"]),
        "event_added_p50_ms": x["event_delay_p50_ms"] - base["event_delay_p50_ms"],
        "event_added_p99_ms": x["event_delay_p99_ms"] - base["event_delay_p99_ms"],
        "batched_events": x["batched_events"], "batched_events_mitmdump": base["batched_events"],
    }
    return rows, out


async def run_overhead(plan: Plan, workdir: Path, lab: Lab | None = None) -> dict[str, Any]:
    """Direct vs proxies, to the stamped simulator or (`lab`) one real llama-server."""
    sim_port, mitm_port, xb_port = free_port(), free_port(), free_port()
    config = write_crossbar_toml(workdir / "overhead.toml", xb_port, workdir / "overhead.db",
                                 {"sim": sim_port}, "bench", poll_interval="30s", parallel=2)
    targets = [Target("direct", sim_port, CHAT, Conn(sim_port)),
               Target("mitmdump", mitm_port, CHAT, Conn(mitm_port)),
               Target("crossbar", xb_port, "/bench" + CHAT, Conn(xb_port))]
    result: dict[str, Any] = {"token_ms": plan.token_ms, "max_tokens": plan.max_tokens,
                              "requests_per_target": plan.overhead_n, "warmup": plan.overhead_warmup,
                              "upstream": "llama-server" if lab else "stamped simulator", "sizes": {}}
    sizes = REAL_SIZES if lab else SIZES
    rows: list[list[str]] = []
    async with contextlib.AsyncExitStack() as stack:
        if lab is None:
            upstream = ("sim", sim_cmd(sim_port, plan.token_ms, plan.max_tokens))
        else:
            upstream = ("llama-server", llama_cmd(lab, sim_port, REAL_OVERHEAD_CTX, REAL_OVERHEAD_ARGS))
            result["llama_server_ctx"] = REAL_OVERHEAD_CTX
        await stack.enter_async_context(running(*upstream, workdir, sim_port, "/health"))
        if lab is not None:
            props = await llama_props(lab, sim_port)
            result["slot_ctx"] = props.get("default_generation_settings", {}).get("n_ctx")
        await stack.enter_async_context(running("mitmdump", bare_mitmdump_cmd({mitm_port: sim_port}, config),
                                                workdir, mitm_port, "/health"))
        await stack.enter_async_context(running("crossbar", crossbar_cmd(config), workdir, xb_port,
                                                "/_crossbar/hosts"))
        for t in targets:
            stack.push_async_callback(t.conn.close)
        for size_name, size in sizes.items():
            cells = await overhead_size(targets, size, plan)
            size_rows, result["sizes"][size_name] = overhead_rows(size_name, cells, lab is not None)
            rows += size_rows
    if lab is None:
        result["table"] = overhead_table(rows, result["sizes"])
        section("Overhead (ms; added = target - direct at the same percentile)", result["table"])
    else:
        result["llama_server_build"] = lab.build
        result["table"] = real_overhead_table(rows, result["sizes"], plan, result.get("slot_ctx"))
        section(f"Overhead, {lab.heading} (ms; added = target - direct at the same percentile)",
                result["table"])
    return result


def real_overhead_table(rows: list[list[str]], sizes: dict[str, Any], plan: Plan, slot_ctx: Any) -> str:
    main = markdown(["body", "target", "TTFB p50", "TTFB p99", "added p50", "added p99",
                     "span p50", "span p99", "added span p50", "added span p99", "requests"], rows)
    ratio_rows = [[name, fmt(r["ratios"]["ttfb_p50"]), fmt(r["ratios"]["ttfb_p99"]),
                   fmt(r["ratios"]["added_ttfb_p50"]), fmt(r["ratios"]["added_ttfb_p99"])]
                  for name, r in sizes.items()]
    ratios = markdown(["body", "TTFB p50 ratio", "TTFB p99 ratio", "added TTFB p50 ratio",
                       "added TTFB p99 ratio"], ratio_rows)
    flags = " ".join(("-c", str(REAL_OVERHEAD_CTX), "-np 2 -t 1", *REAL_OVERHEAD_ARGS))
    return (f"One llama-server (`tiny-a.gguf`, `{flags}`, {fmt(slot_ctx)} tokens per slot), `max_tokens` "
            f"{plan.max_tokens}, streamed; each body is one conversation whose last message counts up "
            "(the slot cache holds the rest). llama-server closes the connection after every streamed "
            "reply, so direct requests connect anew each time (inside their TTFB), as the proxies' "
            "upstream connections do. The real server stamps no events, "
            "so per-event delay is not measured: `span` = first event -> `[DONE]` at the client, and "
            "`added span` = target - direct at the same percentile (what a path adds to the stream "
            "after its first byte).\n\n"
            + main + f"\n\ncrossbar / bare mitmdump (target: TTFB <= {TTFB_TARGET}):\n\n" + ratios)


def overhead_table(rows: list[list[str]], sizes: dict[str, Any]) -> str:
    main = markdown(["body", "target", "TTFB p50", "TTFB p99", "added p50", "added p99",
                     "event delay p50", "event delay p99", "requests"], rows)
    ratio_rows = [[name, fmt(r["ratios"]["ttfb_p50"]), fmt(r["ratios"]["ttfb_p99"]),
                   fmt(r["ratios"]["event_added_p50_ms"], 3), fmt(r["ratios"]["event_added_p99_ms"], 3),
                   f"{r['ratios']['batched_events']} / {r['ratios']['batched_events_mitmdump']}"]
                  for name, r in sizes.items()]
    ratios = markdown(["body", "TTFB p50 ratio", "TTFB p99 ratio", "event delay added p50 (ms)",
                       "added p99 (ms)", "batched token events: crossbar / mitmdump"], ratio_rows)
    return (main + "\n\ncrossbar vs bare mitmdump (targets: TTFB ratio <= "
            f"{TTFB_TARGET}, event delay added <= {EVENT_ADDED_TARGET_MS} ms at p50, no token event "
            "batched). Bare mitmdump reads each request body whole and streams responses, with the "
            "mitmproxy options crossbar sets for itself:\n\n" + ratios)


# ---------------------------------------------------------------------------- 2. decision cost


STEPS = ("resolve", "peek", "lease", "rewrite")  # lease: placement, lease change and slot


class Crossbar:
    """crossbar's addons in mitmproxy's order, driven directly (no proxy)."""

    def __init__(self, cfg: Config, router: Router) -> None:
        self.rt = Runtime()
        self.rt.cfg, self.rt.router = cfg, router
        self.addons = make_addons(self.rt)
        self.failover = next(a for a in self.addons if type(a).__name__ == "Failover")

    async def request(self, flow: http.HTTPFlow) -> None:
        for addon in self.addons:
            hook = getattr(addon, "request", None)
            if hook is not None:
                await maybe_await(hook(flow))


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def decision_config(db: Path) -> Config:
    hosts = {f"h{i}": {"base_url": f"http://{LOOPBACK}:{9 + i}", "models": {MODEL: {"parallel": 4}}}
             for i in range(3)}
    return parse_config({"listen": f"{LOOPBACK}:7777", "db": str(db), "hosts": hosts,
                         "routes": {"bench": {"default_model": MODEL}}})


async def prefill_leases(router: Router, cfg: Config, count: int, first: int = 0) -> None:
    route = cfg.routes["bench"]
    for i in range(first, first + count):
        fp = hashlib.sha256(b"conversation %d" % i).hexdigest()
        ex = Exchange(route=route, key=Key(route.name, fp, MODEL), path=CHAT, completion=True)
        await router.lease(ex, None)
        ex.end()  # the lease stays; the slot is given back
    router.store.flush(30)


def request_flow(body: bytes) -> http.HTTPFlow:
    request = tutils.treq(method=b"POST", path=b"/bench" + CHAT.encode(), host=LOOPBACK, port=7777,
                          content=body, headers=http.Headers(content_type="application/json"))
    return tflow.tflow(req=request)


def reset_request(flow: http.HTTPFlow) -> None:
    r = flow.request
    r.scheme, r.host, r.port, r.path = "http", LOOPBACK, 7777, "/bench" + CHAT
    flow.response = None
    flow.metadata.clear()


class StepClock:
    """Wraps the functions the request hook calls and adds up the time spent in each (ns)."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}

    def _add(self, name: str, started: int) -> None:
        self.ns[name] = self.ns.get(name, 0) + time.perf_counter_ns() - started

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):
            async def timed_async(*args: Any, **kw: Any) -> Any:
                started = time.perf_counter_ns()
                try:
                    return await fn(*args, **kw)
                finally:
                    self._add(name, started)
            return timed_async

        def timed(*args: Any, **kw: Any) -> Any:
            started = time.perf_counter_ns()
            try:
                return fn(*args, **kw)
            finally:
                self._add(name, started)
        return timed


@contextlib.contextmanager
def instrumented(addon: Crossbar, router: Router, clock: StepClock) -> Iterator[None]:
    """Time the real hook's parts in place: crossbar.request.resolve/peek_body (module functions
    the addon calls), the router's lease (placement, lease change, slot) and the upstream rewrite."""
    plain = {"resolve": req.resolve, "peek": req.peek_body}
    req.resolve = clock.wrap("resolve", plain["resolve"])  # type: ignore[assignment]
    req.peek_body = clock.wrap("peek", plain["peek"])  # type: ignore[assignment]
    patched: list[tuple[object, str]] = []
    for obj, attr, name in ((router, "lease", "lease"), (addon.failover, "_forward", "rewrite")):
        if hasattr(obj, attr):
            setattr(obj, attr, clock.wrap(name, getattr(obj, attr)))
            patched.append((obj, attr))
    try:
        yield
    finally:
        req.resolve, req.peek_body = plain["resolve"], plain["peek"]  # type: ignore[assignment]
        for obj, attr in patched:
            delattr(obj, attr)  # the instance attribute goes; the class's method shows again


async def hook_once(addon: Crossbar, router: Router, flow: http.HTTPFlow) -> tuple[int, int]:
    """The real `Crossbar.request` hook, timed whole, then `free_slot` (ns each); the rest of
    the request's bookkeeping (`finish`: lease touch, accounting row) runs untimed."""
    reset_request(flow)
    t0 = time.perf_counter_ns()
    await addon.request(flow)
    t1 = time.perf_counter_ns()
    ex = flow.metadata.get(META)
    if flow.response is not None or ex is None:
        answer = flow.response.get_text() if flow.response is not None else "no exchange"
        raise RuntimeError(f"crossbar did not forward the benchmark request: {answer}")
    t2 = time.perf_counter_ns()
    ex.drop_slot()
    t3 = time.perf_counter_ns()
    router.finish(ex)
    router.store.flush(10)  # every round starts with an idle store writer, as at a modest request rate
    return t1 - t0, t3 - t2


def keep_alive(addon: Crossbar, router: Router, flow: http.HTTPFlow) -> None:
    """Record that the flow's client connection holds open upstream connections to every host,
    as mitmproxy's `server_connected` hook would on a kept-alive connection: the request then
    needs no pre-flight (a new upstream connection's TCP check is not part of the decision)."""
    addresses = {(h.host, h.port) for h in router.cfg.hosts.values()}
    addon.rt.upstreams[flow.client_conn] = addresses


async def decision_size(addon: Crossbar, router: Router, size: int, n: int) -> dict[str, Any]:
    flow = request_flow(chat_body_template(size, 16)(1))
    keep_alive(addon, router, flow)
    warmup = 5  # the first round creates this conversation's lease
    hooks, frees = [], []
    for i in range(warmup + n):
        hook, free = await hook_once(addon, router, flow)
        if i >= warmup:
            hooks.append(hook / 1e3)
            frees.append(free / 1e3)
    parts: dict[str, list[float]] = {}
    for _ in range(n):
        clock = StepClock()
        with instrumented(addon, router, clock):
            hook, _ = await hook_once(addon, router, flow)
        for name, ns in clock.ns.items():
            parts.setdefault(name, []).append(ns / 1e3)
        parts.setdefault("other", []).append((hook - sum(clock.ns.values())) / 1e3)
    decision = [h + f for h, f in zip(hooks, frees, strict=True)]
    return {"n": n, "body_bytes": len(flow.request.raw_content or b""), "leases": router.leases.count(),
            "hook_p50_us": pct(hooks, 50), "hook_p99_us": pct(hooks, 99),
            "free_slot_p50_us": pct(frees, 50),
            "total_p50_us": pct(decision, 50), "total_p99_us": pct(decision, 99),
            "steps_p50_us": {k: pct(v, 50) for k, v in parts.items()},
            "steps_p99_us": {k: pct(v, 99) for k, v in parts.items()}}


@contextlib.asynccontextmanager
async def decision_router(workdir: Path, leases: int) -> AsyncIterator[tuple[Crossbar, Router]]:
    cfg = decision_config(workdir / "decision.db")
    router = Router(cfg)
    router.open()
    try:
        addon = Crossbar(cfg, router)
        await prefill_leases(router, cfg, leases - 1)  # + the measured conversation's own lease = `leases`
        yield addon, router
    finally:
        await router.close()


async def run_decision(plan: Plan, workdir: Path, overhead: dict[str, Any] | None) -> dict[str, Any]:
    result: dict[str, Any] = {"hosts": 3, "sizes": {}}
    async with decision_router(workdir, plan.leases) as (addon, router):
        for size_name, n in plan.decision_n.items():
            result["sizes"][size_name] = await decision_size(addon, router, SIZES[size_name], n)
        result["admin"] = await admin_view_cost(router, SNAPSHOT_LEASES)
    for size_name, d in result["sizes"].items():
        # (a `--real` overhead run has no 1 MiB bodies: that ratio is then n/a)
        mitm = (overhead or {}).get("sizes", {}).get(size_name, {}).get("targets", {}).get("mitmdump")
        d["mitmdump_added_ttfb_p50_ms"] = mitm["added_ttfb_p50_ms"] if mitm else math.nan
        d["mitmdump_added_ttfb_p99_ms"] = mitm["added_ttfb_p99_ms"] if mitm else math.nan
        d["mitmdump_ttfb_p50_ms"] = mitm["ttfb_p50_ms"] if mitm else math.nan
        d["ratio_p50"] = ratio(d["total_p50_us"] / 1e3, d["mitmdump_added_ttfb_p50_ms"])
        d["ratio_p99"] = ratio(d["total_p99_us"] / 1e3, d["mitmdump_added_ttfb_p99_ms"])
        d["ratio_of_full_ttfb_p50"] = ratio(d["total_p50_us"] / 1e3, d["mitmdump_ttfb_p50_ms"])
    result["table"] = decision_table(result["sizes"], plan.leases) + "\n\n" + admin_table(result["admin"])
    section("Decision cost (in-process, µs)", result["table"])
    return result


SNAPSHOT_LEASES = 20_000
ADMIN_REPEATS = 7


async def admin_view_cost(router: Router, leases: int) -> dict[str, Any]:
    """What the dashboard's lease views cost the event loop at `leases` leases (median ms)."""
    have = router.leases.count()
    await prefill_leases(router, router.cfg, leases - have, first=have)
    admin = Admin(router)
    out: dict[str, Any] = {"leases": router.leases.count()}
    for name, view in (("snapshot_ms", router.leases.snapshot), ("routes_ms", admin.routes)):
        times = []
        for _ in range(ADMIN_REPEATS):
            t0 = now_ns()
            view()
            times.append((now_ns() - t0) / 1e6)
        out[name] = pct(times, 50)
    return out


def admin_table(a: dict[str, Any]) -> str:
    return (f"Lease views at {a['leases']:,} leases (median of {ADMIN_REPEATS}, ms; the dashboard asks every "
            "2 s): `LeaseTable.snapshot()` " + fmt(a["snapshot_ms"], 1) + ", `GET /_crossbar/routes` body "
            + fmt(a["routes_ms"], 1) + ".")


def decision_table(sizes: dict[str, Any], leases: int) -> str:
    rows = [[name, fmt(d["total_p50_us"], 1), fmt(d["total_p99_us"], 1),
             fmt(d["mitmdump_added_ttfb_p50_ms"] * 1e3, 0), fmt(d["mitmdump_added_ttfb_p99_ms"] * 1e3, 0),
             fmt(d["ratio_p50"], 3), fmt(d["ratio_p99"], 3)]
            for name, d in sizes.items()]
    main = markdown(["body", "crossbar decision p50", "p99", "bare mitmdump own cost p50", "p99",
                     "ratio p50", "ratio p99"], rows)
    names = [s for s in (*STEPS, "other") if any(s in d["steps_p50_us"] for d in sizes.values())]
    steps = markdown(["body", *names, "free_slot"],
                     [[name, *[fmt(d["steps_p50_us"].get(s), 1) for s in names],
                       fmt(d["free_slot_p50_us"], 1)] for name, d in sizes.items()])
    return (f"{leases:,} live leases, 3 hosts. Decision = the real `Crossbar.request` hook on a mitmproxy "
            "flow (route, body peek, lease, slot, upstream rewrite) + `free_slot`; bare mitmdump's own "
            "per-request cost = its added TTFB from the overhead section "
            f"(target: ratio <= {DECISION_TARGET}).\n\n"
            + main + "\n\nWhere the time goes (p50, µs; `other` = the hook minus its timed parts):\n\n"
            + steps)


# ---------------------------------------------------------------------------- 3. affinity


@dataclass
class Turn:
    conv: int
    turn: int
    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0


def conversation(conv: int, turns: int) -> Iterator[list[dict[str, str]]]:
    """Growing turns: each appends an assistant answer and a new user message to the last one."""
    messages = [{"role": "system", "content": f"You are coding agent {conv}. " + filler(1000)},
                {"role": "user", "content": f"Task {conv}: make the failing test in module_{conv}.py pass."}]
    for t in range(turns):
        yield [dict(m) for m in messages]
        messages += [{"role": "assistant", "content": f"Step {t} of agent {conv}: " + filler(150)},
                     {"role": "user", "content": f"Tool output {t} for agent {conv}: " + filler(60)}]


def usage_of(reply: dict[str, Any]) -> tuple[int, int]:
    usage = reply.get("usage") or {}
    timings = reply.get("timings") or {}
    cached = timings.get("cache_n")
    if cached is None:
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return int(usage.get("prompt_tokens", 0)), int(cached)


Send = Callable[[list[dict[str, str]]], Awaitable[tuple[int, dict[str, Any]]]]


async def drive(send: Send, plan: Plan) -> list[Turn]:
    """All conversations at once, each turn after the previous one, at most `in_flight` requests."""
    gate = asyncio.Semaphore(plan.in_flight)
    turns: list[Turn] = []

    async def one(conv: int) -> None:
        think = random.Random(conv)  # the same think times for every method
        for t, messages in enumerate(conversation(conv, plan.turns)):
            # a varied pause between turns (tool runs, the user typing), as with real agents; in
            # lock-step, round-robin would send each conversation to the same host every time
            await asyncio.sleep(think.uniform(0, THINK_MAX_S))
            async with gate:
                status, reply = await send(messages)
            turns.append(Turn(conv, t, status, *(usage_of(reply) if status == 200 else (0, 0))))

    await asyncio.gather(*(one(c) for c in range(plan.conversations)))
    return turns


def poster(session: aiohttp.ClientSession, urls: Callable[[], str]) -> Send:
    async def send(messages: list[dict[str, str]]) -> tuple[int, dict[str, Any]]:
        body = {"model": MODEL, "messages": messages, "max_tokens": AFFINITY_MAX_TOKENS, "stream": False}
        async with session.post(urls(), json=body, timeout=aiohttp.ClientTimeout(total=60)) as resp:
            reply = await resp.json(content_type=None) if resp.status == 200 else {}
            return resp.status, reply

    return send


def shares(turns: list[Turn]) -> dict[str, Any]:
    ok = sorted((t for t in turns if t.status == 200), key=lambda t: (t.conv, t.turn))
    prev: dict[int, Turn] = {}
    ideal = 0
    for t in ok:
        before = prev.get(t.conv)
        ideal += before.prompt_tokens if before is not None and before.turn == t.turn - 1 else 0
        prev[t.conv] = t
    prompt = sum(t.prompt_tokens for t in ok)
    cached = sum(t.cached_tokens for t in ok)
    return {"requests": len(ok), "errors": len(turns) - len(ok), "prompt_tokens": prompt,
            "cached_tokens": cached, "ideal_cached_tokens": ideal,
            "cached_share": ratio(cached, prompt), "ideal_share": ratio(ideal, prompt)}


@dataclass
class Fleet:
    """Three upstream hosts of 2 slots each, fresh (empty caches) for one method's run."""

    ports: list[int]
    requests_per_host: Callable[[], Awaitable[list[int]]]


FleetFactory = Callable[[str], contextlib.AbstractAsyncContextManager[Fleet]]


@dataclass(frozen=True)
class Scenario:
    name: str
    targeted: bool  # crossbar / ideal is checked against AFFINITY_TARGET (else shown for context)
    sim_cache_ram_tokens: int = 0
    llama_args: tuple[str, ...] = ()


SCENARIOS = (Scenario("host RAM cache (default)", True, sim_cache_ram_tokens=1 << 30),
             Scenario("slot cache only (cache_ram_tokens=0)", False, sim_cache_ram_tokens=0))
REAL_SCENARIOS = (Scenario("host prompt cache (default --cache-ram)", True),
                  Scenario("slot cache only (--cache-ram 0)", False, llama_args=("--cache-ram", "0")))


def sim_fleet(scenario: Scenario) -> FleetFactory:
    @contextlib.asynccontextmanager
    async def fleet(tag: str) -> AsyncIterator[Fleet]:
        sims: list[SimServer] = []

        async def counts() -> list[int]:
            return [len(sim.stats.records) for sim in sims]

        try:
            for _ in range(3):
                sim = SimServer(SimConfig(models=[MODEL], n_slots=2, ctx=32768, token_ms=2.0,
                                          prompt_ms_per_token=0.01, default_max_tokens=8,
                                          cache_ram_tokens=scenario.sim_cache_ram_tokens), host=LOOPBACK)
                await sim.start()
                sims.append(sim)
            yield Fleet([sim.port for sim in sims], counts)
        finally:
            for sim in sims:
                await sim.close()

    return fleet


def chat_tokens(messages: list[dict[str, str]]) -> int:
    """Prompt tokens of a chat on the tiny lab model (one token per byte, ChatML template)."""
    return sum(len(m["role"]) + len(m["content"].encode()) + 4 for m in messages) + 11


def real_slot_ctx(plan: Plan) -> tuple[int, int]:
    """(longest prompt in tokens, per-slot context for it plus the reply, rounded up to 1024)."""
    longest = max(chat_tokens(messages) for conv in range(plan.conversations)
                  for messages in conversation(conv, plan.turns))
    return longest, -(-(longest + AFFINITY_MAX_TOKENS) // 1024) * 1024


async def predicted_requests(port: int) -> int:
    """Completions a real server answered: tokens it generated / tokens per turn (the tiny model
    never stops early, so every turn generates exactly AFFINITY_MAX_TOKENS)."""
    async with aiohttp.ClientSession() as session, session.get(f"http://{LOOPBACK}:{port}/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith("llamacpp:tokens_predicted_total "):
            return round(float(line.split()[1]) / AFFINITY_MAX_TOKENS)
    return -1


def real_fleet(lab: Lab, scenario: Scenario, workdir: Path, slot_ctx: int) -> FleetFactory:
    @contextlib.asynccontextmanager
    async def fleet(tag: str) -> AsyncIterator[Fleet]:
        ports = [free_port() for _ in range(3)]

        async def counts() -> list[int]:
            return [await predicted_requests(port) for port in ports]

        async with contextlib.AsyncExitStack() as stack:
            for i, port in enumerate(ports):
                cmd = llama_cmd(lab, port, 2 * slot_ctx, scenario.llama_args)
                await stack.enter_async_context(running(f"llama-{tag}-h{i}", cmd, workdir, port, "/health"))
                props = await llama_props(lab, port)
                got = props.get("default_generation_settings", {}).get("n_ctx")
                if got != slot_ctx:
                    raise RuntimeError(f"llama-server on :{port}: {got} tokens per slot, wanted {slot_ctx}")
            yield Fleet(ports, counts)

    return fleet


async def crossbar_usage(session: aiohttp.ClientSession, port: int, route: str,
                         expect: int) -> dict[str, Any]:
    """crossbar's own accounting for the route, once all `expect` rows are written (or 15 s)."""
    row: dict[str, Any] = {}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        url = f"http://{LOOPBACK}:{port}/_crossbar/usage?by=route&since=1h"
        async with session.get(url) as resp:
            rows = await resp.json(content_type=None)
        row = next((r for r in rows if r.get("key") == route), {})
        if row.get("requests", 0) >= expect:
            break
        await asyncio.sleep(0.2)
    return row


async def affinity_crossbar(plan: Plan, workdir: Path, fleet: FleetFactory, tag: str) -> dict[str, Any]:
    port = free_port()
    async with fleet(f"{tag}-xb") as hosts_up, aiohttp.ClientSession() as session:
        hosts = {f"h{i}": host_port for i, host_port in enumerate(hosts_up.ports)}
        config = write_crossbar_toml(workdir / f"affinity-{tag}.toml", port, workdir / f"affinity-{tag}.db",
                                     hosts, "agents", poll_interval="1s", parallel=2)
        name = f"crossbar-affinity-{tag}"
        async with running(name, crossbar_cmd(config), workdir, port, "/_crossbar/hosts"):
            url = f"http://{LOOPBACK}:{port}/agents{CHAT}"
            turns = await drive(poster(session, lambda: url), plan)
            result = shares(turns)
            result["crossbar_usage"] = await crossbar_usage(session, port, "agents", result["requests"])
        result["requests_per_host"] = await hosts_up.requests_per_host()
    return result


async def affinity_round_robin(plan: Plan, fleet: FleetFactory, tag: str) -> dict[str, Any]:
    async with fleet(f"{tag}-rr") as hosts_up, aiohttp.ClientSession() as session:
        count = iter(range(10**9))
        urls = [f"http://{LOOPBACK}:{port}{CHAT}" for port in hosts_up.ports]
        turns = await drive(poster(session, lambda: urls[next(count) % len(urls)]), plan)
        result = shares(turns)
        result["requests_per_host"] = await hosts_up.requests_per_host()
    return result


async def run_affinity(plan: Plan, workdir: Path, lab: Lab | None = None) -> dict[str, Any]:
    """crossbar vs round-robin vs ideal on 3 fresh simulated or (`lab`) real hosts per method."""
    result: dict[str, Any] = {"conversations": plan.conversations, "turns": plan.turns,
                              "in_flight": plan.in_flight, "hosts": 3, "slots_per_host": 2,
                              "upstream": "llama-server" if lab else "simulator", "scenarios": {}}
    if lab is not None:
        result["longest_prompt_tokens"], result["slot_ctx"] = real_slot_ctx(plan)
    for i, scenario in enumerate(REAL_SCENARIOS if lab else SCENARIOS):
        fleet = (sim_fleet(scenario) if lab is None
                 else real_fleet(lab, scenario, workdir, result["slot_ctx"]))
        xb = await affinity_crossbar(plan, workdir, fleet, str(i))
        rr = await affinity_round_robin(plan, fleet, str(i))
        usage = xb["crossbar_usage"]
        xb["accounting_matches"] = (usage.get("prompt_tokens") == xb["prompt_tokens"]
                                    and usage.get("cached_tokens") == xb["cached_tokens"]
                                    and usage.get("requests") == xb["requests"])
        result["scenarios"][scenario.name] = {
            "targeted": scenario.targeted, "llama_args": list(scenario.llama_args),
            "crossbar": xb, "round_robin": rr,
            "crossbar_vs_ideal": ratio(xb["cached_share"], xb["ideal_share"]),
            "round_robin_vs_ideal": ratio(rr["cached_share"], rr["ideal_share"])}
    if lab is None:
        result["table"] = affinity_table(result["scenarios"], plan)
        section("Affinity (share of prompt tokens served from cache)", result["table"])
    else:
        result["llama_server_build"] = lab.build
        result["table"] = affinity_table(result["scenarios"], plan, lab, result["slot_ctx"],
                                         result["longest_prompt_tokens"])
        section(f"Affinity, {lab.heading} (share of prompt tokens served from cache)", result["table"])
    return result


def affinity_table(scenarios: dict[str, Any], plan: Plan, lab: Lab | None = None, slot_ctx: int = 0,
                   longest: int = 0) -> str:
    rows, checks = [], []
    for name, s in scenarios.items():
        xb, rr = s["crossbar"], s["round_robin"]
        methods = (("crossbar", xb, s["crossbar_vs_ideal"]), ("round-robin", rr, s["round_robin_vs_ideal"]))
        for method, r, vs in methods:
            rows.append([name, method, fmt(r["requests"]) + (f" ({r['errors']} err)" if r["errors"] else ""),
                         fmt(r["prompt_tokens"]), fmt(r["cached_tokens"]), fmt(r["cached_share"], 3),
                         fmt(vs, 3), "/".join(str(n) for n in r["requests_per_host"])])
        rows.append([name, "ideal", fmt(xb["requests"]), fmt(xb["prompt_tokens"]),
                     fmt(xb["ideal_cached_tokens"]), fmt(xb["ideal_share"], 3), "1.000", "-"])
        u = xb["crossbar_usage"]
        checks.append(f"- {name}: crossbar's `/_crossbar/usage` says {fmt(u.get('requests'))} requests, "
                      f"{fmt(u.get('prompt_tokens'))} prompt / {fmt(u.get('cached_tokens'))} cached tokens; "
                      f"client sums {fmt(xb['prompt_tokens'])} / {fmt(xb['cached_tokens'])}: "
                      + ("match" if xb["accounting_matches"] else "MISMATCH"))
    head = markdown(["scenario", "method", "requests", "prompt tokens", "cached tokens", "cached share",
                     "/ ideal", "requests per host"], rows)
    hosts = ("3 hosts x 2 slots" if lab is None else
             f"3 llama-servers (`tiny-a.gguf`, `-c {2 * slot_ctx} -np 2 -t 1`: {slot_ctx:,} tokens per slot, "
             f"longest prompt {longest:,}), fresh for every method; cached tokens = `timings.cache_n`")
    return (f"{plan.conversations} conversations x {plan.turns} growing turns, {plan.in_flight} requests in "
            f"flight, {AFFINITY_MAX_TOKENS} tokens per reply, {hosts}. Ideal: every turn cached but its new "
            f"tokens (target: crossbar >= {AFFINITY_TARGET} x ideal with the host RAM cache).\n\n"
            + head + "\n\nAccounting cross-check:\n\n" + "\n".join(checks))


# ---------------------------------------------------------------------------- 4. pressure


RPS_CLIENTS = 16
RPS_WARMUP_S = 0.5  # per process, before the first window
RPS_TARGET = 0.95  # crossbar's requests per second >= 0.95 x bare mitmdump's
RATIO_LEVEL = 0.95  # confidence of the interval given with the requests/s ratio
RATIO_RESAMPLES = 2000  # bootstrap samples behind it
STALL_TARGET_MS = 20.0  # a neighbour stream's largest gap grows by less than this
RSS_TARGET = 1.10  # RSS after the aborted uploads <= 1.1 x warm
ABORTED_UPLOADS = 8
BIG_ANSWER_INPUTS = 15_000  # embeddings of 64 floats each: a ~20 MiB non-streamed answer
NEIGHBOUR_TOKENS = 100  # at token_ms apart: a stream of about a second
EMBEDDINGS = "/v1/embeddings"


@dataclass
class Proxy:
    """One proxy under pressure: where its neighbour streams and where its bulk work goes."""

    name: str
    proc: Proc
    stream_port: int
    stream_path: str
    bulk_port: int
    bulk_prefix: str  # prepended to the upstream path on the bulk listener


def many_messages_body(size: int) -> bytes:
    """A chat body of exactly `size` bytes made of many small messages."""
    head, tail = b'{"model":"' + MODEL.encode() + b'","messages":[', b"]}"
    one = b'{"role":"user","content":"message %07d"},'
    count = (size - len(head) - len(tail)) // len(one % 0)
    body = head + b"".join(one % i for i in range(count))[:-1] + tail
    return body[:-len(tail)] + b" " * (size - len(body)) + tail


async def rps_window(proxy: Proxy, seconds: float, conns: Sequence[Conn]) -> tuple[float, int, int]:
    """Requests per second of `conns` (keep-alive clients of `proxy`) sending small non-streamed
    chats for `seconds` (each client's last request may end after that), how many were answered
    200 and how many were not."""
    stop_at = time.monotonic() + seconds
    done = errors = 0

    async def client(conn: Conn, k: int) -> None:
        nonlocal done, errors
        for i in itertools.count():
            if time.monotonic() >= stop_at:
                return
            body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [
                {"role": "user", "content": f"client {k}"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": f"question {i}"}]}).encode()
            got = await conn.post_stream(proxy.bulk_prefix + CHAT, body)
            done, errors = done + (got.status == 200), errors + (got.status != 200)

    started = time.monotonic()
    await asyncio.gather(*(client(c, k) for k, c in enumerate(conns)))
    return done / (time.monotonic() - started), done, errors


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Windows:
    """Per proxy name: requests/s of each window, CPU µs per request of each window, failures,
    connections opened again after the first (a server closed one: later windows then pay
    connection set-up), and CPU µs per request over the whole run (the store's writer commits a
    window's rows up to a second later, often outside that window)."""

    rps: dict[str, list[float]]
    cpu_us: dict[str, list[float]]
    errors: dict[str, int]
    reopened: dict[str, int] = field(default_factory=dict)
    cpu_us_whole: dict[str, float] = field(default_factory=dict)


async def rotating_windows(proxies: Sequence[Proxy], windows: int, seconds: float) -> Windows:
    """`windows` rounds of one window per proxy, the order rotating each round. This machine's
    speed drifts (a shared host), so a round compares the proxies at nearly the same moment. Each
    proxy keeps its RPS_CLIENTS keep-alive connections from one window to the next (a window
    measures requests, not connection set-up, and can be short). CPU time per request (all the
    proxy's threads) is read around each window, and around the whole run."""
    out = Windows({p.name: [] for p in proxies}, {p.name: [] for p in proxies}, {p.name: 0 for p in proxies})
    pools = {p.name: [Conn(p.bulk_port) for _ in range(RPS_CLIENTS)] for p in proxies}
    try:
        for proxy in proxies:  # warm-up: connections open, caches and specialised code warm
            _, _, failed = await rps_window(proxy, RPS_WARMUP_S, pools[proxy.name])
            out.errors[proxy.name] += failed
        first = {p.name: cpu_seconds(p.proc.popen.pid) for p in proxies}
        answered = {p.name: 0 for p in proxies}
        for window in range(windows):
            shift = window % len(proxies)
            for proxy in [*proxies[shift:], *proxies[:shift]]:
                pid = proxy.proc.popen.pid
                before = cpu_seconds(pid)
                value, done, failed = await rps_window(proxy, seconds, pools[proxy.name])
                used = cpu_seconds(pid) - before
                out.rps[proxy.name].append(value)
                out.cpu_us[proxy.name].append(used / max(1, done) * 1e6)
                out.errors[proxy.name] += failed
                answered[proxy.name] += done
        for p in proxies:
            used = cpu_seconds(p.proc.popen.pid) - first[p.name]
            out.cpu_us_whole[p.name] = used / max(1, answered[p.name]) * 1e6
            out.reopened[p.name] = sum(conn.opened for conn in pools[p.name]) - RPS_CLIENTS
    finally:
        for conns in pools.values():
            for conn in conns:
                await conn.close()
    return out


def kind_of(name: str) -> str:
    """A proxy process's kind: its name up to "#" ("crossbar#1" is a second crossbar process)."""
    return name.partition("#")[0]


def by_kind(figures: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per kind of proxy, each round's mean over the kind's processes."""
    kinds: dict[str, list[list[float]]] = {}
    for name, values in figures.items():
        kinds.setdefault(kind_of(name), []).append(values)
    return {kind: [sum(r) / len(r) for r in zip(*replicas, strict=True)] for kind, replicas in kinds.items()}


def round_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """Each round's ratio a / b, leaving out the rounds without a finite one (b's window answered
    nothing, say): the median and its interval are both taken from these."""
    return [r for r in (ratio(x, y) for x, y in zip(a, b, strict=True)) if math.isfinite(r)]


def pair_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median of the rounds' ratios a / b."""
    return pct(round_ratios(a, b), 50)


def ratio_and_interval(a: Sequence[float], b: Sequence[float]) -> tuple[float, tuple[float, float]]:
    """The median of the rounds' ratios a / b and its bootstrap interval, from the same rounds."""
    ratios = round_ratios(a, b)
    return pct(ratios, 50), median_interval(ratios)


def median_interval(values: Sequence[float], level: float = RATIO_LEVEL, resamples: int = RATIO_RESAMPLES,
                    seed: int = 0) -> tuple[float, float]:
    """A `level` bootstrap confidence interval of the median of `values` (this run's rounds): the
    central `level` of the medians of `resamples` samples drawn from them with replacement, as many
    as there are. It reflects the spread of the rounds only, not what a run with fresh processes
    adds (their own luck of hash seed and memory layout), so another run's median may fall outside
    it. Seeded and independent of the values' order: one run's figures give one interval. NaN with
    fewer than three finite values."""
    if not 0 < level < 1 or resamples < 1:
        raise ValueError(f"level must be in (0, 1) and resamples >= 1, not {level}, {resamples}")
    finite = sorted(v for v in values if math.isfinite(v))
    if len(finite) < 3:
        return math.nan, math.nan
    draw = random.Random(seed).choices
    medians = sorted(pct(draw(finite, k=len(finite)), 50) for _ in range(resamples))
    outside = int((1 - level) / 2 * resamples + 1e-9)  # medians left out at each end
    return medians[outside], medians[resamples - 1 - outside]


async def measure_rps(proxies: Sequence[Proxy], plan: Plan) -> dict[str, Any]:
    """Crossbar beside bare mitmdump in rotating windows; the ratio reported is the median of the
    rounds' ratios, each round's figure of a kind the mean of its processes. CPU time per request
    is the other view."""
    w = await rotating_windows(proxies, plan.rps_windows, plan.rps_window_s)
    rps, cpu_us = by_kind(w.rps), by_kind(w.cpu_us)
    result: dict[str, Any] = {kind: {"rounds": values, "median": pct(values, 50),
                                     "errors": _kind_sum(w.errors, kind),
                                     "reopened": _kind_sum(w.reopened, kind),
                                     "cpu_us_per_request": pct(cpu_us[kind], 50),
                                     "cpu_us_per_request_whole_run": _kind_mean(w.cpu_us_whole, kind)}
                              for kind, values in rps.items()}
    result["processes"] = len(proxies) // len(rps)
    result["per_process"] = {"rps": w.rps, "cpu_us_per_request": w.cpu_us}
    result["pair_ratios"] = [ratio(x, b) for x, b in zip(rps["crossbar"], rps["mitmdump"], strict=True)]
    result["ratio"], result["ratio_interval"] = ratio_and_interval(rps["crossbar"], rps["mitmdump"])
    return result


def _of_kind(figures: dict[str, Any], kind: str) -> list[Any]:
    return [value for name, value in figures.items() if kind_of(name) == kind]


def _kind_sum(figures: dict[str, int], kind: str) -> int:
    return sum(_of_kind(figures, kind))


def _kind_mean(figures: dict[str, float], kind: str) -> float:
    values = _of_kind(figures, kind)
    return sum(values) / len(values) if values else math.nan


async def neighbour(proxy: Proxy) -> tuple[float, float]:
    """One streamed reply: its largest gap between token events and its largest event delay (ms)."""
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": NEIGHBOUR_TOKENS,
                       "messages": [{"role": "user", "content": "neighbour"}]}).encode()
    conn = Conn(proxy.stream_port)
    try:
        got = await conn.post_stream(proxy.stream_path, body)
    finally:
        await conn.close()
    arrivals = [at for at, stamp in got.events if stamp is not None][1:-1]
    gaps = [(b - a) / 1e6 for a, b in itertools.pairwise(arrivals)]
    delays = [(at - stamp) / 1e6 for at, stamp in got.events if stamp is not None]
    return (max(gaps) if gaps else math.nan), (max(delays) if delays else math.nan)


async def raw_exchange(port: int, head: bytes, body: bytes, abort: bool = False) -> int:
    """Send a request in 1 MiB writes; read the whole answer (its size), or abort one byte early."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        writer.write(head)
        end = len(body) - 1 if abort else len(body)
        for at in range(0, end, 1 << 20):
            writer.write(body[at:min(at + (1 << 20), end)])
            await writer.drain()
        if abort:
            return 0
        _, headers = await read_head(reader)
        return sum([len(chunk) async for chunk in body_chunks(reader, headers)])
    finally:
        writer.transport.abort() if abort else writer.close()


def post_head(path: str, port: int, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {LOOPBACK}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode()


async def stall_round(proxy: Proxy, upload: bytes, answer_body: bytes) -> dict[str, float]:
    quiet_gap, quiet_delay = await neighbour(proxy)
    stream = asyncio.create_task(neighbour(proxy))
    await asyncio.sleep(0.15)  # the neighbour's stream is under way
    chat, emb = proxy.bulk_prefix + CHAT, proxy.bulk_prefix + EMBEDDINGS
    _, answer = await asyncio.gather(
        raw_exchange(proxy.bulk_port, post_head(chat, proxy.bulk_port, len(upload)), upload),
        raw_exchange(proxy.bulk_port, post_head(emb, proxy.bulk_port, len(answer_body)), answer_body))
    loaded_gap, loaded_delay = await stream
    return {"quiet_gap_ms": quiet_gap, "loaded_gap_ms": loaded_gap, "gap_growth_ms": loaded_gap - quiet_gap,
            "quiet_delay_ms": quiet_delay, "loaded_delay_ms": loaded_delay, "answer_bytes": answer}


async def aborted_uploads(proxy: Proxy, max_body: int) -> dict[str, float]:
    """RSS when warm, then after ABORTED_UPLOADS concurrent `max_body` uploads cut one byte short."""
    await asyncio.sleep(1.0)
    warm = rss_kib(proxy.proc.popen.pid)
    body = b" " * max_body
    path = proxy.bulk_prefix + CHAT
    await asyncio.gather(*(raw_exchange(proxy.bulk_port, post_head(path, proxy.bulk_port, max_body), body,
                                        abort=True) for _ in range(ABORTED_UPLOADS)))
    peak = rss_kib(proxy.proc.popen.pid)
    await asyncio.sleep(3.0)
    after = rss_kib(proxy.proc.popen.pid)
    return {"warm_kib": warm, "peak_kib": peak, "after_kib": after, "after_over_warm": ratio(after, warm)}


def rss_kib(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@contextlib.asynccontextmanager
async def pressure_proxies(plan: Plan, workdir: Path) -> AsyncIterator[tuple[list[Proxy], int]]:
    """A stamped sim for the neighbour streams, a fast 16-slot sim for bulk work, and
    `plan.rps_processes` processes of each proxy in front of them (crossbar: route `bench` and
    route `bulk`; bare mitmdump: one listener each). The first of each kind is named "mitmdump" and
    "crossbar", the others "mitmdump#1", "crossbar#1", ..."""
    sim_port, bulk_port = free_port(), free_port()
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(running("sim", sim_cmd(sim_port, plan.token_ms, plan.max_tokens),
                                                workdir, sim_port, "/health"))
        await stack.enter_async_context(running("bulk-sim", sim_cmd(bulk_port, 0.0, 1, slots=RPS_CLIENTS),
                                                workdir, bulk_port, "/health"))
        proxies: list[Proxy] = []
        for n in range(max(1, plan.rps_processes)):
            tag = f"#{n}" if n else ""
            xb_port, mitm_stream, mitm_bulk = free_port(), free_port(), free_port()
            config = write_crossbar_toml(workdir / f"pressure{n}.toml", xb_port, workdir / f"pressure{n}.db",
                                         {"sim": sim_port, "fast": bulk_port}, "bench", poll_interval="30s",
                                         parallel=2, own_routes={"bulk": ("fast", RPS_CLIENTS)})
            mitm = await stack.enter_async_context(running(
                f"mitmdump{n}", bare_mitmdump_cmd({mitm_stream: sim_port, mitm_bulk: bulk_port}, config),
                workdir, mitm_stream, "/health"))
            xb = await stack.enter_async_context(running(
                f"crossbar{n}", crossbar_cmd(config), workdir, xb_port, "/_crossbar/hosts"))
            proxies += [Proxy(f"mitmdump{tag}", mitm, mitm_stream, CHAT, mitm_bulk, ""),
                        Proxy(f"crossbar{tag}", xb, xb_port, "/bench" + CHAT, xb_port, "/bulk")]
        yield proxies, load_config(config).max_body


async def run_pressure(plan: Plan, workdir: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"rps": {}, "stall": {}, "rss": {}}
    async with pressure_proxies(plan, workdir) as (every, max_body):
        result["rps"] = await measure_rps(every, plan)
        proxies = [p for p in every if p.name == kind_of(p.name)]  # the first of each kind: stalls, memory
        upload = many_messages_body(max_body)
        answer_body = json.dumps({"model": MODEL, "input": [f"text {i}" for i in range(BIG_ANSWER_INPUTS)]}
                                 ).encode()
        rounds: dict[str, list[dict[str, float]]] = {p.name: [] for p in proxies}
        for _ in range(plan.stall_rounds):
            for proxy in proxies:
                rounds[proxy.name].append(await stall_round(proxy, upload, answer_body))
        for name, rs in rounds.items():
            growth = [r["gap_growth_ms"] for r in rs]
            result["stall"][name] = {
                "rounds": rs, "quiet_gap_p50_ms": pct([r["quiet_gap_ms"] for r in rs], 50),
                "loaded_gap_p50_ms": pct([r["loaded_gap_ms"] for r in rs], 50),
                "gap_growth_p50_ms": pct(growth, 50), "gap_growth_max_ms": max(growth),
                "loaded_delay_max_ms": max(r["loaded_delay_ms"] for r in rs),
                "answer_mib": rs[0]["answer_bytes"] / (1 << 20)}
        result["upload_mib"] = len(upload) / (1 << 20)
        for proxy in proxies:
            result["rss"][proxy.name] = await aborted_uploads(proxy, max_body)
    result["table"] = pressure_table(result, plan)
    section("Throughput, stalls and memory", result["table"])
    return result


def _rps_row(name: str, kind: dict[str, Any]) -> list[str]:
    """One proxy's row of the requests-per-second table."""
    return [name, fmt(kind["median"], 0), fmt(kind["cpu_us_per_request"], 0),
            fmt(kind["cpu_us_per_request_whole_run"], 0), " / ".join(fmt(v, 0) for v in kind["rounds"]),
            str(kind["errors"]), str(kind["reopened"])]


def pressure_table(r: dict[str, Any], plan: Plan) -> str:
    rps = markdown(["proxy", "requests/s (median of rounds)", "CPU per request (µs, median of windows)",
                    "CPU per request (µs, whole run)", "rounds", "errors", "connections reopened"],
                   [_rps_row(name, r["rps"][name]) for name in ("mitmdump", "crossbar")])
    stall = markdown(["proxy", "neighbour's largest gap, quiet (p50)", "under load (p50)", "growth p50",
                      "growth worst", "largest event delay under load"],
                     [[name, fmt(s["quiet_gap_p50_ms"]), fmt(s["loaded_gap_p50_ms"]),
                       fmt(s["gap_growth_p50_ms"]), fmt(s["gap_growth_max_ms"]),
                       fmt(s["loaded_delay_max_ms"])]
                      for name, s in r["stall"].items()])
    rss = markdown(["proxy", "warm RSS (MiB)", "peak", "3 s after", "after / warm"],
                   [[name, fmt(m["warm_kib"] / 1024, 0), fmt(m["peak_kib"] / 1024, 0),
                     fmt(m["after_kib"] / 1024, 0), fmt(m["after_over_warm"])]
                    for name, m in r["rss"].items()])
    cpu = ratio(r["rps"]["crossbar"]["cpu_us_per_request"], r["rps"]["mitmdump"]["cpu_us_per_request"])
    cpu_whole = ratio(r["rps"]["crossbar"]["cpu_us_per_request_whole_run"],
                      r["rps"]["mitmdump"]["cpu_us_per_request_whole_run"])
    return (f"Requests per second: {RPS_CLIENTS} keep-alive clients, small non-streamed chats to a simulated "
            "host that answers at once over connections kept from window to window; "
            f"{plan.rps_windows} rounds, each a {plan.rps_window_s:g} s window of every process, "
            f"{r['rps']['processes']} process(es) of each proxy, a round's figure of a proxy the mean of "
            "its processes "
            f"(target: crossbar >= {RPS_TARGET} x mitmdump; median of the rounds' ratios "
            f"{fmt(r['rps']['ratio'], 3)}, {interval_text(r['rps']['ratio_interval'])}; "
            f"CPU per request, crossbar / mitmdump, {fmt(cpu)} over the windows, "
            f"{fmt(cpu_whole)} over the whole run; a connection reopened pays set-up in later windows).\n\n"
            + rps + f"\n\nStalls: a neighbour stream ({NEIGHBOUR_TOKENS} tokens, {plan.token_ms:g} ms apart) "
            f"alone, then again while one client sends a {fmt(r['upload_mib'], 1)} MiB (max_body) chat of "
            f"small messages and another receives a ~{fmt(r['stall']['crossbar']['answer_mib'], 0)} MiB "
            f"non-streamed embeddings answer; {plan.stall_rounds} rounds per proxy (ms; target: growth < "
            f"{STALL_TARGET_MS:g} ms).\n\n" + stall
            + f"\n\nMemory: {ABORTED_UPLOADS} concurrent uploads of max_body bytes, each cut one byte short "
            f"(target: after <= {RSS_TARGET} x warm).\n\n" + rss)


def interval_range(bounds: tuple[float, float]) -> str:
    lo, hi = bounds
    return f"{fmt(lo, 3)}–{fmt(hi, 3)}"


def interval_text(bounds: tuple[float, float]) -> str:
    return f"{RATIO_LEVEL * 100:g} % bootstrap interval {interval_range(bounds)}"


def pressure_checks(results: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    r = results.get("pressure")
    if not r:
        return []
    growth = r["stall"]["crossbar"]["gap_growth_p50_ms"]
    rss = r["rss"]["crossbar"]["after_over_warm"]
    rate = r["rps"]["ratio"]
    return [("requests per second, crossbar / mitmdump",
             f"{fmt(rate, 3)} ({interval_text(r['rps']['ratio_interval'])})", f">= {RPS_TARGET}",
             None if math.isnan(rate) else rate >= RPS_TARGET),
            ("neighbour stream's largest gap growth under load, crossbar (ms, p50)", fmt(growth),
             f"< {STALL_TARGET_MS:g}", growth < STALL_TARGET_MS),
            ("RSS after aborted uploads / warm, crossbar", fmt(rss, 3), f"<= {RSS_TARGET}",
             rss <= RSS_TARGET)]


# ---------------------------------------------------------------------------- summary and main


def checks(results: dict[str, Any]) -> list[tuple[str, str, str, bool | None]]:
    out: list[tuple[str, str, str, bool | None]] = []
    overhead = results.get("overhead", {})
    stamped = overhead.get("upstream") != "llama-server"  # the real server stamps no events
    for size, r in overhead.get("sizes", {}).items():
        rt = r["ratios"]
        for key, label in (("ttfb_p50", "TTFB p50"), ("ttfb_p99", "TTFB p99")):
            out.append((f"overhead {size}: {label}, crossbar / mitmdump", fmt(rt[key], 3),
                        f"<= {TTFB_TARGET}", None if math.isnan(rt[key]) else rt[key] <= TTFB_TARGET))
        if stamped:
            added = rt["event_added_p50_ms"]
            out.append((f"overhead {size}: event delay p50, crossbar - mitmdump (ms)", fmt(added, 3),
                        f"<= {EVENT_ADDED_TARGET_MS}",
                        None if math.isnan(added) else added <= EVENT_ADDED_TARGET_MS))
            out.append((f"overhead {size}: token events batched by crossbar", str(rt["batched_events"]),
                        "0", rt["batched_events"] == 0))
    out += pressure_checks(results)
    for size, d in results.get("decision", {}).get("sizes", {}).items():
        for key in ("ratio_p50", "ratio_p99"):
            out.append((f"decision {size}: decision / mitmdump's own cost ({key[-3:]})", fmt(d[key], 3),
                        f"<= {DECISION_TARGET}", None if math.isnan(d[key]) else d[key] <= DECISION_TARGET))
    for name, s in results.get("affinity", {}).get("scenarios", {}).items():
        value = s["crossbar_vs_ideal"]
        target = s["targeted"]
        out.append((f"affinity, {name}: crossbar / ideal", fmt(value, 3),
                    f">= {AFFINITY_TARGET}" if target else "(context)",
                    (value >= AFFINITY_TARGET) if target else None))
        out.append((f"affinity, {name}: crossbar accounting = client sums",
                    str(s["crossbar"]["accounting_matches"]), "true", s["crossbar"]["accounting_matches"]))
    return out


def summary(results: dict[str, Any]) -> str:
    rows = [[name, value, target, verdict(ok)] for name, value, target, ok in checks(results)]
    return markdown(["check", "value", "target", "result"], rows)


def environment(plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    def git(*cmd: str) -> str:
        try:
            done = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10)
            return done.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": sys.version.split()[0],
            "mitmproxy": mitmproxy_version.VERSION, "aiohttp": aiohttp.__version__,
            "git_commit": git("rev-parse", "--short", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain")),
            "command": " ".join([".venv/bin/python bench/bench.py", *sys.argv[1:]]),
            "quick": args.quick, "only": args.only, "real": args.real, "plan": plan.__dict__}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a ~20 s smoke run per section")
    p.add_argument("--real", action="store_true",
                   help="overhead and affinity against real llama-server processes ($CROSSBAR_LLAMA_LAB, "
                        "default ~/.cache/crossbar-llama-lab) instead of the simulator")
    p.add_argument("--only", choices=("overhead", "decision", "affinity", "pressure"), action="append",
                   help="run only this section (repeatable)")
    p.add_argument("--out", type=Path, help="JSON result file (default bench/results/bench-<time>.json)")
    return p.parse_args(argv)


def json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


async def run(args: argparse.Namespace) -> dict[str, Any]:
    lab = Lab.find() if args.real else None
    plans = (QUICK, Plan()) if lab is None else (REAL_QUICK, REAL)
    plan = plans[0] if args.quick else plans[1]
    # the decision cost is in-process and engine-independent: `--real` runs it only when asked
    everything = ["overhead", "decision", "affinity", "pressure"]
    wanted = args.only or (["overhead", "affinity"] if lab else everything)
    results: dict[str, Any] = {"environment": environment(plan, args)}
    if lab is not None:
        results["environment"]["llama_server"] = {"path": str(lab.server), "model": str(lab.model)}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crossbar-bench-") as tmp:
        workdir = Path(tmp)
        if "overhead" in wanted:
            results["overhead"] = await run_overhead(plan, workdir, lab)
        if "decision" in wanted:
            results["decision"] = await run_decision(plan, workdir, results.get("overhead"))
        if "affinity" in wanted:
            results["affinity"] = await run_affinity(plan, workdir, lab)
        if "pressure" in wanted and lab is None:
            results["pressure"] = await run_pressure(plan, workdir)
    if lab is not None:
        results["environment"]["llama_server"]["build"] = lab.build
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    results["summary"] = summary(results)
    against = f", {lab.heading}" if lab else ""
    section(f"Summary{against} (run took {results['elapsed_s']} s)",
            results["summary"], [f"\nCommand: `{results['environment']['command']}`"])
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    try:
        results = asyncio.run(run(args))
    except KeyboardInterrupt:
        print("interrupted; every started process was stopped", file=sys.stderr)
        return 130
    out = args.out or RESULTS / f"bench-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(json_safe(results), indent=2) + "\n")
    print(f"\nresults written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
