"""Placement under uneven load on a real fleet: strict stickiness vs crossbar through mitmdump.

    .venv/bin/python bench/yield_fleet.py [--seed 0] [--factors 2] [--loads even,skewed] [--out FILE.json]

The session sets of `bench/yield_bench.py` (same seed, same sessions), sent for real: three
simulated llama-servers (`python -m llamasim`, one slot each, the time model of that benchmark:
prefill 0.05 ms per token = 20k tok/s, generation 1 ms per token = 1k tok/s, the host prompt
cache), every one a subprocess, and each turn a real non-streamed chat request whose prompt is
the session's growing conversation (one token per byte in the simulator), with the session's
think times between turns. Policies, each on a fresh fleet (empty caches):

- strict: the client sends each session to the host its session hash names, directly;
- crossbar: through `mitmdump` running crossbar (every host a candidate of one route, the
  session named by `X-Session-Id`), at each yield factor of `--factors` (0: yielding off).

Reported per load: p50/p95/max/mean turn latency (request to whole answer, seconds), cached share
of prompt tokens (from the answers' `timings`), moves (`moved:yield` rows), and the ratios to
strict against the issue's targets (PASS/MISS, never asserted). A run is wall-clock and takes a
few minutes; `bench/yield_bench.py` is the deterministic twin on a virtual clock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp
import yield_bench as yb

import bench as fleet_tools  # the process helpers of bench/bench.py

LOOPBACK = fleet_tools.LOOPBACK
MODEL = fleet_tools.MODEL
HOSTS = yb.HOSTS
SLOT_CTX = 262_144  # room for a session's whole conversation (up to ~110k tokens)
TIMEOUT = aiohttp.ClientTimeout(total=600)
LETTERS = string.ascii_letters + string.digits + " "

Send = Callable[[str, list[dict[str, str]], int], Awaitable[dict[str, Any]]]


@dataclass
class Result(yb.Result):
    errors: int = 0  # turns that got no answer (the session stops there)

    def summary(self) -> dict[str, float]:
        return {**super().summary(), "errors": self.errors}


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choices(LETTERS, k=max(n, 1)))


async def run_session(session: yb.Session, send: Send, result: Result) -> None:
    """The session's turns in order: each appends the previous answer and its new input."""
    rng = random.Random(session.name)
    await asyncio.sleep(session.start_s)
    messages = [{"role": "system", "content": f"agent {session.name} " + text(rng, session.context_tokens)}]
    for index, turn in enumerate(session.turns):
        if index:
            await asyncio.sleep(turn.think_s)
        messages.append({"role": "user", "content": text(rng, turn.added_tokens)})
        started = time.monotonic()
        reply = await send(session.name, messages, turn.reply_tokens)
        if not reply:
            result.errors += 1
            return
        result.latencies.append(time.monotonic() - started)
        timings = reply.get("timings") or {}
        result.prompt_tokens += int(timings.get("prompt_n", 0)) + int(timings.get("cache_n", 0))
        result.cached_tokens += int(timings.get("cache_n", 0))
        messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})


def sender(http: aiohttp.ClientSession, url_of: Callable[[str], str]) -> Send:
    async def send(session: str, messages: list[dict[str, str]], reply_tokens: int) -> dict[str, Any]:
        body = {"model": MODEL, "messages": messages, "max_tokens": reply_tokens, "stream": False}
        async with http.post(url_of(session), json=body, headers={"X-Session-Id": session}) as resp:
            return await resp.json(content_type=None) if resp.status == 200 else {}

    return send


def sim_cmd(port: int) -> list[str]:
    return [fleet_tools.PYTHON, "-m", "llamasim", "--host", LOOPBACK, "--port", str(port), "--model", MODEL,
            "--slots", "1", "--ctx", str(SLOT_CTX), "--prompt-ms", str(1e3 / yb.FLEET.prefill_tps),
            "--token-ms", str(1e3 / yb.FLEET.gen_tps), "--max-tokens", "16"]


