"""Placement under uneven load: strict session-hash stickiness vs crossbar's policy, one run.

    .venv/bin/python bench/yield_bench.py [--seed 0] [--seeds 60] [--factors 1,1.5,2,3] [--out FILE.json]

The same sessions run on a time-modelled fleet (`llamasim.timed`: 3 hosts x 1 slot, prefill
20k tok/s, generation 1k tok/s, a host prompt cache, on a virtual clock, so a run is
deterministic and takes milliseconds) through each placement:

- strict: every turn of a session goes to the host its session hash names;
- crossbar before: a new session goes to the most free slots x weight, then the shortest queue,
  then config order (the ranking before held work); leases never move;
- crossbar, held work: a new session goes where `crossbar.choose` ranks best by the work hosts
  hold (running, queued, leases, recent busy time per slot x weight);
- crossbar, held work, yield factor F: also, a turn that would wait on its host (on arrival, and
  again whenever a slot frees while it is queued, once per turn) asks
  `crossbar.yieldpolicy.decide` whether to move. Rates come from `crossbar.learn.RateLearner`
  fed with the hosts' `timings`, busy time from `crossbar.learn.BusyMeter`, and what a host
  likely caches from the tokens it last served of the session: only facts crossbar's router has.

Two loads: even (12 sessions, replies of 100-700 tokens) and skewed (8 sessions, 2 of which
generate 4-6k tokens every turn); 8 turns per session, first contexts of 20-40k tokens, sessions
starting within 2 s. Reported per load for `--seed`: p50/p95/max/mean turn latency (arrival to
last token), cached share of prompt tokens, moves, busy time per host, and the ratios against
strict with the targets' PASS/MISS; then, over `--seeds` session sets, how often each variant
meets the targets and its median ratios. `--factors` (default: the shipped factor) adds yield
factors to compare. Targets are reported, never asserted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from crossbar.choose import Candidate, choose
from crossbar.learn import BusyMeter, RateLearner
from crossbar.yieldpolicy import DEFAULT_FACTOR, HostLoad, Move, decide
from llamasim.timed import TimedHost, TimedRequest, TimeModel, VirtualClock

MODEL = "m"
HOSTS = ("h1", "h2", "h3")
FLEET = TimeModel(prefill_tps=20_000.0, gen_tps=1_000.0, slots=1)
TURNS = 8
ACTIVE_WINDOW_S = 600.0  # a lease used this recently counts as held work


@dataclass(frozen=True, slots=True)
class Turn:
    added_tokens: int  # the user message / tool output this turn appends to the context
    reply_tokens: int
    think_s: float  # client time between the previous reply and this turn


@dataclass(frozen=True, slots=True)
class Session:
    name: str
    start_s: float
    context_tokens: int  # prompt of the first turn
    turns: tuple[Turn, ...]


def make_sessions(rng: random.Random, count: int, long_generators: int) -> list[Session]:
    sessions = []
    for i in range(count):
        long = i < long_generators
        turns = tuple(
            Turn(rng.randint(300, 2_500), rng.randint(4_000, 6_000) if long else rng.randint(100, 700),
                 rng.uniform(0.5, 3.0))
            for _ in range(TURNS)
        )
        sessions.append(Session(f"s{i:02d}-{rng.getrandbits(32):08x}", rng.uniform(0.0, 2.0),
                                rng.randint(20_000, 40_000), turns))
    return sessions


class Strict:
    """Session-hash stickiness: the host is a function of the session alone."""

    name = "strict"

    def __init__(self, hosts: dict[str, TimedHost]) -> None:
        self.names = sorted(hosts)
        self.moves = 0

    def place(self, session: str, prompt_tokens: int, now: float) -> str:
        digest = int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big")
        return self.names[digest % len(self.names)]

    def started(self, request: TimedRequest, host: str) -> None:
        return None

    def finished(self, request: TimedRequest, host: str) -> None:
        return None


@dataclass
class Lease:
    host: str
    used: float


class CrossbarPolicy:
    """crossbar's placement, fed only with what its router can know."""

    def __init__(self, hosts: dict[str, TimedHost], clock: Callable[[], float], factor: float,
                 held_work: bool = True) -> None:
        self.name = variant_name(factor, held_work)
        self.held_work = held_work
        self.hosts = hosts
        self.clock = clock
        self.factor = factor
        self.learner = RateLearner(clock)
        self.meter = BusyMeter(clock)
        self.leases: dict[str, Lease] = {}
        self.yielded: set[str] = set()  # sessions whose current turn has yielded once already
        self.moves = 0

    def place(self, session: str, prompt_tokens: int, now: float) -> str:
        lease = self.leases.get(session)
        if lease is None:
            lease = self.leases[session] = Lease(self._place_new(now), now)
        elif self._would_wait(lease.host):
            target = self._yield_target(session, prompt_tokens, len(self.hosts[lease.host].waiting), now)
            if target:
                lease.host = target
        lease.used = now
        return lease.host

    def rebalance(self, now: float) -> None:
        """A slot freed somewhere: each queued turn may yield to another host (once per turn)."""
        for h in self.hosts.values():
            for ahead, request in enumerate(list(h.waiting)):
                if request.conversation in self.yielded:
                    continue
                target = self._yield_target(request.conversation, request.prompt_tokens, ahead, now)
                if target and h.withdraw(request):
                    self.leases[request.conversation].host = target
                    self.hosts[target].submit(request)

    def _yield_target(self, session: str, prompt_tokens: int, ahead: int, now: float) -> str:
        lease = self.leases[session]
        home = self._load(lease.host, session, now, ahead)
        others = [self._load(name, session, now, len(h.waiting)) for name, h in self.hosts.items()
                  if name != lease.host]
        verdict = decide(prompt_tokens, home, others, self.factor)
        if not isinstance(verdict, Move):
            return ""
        self.moves += 1
        self.yielded.add(session)
        return verdict.host

    def _place_new(self, now: float) -> str:
        candidates = self._candidates(now)
        if not self.held_work:  # the ranking before held work: free slots x weight, queue, config order
            return min(candidates, key=lambda c: (-(max(c.free_slots, 0) * c.weight), c.queued, c.order)).name
        choice = choose(candidates)
        assert choice is not None
        return choice.host

    def _would_wait(self, host: str) -> bool:
        h = self.hosts[host]
        return len(h.running) + len(h.waiting) >= h.model.slots

    def _candidates(self, now: float) -> list[Candidate]:
        held = {h: 0 for h in self.hosts}
        for lease in self.leases.values():
            if now - lease.used <= ACTIVE_WINDOW_S:
                held[lease.host] += 1
        return [
            Candidate(name, True, False, True, True, h.model.slots - len(h.running), 1.0, len(h.waiting), i,
                      slots=h.model.slots, in_flight=len(h.running), active_leases=held[name],
                      recent_busy=self.meter.busy(name))
            for i, (name, h) in enumerate(self.hosts.items())
        ]

    def _load(self, name: str, session: str, now: float, queued: int) -> HostLoad:
        h = self.hosts[name]
        running = [(now - r.started, r.conversation) for r in h.running]
        return self.learner.host_load(name, MODEL, h.model.slots, running, queued, session)

    def started(self, request: TimedRequest, host: str) -> None:
        self.meter.start(host)

    def finished(self, request: TimedRequest, host: str) -> None:
        self.meter.end(host)
        self.learner.observe(host, MODEL, self.hosts[host].timings(request), request.conversation)
        self.yielded.discard(request.conversation)
        if self.factor > 0:
            self.rebalance(self.clock())


