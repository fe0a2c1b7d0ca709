"""End-to-end harness: simulated llama-servers + the real crossbar addon in a real mitmproxy
DumpMaster, listening on an ephemeral loopback port in the test's event loop."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mitmproxy import options
from mitmproxy.tools.dump import DumpMaster

from crossbar.addons import Runtime, make_addon
from crossbar.addons.listeners import SWITCH_INTERVAL
from llamasim import SimConfig, SimServer

ROOT = Path(__file__).resolve().parent.parent
MITMDUMP = str(Path(sys.executable).with_name("mitmdump"))


@dataclass
class HostSpec:
    models: dict[str, dict[str, int]]  # model -> {"parallel": n} (may be empty)
    weight: float = 1.0
    sim: SimConfig | None = None  # None: a SimConfig serving the first model


@dataclass
class Fleet:
    sims: dict[str, SimServer] = field(default_factory=dict)

    def __getitem__(self, name: str) -> SimServer:
        return self.sims[name]


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


def write_config(
    path: Path,
    hosts: Mapping[str, tuple[str, HostSpec]],
    routes: Mapping[str, Mapping[str, Any]],
    **top: Any,
) -> Path:
    lines = [f"listen = {toml_value(top.pop('listen', '127.0.0.1:0'))}",
             f"db = {toml_value(str(top.pop('db', path.with_suffix('.db'))))}",
             f"poll_interval = {toml_value(top.pop('poll_interval', '0.2s'))}",
             f"poll_timeout = {toml_value(top.pop('poll_timeout', '1s'))}"]
    lines += [f"{k} = {toml_value(v)}" for k, v in top.items()]
    for name, (url, spec) in hosts.items():
        lines += [f"[hosts.{json.dumps(name)}]", f"base_url = {toml_value(url)}",
                  f"weight = {toml_value(spec.weight)}", f"models = {toml_value(spec.models)}"]
    for name, conf in routes.items():
        lines.append(f"[routes.{json.dumps(name)}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in conf.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@asynccontextmanager
async def sim_fleet(specs: Mapping[str, HostSpec]) -> AsyncIterator[Fleet]:
    fleet = Fleet()
    try:
        for name, spec in specs.items():
            cfg = spec.sim or SimConfig(models=[next(iter(spec.models))])
            sim = SimServer(cfg)
            await sim.start()
            fleet.sims[name] = sim
        yield fleet
    finally:
        for sim in fleet.sims.values():
            await sim.close()


@dataclass
class Proxy:
    port: int
    addon: Runtime  # what crossbar's addons share (config, router, per-connection state)
    master: DumpMaster
    config_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def router(self) -> Any:
        assert self.addon.router is not None
        return self.addon.router


@asynccontextmanager
async def crossbar_proxy(config_path: Path, *, wait_polls: int = 1) -> AsyncIterator[Proxy]:
    """The real addon in a real DumpMaster. With `server=False` nothing listens until the addon
    opens the listeners of its TOML, exactly as under `./run.sh`."""
    opts = options.Options(server=False)
    master = DumpMaster(opts, with_termlog=False, with_dumper=False)
    addon = Runtime()
    master.addons.add(make_addon(addon))
    master.options.update(crossbar_config=str(config_path))
    task = asyncio.create_task(master.run())
    ps = master.addons.get("proxyserver")
    for _ in range(500):
        if addon.router is not None and ps.listen_addrs():
            break
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    else:
        raise AssertionError("crossbar did not start listening")
    for _ in range(500):
        if addon.router.poller.rounds >= wait_polls:
            break
        await asyncio.sleep(0.01)
    port = ps.listen_addrs()[0][1]
    try:
        yield Proxy(port, addon, master, config_path)
    finally:
        master.shutdown()
        await asyncio.wait_for(task, 10)


async def raw_http(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes, read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()


def post_bytes(path: str, body: bytes, headers: Mapping[str, str] | None = None,
               close: bool = True) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: crossbar", f"Content-Length: {len(body)}",
            "Content-Type: application/json"]
    if close:
        head.append("Connection: close")
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def split_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = dechunk(body)
    return status, headers, body


def dechunk(data: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        end = data.find(b"\r\n", pos)
        if end < 0:
            raise ValueError("incomplete chunked body")
        size = int(data[pos:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2:end + 2 + size]
        pos = end + 2 + size + 2
        if pos > len(data):
            raise ValueError("incomplete chunked body")


def chat(messages: Sequence[Mapping[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"messages": list(messages), **extra}


def conversation(session: str, turns: int, pad: int = 0) -> list[list[dict[str, str]]]:
    """Growing turns of one conversation: each turn's messages extend the previous turn's."""
    msgs = [{"role": "system", "content": f"You are agent {session}. " + "x" * pad},
            {"role": "user", "content": f"task of session {session}"}]
    out = []
    for i in range(turns):
        out.append([dict(m) for m in msgs])
        msgs += [{"role": "assistant", "content": f"answer {i} " + "y" * 40},
                 {"role": "user", "content": f"follow-up {i} of {session}"}]
    return out


# ---------------------------------------------------------------- subprocess mitmdump


@dataclass
class MitmdumpProcess:
    proc: subprocess.Popen[str]
    port: int
    output: list[str]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)


def start_mitmdump(config: Path, extra: Sequence[str] = (), timeout: float = 30,
                   plain: bool = False) -> MitmdumpProcess:
    """`mitmdump -s addons/crossbar.py --set crossbar_config=PATH`, as run.sh runs it; waits until
    `GET /_crossbar/hosts` would answer (the "serving on" line) and returns the bound port."""
    cmd = [MITMDUMP, "-s", str(ROOT / "addons" / "crossbar.py"), "--set", f"crossbar_config={config}",
           "--set", "flow_detail=0", *extra]
    if not plain and "server=false" not in extra:  # plain: the bare documented command
        cmd += ["--set", "server=false"]
    return serving(launch(cmd), timeout)


def launch(cmd: Sequence[str]) -> subprocess.Popen[str]:
    """`cmd` (mitmdump, or run.sh) with its output piped, as `serving` reads it."""
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=ROOT)


def serving(proc: subprocess.Popen[str], timeout: float = 30) -> MitmdumpProcess:
    """Waits for crossbar's "serving on" line and returns the bound port; kills it otherwise."""
    assert proc.stdout is not None
    output: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        output.append(line)
        if "crossbar: serving on" in line:
            port = int(line.rsplit(":", 1)[1].split(",")[0].strip())
            _drain_in_background(proc, output)
            return MitmdumpProcess(proc, port, output)
    proc.kill()
    proc.wait()
    raise AssertionError("mitmdump did not start:\n" + "".join(output))


