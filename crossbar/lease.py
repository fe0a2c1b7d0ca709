"""The sticky lease table: which host each conversation is on, and keeping it there.

A llama-server prompt cache lives in one process, so a conversation that moves host
re-prefills its whole context. A lease therefore moves only when its host is unhealthy
(or excluded after a failure), when it has been idle longer than `idle`, or when an
operator pins or releases the route. A better host appearing is never a reason to move.

Memory is authoritative; every change is written through to the persister (the store),
whose calls never block and never raise. Not thread-safe: use from one event loop.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

ACTIVE = "active"
PINNED = "pinned"

# reasons recorded in lease events
NEW = "new"
UNHEALTHY = "unhealthy"
IDLE = "idle"
PIN = "pin"
RELEASE = "release"
DRAIN = "drain"
CONTEXT = "context"  # the context guard moved a conversation to a host where its prompt fits


class LeaseError(Exception):
    """Base of the lease table's errors."""


class PinnedDown(LeaseError):
    """The route is pinned to a host that is not healthy (never a silent move)."""


class NoHost(LeaseError):
    """No usable host for the request."""


class UnknownHost(LeaseError):
    """The host is not one of the route's candidates."""


class Decision(StrEnum):
    REUSED = "reused"
    NEW = "new"
    INHERITED = "inherited"
    PINNED = "pinned"
    MOVED = "moved:unhealthy"
    IDLE = "moved:idle"
    CONTEXT = "moved:context"


@dataclass(frozen=True, slots=True)
class Key:
    route: str
    fp: str
    model: str


@dataclass(slots=True)
class Lease:
    key: Key
    host: str
    state: str  # "active" | "pinned" (a lease held on its route's pin)
    created: float
    last_used: float


@dataclass(frozen=True, slots=True)
class Grant:
    host: str
    decision: Decision
    moved_from: str | None = None


class Persister(Protocol):
    """Write-through target (crossbar.store.Store); calls are non-blocking and never raise."""

    def save_lease(
        self, route: str, fp: str, model: str, host: str, state: str, created: float, last_used: float
    ) -> None: ...

    def delete_lease(self, route: str, fp: str, model: str) -> None: ...

    def record_event(
        self,
        ts: float,
        route: str,
        fp: str,
        model: str,
        from_host: str | None,
        to_host: str | None,
        reason: str,
    ) -> None: ...


class HostView(Protocol):
    def healthy(self, host: str) -> bool: ...

    def draining(self, host: str) -> bool: ...


# (eligible candidate names in route order, model) -> chosen host, or None
ChooseFn = Callable[[Sequence[str], str], str | None]


def _is_pin_row(row: Any) -> bool:
    return row.fp == "" and row.model == "" and row.state == PINNED


