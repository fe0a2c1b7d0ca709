"""The comparison tools of bench/: what they read and which code they run."""

from __future__ import annotations

import asyncio
import math
import os
import random
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import instructions
import linecount_addon
import lines
import rps_ab

import bench


def test_a_callgrind_dump_is_read_for_its_totals(tmp_path: Path) -> None:
    dump = tmp_path / "callgrind.x.1"
    dump.write_text("version: 1\ncreator: callgrind-3.19.0\npart: 1\nevents: Ir\nsummary: 2078437611\n"
                    "totals: 2078438221\n")
    assert instructions.counted(dump) == {"Ir": 2078437611}
    dump.write_text("events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw\nsummary: 900 300 100 40 12 3 1 2 0\n")
    assert instructions.counted(dump) == {"Ir": 900, "Dr": 300, "Dw": 100, "I1mr": 40, "D1mr": 12, "D1mw": 3,
                                          "ILmr": 1, "DLmr": 2, "DLmw": 0}
    dump.write_text("events: Ir\n")
    with pytest.raises(RuntimeError, match="no summary"):
        instructions.counted(dump)


_PERF_MAP = """\
7f00 b py::<module>:/src/crossbar/addons/crossbar.py
9000 20 py::Route.request:/src/crossbar/crossbar/addons/route.py
9020 20 py::_run_async.<locals>.hook:/src/crossbar/crossbar/addons/bundle.py
9040 20 py::_run_async.<locals>.hook:/src/crossbar/crossbar/addons/bundle.py
9060 20 py::HTTPLayer.handle:/src/crossbar/.venv/site-packages/mitmproxy/proxy/layers/http/__init__.py
9080 10 py::Exchange.end:/src/crossbar/crossbar/exchange.py
"""
# a checkout named like its package, as a clone is: only functions under its crossbar/ count
_ANNOTATED = """\
--------------------------------------------------------------------------------
Ir                     D1mr
--------------------------------------------------------------------------------
3,000,000 (100.0%)  60,000 (100.0%)  PROGRAM TOTALS
   900,000 (30.0%)   6,000 (10.0%)  ???:0x0000000000009061 [???]
   600,000 (20.0%)   3,000 ( 5.0%)  ???:0x0000000000009004 [???]
   450,000 (15.0%)   4,500 ( 7.5%)  ???:0x0000000000009020 [???]
   150,000 ( 5.0%)     300 ( 0.5%)  ???:0x000000000000904b [???]
    60,000 ( 2.0%)           .      ???:0x0000000000009081 [???]
    30,000 ( 1.0%)     600 ( 1.0%)  /python/Python/ceval.c:_PyEval_EvalFrameDefault [libpython3.12.so]
    20,000 ( 0.7%)     400 ( 0.7%)  ???:0x0000000000009095 [libssl.so.3]
    10,000 ( 0.3%)      90 ( 0.2%)  ???:0x0000000000007f01 [???]
"""


def test_a_python_function_s_inclusive_cost_is_read_through_its_perf_trampoline() -> None:
    stubs = instructions.perf_map(_PERF_MAP)
    assert stubs.starts == sorted(stubs.starts) and len(stubs.names) == 6
    costs = instructions.function_costs(_ANNOTATED, stubs, requests=300, package="/src/crossbar/crossbar/")
    # mitmproxy's function and the addon script's module are not the package's; C code has no stub,
    # nor has an address past the last stub's end; the two stubs of one closure add up; a count
    # callgrind shows as "." is none
    route, hook, end = (f"py::{name}:/src/crossbar/crossbar/{module}.py" for name, module in
                        (("Route.request", "addons/route"), ("_run_async.<locals>.hook", "addons/bundle"),
                         ("Exchange.end", "exchange")))
    cost = instructions.FunctionCost
    assert costs == {route: cost(2000, 10), hook: cost(2000, 16), end: cost(200, 0)}
    only_instructions = instructions.function_costs(
        "Ir\n   600,000 (20.0%)  ???:0x0000000000009004 [???]\n", stubs, 300, "/src/crossbar/crossbar/")
    assert only_instructions == {route: cost(2000)}
    table = instructions.functions_table(costs, top=2)
    assert "_run_async.<locals>.hook:/src/crossbar/crossbar/addons/bundle.py | 2,000 | 16" in table
    # ranked by misses: no miss is 0, not its instructions (200, which would rank it first)
    assert "Route.request" in table and "Exchange.end" not in table


def test_the_other_tree_runs_its_own_entry_script(tmp_path: Path) -> None:
    cmd = bench.crossbar_cmd(tmp_path / "c.toml", tmp_path / "before")
    assert cmd[cmd.index("-s") + 1] == str(tmp_path / "before" / "addons" / "crossbar.py")
    assert f"crossbar_config={tmp_path / 'c.toml'}" in cmd