def _drain_in_background(proc: subprocess.Popen[str], output: list[str]) -> None:
    import threading

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            output.append(line)

    threading.Thread(target=pump, daemon=True).start()


# ---------------------------------------------------------------- e2e helpers (appended)

POLL_PATHS = frozenset({"/health", "/v1/models", "/props", "/slots"})
JsonObj = dict[str, Any]


async def wait_until(predicate: Any, timeout: float = 5.0, interval: float = 0.02, what: str = "") -> None:
    """Bounded polling until `predicate()` (sync or async) is true; fails the test otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate!r}")
        await asyncio.sleep(interval)


async def committed(proxy: Proxy) -> bool:
    """Account every finished request and wait for the store's writer to commit what it holds."""
    proxy.router.account_finished()
    return await asyncio.to_thread(proxy.router.store.flush)


async def request_rows(proxy: Proxy) -> list[Any]:
    """Every `requests` row, after the store's background writer has caught up."""
    await committed(proxy)
    return await asyncio.to_thread(proxy.router.store.requests_since, 0)


async def lease_event_rows(proxy: Proxy) -> list[Any]:
    """Every lease event (oldest first), after the background writer has caught up."""
    store = proxy.router.store
    await asyncio.to_thread(store.flush)
    return list(reversed(await asyncio.to_thread(store.lease_events, 10_000)))


def completion_count(sim: SimServer) -> int:
    """Completion-type requests the sim received (any path that is not polled by crossbar)."""
    return sum(n for path, n in sim.stats.requests.items() if path not in POLL_PATHS)


def is_error_shape(body: Any, status: int) -> bool:
    """crossbar's own error shape `{"error":{"code","type","message"}}` with the right code."""
    err = body.get("error") if isinstance(body, dict) else None
    return (isinstance(err, dict) and err.get("code") == status and isinstance(err.get("type"), str)
            and isinstance(err.get("message"), str) and bool(err["message"]))


def sse_data(body: bytes) -> list[bytes]:
    """The `data:` payloads of an SSE body, in order."""
    return [line[5:].strip() for line in body.split(b"\n") if line.startswith(b"data:")]


