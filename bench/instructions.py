"""Instructions per request of bare mitmdump and crossbar, counted by valgrind's callgrind.

    .venv/bin/python bench/instructions.py [OTHER_TREE ...] [--requests N] [--cache-sim] [--functions K]

Timings on a shared machine drift by a factor of two within seconds; an instruction count does
not. Each proxy runs under `valgrind --tool=callgrind` with counting switched off, takes 100
requests to warm up, then counts exactly the instructions (all threads: the event loop and the
database writer) of N more requests of the pressure section's load (small non-streamed chats,
4 keep-alive clients, a simulated host that answers at once). Reported: instructions per
request, each crossbar tree's count ÷ bare mitmdump's, and how many of them ran on the event
loop's thread (the rest is the store's writer thread). `--keep DIR` keeps callgrind's dumps, one per
proxy and thread, for `callgrind_annotate`. Under valgrind a request takes tens of times longer,
so the writer thread commits smaller batches than at full speed: its share here is an upper
bound. OTHER_TREE, another crossbar checkout
(`git worktree add /tmp/before <commit>`), is measured the same way from this tree's virtualenv.

`--functions K` runs each proxy with Python's perf trampolines (`PYTHONPERFSUPPORT=1`: every
Python function is entered through a small stub of its own, named in `/tmp/perf-PID.map`) and
reports, per crossbar tree, the K functions of its `crossbar` package that cost the event loop the
most first-level data cache misses (instructions without `--cache-sim`), inclusive of what they
call, per request. The trampolines add instructions of their own to every Python call, so compare
these figures with each other, not with a run without them.

Needs valgrind (`apt install valgrind`). Under valgrind each proxy runs tens of times slower: about
a minute per proxy for the default 300 requests. Every process it starts is stopped by it.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench

WARMUP = 100
CLIENTS = 4


@dataclass(frozen=True)
class Count:
    """Instructions per request: all threads, and the event loop's thread alone; with the cache
    simulation, the event loop thread's first-level data and instruction cache misses too."""

    total: float
    loop: float
    d1_misses: float | None = None
    i1_misses: float | None = None
    functions: dict[str, FunctionCost] = field(default_factory=dict)  # with --functions


@dataclass(frozen=True)
class FunctionCost:
    """One Python function's cost to the event loop per request, inclusive of what it calls."""

    instructions: float
    d1_misses: float | None = None


PERF_MAP = "/tmp/perf-{pid}.map"  # where Python's perf trampolines name themselves
# a line of `callgrind_annotate --inclusive=yes`: its counts (a percentage after each, or `.` for
# none), then a function known only by its address
_ANNOTATED = re.compile(r"^\s*((?:(?:[\d,]+(?:\s+\([^)]*\))?|\.)\s+)+)(?:\?\?\?:)?0x([0-9a-fA-F]+)\b")
_COUNT = re.compile(r"([\d,]+|\.)(?:\s+\([^)]*\))?")


@dataclass(frozen=True)
class Stubs:
    """The perf trampolines of one process, by address: each one's start, end and name."""

    starts: list[int]
    ends: list[int]
    names: list[str]

    def name_at(self, address: int) -> str | None:
        at = bisect.bisect_right(self.starts, address) - 1
        return self.names[at] if at >= 0 and address < self.ends[at] else None


def perf_map(text: str) -> Stubs:
    """The stubs a perf map lists, one per line: `START SIZE NAME`, hexadecimal."""
    stubs = sorted((int(start, 16), int(start, 16) + int(size, 16), name) for start, size, name in
                   (line.split(" ", 2) for line in text.splitlines() if line.count(" ") >= 2))
    return Stubs([s for s, _, _ in stubs], [e for _, e, _ in stubs], [n for _, _, n in stubs])


def function_costs(annotated: str, stubs: Stubs, requests: int, package: str) -> dict[str, FunctionCost]:
    """Per Python function defined under the folder `package` (its perf-map name,
    `py::QUALNAME:FILE`): the inclusive counts `callgrind_annotate --inclusive=yes
    --show=Ir[,D1mr]` gives its stub, per request. Stubs of one name (a function made again, such
    as a closure) are added up."""
    sums: dict[str, list[int]] = {}
    for line in annotated.splitlines():
        found = _ANNOTATED.match(line)
        name = stubs.name_at(int(found.group(2), 16)) if found else None
        if found is None or name is None or not name.rpartition(":")[2].startswith(package):
            continue
        counts = [0 if n == "." else int(n.replace(",", "")) for n in _COUNT.findall(found.group(1))]
        total = sums.setdefault(name, [0] * len(counts))
        for i, n in enumerate(counts[:len(total)]):
            total[i] += n
    return {name: FunctionCost(c[0] / requests, c[1] / requests if len(c) > 1 else None)
            for name, c in sums.items()}


