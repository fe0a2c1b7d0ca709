"""Placement: which host a request goes to, and what that does to its conversation's lease.

One pure function, `place`, makes every placement decision: the first one, and each re-placement
after a failure (refused connection, 5xx, a host marked down while the request waited for a slot).
It reads a snapshot of the fleet and the lease table's view of the conversation and returns either
a `Placement` (host, decision, and the lease change to apply once the request really goes there) or
a `Refusal` (why, and which hosts are worth waking before asking again). No I/O, no clock.

The rules, in order:
  model      none given → refused; one that no host of the route lists or reports → refused
  pin        a pinned route goes to its pin; a pinned host that is down is refused, never moved
  read       a GET pass-through follows the route's leases for the model; it creates no lease
  reuse      an existing lease stays while its host is usable and the prompt fits there
  yield      ... unless its host has no free slot and waiting there would cost more than
             re-prefilling on another host (`crossbar.yieldpolicy`, by `Ask.yield_factor`)
  move       otherwise it moves to an open host (reason: unhealthy, retried or context)
  idle       a lease idle longer than `lease_idle` (nothing in flight or queued) is placed anew,
             also when the idle sweep already dropped it
  inherit    a new fingerprint takes its route's fingerprint-less lease host when that is open
  choose     else `choose()` ranks the open hosts where the prompt fits

Most requests are a conversation's next turn on the host its lease already names. `stay` answers
that case from the lease host's own state alone, exactly as `place` would, and hands every other
case to `place`; the request path asks it first and skips reading the route's fleet.

The values placement reads and returns for every request are named tuples: immutable like frozen
dataclasses, and built in one step rather than one `object.__setattr__` call per field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from crossbar.choose import Candidate, Choice, choose
from crossbar.decisions import Decision, Reason, Rejection
from crossbar.guard import fits
from crossbar.yieldpolicy import HostLoad, Move, decide

Pick = Callable[[Sequence[Candidate]], Choice | None]


class Change(StrEnum):
    NONE = "none"  # reads, and refusals: the table is untouched
    USE = "use"  # the lease stays; it was used now
    CREATE = "create"  # a new lease
    MOVE = "move"  # the lease changes host (`reason` says why)
    RENEW = "renew"  # an idle lease is dropped and the conversation placed anew


class LeaseChange(NamedTuple):
    kind: Change
    host: str = ""
    from_host: str = ""
    reason: Reason = Reason.NEW


NO_CHANGE = LeaseChange(Change.NONE)


class LeaseView(NamedTuple):
    """What the lease table knows about one conversation (route, fingerprint, model)."""

    pin: str = ""  # the route's pinned host ("" = not pinned)
    host: str = ""  # the conversation's lease host ("" = no lease)
    last_used: float = 0.0  # end of its last request
    busy: bool = False  # a request of it is in flight or queued: never idle
    parent: str = ""  # without a lease host: the host of the route's fingerprint-less lease for the model
    route_hosts: tuple[str, ...] = ()  # reads: hosts the route's leases for the model live on
    idled: str = ""  # no lease because it idled out (swept): the host it was on


class Ask(NamedTuple):
    """The request's facts."""

    route: str
    model: str
    hosts: tuple[str, ...]  # the route's candidates in preference order
    fp: str = ""
    read: bool = False  # a GET pass-through or control call: follows the lease, creates none
    tokens: int = 0  # estimated prompt tokens (0 = not estimated)
    excluded: frozenset[str] = frozenset()  # hosts that already failed this request
    why: Reason = Reason.UNHEALTHY  # why a lease that cannot stay moves: unhealthy | retried
    yield_factor: float = 0.0  # a turn leaves its busy host when wait > factor x move cost; 0: never


class Snapshot(NamedTuple):
    """The fleet as seen for this request's model."""

    candidates: Mapping[str, Candidate]  # per host of the route (only those asked about are read)
    ctx: Mapping[str, int]  # per-slot context for the model per host (0 = unknown)
    known: bool = True  # some host of the route lists or reports the model
    tokens: Mapping[str, int] | None = None  # per-host prompt estimate (learned); None: `Ask.tokens`
    # per host, the work it holds and its learned rates as this conversation's turn sees them
    # (read only when the lease's host has no free slot); None: no yield
    loads: Mapping[str, HostLoad] | None = None


class Placement(NamedTuple):
    host: str
    decision: Decision
    change: LeaseChange = NO_CHANGE
    loads_model: bool = False  # no open host had the model loaded: this one will load it