def test_rounds_are_compared_pairwise_not_by_their_medians() -> None:
    # the machine's speed moved between rounds: two rounds say 0.5; the medians (100 / 400) say 0.25
    a, b = [300, 100, 50], [600, 200, 400]
    assert bench.pair_ratio(a, b) == 0.5
    assert bench.pct(a, 50) / bench.pct(b, 50) == 0.25


def test_the_ratio_comes_with_a_bootstrap_interval_of_its_median() -> None:
    rounds = [0.80, 0.85, 0.90, 0.92, 0.94, 0.95, 0.96, 0.98, 1.00, 1.05, 1.10, 1.20]
    lo, hi = bench.median_interval(rounds)
    assert lo < bench.pct(rounds, 50) < hi
    half_lo, half_hi = bench.median_interval(rounds, level=0.5)  # a lower level: a narrower interval
    assert lo <= half_lo < half_hi <= hi and (half_lo, half_hi) != (lo, hi)
    more_lo, more_hi = bench.median_interval(rounds * 9)  # more rounds alike: a narrower interval
    assert lo <= more_lo < more_hi <= hi and more_hi - more_lo < (hi - lo) / 2
    # three values, every sample's median known: 7 of 27 samples give 1, 7 give 3, 13 give 2
    assert bench.median_interval([1.0, 2.0, 3.0], level=0.4) == (2.0, 2.0)
    assert bench.median_interval([1.0, 2.0, 3.0], level=0.9) == (1.0, 3.0)
    assert bench.median_interval([0.9] * 5) == (0.9, 0.9)


def test_the_interval_is_one_per_run_and_leaves_out_rounds_without_a_figure() -> None:
    drawn = random.Random(7)
    rounds = [drawn.gauss(0.95, 0.1) for _ in range(60)]
    assert bench.median_interval(rounds) == bench.median_interval(list(reversed(rounds)))  # order
    assert bench.median_interval(rounds) == bench.median_interval(rounds)  # seeded
    assert bench.median_interval(rounds, seed=1) != bench.median_interval(rounds)
    assert bench.median_interval([0.9, math.nan, 0.9, math.inf, 0.9]) == (0.9, 0.9)
    assert all(math.isnan(v) for v in bench.median_interval([0.9, 1.0]))  # too few rounds to say
    with pytest.raises(ValueError):
        bench.median_interval(rounds, level=1.0)
    # a round whose bare window answered nothing has no ratio: the median and its interval both
    # come from the others
    crossbar, bare = [90.0, 95.0, 100.0, 50.0], [100.0, 100.0, 100.0, 0.0]
    assert bench.round_ratios(crossbar, bare) == [0.9, 0.95, 1.0]
    assert bench.pair_ratio(crossbar, bare) == 0.95


async def test_the_tree_comparison_reports_each_ratio_with_its_interval(
        monkeypatch: pytest.MonkeyPatch) -> None:
    bare = [100.0, 100.0, 100.0, 100.0]
    windows = bench.Windows(rps={"mitmdump#0": bare, "this#0": [90.0, 95.0, 100.0, 105.0],
                                 "other#0": [80.0, 80.0, 80.0, 80.0]},
                            cpu_us={"mitmdump#0": [1.0] * 4, "this#0": [1.1] * 4, "other#0": [1.2] * 4},
                            errors={"mitmdump#0": 0, "this#0": 0, "other#0": 0})

    async def fake_windows(proxies: object, n: int, seconds: float) -> bench.Windows:
        return windows

    monkeypatch.setattr(bench, "rotating_windows", fake_windows)
    result = await rps_ab.rounds([], 4)
    lo, hi = result["this"]["rps_ratio_interval"]
    assert 0.9 <= lo <= result["this"]["rps_ratio"] == 0.975 <= hi <= 1.05
    assert result["other"]["rps_ratio_interval"] == (0.8, 0.8)
    assert f"| {bench.fmt(lo, 3)}–{bench.fmt(hi, 3)} |" in rps_ab.table(result, Path("/before"))


def test_cpu_time_is_read_for_the_whole_process() -> None:
    before = bench.cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))  # some CPU work in this process
    assert bench.cpu_seconds(os.getpid()) > before


def test_pinning_gives_the_proxies_the_last_cpu_and_the_load_the_rest() -> None:
    assert rps_ab.split_cpus({0, 1}) == ({1}, {0})
    assert rps_ab.split_cpus({2, 5, 7}) == ({7}, {2, 5})
    with pytest.raises(ValueError, match="two CPUs"):
        rps_ab.split_cpus({3})
    cmd = ["mitmdump", "-s", "x.py"]
    assert rps_ab.pinned(cmd, None) == cmd
    assert rps_ab.pinned(cmd, {1, 0}) == ["taskset", "-c", "0,1", *cmd]


