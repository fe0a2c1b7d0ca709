"""What the shared PostgreSQL store adds to a request's TTFB, against SQLite, in one run.

    .venv/bin/python bench/shared_bench.py [--n 300] [--out FILE.json]

One simulated llama-server (no generation delay) on loopback; two crossbar `mitmdump` processes in
front of it, one on a SQLite file and one on a throwaway PostgreSQL cluster on loopback (Debian's
`postgresql` package, as the tests start it); requests go round-robin to the host directly and
through each, so every target sees the same machine load. Measured per target, streamed chats,
TTFB = send → first body byte:

- existing: a turn of a conversation the instance already holds (its lease is in memory);
- new: the first turn of a conversation nobody has seen (PostgreSQL: a lookup of the shared lease
  table and the claim of the new lease; SQLite: neither).

PostgreSQL runs twice: once with the host's `parallel` unset (slots held per instance) and once
with `parallel` set, where every request also takes a fleet-wide slot (the difference is its
cost).

Reported: p50/p95 TTFB and what each adds to going direct (p50 difference). Targets are reported,
never asserted: an existing conversation should cost no database round trip on PostgreSQL either,
i.e. its added TTFB should match SQLite's within noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import aiohttp  # noqa: E402
from harness import HostSpec, MitmdumpProcess, start_mitmdump, write_config  # noqa: E402
from pg import PgServer, cluster_in, find_bindir  # noqa: E402

from llamasim import SimConfig, SimServer  # noqa: E402

CHAT = "/v1/chat/completions"
TARGETS = ("direct", "sqlite", "postgres", "postgres+parallel")


def messages(tag: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"task {tag}"}]


async def ttfb(session: aiohttp.ClientSession, url: str, msgs: list[dict[str, str]]) -> float:
    body = {"messages": msgs, "max_tokens": 2, "stream": True, "model": "m"}
    t0 = time.perf_counter()
    async with session.post(url, json=body) as resp:
        await resp.content.readany()
        first = time.perf_counter() - t0
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status}")
    return first * 1000


def start_pg(top: Path) -> PgServer:
    """A throwaway cluster, made the way tests/pg.py makes the tests' one."""
    bindir = find_bindir()
    if bindir is None:
        sys.exit("shared_bench: no initdb (install Debian's postgresql)")
    top.mkdir()
    server = cluster_in(top, bindir)
    server.start()
    return server


async def run(n: int) -> dict[str, Any]:
    top = Path(tempfile.mkdtemp(prefix="crossbar-shared-bench-"))
    top.chmod(0o755)  # the cluster's owner must reach its data directory below
    pg = start_pg(top / "pg")
    sim = SimServer(SimConfig(models=["m"], n_slots=8, ctx=65536))
    await sim.start()
    procs: list[MitmdumpProcess] = []
    try:
        route = {"r": {"hosts": ["a"], "default_model": "m"}}
        shared = pg.url(pg.create_database())
        # (database, the host's models): `parallel` set is held fleet-wide, with a slot per request
        setups = {"sqlite": (str(top / "bench.db"), {"m": {}}), "postgres": (shared, {"m": {}}),
                  "postgres+parallel": (pg.url(pg.create_database()), {"m": {"parallel": 8}})}
        urls = {"direct": f"{sim.url}{CHAT}"}
        for name, (db, models) in setups.items():
            cfg = write_config(top / f"{name}.toml", {"a": (sim.url, HostSpec(models))}, route, db=db,
                               poll_interval="1s")
            proc = start_mitmdump(cfg, ["--set", "server=false"])
            procs.append(proc)
            urls[name] = f"http://127.0.0.1:{proc.port}/r{CHAT}"
        await asyncio.sleep(2.5)  # the first polls
        timings: dict[str, dict[str, list[float]]] = {t: {"existing": [], "new": []} for t in TARGETS}
        async with aiohttp.ClientSession() as session:
            for target in TARGETS:  # warm: connections, and the conversation that exists
                for _ in range(5):
                    await ttfb(session, urls[target], messages("held"))
            for i in range(n):
                for target in TARGETS:
                    timings[target]["existing"].append(await ttfb(session, urls[target], messages("held")))
                    timings[target]["new"].append(
                        await ttfb(session, urls[target], messages(f"new-{target}-{i}")))
        return report(timings)
    finally:
        for p in procs:
            p.stop()
        await sim.close()
        pg.stop()
        shutil.rmtree(top, ignore_errors=True)


def p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def report(timings: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    print("| conversation | target | p50 TTFB ms | p95 TTFB ms | added p50 ms |")
    print("|---|---|---|---|---|")
    for kind in ("existing", "new"):
        direct = statistics.median(timings["direct"][kind])
        for target in TARGETS:
            values = timings[target][kind]
            p50, p95 = statistics.median(values), p(values, 95)
            added = p50 - direct
            out[f"{kind}/{target}"] = {"p50_ms": p50, "p95_ms": p95, "added_p50_ms": added}
            shown = "" if target == "direct" else f"{added:.2f}"
            print(f"| {kind} | {target} | {p50:.2f} | {p95:.2f} | {shown} |")
    extra = out["existing/postgres"]["added_p50_ms"] - out["existing/sqlite"]["added_p50_ms"]
    verdict = "PASS" if extra < 1.0 else "MISS"
    print(f"\nexisting conversation, PostgreSQL vs SQLite: {extra:+.2f} ms at p50 "
          f"(target: no database round trip, within 1 ms of SQLite) {verdict}")
    extra_new = out["new/postgres"]["added_p50_ms"] - out["new/sqlite"]["added_p50_ms"]
    print(f"new conversation, PostgreSQL vs SQLite: {extra_new:+.2f} ms at p50 (lease lookup + claim)")
    for kind in ("existing", "new"):
        slot = out[f"{kind}/postgres+parallel"]["added_p50_ms"] - out[f"{kind}/postgres"]["added_p50_ms"]
        print(f"{kind} conversation, a fleet-wide slot (`parallel` set): {slot:+.2f} ms at p50")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300, help="requests per target and kind")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    result = asyncio.run(run(args.n))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