class Home(NamedTuple):
    """What the fleet says about a lease's own host, for `stay`."""

    known: bool  # the host lists or reports the model
    healthy: bool
    fits: bool  # the prompt fits its per-slot context for the model
    free: bool  # it has a free slot for the model


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: Rejection  # MISSING_MODEL | UNKNOWN_MODEL | PINNED_DOWN | NO_HOST | CONTEXT
    message: str
    wake: tuple[str, ...] = ()  # hosts worth waking before placing again
    n_ctx: int = 0  # CONTEXT: the largest per-slot context among the route's hosts for the model


class _Fleet:
    """The two definitions everything else is built on."""

    def __init__(self, ask: Ask, snap: Snapshot):
        self.ask, self.snap = ask, snap
        self.by_name = snap.candidates

    def usable(self, host: str) -> bool:
        """Can a request (or an existing lease) be served by `host`? Healthy, a candidate of the
        route and not excluded. A draining host keeps its conversations."""
        if host not in self.ask.hosts or host in self.ask.excluded:
            return False
        c = self.by_name.get(host)
        return c is not None and c.healthy

    def open(self, host: str) -> bool:
        """Can `host` take a new conversation? Usable and not draining."""
        return self.usable(host) and not self.by_name[host].draining

    def tokens(self, host: str) -> int:
        return self.ask.tokens if self.snap.tokens is None else self.snap.tokens.get(host, self.ask.tokens)

    def fits(self, host: str) -> bool:
        return fits(self.tokens(host), self.snap.ctx.get(host, 0))

    def serves(self, host: str) -> bool:
        c = self.by_name.get(host) if host in self.ask.hosts else None
        return c is not None and (c.loaded or c.listed)

    def largest_ctx(self) -> int:
        """The largest per-slot context among the route's hosts that serve the model."""
        return max((self.snap.ctx.get(h, 0) for h in self.ask.hosts if self.serves(h)), default=0)

    def asleep(self) -> tuple[str, ...]:
        return tuple(h for h in self.ask.hosts if h in self.by_name and not self.by_name[h].healthy)

    def open_candidates(self, avoid: str) -> list[Candidate]:
        return [self.by_name[h] for h in self.ask.hosts if h != avoid and self.open(h)]


def place(ask: Ask, snap: Snapshot, lease: LeaseView, now: float, lease_idle: float,
          pick: Pick = choose) -> Placement | Refusal:
    if not ask.model and not ask.read:  # a read without a model (GET /v1/models) is fine
        return Refusal(Rejection.MISSING_MODEL, "model name is missing from the request")
    if not snap.known:
        return Refusal(Rejection.UNKNOWN_MODEL, f"model '{ask.model}' not found")
    fleet = _Fleet(ask, snap)
    if lease.pin:
        return _pinned(fleet, lease)
    if ask.read:
        return _read(fleet, lease, pick)
    if lease.host and (lease.busy or now - lease.last_used <= lease_idle):
        return _existing(fleet, lease, pick)
    if lease.host:  # idle: placed anew, as if it had no lease
        found = _new_host(fleet, pick, avoid="")
        if isinstance(found, Refusal):
            return found
        host, loads = found
        return Placement(host, Decision.IDLE, LeaseChange(Change.RENEW, host, lease.host, Reason.IDLE), loads)
    if ask.fp and lease.parent and _inheritable(fleet, lease.parent):
        return Placement(lease.parent, Decision.INHERITED, LeaseChange(Change.CREATE, lease.parent))
    found = _new_host(fleet, pick, avoid="")
    if isinstance(found, Refusal):
        return found
    host, loads = found
    decision = Decision.RETRIED if ask.excluded else Decision.IDLE if lease.idled else Decision.NEW
    return Placement(host, decision, LeaseChange(Change.CREATE, host), loads)


def stay(ask: Ask, lease: LeaseView, home: Home, now: float, lease_idle: float) -> Placement | None:
    """The usual turn, decided from its lease host alone: the answer `place` gives when the
    conversation stays where it is (healthy host, prompt fits, a free slot, so nothing to yield),
    or None whenever `place` has more to weigh."""
    host = lease.host
    if (not host or lease.pin or ask.read or ask.excluded or not ask.model or host not in ask.hosts
            or not (home.known and home.healthy and home.fits and (home.free or ask.yield_factor <= 0))
            or not (lease.busy or now - lease.last_used <= lease_idle)):
        return None
    return Placement(host, Decision.REUSED, LeaseChange(Change.USE, host))