@dataclass
class Result:
    policy: str
    latencies: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    moves: int = 0
    busy_s: dict[str, float] = field(default_factory=dict)
    span_s: float = 0.0

    def summary(self) -> dict[str, float]:
        ordered = sorted(self.latencies)
        return {
            "p50": pct(ordered, 0.50), "p95": pct(ordered, 0.95), "max": ordered[-1],
            "mean": statistics.fmean(ordered), "cached": self.cached_tokens / self.prompt_tokens,
            "moves": self.moves, "turns": len(ordered),
        }


def pct(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    rank = max(1, -(-len(ordered) * q // 1))
    return ordered[int(rank) - 1]


def run(sessions: list[Session], make_policy: Callable[[dict[str, TimedHost], VirtualClock], Any]) -> Result:
    clock = VirtualClock()
    hosts = {name: TimedHost(name, clock, FLEET) for name in HOSTS}
    policy = make_policy(hosts, clock)
    result = Result(policy.name)

    def turn(session: Session, index: int, context: int) -> None:
        arrived = clock.now
        spec = session.turns[index]
        prompt = context + spec.added_tokens
        host = policy.place(session.name, prompt, arrived)

        def done(request: TimedRequest) -> None:
            policy.finished(request, request.host)
            result.latencies.append(request.finished - arrived)
            result.prompt_tokens += request.prompt_tokens
            result.cached_tokens += request.cache_n
            if index + 1 < len(session.turns):
                think = session.turns[index + 1].think_s
                clock.at(clock.now + think, lambda: turn(session, index + 1, prompt + spec.reply_tokens))

        hosts[host].submit(TimedRequest(session.name, prompt, spec.reply_tokens,
                                        on_start=lambda r: policy.started(r, r.host), on_done=done))

    for s in sessions:
        clock.at(s.start_s, lambda s=s: turn(s, 0, s.context_tokens))
    clock.run()
    result.moves = policy.moves
    result.busy_s = {name: round(h.busy_s, 1) for name, h in hosts.items()}
    result.span_s = clock.now
    return result


def strict_policy(hosts: dict[str, TimedHost], clock: VirtualClock) -> Strict:
    return Strict(hosts)


def variant_name(factor: float, held_work: bool) -> str:
    if not held_work:
        return "crossbar before (free slots, config order)"
    if factor <= 0:
        return "crossbar, held work, yield off"
    return f"crossbar, held work, yield factor {factor:g}"


def crossbar_policy(factor: float, held_work: bool = True
                    ) -> Callable[[dict[str, TimedHost], VirtualClock], CrossbarPolicy]:
    return lambda hosts, clock: CrossbarPolicy(hosts, lambda: clock.now, factor, held_work)


def variants(factors: list[float]) -> list[Callable[[dict[str, TimedHost], VirtualClock], Any]]:
    """strict first, then crossbar before held work, with held work only, and at each factor."""
    return [strict_policy, crossbar_policy(0.0, held_work=False), crossbar_policy(0.0)] + [
        crossbar_policy(f) for f in factors if f > 0
    ]


LOADS = {"even": (12, 0), "skewed": (8, 2)}
TARGETS = {  # (metric, ratio limit, higher is better)
    "even": [("p95", 1.05, False), ("cached", 0.98, True)],
    "skewed": [("p95", 0.95, False), ("mean", 1.05, False), ("cached", 0.95, True)],
}


def ratios(strict: dict[str, float], ours: dict[str, float]) -> dict[str, float]:
    return {k: ours[k] / strict[k] if strict[k] else (math.inf if ours[k] else 1.0)
            for k in ("p50", "p95", "max", "mean", "cached")}


def met(load: str, ratio: dict[str, float]) -> bool:
    return all((ratio[m] >= limit) if higher else (ratio[m] <= limit) for m, limit, higher in TARGETS[load])


def compare(seed: int, factors: list[float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for load, (count, long_generators) in LOADS.items():
        sessions = make_sessions(random.Random(f"{seed}-{load}"), count, long_generators)
        rows = [run(sessions, make) for make in variants(factors)]
        base = rows[0].summary()
        out[load] = [{"policy": r.policy, **r.summary(), "busy_s": r.busy_s, "span_s": round(r.span_s, 1),
                      "ratio": ratios(base, r.summary())} for r in rows]
    return out


def print_tables(report: dict[str, Any]) -> None:
    for load, rows in report.items():
        print(f"\n{load} load ({LOADS[load][0]} sessions x {TURNS} turns, {LOADS[load][1]} long generators)")
        print("| policy | p50 s | p95 s | max s | mean s | cached | moves | busy s per host |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            busy = " / ".join(f"{v:g}" for v in r["busy_s"].values())
            print(f"| {r['policy']} | {r['p50']:.2f} | {r['p95']:.2f} | {r['max']:.2f} | {r['mean']:.2f} "
                  f"| {r['cached']:.3f} | {r['moves']} | {busy} |")
        for r in rows[1:]:
            q = r["ratio"]
            verdict = "PASS" if met(load, q) else "MISS"
            print(f"{r['policy']} / strict: p95 {q['p95']:.2f}, mean {q['mean']:.2f}, max {q['max']:.2f}, "
                  f"cached {q['cached']:.3f} -> {verdict}")


def sweep(seeds: int, factors: list[float]) -> dict[str, Any]:
    """How often each variant meets the targets over many session sets, and its median figures."""
    tally: dict[str, Any] = {}
    for seed in range(seeds):
        report = compare(seed, factors)
        for load, rows in report.items():
            for r in rows[1:]:
                cell = tally.setdefault(load, {}).setdefault(r["policy"], {"met": 0, "p95": [], "mean": [],
                                                                           "cached": [], "moves": []})
                cell["met"] += met(load, r["ratio"])
                for key in ("p95", "mean", "cached"):
                    cell[key].append(r["ratio"][key])
                cell["moves"].append(r["moves"])
    print(f"\nover {seeds} session sets (seeds 0-{seeds - 1}): targets met; medians of the ratios to strict")
    print("| load | policy | targets met | p95 ratio | mean ratio | cached ratio | moves per run |")
    print("|---|---|---|---|---|---|---|")
    for load, cells in tally.items():
        for policy, cell in cells.items():
            medians = [statistics.median(cell[k]) for k in ("p95", "mean", "cached", "moves")]
            print(f"| {load} | {policy} | {cell['met']}/{seeds} | {medians[0]:.2f} | {medians[1]:.2f} "
                  f"| {medians[2]:.3f} | {medians[3]:g} |")
    return tally


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0, help="the session set shown in detail")
    p.add_argument("--factors", default=f"{DEFAULT_FACTOR:g}",
                   help="comma-separated yield factors for crossbar; 0 turns yielding off")
    p.add_argument("--seeds", type=int, default=60, help="session sets in the summary (0: none)")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    factors = [float(f) for f in args.factors.split(",")]
    report = compare(args.seed, factors)
    print(f"fleet: {len(HOSTS)} hosts x {FLEET.slots} slot, prefill {FLEET.prefill_tps:g} tok/s, "
          f"generation {FLEET.gen_tps:g} tok/s; seed {args.seed}")
    print_tables(report)
    if args.seeds:
        report["sweep"] = sweep(args.seeds, factors)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1, default=lambda o: asdict(o))


if __name__ == "__main__":
    main()