def functions_table(costs: dict[str, FunctionCost], top: int) -> str:
    """The `top` functions by data cache misses (by instructions without the cache simulation)."""
    def weight(cost: FunctionCost) -> float:
        return cost.d1_misses if cost.d1_misses is not None else cost.instructions

    ranked = sorted(costs.items(), key=lambda kv: -weight(kv[1]))[:top]
    rows = [[name.removeprefix("py::"), bench.fmt(cost.instructions, 0), bench.fmt(cost.d1_misses, 0)]
            for name, cost in ranked]
    return bench.markdown(["function (inclusive, per request)", "instructions", "D1 misses"], rows)


async def load(proxy: bench.Proxy, requests: int) -> None:
    """`requests` small chats over CLIENTS keep-alive connections; any failure is an error."""
    conns = [bench.Conn(proxy.bulk_port) for _ in range(CLIENTS)]
    numbers = itertools.count()

    async def client(conn: bench.Conn, k: int) -> None:
        while (i := next(numbers)) < requests:
            body = json.dumps({"model": bench.MODEL, "max_tokens": 1, "messages": [
                {"role": "user", "content": f"client {k}"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": f"question {i}"}]}).encode()
            got = await conn.post_stream(proxy.bulk_prefix + bench.CHAT, body)
            if got.status != 200:
                raise RuntimeError(f"{proxy.name}: a request got HTTP {got.status}")

    try:
        await asyncio.gather(*(client(conn, k) for k, conn in enumerate(conns)))
    finally:
        for conn in conns:
            await conn.close()


def callgrind_control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True, timeout=120)


def counted(dump: Path) -> dict[str, int]:
    """The totals of a callgrind dump, by event (Ir: instructions; with the cache simulation D1mr,
    I1mr, ...: misses)."""
    events: list[str] = []
    for line in dump.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("summary:"):
            return dict(zip(events, map(int, line.split()[1:]), strict=True))
    raise RuntimeError(f"{dump}: no summary line")


async def per_request(name: str, tree: Path | None, requests: int, workdir: Path,
                      cache_sim: bool = False, functions: bool = False) -> Count:
    """Instructions per request of bare mitmdump (`tree` None) or of crossbar from `tree`."""
    host_port, port = bench.free_port(), bench.free_port()
    config = bench.write_crossbar_toml(workdir / f"{name}.toml", port, workdir / f"{name}.db",
                                       {"fast": host_port}, "bench", poll_interval="30s",
                                       parallel=bench.RPS_CLIENTS)
    # under valgrind the first health poll can take seconds: give it time instead of marking it down
    config.write_text(config.read_text().replace('poll_timeout = "2s"', 'poll_timeout = "60s"'))
    out = workdir / f"callgrind.{name}"
    valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                *(["--cache-sim=yes"] if cache_sim else []), f"--callgrind-out-file={out}.%p"]
    if tree is None:
        cmd, ready, prefix = bench.bare_mitmdump_cmd({port: host_port}, config), "/health", ""
    else:
        cmd, ready, prefix = bench.crossbar_cmd(config, tree), "/_crossbar/hosts", "/bench"
    if functions:  # `env` execs valgrind, which runs the proxy: one process, one pid, one perf map
        valgrind = ["env", "PYTHONPERFSUPPORT=1", *valgrind]
    host_cmd = bench.sim_cmd(host_port, 0.0, 1, slots=bench.RPS_CLIENTS)
    stubs: Path | None = None  # the proxy's perf map, removed however the run ends
    try:
        async with bench.running("host", host_cmd, workdir, host_port, "/health"), \
                bench.running(name, valgrind + cmd, workdir, port, ready, ready_timeout=300) as proc:
            proxy = bench.Proxy(name, proc, port, bench.CHAT, port, prefix)
            pid = proc.popen.pid
            stubs = Path(PERF_MAP.format(pid=pid)) if functions else None
            await load(proxy, WARMUP)
            callgrind_control(pid, "--instr=on")
            callgrind_control(pid, "--zero")
            await load(proxy, requests)
            callgrind_control(pid, "--dump")
            callgrind_control(pid, "--instr=off")
        dumps = sorted(workdir.glob(f"callgrind.{name}.*.1-*"))  # one per thread: -01 is the event loop's
        if not dumps:
            raise RuntimeError(f"{name}: callgrind wrote no dump")
        costs: dict[str, FunctionCost] = {}
        if stubs is not None and tree is not None:
            costs = python_functions(dumps[0], stubs, requests, cache_sim, f"{tree}/crossbar/")
    finally:
        if stubs is not None:
            stubs.unlink(missing_ok=True)
    threads = [counted(dump) for dump in dumps]
    loop = threads[0]
    misses = {key: loop[key] / requests if key in loop else None for key in ("D1mr", "I1mr")}
    return Count(total=sum(t["Ir"] for t in threads) / requests, loop=loop["Ir"] / requests,
                 d1_misses=misses["D1mr"], i1_misses=misses["I1mr"], functions=costs)


def python_functions(dump: Path, stubs: Path, requests: int, cache_sim: bool,
                     package: str) -> dict[str, FunctionCost]:
    """The inclusive costs, in the event loop's dump, of the functions defined under `package`."""
    shown = "Ir,D1mr" if cache_sim else "Ir"
    annotated = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", f"--show={shown}", str(dump)],
        check=True, capture_output=True, text=True, timeout=600).stdout
    return function_costs(annotated, perf_map(stubs.read_text()), requests, package)


async def measure(trees: Sequence[Path], requests: int, keep: Path | None,
                  cache_sim: bool = False, functions: bool = False) -> dict[str, Count]:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        result = {"mitmdump": await per_request("mitmdump", None, requests, workdir, cache_sim, functions)}
        for i, tree in enumerate(trees):
            result[str(tree)] = await per_request(f"crossbar{i}", tree, requests, workdir, cache_sim,
                                                  functions)
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for dump in workdir.glob("callgrind.*"):
                shutil.copy(dump, keep / dump.name)
        return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("other", type=Path, nargs="*", help="other crossbar checkouts to count too")
    parser.add_argument("--requests", type=int, default=300, help="requests counted per proxy (default 300)")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep the callgrind dumps (one per proxy and thread) in DIR")
    parser.add_argument("--cache-sim", action="store_true",
                        help="also simulate the caches: the event loop's first-level misses per request")
    parser.add_argument("--functions", type=int, default=0, metavar="K",
                        help="with Python's perf trampolines: each crossbar tree's K costliest functions")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.error("valgrind is not installed (apt install valgrind)")
    others = [tree.resolve() for tree in args.other]
    for tree in others:
        if not (tree / "addons" / "crossbar.py").is_file():
            parser.error(f"{tree} is not a crossbar checkout (no addons/crossbar.py)")
    signal.signal(signal.SIGTERM, bench._sigterm)  # unwinds, so every process started is stopped
    if args.functions < 0:
        parser.error("--functions takes a count of functions")
    result = asyncio.run(measure([bench.ROOT, *others], args.requests, args.keep, args.cache_sim,
                                 args.functions > 0))
    bare = result["mitmdump"]
    rows = [[name if name == "mitmdump" else f"crossbar, {name}", bench.fmt(count.total, 0),
             bench.fmt(count.total / bare.total, 3), bench.fmt(count.loop, 0),
             bench.fmt(count.total - count.loop, 0)] for name, count in result.items()]
    head = ["proxy", "instructions per request", "÷ bare mitmdump", "event loop thread", "other threads"]
    if args.cache_sim:
        head += ["D1 misses (event loop)", "I1 misses (event loop)"]
        for row, count in zip(rows, result.values(), strict=True):
            row += [bench.fmt(count.d1_misses, 0), bench.fmt(count.i1_misses, 0)]
    if args.functions:
        print("(all proxies ran with Python's perf trampolines, which add instructions and misses)\n")
    print(bench.markdown(head, rows))
    for name, count in result.items():
        if name != "mitmdump" and args.functions:
            print(f"\ncrossbar, {name}: its {args.functions} costliest functions (with perf trampolines)\n")
            print(functions_table(count.functions, args.functions))
    if args.out:
        args.out.write_text(json.dumps({name: asdict(count) for name, count in result.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