class LeaseTable:
    def __init__(self, persist: Persister, hosts: HostView, choose: ChooseFn, idle: float) -> None:
        self._persist = persist
        self._hosts = hosts
        self._choose = choose
        self._idle = idle
        self._leases: dict[Key, Lease] = {}
        self._by_route: dict[str, dict[Key, Lease]] = {}
        self._pins: dict[str, str] = {}

    # ---- start-up ---------------------------------------------------------------------------

    def load(self, rows: Iterable[Any]) -> None:
        """Replace the table with stored rows; fp == model == "" with state "pinned" is a route pin."""
        rows = list(rows)
        self._leases.clear()
        self._by_route.clear()
        self._pins = {row.route: row.host for row in rows if _is_pin_row(row)}
        for row in rows:
            if not _is_pin_row(row):
                self._load_lease(row)

    def _load_lease(self, row: Any) -> None:
        key = Key(row.route, row.fp, row.model)
        state = PINNED if self._pins.get(row.route) == row.host else ACTIVE
        self._put(Lease(key, row.host, state, float(row.created), float(row.last_used)))

    # ---- the request path -------------------------------------------------------------------

    def acquire(
        self, key: Key, candidates: Sequence[str], now: float, exclude: Collection[str] = (),
        reason: str = UNHEALTHY,
    ) -> Grant:
        """The host for this request; `exclude` holds hosts that just failed it (treated as unhealthy).
        `reason` names why an existing lease that cannot stay moves (event and decision)."""
        pin = self._pins.get(key.route)
        if pin is not None:
            return self._acquire_pinned(key, pin, now, exclude)
        lease = self._leases.get(key)
        if lease is None:
            host, decision = self._place(key, candidates, exclude)
            self._create(key, host, ACTIVE, now)
            return Grant(host, decision)
        if now - lease.last_used > self._idle:
            self._drop(lease, now, IDLE, None)
            host, _ = self._place(key, candidates, exclude)
            self._create(key, host, ACTIVE, now)
            return Grant(host, Decision.IDLE, moved_from=lease.host)
        if self._usable(lease.host, candidates, exclude):
            self._use(lease, now)
            return Grant(lease.host, Decision.REUSED)
        host, _ = self._place(key, candidates, (*exclude, lease.host))
        self._move(lease, host, now, reason)
        decision = Decision.CONTEXT if reason == CONTEXT else Decision.MOVED
        return Grant(host, decision, moved_from=lease.host)

    def _acquire_pinned(self, key: Key, pin: str, now: float, exclude: Collection[str]) -> Grant:
        if pin in exclude or not self._hosts.healthy(pin):
            raise PinnedDown(f"route {key.route!r} is pinned to {pin!r}, which is not healthy")
        lease = self._leases.get(key)
        if lease is None:
            self._create(key, pin, PINNED, now)
            return Grant(pin, Decision.PINNED)
        if lease.host != pin:
            self._move(lease, pin, now, PIN)
            return Grant(pin, Decision.PINNED, moved_from=lease.host)
        lease.state = PINNED
        self._use(lease, now)
        return Grant(pin, Decision.PINNED)

    def _usable(self, host: str, candidates: Sequence[str], exclude: Collection[str]) -> bool:
        """Can an existing lease stay on `host`? (A draining host keeps its leases.)"""
        return host not in exclude and host in candidates and self._hosts.healthy(host)

    def _open(self, host: str, candidates: Sequence[str], exclude: Collection[str]) -> bool:
        """Can `host` take a new lease?"""
        return self._usable(host, candidates, exclude) and not self._hosts.draining(host)

    def _place(self, key: Key, candidates: Sequence[str], exclude: Collection[str]) -> tuple[str, Decision]:
        """A host for a lease the key does not have yet; changes nothing."""
        if key.fp:
            parent = self._leases.get(Key(key.route, "", key.model))
            if parent is not None and self._open(parent.host, candidates, exclude):
                return parent.host, Decision.INHERITED
        eligible = [h for h in candidates if self._open(h, candidates, exclude)]
        host = self._choose(eligible, key.model) if eligible else None
        if host is None or host not in eligible:
            raise NoHost(f"route {key.route!r}: no usable host for model {key.model!r}")
        return host, Decision.NEW

    def touch(self, key: Key, now: float) -> None:
        """The request finished: the conversation was used now."""
        lease = self._leases.get(key)
        if lease is not None:
            self._use(lease, now)

    # ---- housekeeping and operator actions ----------------------------------------------------

    def expire_idle(self, now: float) -> int:
        """Drop leases unused for longer than `idle` (pins never expire); returns how many."""
        stale = [lease for lease in self._leases.values() if now - lease.last_used > self._idle]
        for lease in stale:
            self._drop(lease, now, IDLE, None)
        return len(stale)

    def pin(self, route: str, host: str, candidates: Sequence[str], now: float) -> None:
        """Send the route's conversations to `host`; leases elsewhere are dropped."""
        if host not in candidates:
            raise UnknownHost(f"route {route!r}: {host!r} is not one of its hosts")
        old = self._pins.get(route)
        if old == host:
            return
        self._pins[route] = host
        self._event(now, Key(route, "", ""), old, host, PIN)
        for lease in self._route_leases(route):
            if lease.host != host:
                self._drop(lease, now, PIN, host)
            else:
                lease.state = PINNED
                self._save(lease)
        # saved last: a model-less route lease (route, "", "") shares the pin row's key
        self._persist.save_lease(route, "", "", host, PINNED, now, now)

    def unpin(self, route: str, now: float) -> None:
        """Clear the route's pin; its leases stay where they are."""
        host = self._pins.pop(route, None)
        if host is None:
            return
        self._persist.delete_lease(route, "", "")
        self._event(now, Key(route, "", ""), host, None, RELEASE)
        for lease in self._route_leases(route):
            lease.state = ACTIVE
            self._save(lease)

    def pinned(self, route: str) -> str:
        """The route's pinned host, or "" when it is not pinned."""
        return self._pins.get(route, "")

    def release(self, route: str, now: float) -> int:
        """Drop every lease of the route and clear its pin; returns how many leases were dropped."""
        leases = self._route_leases(route)
        for lease in leases:
            self._drop(lease, now, RELEASE, None)
        self.unpin(route, now)
        return len(leases)

    def drain(self, host: str, now: float) -> int:
        """Record a drain event per lease on `host`; the leases stay. Returns how many."""
        on_host = [lease for lease in self._leases.values() if lease.host == host]
        for lease in on_host:
            self._event(now, lease.key, host, None, DRAIN)
        return len(on_host)

    # ---- views ------------------------------------------------------------------------------

    def snapshot(self) -> list[Lease]:
        """Copies of every lease, sorted by (route, fp, model); pins are not leases."""
        return _sorted_copies(self._leases.values())

    def leases_of(self, route: str) -> list[Lease]:
        return _sorted_copies(self._by_route.get(route, {}).values())

    def count(self) -> int:
        return len(self._leases)

    # ---- memory + write-through -----------------------------------------------------------------

    def _route_leases(self, route: str) -> list[Lease]:
        return list(self._by_route.get(route, {}).values())

    def _put(self, lease: Lease) -> None:
        self._leases[lease.key] = lease
        self._by_route.setdefault(lease.key.route, {})[lease.key] = lease

    def _remove(self, lease: Lease) -> None:
        del self._leases[lease.key]
        of_route = self._by_route[lease.key.route]
        del of_route[lease.key]
        if not of_route:
            del self._by_route[lease.key.route]

    def _create(self, key: Key, host: str, state: str, now: float) -> None:
        lease = Lease(key, host, state, now, now)
        self._put(lease)
        self._save(lease)
        self._event(now, key, None, host, NEW)

    def _move(self, lease: Lease, host: str, now: float, reason: str) -> None:
        moved = Lease(lease.key, host, PINNED if reason == PIN else ACTIVE, now, now)
        self._put(moved)
        self._save(moved)
        self._event(now, lease.key, lease.host, host, reason)

    def _use(self, lease: Lease, now: float) -> None:
        lease.last_used = now
        self._save(lease)

    def _drop(self, lease: Lease, now: float, reason: str, to_host: str | None) -> None:
        self._remove(lease)
        self._persist.delete_lease(lease.key.route, lease.key.fp, lease.key.model)
        self._event(now, lease.key, lease.host, to_host, reason)

    def _save(self, lease: Lease) -> None:
        k = lease.key
        self._persist.save_lease(
            k.route, k.fp, k.model, lease.host, lease.state, lease.created, lease.last_used
        )

    def _event(self, now: float, key: Key, from_host: str | None, to_host: str | None, reason: str) -> None:
        self._persist.record_event(now, key.route, key.fp, key.model, from_host, to_host, reason)


_ORDER = operator.attrgetter("key.route", "key.fp", "key.model")


def _sorted_copies(leases: Iterable[Lease]) -> list[Lease]:
    # built directly: dataclasses.replace() costs several times more per lease
    return [Lease(lease.key, lease.host, lease.state, lease.created, lease.last_used)
            for lease in sorted(leases, key=_ORDER)]