def test_line_counts_are_summed_per_request_by_module_and_function() -> None:
    counts = {"calls": {"app.py:Router.lease": 200, "lease.py:view": 400},
              "lines": {"app.py:Router.lease:10": 200, "app.py:Router.lease:11": 50,
                        "lease.py:view:5": 400, "addons/route.py:Route.request:3": 200}}
    got = lines.per_request(counts, 100)
    assert (got.lines, got.calls) == (8.5, 6.0)
    assert got.distinct == 3  # line 11 ran on half of the requests only
    assert got.modules == {"app.py": 2.5, "lease.py": 4.0, "addons/route.py": 2.0}
    assert got.functions == {"app.py:Router.lease": 2.5, "lease.py:view": 4.0,
                             "addons/route.py:Route.request": 2.0}


def test_the_counting_script_runs_first_and_counts_the_tree_it_is_given(tmp_path: Path) -> None:
    cmd = lines.counted_cmd(tmp_path / "c.toml", tmp_path / "before")
    scripts = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "-s"]
    assert scripts == [str(lines.ADDON), str(tmp_path / "before" / "addons" / "crossbar.py")]
    assert f"linecount_root={tmp_path / 'before' / 'crossbar'}" in cmd


def test_the_counting_script_counts_only_code_under_its_root(tmp_path: Path) -> None:
    package = tmp_path / "crossbar"
    package.mkdir()
    (package / "counted_mod.py").write_text("def work(n):\n    total = 0\n    for i in range(n):\n"
                                            "        total += i\n    return total\n")
    sys.path.insert(0, str(package))
    try:
        import counted_mod
    finally:
        sys.path.remove(str(package))
    counter = linecount_addon.LineCount(str(package))
    counter.start()
    try:
        counted_mod.work(3)
        textwrap.dedent("  x")  # Python code outside the root: not counted
    finally:
        counts = counter.stop()
    assert counts["calls"] == {"counted_mod.py:work": 1}
    assert counts["lines"] == {"counted_mod.py:work:2": 1, "counted_mod.py:work:3": 4,
                               "counted_mod.py:work:4": 3, "counted_mod.py:work:5": 1}


def test_the_counting_script_takes_a_second_start_and_a_stop_without_one(tmp_path: Path) -> None:
    counter = linecount_addon.LineCount(str(tmp_path))
    assert counter.stop() == {"calls": {}, "lines": {}}
    counter.start()
    counter.start()
    assert counter.stop() == {"calls": {}, "lines": {}}


def test_replicas_are_averaged_round_by_round_per_kind() -> None:
    figures = {"mitmdump#0": [10.0, 20.0], "this#0": [8.0, 18.0], "mitmdump#1": [12.0, 22.0],
               "this#1": [10.0, 20.0]}
    assert bench.by_kind(figures) == {"mitmdump": [11.0, 21.0], "this": [9.0, 19.0]}


async def _counting_server(connections: list[int], answers_per_connection: int = 0) -> asyncio.Server:
    """A keep-alive HTTP/1.1 server on loopback answering every POST with a small JSON body,
    closing a connection after `answers_per_connection` answers (0: never); `connections` gets
    one entry per connection it accepts."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        answered = 0
        try:
            while answers_per_connection == 0 or answered < answers_per_connection:
                answered += 1
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    return await asyncio.start_server(serve, bench.LOOPBACK, 0)


async def _windows(answers_per_connection: int = 0) -> tuple[bench.Windows, int]:
    """Three rounds of 0.1 s windows of two "proxies" that are one counting server; the windows
    and how many connections the server accepted."""
    connections: list[int] = []
    server = await _counting_server(connections, answers_per_connection)
    port = server.sockets[0].getsockname()[1]
    this = SimpleNamespace(popen=SimpleNamespace(pid=os.getpid()))  # CPU time is read from this process
    proxies = [bench.Proxy(name, this, port, "", port, "") for name in ("mitmdump", "crossbar")]
    try:
        return await bench.rotating_windows(proxies, windows=3, seconds=0.1), len(connections)
    finally:
        server.close()
        await server.wait_closed()


async def test_rate_windows_keep_their_connections_from_one_window_to_the_next() -> None:
    w, connections = await _windows()
    assert connections == 2 * bench.RPS_CLIENTS  # opened once per proxy, warm-up included
    assert w.reopened == {"mitmdump": 0, "crossbar": 0}
    assert all(len(values) == 3 and min(values) > 0 for values in w.rps.values())
    assert w.errors == {"mitmdump": 0, "crossbar": 0}
    assert all(value > 0 for value in w.cpu_us_whole.values())


async def test_a_connection_the_server_closed_is_reported_as_reopened() -> None:
    w, connections = await _windows(answers_per_connection=1)
    assert connections > 2 * bench.RPS_CLIENTS
    assert sum(w.reopened.values()) == connections - 2 * bench.RPS_CLIENTS
    assert w.errors == {"mitmdump": 0, "crossbar": 0}  # each request still answered
