"""Python lines and calls of crossbar's own code per request, counted exactly.

    .venv/bin/python bench/lines.py [OTHER_TREE ...] [--requests N] [--top K] [--out FILE.json]

Time on a shared machine drifts too much to see a change of a few percent; what crossbar's hooks
cost tracks how much of its code a request runs, and that can be counted. Each tree's crossbar
runs under mitmdump with `bench/linecount_addon.py` (`sys.monitoring`) in front of it, takes 100
requests to warm up, then counts the lines and function calls in its `crossbar` package during N
more requests of the pressure section's load (small non-streamed chats, 4 keep-alive clients, a
simulated host that answers at once). Reported per tree: lines, calls, distinct lines run at
least once per request on average, and the same by module; with `--top K`, this tree's K
functions that run the most lines. With `--everything`, all Python code in the process is counted
(mitmproxy's, the standard library's, code generated at run time such as named tuples'
constructors), for bare mitmdump too: what crossbar's hooks make run beyond crossbar's own files
shows up as well. OTHER_TREE, another crossbar checkout (`git worktree add
/tmp/before <commit>`), runs from this tree's virtualenv. Every process it starts is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import urllib.request
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import instructions

import bench

WARMUP = 100
ADDON = Path(__file__).resolve().parent / "linecount_addon.py"


@dataclass(frozen=True)
class PerRequest:
    """Counts per request: over all of crossbar, by module, and by function."""

    lines: float
    calls: float
    distinct: int  # lines run at least once per request on average
    modules: dict[str, float] = field(default_factory=dict)  # lines per request
    functions: dict[str, float] = field(default_factory=dict)  # lines per request


def per_request(counts: Mapping[str, Mapping[str, int]], requests: int) -> PerRequest:
    """Summarise the addon's answer ("module:function" calls, "module:function:line" lines)."""
    modules: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    distinct = 0
    for where, n in counts["lines"].items():
        function = where.rsplit(":", 1)[0]
        modules[function.split(":", 1)[0]] += n / requests
        functions[function] += n / requests
        distinct += n >= requests
    return PerRequest(lines=sum(counts["lines"].values()) / requests,
                      calls=sum(counts["calls"].values()) / requests, distinct=distinct,
                      modules=dict(modules), functions=dict(functions))


def _get(port: int, path: str) -> dict[str, dict[str, int]]:
    with urllib.request.urlopen(f"http://{bench.LOOPBACK}:{port}{path}", timeout=60) as reply:
        return json.loads(reply.read())


async def count(tree: Path | None, requests: int, workdir: Path, name: str, everything: bool) -> PerRequest:
    """Per request of crossbar from `tree`, or of bare mitmdump (`tree` None: `everything` only)."""
    host_port, port = bench.free_port(), bench.free_port()
    config = bench.write_crossbar_toml(workdir / f"{name}.toml", port, workdir / f"{name}.db",
                                       {"fast": host_port}, "bench", poll_interval="30s",
                                       parallel=bench.RPS_CLIENTS)
    host_cmd = bench.sim_cmd(host_port, 0.0, 1, slots=bench.RPS_CLIENTS)
    if tree is None:
        cmd, ready, prefix = bare_counted_cmd(config, host_port, port), "/health", ""
    else:
        cmd, ready, prefix = counted_cmd(config, tree, everything), "/_crossbar/hosts", "/bench"
    async with bench.running("host", host_cmd, workdir, host_port, "/health"), \
            bench.running(name, cmd, workdir, port, ready) as proc:
        proxy = bench.Proxy(name, proc, port, bench.CHAT, port, prefix)
        await instructions.load(proxy, WARMUP)
        await asyncio.to_thread(_get, port, "/__linecount/start")
        await instructions.load(proxy, requests)
        counts = await asyncio.to_thread(_get, port, "/__linecount/stop")
    return per_request(counts, requests)


def counted_cmd(config: Path, tree: Path, everything: bool = False) -> list[str]:
    """crossbar from `tree` with the counting script loaded first, counting `tree`'s package (or,
    with `everything`, all Python code)."""
    mitmdump, *rest = bench.crossbar_cmd(config, tree)
    root = "/" if everything else tree / "crossbar"
    return [mitmdump, "-s", str(ADDON), "--set", f"linecount_root={root}", *rest]


def bare_counted_cmd(config: Path, host_port: int, port: int) -> list[str]:
    """Bare mitmdump, as the other benchmarks run it, counting all Python code."""
    bare = bench.bare_mitmdump_cmd({port: host_port}, config)
    return [*bare, "-s", str(ADDON), "--set", "linecount_root=/"]


async def measure(trees: Sequence[Path], requests: int, everything: bool) -> dict[str, PerRequest]:
    with tempfile.TemporaryDirectory() as tmp:
        result = {str(tree): await count(tree, requests, Path(tmp), f"crossbar{i}", everything)
                  for i, tree in enumerate(trees)}
        if everything:
            result["bare mitmdump"] = await count(None, requests, Path(tmp), "mitmdump", everything)
        return result


def table(result: Mapping[str, PerRequest], top: int) -> str:
    trees = list(result)
    out = ["| proxy | lines per request | calls per request | distinct lines |", "|---|---|---|---|"]
    out += [f"| {t} | {r.lines:,.0f} | {r.calls:,.0f} | {r.distinct:,} |" for t, r in result.items()]
    modules = sorted({m for r in result.values() for m in r.modules},
                     key=lambda m: -result[trees[0]].modules.get(m, 0.0))
    out += ["", "| module | " + " | ".join(trees) + " |", "|---|" + "---|" * len(trees)]
    out += [f"| {m} | " + " | ".join(f"{result[t].modules.get(m, 0.0):,.1f}" for t in trees) + " |"
            for m in modules]
    if top:
        first = result[trees[0]]
        out += ["", f"| function ({trees[0]}) | lines per request |", "|---|---|"]
        out += [f"| {f} | {n:,.1f} |" for f, n in Counter(first.functions).most_common(top)]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, nargs="*", help="other crossbar checkouts to count too")
    parser.add_argument("--requests", type=int, default=1000, help="requests counted per tree (default 1000)")
    parser.add_argument("--top", type=int, default=0, help="also list this tree's K busiest functions")
    parser.add_argument("--everything", action="store_true",
                        help="count all Python code (mitmproxy, the standard library), bare mitmdump too")
    parser.add_argument("--out", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    others = [tree.resolve() for tree in args.other]
    for tree in others:
        if not (tree / "addons" / "crossbar.py").is_file():
            parser.error(f"{tree} is not a crossbar checkout (no addons/crossbar.py)")
    result = asyncio.run(measure([bench.ROOT, *others], args.requests, args.everything))
    print(table(result, args.top))
    if args.out:
        args.out.write_text(json.dumps({t: asdict(r) for t, r in result.items()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