def single_host_config(path: Path, url: str, *, models: Sequence[str] = ("m",), parallel: int = 0,
                       routes: Mapping[str, Mapping[str, Any]] | None = None, **top: Any) -> Path:
    """One host "a" serving `models`, route "r" (and template "opencode-*") on it, default model first."""
    spec = HostSpec({m: ({"parallel": parallel} if parallel else {}) for m in models})
    default = {"hosts": ["a"], "default_model": models[0]}
    return write_config(path, {"a": (url, spec)},
                        routes or {"r": default, "opencode-*": default}, **top)


@dataclass
class RecordingUpstream:
    """A tiny llama-server stand-in that records the raw request bodies it gets and answers fixed
    bytes. A streamed answer sends `chunks[0]`, then waits for `gate` before sending the rest."""

    json_body: bytes
    chunks: Sequence[bytes]
    extra_headers: Mapping[str, str] = field(default_factory=dict)
    received: list[bytes] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)  # path and query of every request, polls included
    host_fields: list[str | None] = field(default_factory=list)  # the Host field of each POST
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0
    chunked: bool = False  # a non-streamed answer sent chunked, without a Content-Length
    status: int = 200  # of a non-streamed answer
    address: str = "127.0.0.1"

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}"

    async def handle(self, request: Any) -> Any:
        from aiohttp import web

        json_type = {"Content-Type": "application/json"}
        self.targets.append(request.path_qs)
        if request.method == "GET":
            bodies = {"/health": b'{"status":"ok"}', "/v1/models": b'{"data":[{"id":"m"}]}',
                      "/props": b'{"total_slots":4,"default_generation_settings":{"n_ctx":4096}}'}
            if request.path in bodies:
                return web.Response(body=bodies[request.path], headers=json_type)
            return web.Response(status=404, body=b'{"error":"nf"}', headers=json_type)
        raw = await request.read()
        self.received.append(raw)
        self.host_fields.append(request.headers.get("Host"))
        answer_headers = {**json_type, **self.extra_headers}
        streamed = json.loads(raw).get("stream")
        if not streamed and not self.chunked:
            return web.Response(status=self.status, body=self.json_body, headers=answer_headers)
        if not streamed:
            answer = web.StreamResponse(status=self.status, headers=answer_headers)
            answer.enable_chunked_encoding()
            await answer.prepare(request)
            for at in range(0, len(self.json_body), 1 << 16):
                await answer.write(self.json_body[at:at + (1 << 16)])
            await answer.write_eof()
            return answer
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **self.extra_headers})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(self.chunks[0])
        await self.gate.wait()
        for chunk in self.chunks[1:]:
            await resp.write(chunk)
        await resp.write_eof()
        return resp


@asynccontextmanager
async def recording_upstream(
    json_body: bytes, chunks: Sequence[bytes], extra_headers: Mapping[str, str] | None = None,
    chunked: bool = False, status: int = 200, address: str = "127.0.0.1",
) -> AsyncIterator[RecordingUpstream]:
    from aiohttp import web

    up = RecordingUpstream(json_body, chunks, dict(extra_headers or {}), chunked=chunked, status=status,
                           address=address)
    runner = web.ServerRunner(web.Server(up.handle), shutdown_timeout=0.5, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, address, 0)
    await site.start()
    up.port = runner.addresses[0][1]
    try:
        yield up
    finally:
        up.gate.set()
        await runner.cleanup()


@asynccontextmanager
async def fleet_with_route(tmp_path: Path, specs: Mapping[str, HostSpec], **top: Any,
                           ) -> AsyncIterator[tuple[Fleet, Proxy]]:
    """Sims for `specs` and crossbar with route "r" (default model "m") over all of them, in
    config order; `top` adds top-level config keys."""
    async with sim_fleet(specs) as fleet:
        cfg = write_config(tmp_path / "crossbar.toml", {n: (fleet[n].url, s) for n, s in specs.items()},
                           {"r": {"hosts": list(specs), "default_model": "m"}}, **top)
        async with crossbar_proxy(cfg) as proxy:
            yield fleet, proxy


async def largest_loop_gap(run: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    """The event loop's longest pause (s) while `run` runs, seen by a 1 ms ticker, with the
    interpreter's switch interval crossbar sets; and what `run` gave."""
    loop = asyncio.get_running_loop()
    gaps: list[float] = []
    done = False

    async def tick() -> None:
        last = loop.time()
        while not done:
            await asyncio.sleep(0.001)
            now = loop.time()
            gaps.append(now - last)
            last = now

    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0.02)
        result = await run()
        await asyncio.sleep(0.02)
        done = True
        await ticker
    finally:
        sys.setswitchinterval(interval)
    return max(gaps), result