def _pinned(fleet: _Fleet, lease: LeaseView) -> Placement | Refusal:
    pin, ask = lease.pin, fleet.ask
    if not fleet.usable(pin):
        return Refusal(Rejection.PINNED_DOWN,
                       f"route {ask.route!r} is pinned to {pin!r}, which is not healthy", wake=(pin,))
    if not fleet.fits(pin):
        return _too_long(fleet)
    if ask.read or lease.host == pin:
        return Placement(pin, Decision.PINNED, NO_CHANGE if ask.read else LeaseChange(Change.USE, pin))
    if lease.host:
        return Placement(pin, Decision.PINNED, LeaseChange(Change.MOVE, pin, lease.host, Reason.PIN))
    return Placement(pin, Decision.PINNED, LeaseChange(Change.CREATE, pin))


def _read(fleet: _Fleet, lease: LeaseView, pick: Pick) -> Placement | Refusal:
    for host in lease.route_hosts:
        if fleet.usable(host):
            return Placement(host, Decision.REUSED)
    found = _new_host(fleet, pick, avoid="")
    if isinstance(found, Refusal):
        usable = [h for h in fleet.ask.hosts if fleet.usable(h)]
        if not usable:
            return found
        return Placement(usable[0], Decision.NEW)
    return Placement(found[0], Decision.NEW)


def _existing(fleet: _Fleet, lease: LeaseView, pick: Pick) -> Placement | Refusal:
    ask = fleet.ask
    if fleet.usable(lease.host) and fleet.fits(lease.host):
        return _yielded(fleet, lease.host) or Placement(lease.host, Decision.REUSED,
                                                         LeaseChange(Change.USE, lease.host))
    context = fleet.usable(lease.host)  # usable but too small: the context guard moves it
    found = _new_host(fleet, pick, avoid=lease.host)
    if isinstance(found, Refusal):
        return found
    host, loads = found
    if context:
        reason, decision = Reason.CONTEXT, Decision.CONTEXT
    elif ask.excluded:
        reason, decision = ask.why, Decision.RETRIED
    else:
        reason, decision = Reason.UNHEALTHY, Decision.MOVED
    return Placement(host, decision, LeaseChange(Change.MOVE, host, lease.host, reason), loads)


def _inheritable(fleet: _Fleet, parent: str) -> bool:
    """A new conversation follows the route's key-less lease only to a host that can take it now:
    open, the prompt fits, and a slot is free. Otherwise it is placed by load like any other, so
    one key-less request (an embeddings call, a system-only chat) never stacks every new
    conversation of the route on one host."""
    return fleet.open(parent) and fleet.fits(parent) and fleet.by_name[parent].free_slots > 0


def _yielded(fleet: _Fleet, home: str) -> Placement | None:
    """The lease's host has no free slot for the turn: a move to where waiting plus re-prefilling
    costs less (by the factor), or None to stay. Targets are open hosts with the model loaded
    where the prompt fits; a request already re-placed after a failure never yields."""
    ask, loads = fleet.ask, fleet.snap.loads
    if ask.yield_factor <= 0 or loads is None or ask.excluded or fleet.by_name[home].free_slots > 0:
        return None
    others = [loads[c.name] for c in fleet.open_candidates(home) if c.loaded and fleet.fits(c.name)]
    verdict = decide(fleet.tokens(home), loads[home], others, ask.yield_factor)
    if not isinstance(verdict, Move):
        return None
    return Placement(verdict.host, Decision.YIELD, LeaseChange(Change.MOVE, verdict.host, home, Reason.YIELD))


def _new_host(fleet: _Fleet, pick: Pick, avoid: str) -> tuple[str, bool] | Refusal:
    """The best open host where the prompt fits (never `avoid`), or why there is none."""
    ask = fleet.ask
    open_hosts = fleet.open_candidates(avoid)
    fitting = [c for c in open_hosts if fleet.fits(c.name)]
    choice = pick(fitting) if fitting else None
    if choice is not None and any(c.name == choice.host for c in fitting):
        return choice.host, choice.loads_model
    if open_hosts and not fitting and pick(open_hosts) is not None:
        return _too_long(fleet)
    return Refusal(Rejection.NO_HOST, f"route {ask.route!r}: no usable host for model {ask.model!r}",
                   wake=fleet.asleep())


def _too_long(fleet: _Fleet) -> Refusal:
    n_ctx = fleet.largest_ctx()
    wake = tuple(h for h in fleet.asleep() if fleet.serves(h) and fleet.fits(h))
    return Refusal(Rejection.CONTEXT,
                   f"prompt too large: request (~{fleet.ask.tokens} tokens) exceeds the available "
                   f"context size ({n_ctx} tokens) of every host that serves this model",
                   wake=wake, n_ctx=n_ctx)
