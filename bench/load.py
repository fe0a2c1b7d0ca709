"""Load test: many concurrent streaming sessions through crossbar for a set time.

    .venv/bin/python bench/load.py [--seconds 30] [--sessions 64] [--hosts 3]

Loopback only, bounded in time and size. It starts `--hosts` simulated llama-servers
(`python -m llamasim`, one process each) and crossbar exactly as `run.sh` runs it
(`mitmdump -s addons/crossbar.py --set crossbar_config=… --set server=false`), then runs
`--sessions` conversations at once, each sending its turns one after another (streamed, half of
them asking for usage), for `--seconds`. Alongside, one probe session alternates the same kind of
request sent directly to a sim and through crossbar, so the added time to first byte is measured
under the same load in the same run.

Reported: requests and errors by cause, accounting rows vs requests (after crossbar's SIGTERM
flush), TTFB percentiles (load, probe direct, probe through crossbar, added), and the crossbar
process's RSS (VmRSS) when ready, after warm-up, every few seconds, and at the end.
Targets: 0 unexpected errors, rows == requests, RSS flat within 10 % after warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODEL = "m"
CHAT = "/v1/chat/completions"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Stats:
    requests: int = 0  # sent through crossbar
    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    ttfb_ms: list[float] = field(default_factory=list)
    direct_ms: list[float] = field(default_factory=list)
    probe_ms: list[float] = field(default_factory=list)
    added_ms: list[float] = field(default_factory=list)


def turn_body(session: int, turn: int, usage: bool) -> dict[str, Any]:
    msgs: list[dict[str, str]] = [{"role": "system", "content": f"You are load session {session}."},
                                  {"role": "user", "content": f"task {session}"}]
    for i in range(turn % 8):  # the conversation grows for 8 turns, then starts over (same fingerprint)
        msgs += [{"role": "assistant", "content": f"answer {i} " + "y" * 60},
                 {"role": "user", "content": f"follow-up {i}"}]
    body: dict[str, Any] = {"model": MODEL, "messages": msgs, "stream": True, "max_tokens": 8}
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


async def one_request(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[str, float]:
    """('' or an error cause, ms to the first body byte)."""
    t0 = time.monotonic()
    ttfb = float("nan")
    try:
        async with http.post(url, json=body) as resp:
            first = await resp.content.readany()
            ttfb = (time.monotonic() - t0) * 1000
            if resp.status != 200:
                return f"HTTP {resp.status}", ttfb
            rest = await resp.read()
            data = first + rest
            if not data.rstrip().endswith(b"data: [DONE]"):
                return "stream without [DONE]", ttfb
            return "", ttfb
    except aiohttp.ClientPayloadError:
        return "cut stream", ttfb
    except (aiohttp.ClientError, OSError) as exc:
        return type(exc).__name__, ttfb
    except TimeoutError:
        return "timeout", ttfb


async def session_loop(http: aiohttp.ClientSession, base: str, session: int, stop: asyncio.Event,
                       stats: Stats) -> None:
    turn = 0
    while not stop.is_set():
        stats.requests += 1
        body = turn_body(session, turn, session % 2 == 0)
        cause, ttfb = await one_request(http, f"{base}/load{CHAT}", body)
        if cause:
            stats.errors[cause] += 1
        else:
            stats.ok += 1
            stats.ttfb_ms.append(ttfb)
        turn += 1


async def probe_loop(http: aiohttp.ClientSession, base: str, direct: str, stop: asyncio.Event,
                     stats: Stats) -> None:
    """Pairs of identical-shape requests, direct then through crossbar, one after another."""
    turn = 0
    while not stop.is_set():
        body = turn_body(10_000, turn, False)
        d_cause, d_ttfb = await one_request(http, f"{direct}{CHAT}", body)
        stats.requests += 1
        c_cause, c_ttfb = await one_request(http, f"{base}/probe{CHAT}", body)
        if c_cause:
            stats.errors[f"probe: {c_cause}"] += 1
        else:
            stats.ok += 1
        if not d_cause and not c_cause:
            stats.direct_ms.append(d_ttfb)
            stats.probe_ms.append(c_ttfb)
            stats.added_ms.append(c_ttfb - d_ttfb)
        turn += 1
        await asyncio.sleep(0.05)


def start_sim(port: int, slots: int, token_ms: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "llamasim", "--port", str(port), "--model", MODEL, "--slots", str(slots),
         "--token-ms", str(token_ms), "--max-tokens", "8", "--ctx", str(slots * 8192)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the one line it prints
    if "listening" not in line:
        proc.kill()
        raise SystemExit(f"load: the simulated llama-server did not start: {line}")
    return proc


def write_config(path: Path, db: Path, listen: int, sims: list[int], parallel: int) -> None:
    lines = [f'listen = "127.0.0.1:{listen}"', f'db = "{db}"', 'poll_interval = "2s"', 'poll_timeout = "2s"',
             "queue_max = 64"]
    for i, port in enumerate(sims):
        lines += [f"[hosts.h{i}]", f'base_url = "http://127.0.0.1:{port}"',
                  f'models = {{ "{MODEL}" = {{ parallel = {parallel} }} }}']
    for route in ("load", "probe"):
        lines += [f"[routes.{route}]", f'default_model = "{MODEL}"']
    path.write_text("\n".join(lines) + "\n")


def start_crossbar(config: Path, port: int, log: Path) -> subprocess.Popen[str]:
    """The command run.sh runs; its output goes to `log` (a pipe nobody reads would block it)."""
    cmd = [str(BIN / "mitmdump"), "-s", str(ROOT / "addons" / "crossbar.py"),
           "--set", f"crossbar_config={config}", "--set", "server=false", "--set", "flow_detail=0"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /_crossbar/hosts HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if s.recv(16).startswith(b"HTTP/1.1 200"):
                    return proc
        except OSError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"load: crossbar did not become ready:\n{log.read_text()}")


def count_rows(db: Path) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT count(*) FROM requests").fetchone()[0])
    finally:
        conn.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sims_ports = [free_port() for _ in range(args.hosts)]
    slots = max(2, -(-args.sessions // args.hosts) + 1)
    sims = [start_sim(p, slots, args.token_ms) for p in sims_ports]
    tmp = Path(tempfile.mkdtemp(prefix="crossbar-load-"))
    port = free_port()
    config, db = tmp / "crossbar.toml", tmp / "crossbar.db"
    write_config(config, db, port, sims_ports, slots)
    crossbar_log = tmp / "crossbar.log"
    crossbar = start_crossbar(config, port, crossbar_log)
    out: dict[str, Any] = {"sessions": args.sessions, "seconds": args.seconds, "hosts": args.hosts,
                           "token_ms": args.token_ms}
    samples: list[tuple[float, int]] = []
    try:
        out["rss_ready_kib"] = rss_kib(crossbar.pid)
        base, direct = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{sims_ports[0]}"
        stats = Stats()
        stop = asyncio.Event()
        connector = aiohttp.TCPConnector(limit=args.sessions + 8)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
            tasks = [asyncio.create_task(session_loop(http, base, i, stop, stats))
                     for i in range(args.sessions)]
            tasks.append(asyncio.create_task(probe_loop(http, base, direct, stop, stats)))
            t0 = time.monotonic()
            await asyncio.sleep(min(args.warmup, args.seconds / 3))
            out["rss_warm_kib"] = rss_kib(crossbar.pid)
            while (elapsed := time.monotonic() - t0) < args.seconds:
                samples.append((round(elapsed, 1), rss_kib(crossbar.pid)))
                await asyncio.sleep(min(5.0, args.seconds - elapsed))
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            out["elapsed_s"] = round(time.monotonic() - t0, 1)
        out["rss_end_kib"] = rss_kib(crossbar.pid)
        out["rss_samples_kib"] = samples
        crossbar.send_signal(signal.SIGTERM)
        out["crossbar_exit"] = crossbar.wait(60)
        out["tracebacks_in_log"] = crossbar_log.read_text(errors="replace").count("Traceback")
        out["requests"] = stats.requests
        out["ok"] = stats.ok
        out["errors"] = dict(stats.errors)
        out["rows"] = count_rows(db)
        out["requests_per_s"] = round(stats.requests / out["elapsed_s"], 1)
        for key, values in (("ttfb_ms_load", stats.ttfb_ms), ("ttfb_ms_probe_direct", stats.direct_ms),
                            ("ttfb_ms_probe_crossbar", stats.probe_ms), ("added_ttfb_ms", stats.added_ms)):
            out[key] = {"p50": round(pct(values, 0.5), 2), "p99": round(pct(values, 0.99), 2)}
        out["added_ttfb_ms"]["mean"] = round(statistics.fmean(stats.added_ms), 2) if stats.added_ms else None
        out["added_ttfb_ms"]["pairs"] = len(stats.added_ms)
        warm, end = out["rss_warm_kib"], out["rss_end_kib"]
        out["rss_growth_after_warmup_pct"] = round((end - warm) / warm * 100, 1) if warm else None
        out["targets_met"] = {
            "no_errors": not stats.errors,
            "rows_equal_requests": out["rows"] == stats.requests,
            "rss_flat_10pct": warm > 0 and abs(end - warm) <= 0.1 * warm,
        }
        return out
    finally:
        for proc in (crossbar, *sims):
            if proc.poll() is None:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench/load.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0, help="how long the load runs (max 600)")
    p.add_argument("--sessions", type=int, default=64, help="concurrent streaming sessions (max 256)")
    p.add_argument("--hosts", type=int, default=3, help="simulated llama-servers (max 8)")
    p.add_argument("--token-ms", type=float, default=10.0, help="the sims' time per generated token")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds before the 'warm' RSS sample")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args(argv)
    if not (1 <= args.seconds <= 600 and 1 <= args.sessions <= 256 and 1 <= args.hosts <= 8):
        p.error("bounds: 1 <= --seconds <= 600, 1 <= --sessions <= 256, 1 <= --hosts <= 8")
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"load: {out['sessions']} streaming sessions x {out['elapsed_s']} s on {out['hosts']} "
          f"simulated hosts (token_ms {out['token_ms']})")
    print(f"  requests through crossbar  {out['requests']} ({out['requests_per_s']}/s), ok {out['ok']}")
    print(f"  errors by cause            {out['errors'] or 'none'}")
    print(f"  accounting rows            {out['rows']} (requests {out['requests']})")
    for label, key in (("TTFB load", "ttfb_ms_load"), ("probe direct", "ttfb_ms_probe_direct"),
                       ("probe crossbar", "ttfb_ms_probe_crossbar")):
        print(f"  {label + ' p50/p99':<26} {out[key]['p50']} / {out[key]['p99']} ms")
    added = out["added_ttfb_ms"]
    print(f"  added TTFB p50/p99         {added['p50']} / {added['p99']} ms ({added['pairs']} pairs)")
    print(f"  crossbar RSS ready/warm/end {out['rss_ready_kib']} / {out['rss_warm_kib']} / "
          f"{out['rss_end_kib']} KiB ({out['rss_growth_after_warmup_pct']} % after warm-up)")
    print(f"  RSS samples (s, KiB)       {out['rss_samples_kib']}")
    print(f"  crossbar exit on SIGTERM   {out['crossbar_exit']}, "
          f"tracebacks in its log: {out['tracebacks_in_log']}")
    print(f"  targets                    {out['targets_met']}")


if __name__ == "__main__":
    main()