LOOP_GAP_TRIES = 5
# between two tries: a machine busy elsewhere (a shared host) is often busy for a while
LOOP_GAP_PAUSE_S = 0.25
# What a try that missed its bound measures of the machine (`machine_state`): PROBE_RUNS runs of
# PROBE_S each, the median of each figure (one pause now and then says nothing of the machine; a slow
# machine is slow in most runs). On a quiet 2-core machine the loop's longest pause beside the probe
# was 2.9-6.0 ms and its read 0.82-0.98 ms; with every CPU busy elsewhere the pause was 7-16 ms.
PROBE_S = 0.3
PROBE_RUNS = 3
QUIET_PROBE_GAP_S = 0.006
QUIET_PROBE_READ_S = 0.0012
# 20k small arrays in 59,001 characters: what one window of a nested body reads in one C call
_PROBE_TEXT = "[" + ",".join(["[" + ",".join(["[]"] * 19) + "]"] * 1000) + "]"


def _probe(seconds: float) -> float:
    """Three reads of the probe's text into fresh memory (the quickest one's time is returned), then
    Python work until `seconds` have passed, which lets go of the interpreter at every switch
    interval: small objects made and freed a few at a time, never one long C call."""
    started = time.perf_counter()
    reads: list[float] = []
    values: list[Any] = []
    for _ in range(3):
        read_from = time.perf_counter()
        values.append(json.loads(_PROBE_TEXT))
        reads.append(time.perf_counter() - read_from)
    values.clear()
    kept: list[Any] = [None] * 1024
    made = 0
    while time.perf_counter() < started + seconds:
        kept[made % len(kept)] = [[] for _ in range(32)]
        made += 1
    return min(reads)


@dataclass(frozen=True)
class MachineState:
    """How the machine ran the probe just now, and what that allows a loop-pause bound."""
    gap: float  # the loop's longest pause beside the probe (s)
    read: float  # the probe's read (s)

    def allowance(self, bound: float) -> float:
        """What `bound`, set for a quiet machine, becomes on this one: a slower read (slow CPU or
        memory) makes the work beside the loop slower in proportion; a longer wait for a CPU adds
        to every pause."""
        return bound * max(1.0, self.read / QUIET_PROBE_READ_S) + max(0.0, self.gap - QUIET_PROBE_GAP_S)

    def __str__(self) -> str:
        return f"probe's pause {self.gap * 1000:.1f} ms, read {self.read * 1000:.2f} ms"


async def machine_state() -> MachineState:
    """The median figures of PROBE_RUNS runs of the probe in a worker thread, the collector off
    (a full collection of the test process's heap pauses the loop some 65 ms)."""
    gaps: list[float] = []
    reads: list[float] = []
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(PROBE_RUNS):
            gap, read = await largest_loop_gap(lambda: asyncio.to_thread(_probe, PROBE_S))
            gaps.append(gap)
            reads.append(read)
    finally:
        if collecting:
            gc.enable()
    return MachineState(sorted(gaps)[len(gaps) // 2], sorted(reads)[len(reads) // 2])


async def within_loop_gap(run: Callable[[], Awaitable[Any]], bound: float,
                          tries: int = LOOP_GAP_TRIES) -> Any:
    """What `run` gave, once a run held the event loop less than `bound` seconds on a quiet machine,
    or less than what the machine measured right after the run allows (`MachineState.allowance`);
    fails with every gap seen when `tries` runs all held it longer. A single C call that holds the
    interpreter holds it on every try, as long on a busy machine as on a quiet one; a machine busy
    elsewhere for a moment is not busy on every try, and one slow for minutes slows the probe too
    (CI runs saw these tests' gaps three to five times their idle size in five tries running)."""
    seen: list[str] = []
    for attempt in range(tries):
        if attempt:
            await asyncio.sleep(LOOP_GAP_PAUSE_S)
        gap, result = await largest_loop_gap(run)
        if gap < bound:
            return result
        state = await machine_state()
        allowed = state.allowance(bound)
        seen.append(f"{gap * 1000:.0f} ms ({state}: {allowed * 1000:.0f} ms allowed)")
        if gap < allowed:
            return result
    raise AssertionError(f"the event loop stalled {', '.join(seen)} in {tries} runs "
                         f"(bound {bound * 1000:.0f} ms on a quiet machine)")