async def run_policy(policy: str, factor: float, sessions: list[yb.Session], workdir: Path) -> Result:
    """One policy on a fresh fleet of simulated hosts (and a fresh crossbar)."""
    ports = {name: fleet_tools.free_port() for name in HOSTS}
    async with (fleet_tools.running(f"{policy}-{HOSTS[0]}", sim_cmd(ports[HOSTS[0]]), workdir,
                                    ports[HOSTS[0]], "/health"),
                fleet_tools.running(f"{policy}-{HOSTS[1]}", sim_cmd(ports[HOSTS[1]]), workdir,
                                    ports[HOSTS[1]], "/health"),
                fleet_tools.running(f"{policy}-{HOSTS[2]}", sim_cmd(ports[HOSTS[2]]), workdir,
                                    ports[HOSTS[2]], "/health"),
                aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=0)) as http):
        if policy == "strict":
            strict = yb.Strict(dict.fromkeys(HOSTS))  # type: ignore[arg-type]  # it reads the names only
            result = Result("strict")
            url_of = lambda s: f"http://{LOOPBACK}:{ports[strict.place(s, 0, 0.0)]}{fleet_tools.CHAT}"  # noqa: E731
            await asyncio.gather(*(run_session(s, sender(http, url_of), result) for s in sessions))
            return result
        return await through_crossbar(factor, sessions, ports, workdir, http)


async def through_crossbar(factor: float, sessions: list[yb.Session], ports: dict[str, int], workdir: Path,
                           http: aiohttp.ClientSession) -> Result:
    port = fleet_tools.free_port()
    config = fleet_tools.write_crossbar_toml(workdir / f"crossbar-{factor:g}.toml", port,
                                             workdir / f"crossbar-{factor:g}.db", ports, "r", "1s", 1)
    first, rest = config.read_text().split("\n", 1)  # a top-level key goes before the first table
    config.write_text(f"{first}\nyield_factor = {factor!r}\n{rest}")
    result = Result(yb.variant_name(factor, held_work=True))
    async with fleet_tools.running(f"crossbar-{factor:g}", fleet_tools.crossbar_cmd(config), workdir, port,
                                   "/_crossbar/hosts"):
        url = f"http://{LOOPBACK}:{port}/r{fleet_tools.CHAT}"
        await asyncio.gather(*(run_session(s, sender(http, lambda _: url), result) for s in sessions))
        async with http.get(f"http://{LOOPBACK}:{port}/_crossbar/usage?by=decision&since=1h") as resp:
            rows = await resp.json(content_type=None)
    result.moves = sum(row["requests"] for row in rows if row["key"] == "moved:yield")
    return result


async def compare(seed: int, factors: list[float], loads: list[str], workdir: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for load in loads:
        count, long_generators = yb.LOADS[load]
        sessions = yb.make_sessions(random.Random(f"{seed}-{load}"), count, long_generators)
        results = [await run_policy("strict", 0.0, sessions, workdir)]
        results += [await run_policy("crossbar", f, sessions, workdir) for f in factors]
        base = results[0].summary()
        report[load] = [{"policy": r.policy, **r.summary(), "ratio": yb.ratios(base, r.summary())}
                        for r in results]
        print_load(load, report[load])
    return report


def print_load(load: str, rows: list[dict[str, Any]]) -> None:
    count, long_generators = yb.LOADS[load]
    print(f"\n{load} load ({count} sessions x {yb.TURNS} turns, {long_generators} long generators)")
    print("| policy | p50 s | p95 s | max s | mean s | cached | moves | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['p50']:.2f} | {r['p95']:.2f} | {r['max']:.2f} | {r['mean']:.2f} "
              f"| {r['cached']:.3f} | {r['moves']} | {r['errors']} |")
    for r in rows[1:]:
        q = r["ratio"]
        verdict = "PASS" if yb.met(load, q) and not r["errors"] else "MISS"
        print(f"{r['policy']} / strict: p95 {q['p95']:.2f}, mean {q['mean']:.2f}, max {q['max']:.2f}, "
              f"cached {q['cached']:.3f} -> {verdict}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0, help="the session set (as in bench/yield_bench.py)")
    p.add_argument("--factors", default="2", help="comma-separated yield factors for crossbar (0: off)")
    p.add_argument("--loads", default="even,skewed", help="comma-separated: even, skewed")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    factors = [float(f) for f in args.factors.split(",")]
    with tempfile.TemporaryDirectory(prefix="crossbar-yield-fleet-") as tmp:
        report = asyncio.run(compare(args.seed, factors, args.loads.split(","), Path(tmp)))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
