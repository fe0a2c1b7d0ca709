"""Requests per second and CPU per request of two crossbar trees and bare mitmdump, side by side.

    .venv/bin/python bench/rps_ab.py OTHER_TREE [--windows N] [--pin] [--replicas K] [--seconds S]
                                     [--out FILE.json]

OTHER_TREE is another checkout of crossbar (say `git worktree add /tmp/before <commit>`); it runs
from this tree's virtualenv. The load is the pressure section's (16 keep-alive clients, small
non-streamed chats to a simulated host that answers at once). The three proxies take 1 s windows
in turn, the order rotating, so all three see the machine at the same moments; on a shared
machine whose speed drifts, comparing separate runs says little. Reported per crossbar tree: the
median over rounds of its requests/s ÷ bare mitmdump's with a 95 % bootstrap confidence interval
of that median (from this run's rounds only: a run with fresh processes may land outside it), and
the median of its CPU time per request ÷ bare mitmdump's (user + system of all its threads, from
/proc). Every process it starts is stopped by it.

`--pin` runs the proxies on the last CPU and the load and the simulated host on the others (with
`taskset`), so that the proxy under load has a CPU of its own and is what limits the rate; without
it the scheduler places every process, and a proxy may share a CPU with the load or the host.

`--replicas K` starts K processes of each proxy and compares, round by round, the mean of each
kind's K windows. One process's rate depends on its luck (string hashing is seeded per process,
and where its objects land in memory), by a few per cent either way between two starts of the
same tree; the mean of several starts moves less. The two trees swap places in every other
replica (give an even K), so neither is always measured right after the other. Two copies of one
tree still came out up to 0.04 apart: treat a smaller difference as noise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench


def pinned(cmd: list[str], cpus: set[int] | None) -> list[str]:
    """`cmd` run on `cpus` only (None: wherever the scheduler puts it)."""
    return cmd if cpus is None else ["taskset", "-c", ",".join(map(str, sorted(cpus))), *cmd]


def split_cpus(available: set[int]) -> tuple[set[int], set[int]]:
    """(the proxies' CPU, the load's and the simulated host's CPUs): the last one for the proxies."""
    if len(available) < 2:
        raise ValueError("--pin needs at least two CPUs")
    last = max(available)
    return {last}, available - {last}


async def measure(other: Path, windows: int, proxy_cpus: set[int] | None = None,
                  replicas: int = 1, seconds: float = 1.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        host_port = bench.free_port()

        def config(name: str, port: int) -> Path:
            return bench.write_crossbar_toml(workdir / f"{name}.toml", port, workdir / f"{name}.db",
                                             {"fast": host_port}, "bench", poll_interval="30s",
                                             parallel=bench.RPS_CLIENTS)

        async with contextlib.AsyncExitStack() as stack:
            host_cmd = bench.sim_cmd(host_port, 0.0, 1, slots=bench.RPS_CLIENTS)
            await stack.enter_async_context(bench.running("host", host_cmd, workdir, host_port, "/health"))
            proxies: list[bench.Proxy] = []
            for n in range(replicas):
                bare_port, this_port, other_port = (bench.free_port() for _ in range(3))
                this_cfg, other_cfg = config(f"this{n}", this_port), config(f"other{n}", other_port)
                bare_cmd = pinned(bench.bare_mitmdump_cmd({bare_port: host_port}, this_cfg), proxy_cpus)
                bare = await stack.enter_async_context(bench.running(
                    f"mitmdump{n}", bare_cmd, workdir, bare_port, "/health"))
                this = await stack.enter_async_context(bench.running(
                    f"this{n}", pinned(bench.crossbar_cmd(this_cfg), proxy_cpus), workdir, this_port,
                    "/_crossbar/hosts"))
                that = await stack.enter_async_context(bench.running(
                    f"other{n}", pinned(bench.crossbar_cmd(other_cfg, other), proxy_cpus), workdir,
                    other_port, "/_crossbar/hosts"))
                trees = [bench.Proxy(f"this#{n}", this, this_port, "", this_port, "/bench"),
                         bench.Proxy(f"other#{n}", that, other_port, "", other_port, "/bench")]
                proxies += [bench.Proxy(f"mitmdump#{n}", bare, bare_port, bench.CHAT, bare_port, ""),
                            *(trees if n % 2 == 0 else reversed(trees))]
            return await rounds(proxies, windows, seconds)


async def rounds(proxies: Sequence[bench.Proxy], windows: int, seconds: float = 1.0) -> dict[str, Any]:
    w = await bench.rotating_windows(proxies, windows, seconds)
    if failed := {name: n for name, n in w.errors.items() if n}:
        raise RuntimeError(f"requests failed: {failed}")
    if reopened := {name: n for name, n in w.reopened.items() if n}:
        print(f"warning: connections reopened (those windows paid connection set-up): {reopened}",
              file=sys.stderr)
    rps, cpu_us = bench.by_kind(w.rps), bench.by_kind(w.cpu_us)
    result: dict[str, Any] = {"windows": windows, "replicas": len(proxies) // 3, "rps": w.rps,
                              "cpu_us_per_request": w.cpu_us, "reopened": w.reopened}
    for name in ("this", "other"):
        rate, interval = bench.ratio_and_interval(rps[name], rps["mitmdump"])
        result[name] = {"rps_ratio": rate, "rps_ratio_interval": interval,
                        "cpu_ratio": bench.pair_ratio(cpu_us[name], cpu_us["mitmdump"]),
                        "cpu_us_per_request": bench.pct(cpu_us[name], 50)}
    result["mitmdump"] = {"cpu_us_per_request": bench.pct(cpu_us["mitmdump"], 50)}
    return result


def table(r: dict[str, Any], other: Path) -> str:
    def row(label: str, f: dict[str, Any]) -> list[str]:
        return [label, bench.fmt(f["rps_ratio"], 3), bench.interval_range(f["rps_ratio_interval"]),
                bench.fmt(f["cpu_ratio"], 3), bench.fmt(f["cpu_us_per_request"], 0)]

    rows = [row(f"this tree ({bench.ROOT})", r["this"]), row(f"other tree ({other})", r["other"]),
            ["bare mitmdump", "1", "", "1", bench.fmt(r["mitmdump"]["cpu_us_per_request"], 0)]]
    return bench.markdown(["proxy", "requests/s ÷ mitmdump (median)",
                           f"its {bench.RATIO_LEVEL * 100:g} % bootstrap interval",
                           "CPU per request ÷ mitmdump (median)", "CPU per request (µs, median)"], rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, help="another crossbar checkout")
    parser.add_argument("--windows", type=int, default=15, help="1 s windows per proxy (default 15)")
    parser.add_argument("--pin", action="store_true",
                        help="proxies on the last CPU, the load and the simulated host on the others")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of a window (default 1 s)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="processes of each proxy, averaged round by round (default 1)")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    other = args.other.resolve()
    if not (other / "addons" / "crossbar.py").is_file():
        parser.error(f"{other} is not a crossbar checkout (no addons/crossbar.py)")
    proxy_cpus = None
    if args.pin:
        if shutil.which("taskset") is None:
            parser.error("--pin needs taskset (util-linux)")
        try:
            proxy_cpus, load_cpus = split_cpus(os.sched_getaffinity(0))
        except ValueError as exc:
            parser.error(str(exc))
        os.sched_setaffinity(0, load_cpus)  # this process (the load) and the simulated host it starts
    signal.signal(signal.SIGTERM, bench._sigterm)  # unwinds, so every process started is stopped
    result = asyncio.run(measure(other, args.windows, proxy_cpus, max(1, args.replicas), args.seconds))
    result["pinned"] = proxy_cpus is not None
    print(table(result, other))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
