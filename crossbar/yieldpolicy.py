"""Lease yield: should a turn leave its busy host and re-prefill elsewhere? (pure, no I/O)

A conversation's turns stay on the host that holds its prompt cache. When that host is busy, the
turn waits for a slot; moving the lease to another host costs re-prefilling the part of the
prompt that host does not hold. The move pays only when the wait is `factor` times what moving
costs, where the re-prefill is charged twice: once to the moved turn and once more for the delay
its longer prefill adds to whatever the new host serves next. Charging it once made conversations
churn between hosts (more prefill, worse mean latency) in the time-modelled benchmark.

Everything here is an estimate from learned rates (see `crossbar.learn`): a host whose rates are
not learned yet is never a target, and an unknown home never yields.

Use: when a turn's leased host has no free slot, the router asks `decide` (with each host's view
from `RateLearner.host_load`) and, on `Move`, moves the lease with reason `YIELD`; a turn still
queued asks again whenever a slot frees on another host, at most one move per turn.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

YIELD = "yield"  # the lease decision / event reason for a turn moved by this policy
DEFAULT_FACTOR = 2.0  # measured with bench/yield_bench.py (see README, Benchmarks)


@dataclass(frozen=True, slots=True)
class Rates:
    """What a host does with a model, learned from llama-server's `timings`."""

    prefill_tps: float  # uncached prompt tokens per second; <= 0 when not learned
    gen_tps: float  # generated tokens per second; <= 0 when not learned
    reply_tokens: float = 0.0  # typical reply length
    prefill_tokens: float = 0.0  # typical uncached prompt tokens of one request

    @property
    def known(self) -> bool:
        return self.prefill_tps > 0 and self.gen_tps > 0

    def service_s(self, prefill_tokens: float, reply_tokens: float) -> float:
        """Seconds one request holds a slot: its prefill plus its generation."""
        return max(prefill_tokens, 0.0) / self.prefill_tps + max(reply_tokens, 0.0) / self.gen_tps

    def typical_service_s(self) -> float:
        return self.service_s(self.prefill_tokens, self.reply_tokens)


@dataclass(frozen=True, slots=True)
class Running:
    """A request forwarded to a host and not finished yet."""

    elapsed_s: float  # since it was forwarded
    reply_tokens: float  # its expected reply: its conversation's last one, else the host's typical
    prefill_tokens: float = 0.0  # uncached prompt tokens it had to prefill (0 when unknown)


@dataclass(frozen=True, slots=True)
class HostLoad:
    """One host as the yield decision sees it, for the turn's model."""

    name: str
    slots: int
    rates: Rates
    running: tuple[Running, ...] = ()  # in flight, oldest or newest first (order is not used)
    queued: int = 0  # requests waiting in crossbar's queue for this host, ahead of the turn
    cached_tokens: int = 0  # how much of this turn's prompt the host likely holds in its cache


@dataclass(frozen=True, slots=True)
class Stay:
    wait_s: float  # estimated wait for a slot on the home host (0 when unknown or free)


@dataclass(frozen=True, slots=True)
class Move:
    host: str
    wait_s: float  # estimated wait on the home host
    target_wait_s: float  # estimated wait for a slot on the new host
    reprefill_s: float  # extra prefill on the new host, charged twice in the decision

    @property
    def cost_s(self) -> float:
        return self.target_wait_s + 2 * self.reprefill_s


def _remaining_s(job: Running, rates: Rates) -> float:
    """Time a running request still holds its slot; one running past its estimate counts as done
    soon, which underestimates waits and so errs toward staying."""
    return max(rates.service_s(job.prefill_tokens, job.reply_tokens) - max(job.elapsed_s, 0.0), 0.0)


def slot_wait_s(host: HostLoad) -> float:
    """Seconds until a slot is free for a request arriving now, behind everything the host holds.

    The longest-running requests hold the slots; any beyond the slot count wait inside the server
    (llama-server queues them) and are served in order, then crossbar's own queue.
    """
    slots = max(host.slots, 1)
    rates = host.rates
    by_age = sorted(host.running, key=lambda job: job.elapsed_s, reverse=True)
    free_at = [_remaining_s(job, rates) for job in by_age[:slots]]
    free_at += [0.0] * (slots - len(free_at))
    heapq.heapify(free_at)
    ahead = [rates.service_s(job.prefill_tokens, job.reply_tokens) for job in by_age[slots:]]
    ahead += [rates.typical_service_s()] * max(host.queued, 0)
    for service in ahead:
        heapq.heappush(free_at, heapq.heappop(free_at) + service)
    return free_at[0]


def prefill_s(prompt_tokens: int, host: HostLoad) -> float:
    uncached = max(prompt_tokens - max(host.cached_tokens, 0), 0)
    return uncached / host.rates.prefill_tps


def _move_to(prompt_tokens: int, home: HostLoad, home_wait: float, other: HostLoad) -> Move:
    extra = max(prefill_s(prompt_tokens, other) - prefill_s(prompt_tokens, home), 0.0)
    return Move(other.name, home_wait, slot_wait_s(other), extra)


def decide(
    prompt_tokens: int, home: HostLoad, others: Sequence[HostLoad], factor: float, pinned: bool = False
) -> Stay | Move:
    """Stay on `home`, or move to the other host where the move costs least, when the home wait
    exceeds `factor` x that cost (and the move gains time at all).

    `others` are the eligible hosts for the model (healthy, not draining, model loaded), without
    `home`. A factor <= 0 turns yielding off; a pinned route never yields.
    """
    if pinned or factor <= 0 or not home.rates.known:
        return Stay(0.0)
    wait = slot_wait_s(home)
    if wait <= 0:
        return Stay(0.0)
    moves = [_move_to(prompt_tokens, home, wait, o) for o in others if o.name != home.name and o.rates.known]
    if not moves:
        return Stay(wait)
    best = min(moves, key=lambda m: m.cost_s)
    if wait > factor * best.cost_s and wait > best.cost_s:
        return best
    return Stay(wait)
