"""The sticky lease table: which host each conversation is on, and keeping it there.

A llama-server prompt cache lives in one process, so a conversation that moves host re-prefills its
whole context. Where a request goes is decided by `crossbar.placement`; this table holds the result,
applies the lease changes placement asks for, and tells its listeners about every change (the store
writes them to `lease_events`, metrics count them).

A conversation with a request in flight or queued is in use (`hold`/`unhold`): it never idles out,
and its idle time counts from the end of its last request. The table is bounded: past
`max_per_route` leases on a route, or `max_leases` in all, the least recently used lease that is not
in use is evicted (an `evicted` event).

Memory is authoritative; every change is written through to the persister (the store), whose calls
never block and never raise. Not thread-safe: use from one event loop.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from crossbar.decisions import Decision, Reason
from crossbar.placement import Change, LeaseChange, LeaseView

__all__ = ["ACTIVE", "PINNED", "Decision", "Key", "Lease", "LeaseEvent", "LeaseTable", "UnknownHost"]

log = logging.getLogger("crossbar.lease")

ACTIVE = "active"
PINNED = "pinned"

MAX_LEASES = 100_000  # in all; ~0.5 KiB each in memory
MAX_LEASES_PER_ROUTE = 20_000


class UnknownHost(Exception):
    """The host is not one of the route's candidates."""


class Key(NamedTuple):
    """A conversation: (route, fingerprint, model). A tuple, so that the lookups every request
    makes in the lease tables hash and compare it in C."""

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
class LeaseEvent:
    ts: float
    key: Key
    from_host: str | None
    to_host: str | None
    reason: Reason


class Persister(Protocol):
    """Write-through target (crossbar.store.Store); calls are non-blocking and never raise."""

    def save_lease(
        self, route: str, fp: str, model: str, host: str, state: str, created: float, last_used: float,
        *, touch: bool = False,
    ) -> None:
        """`touch`: only the lease's last use moved (it may be written later than a change)."""

    def delete_lease(self, route: str, fp: str, model: str, idle_before: float | None = None) -> None: ...


class _Unwritten:
    """The persister while another instance's change is applied: it is written already."""

    def save_lease(self, *_args: Any, **_kw: Any) -> None:
        pass

    def delete_lease(self, *_args: Any, **_kw: Any) -> None:
        pass


Listener = Callable[[LeaseEvent], None]


def _is_pin_row(row: Any) -> bool:
    return row.fp == "" and row.model == "" and row.state == PINNED


class LeaseTable:
    def __init__(self, persist: Persister, idle: float, max_leases: int = MAX_LEASES,
                 max_per_route: int = MAX_LEASES_PER_ROUTE) -> None:
        self._persist = persist
        self.idle = idle
        self.max_leases = max_leases
        self.max_per_route = max_per_route
        self._leases: OrderedDict[Key, Lease] = OrderedDict()  # least recently used first
        self._by_route: dict[str, OrderedDict[Key, Lease]] = {}
        # (route, model) → how many leases each host holds; model None counts every model
        self._hosts_of: dict[tuple[str, str | None], Counter[str]] = {}
        # host → how many leases it holds (every route and model): kept as leases come and go
        self._on_host: Counter[str] = Counter()
        self._pins: dict[str, str] = {}
        # requests queued or in flight per conversation (a plain dict: Counter's missing-key and
        # delete paths are Python calls on every request)
        self._held: dict[Key, int] = {}
        # conversations whose lease idled out, and the host it was on (bounded like the table):
        # their next turn is recorded as a move for idleness, not as a new conversation
        self._idled: OrderedDict[Key, str] = OrderedDict()
        self._listeners: list[Listener] = []
        self.evicted = 0

    def subscribe(self, listener: Listener) -> None:
        """Call `listener(event)` for every lease event, in order."""
        self._listeners.append(listener)

    # ---- start-up ---------------------------------------------------------------------------

    def load(self, rows: Iterable[Any]) -> None:
        """Replace the table with stored rows; fp == model == "" with state "pinned" is a route pin."""
        rows = sorted(rows, key=lambda row: float(row.last_used))
        self._leases.clear()
        self._by_route.clear()
        self._hosts_of.clear()
        self._on_host.clear()
        self._pins = {row.route: row.host for row in rows if _is_pin_row(row)}
        for row in rows:
            if not _is_pin_row(row):
                key = Key(row.route, row.fp, row.model)
                state = PINNED if self._pins.get(row.route) == row.host else ACTIVE
                self._put(Lease(key, row.host, state, float(row.created), float(row.last_used)))

    # ---- the request path -------------------------------------------------------------------

    def view(self, key: Key, read: bool = False, own: bool = False) -> LeaseView:
        """What placement needs to know about `key`'s conversation; `own`: the asking request is
        one of those holding it (it does not keep its own lease from idling)."""
        lease = self._leases.get(key)
        host = lease.host if lease else ""
        # placement reads the key-less lease only for a conversation that has none of its own
        parent = self._leases.get(Key(key.route, "", key.model)) if key.fp and not host else None
        return LeaseView(
            pin=self._pins.get(key.route, ""),
            host=host,
            last_used=lease.last_used if lease else 0.0,
            busy=self._held.get(key, 0) > (1 if own else 0),
            parent=parent.host if parent else "",
            route_hosts=self.route_hosts(key.route, key.model) if read else (),
            idled=self._idled.get(key, ""),
        )

    def since(self, key: Key) -> float | None:
        """When the conversation came to the host its lease names here (None: no lease)."""
        lease = self._leases.get(key)
        return lease.created if lease else None

    def route_hosts(self, route: str, model: str) -> tuple[str, ...]:
        """Hosts the route's leases for `model` (any model when "") live on, most leases first."""
        counts = self._hosts_of.get((route, model or None))
        return tuple(host for host, _ in counts.most_common()) if counts else ()

    def apply(self, key: Key, change: LeaseChange, now: float) -> None:
        """Apply a change placement asked for."""
        lease = self._leases.get(key)
        match change.kind:
            case Change.NONE:
                return
            case Change.USE if lease is not None:
                was = lease.state
                if self._pins.get(key.route) == lease.host:
                    lease.state = PINNED
                changed = lease.state != was
                self._use(lease, now, save=not changed and not self.in_use(key))
                if changed:  # a change, not only a use: written as promptly as any
                    self._save(lease)
            case Change.MOVE if lease is not None:
                state = PINNED if change.reason == Reason.PIN else ACTIVE
                self._replace(Lease(key, change.host, state, now, now))
                self._event(now, key, lease.host, change.host, change.reason)
            case Change.RENEW if lease is not None:
                self._drop(lease, now, Reason.IDLE, None)
                self._create(key, change.host, now)
            case _:
                if lease is None:
                    self._create(key, change.host, now)
                elif lease.host != change.host:  # placed concurrently by another request
                    self._replace(Lease(key, change.host, ACTIVE, now, now))
                    self._event(now, key, lease.host, change.host, change.reason)
                else:
                    self._use(lease, now, save=not self.in_use(key))

    def hold(self, key: Key) -> None:
        """A request of this conversation is queued or in flight."""
        held = self._held
        held[key] = held.get(key, 0) + 1

    def unhold(self, key: Key, now: float, save: bool = True) -> None:
        """That request ended: the conversation was last used now (written unless `save` is False:
        the caller writes it later with `save_use`)."""
        count = self._held.pop(key, 0) - 1
        if count > 0:
            self._held[key] = count
        lease = self._leases.get(key)
        if lease is not None:
            self._use(lease, now, save)

    def save_use(self, key: Key) -> None:
        """Write the conversation's lease as it stands now (its last use), if it still has one: a
        lease moved since is written as moved, and one dropped or evicted since is not written
        back."""
        lease = self._leases.get(key)
        if lease is not None:
            self._save(lease, touch=True)

    def in_use(self, key: Key) -> bool:
        return self._held.get(key, 0) > 0

    def has(self, key: Key) -> bool:
        return key in self._leases

    # ---- what other instances sharing the database did ----------------------------------------
    # Applied to memory only: the instance that made the change wrote it and recorded its events.

    def adopt(self, key: Key, host: str, created: float, last_used: float) -> None:
        """The conversation is on `host` (another instance placed or moved it there)."""
        lease = self._leases.get(key)
        if lease is not None and lease.host == host:
            lease.last_used = max(lease.last_used, last_used)
            return
        self._idled.pop(key, None)
        state = PINNED if self._pins.get(key.route) == host else ACTIVE
        if lease is not None:
            self._remove(lease)
        else:
            with self._unwritten():
                self._make_room(key.route, last_used)
        self._put(Lease(key, host, state, created, last_used))

    def apply_remote_pin(self, route: str, host: str, now: float) -> None:
        """Another instance pinned the route to `host` ("" : unpinned it)."""
        with self._unwritten():
            if not host:
                self.unpin(route, now)
            elif self._pins.get(route) != host:
                self._pins.pop(route, None)
                self.pin(route, host, (host,), now)

    def apply_remote_release(self, route: str, now: float) -> None:
        with self._unwritten():
            self.release(route, now)

    def resync(self, rows: Iterable[Any], now: float) -> None:
        """Take the stored pins and leases (the database wins where it disagrees); leases it does
        not hold stay (their writes are on their way)."""
        rows = list(rows)
        pins = {row.route: row.host for row in rows if _is_pin_row(row)}
        for route in set(self._pins) - set(pins):
            self.apply_remote_pin(route, "", now)
        for route, host in pins.items():
            self.apply_remote_pin(route, host, now)
        for row in rows:
            if not _is_pin_row(row):
                self.adopt(Key(row.route, row.fp, row.model), row.host, float(row.created),
                           float(row.last_used))

    @contextlib.contextmanager
    def _unwritten(self) -> Iterator[None]:
        persist, listeners = self._persist, self._listeners
        self._persist, self._listeners = _Unwritten(), []
        try:
            yield
        finally:
            self._persist, self._listeners = persist, listeners

    # ---- housekeeping and operator actions ----------------------------------------------------

    def expire_idle(self, now: float) -> int:
        """Drop leases unused for longer than `idle` and not in use (pins never expire)."""
        stale = []
        for lease in self._leases.values():  # least recently used first
            if now - lease.last_used <= self.idle:
                break
            if not self.in_use(lease.key):
                stale.append(lease)
        for lease in stale:
            # another instance sharing the database may still use it: its row stays then
            self._drop(lease, now, Reason.IDLE, None, idle_before=now - self.idle)
            self._idled[lease.key] = lease.host
            while len(self._idled) > self.max_leases:
                self._idled.popitem(last=False)
        return len(stale)

    def pin(self, route: str, host: str, candidates: Sequence[str], now: float) -> None:
        """Send the route's conversations to `host`; leases elsewhere are dropped."""
        if host not in candidates:
            raise UnknownHost(f"route {route!r}: {host!r} is not one of its hosts")
        old = self._pins.get(route)
        if old == host:
            return
        self._pins[route] = host
        self._event(now, Key(route, "", ""), old, host, Reason.PIN)
        for lease in self._route_leases(route):
            if lease.host != host:
                self._drop(lease, now, Reason.PIN, host)
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
        self._event(now, Key(route, "", ""), host, None, Reason.RELEASE)
        for lease in self._route_leases(route):
            lease.state = ACTIVE
            self._save(lease)

    def pins(self) -> dict[str, str]:
        """Every pinned route and its host."""
        return dict(self._pins)

    def pinned(self, route: str) -> str:
        """The route's pinned host, or "" when it is not pinned."""
        return self._pins.get(route, "")

    def release(self, route: str, now: float) -> int:
        """Drop every lease of the route and clear its pin; returns how many leases were dropped."""
        leases = self._route_leases(route)
        for lease in leases:
            self._drop(lease, now, Reason.RELEASE, None)
        self.unpin(route, now)
        return len(leases)

    def drop(self, key: Key, reason: Reason, now: float) -> bool:
        """Drop one lease (a reload took its host away); its next turn is placed anew."""
        lease = self._leases.get(key)
        if lease is None:
            return False
        self._drop(lease, now, reason, None)
        return True

    def drain(self, host: str, now: float) -> int:
        """Record a drain event per lease on `host`; the leases stay. Returns how many."""
        on_host = [lease for lease in self._leases.values() if lease.host == host]
        for lease in on_host:
            self._event(now, lease.key, host, None, Reason.DRAIN)
        return len(on_host)

    # ---- views ------------------------------------------------------------------------------

    def snapshot(self) -> list[Lease]:
        """Copies of every lease, sorted by (route, fp, model); pins are not leases."""
        return _sorted_copies(self._leases.values())

    def leases_of(self, route: str, limit: int | None = None) -> list[Lease]:
        """Copies of the route's leases, most recently used first (at most `limit`)."""
        leases = reversed(self._by_route.get(route, {}).values())
        out = []
        for lease in leases:
            if limit is not None and len(out) >= limit:
                break
            out.append(_copy(lease))
        return out

    def count(self, route: str | None = None) -> int:
        if route is None:
            return len(self._leases)
        return len(self._by_route.get(route, ()))

    def routes(self) -> list[str]:
        """Routes that hold leases."""
        return list(self._by_route)

    def active_on(self, host: str) -> int:
        """Conversations leased to `host`: each was used within `idle` seconds, since the idle
        sweep drops the others (or is in use). Counted as leases come and go, never scanned."""
        return self._on_host.get(host, 0)

    def hosts_count(self, route: str) -> dict[str, int]:
        """How many of the route's leases each host holds."""
        return dict(self._hosts_of.get((route, None), {}))

    # ---- memory + write-through -----------------------------------------------------------------

    def _route_leases(self, route: str) -> list[Lease]:
        return list(self._by_route.get(route, {}).values())

    def _put(self, lease: Lease) -> None:
        key = lease.key
        self._leases[key] = lease
        self._by_route.setdefault(key.route, OrderedDict())[key] = lease
        for model in (key.model, None):
            self._hosts_of.setdefault((key.route, model), Counter())[lease.host] += 1
        self._on_host[lease.host] += 1

    def _remove(self, lease: Lease) -> None:
        key = lease.key
        del self._leases[key]
        of_route = self._by_route[key.route]
        del of_route[key]
        if not of_route:
            del self._by_route[key.route]
        for model in (key.model, None):
            counts = self._hosts_of[(key.route, model)]
            counts[lease.host] -= 1
            if counts[lease.host] <= 0:
                del counts[lease.host]
            if not counts:
                del self._hosts_of[(key.route, model)]
        self._on_host[lease.host] -= 1
        if self._on_host[lease.host] <= 0:
            del self._on_host[lease.host]

    def _replace(self, lease: Lease) -> None:
        old = self._leases.get(lease.key)
        if old is not None:
            self._remove(old)
        self._put(lease)
        self._save(lease)

    def _create(self, key: Key, host: str, now: float) -> None:
        self._idled.pop(key, None)
        state = PINNED if self._pins.get(key.route) == host else ACTIVE
        self._make_room(key.route, now)
        lease = Lease(key, host, state, now, now)
        self._put(lease)
        self._save(lease)
        self._event(now, key, None, host, Reason.NEW)

    def _make_room(self, route: str, now: float) -> None:
        """Evict the least recently used idle lease of the route, then of the table, when full."""
        if self.count(route) >= self.max_per_route:
            self._evict(self._by_route[route].values(), now, f"route {route!r} holds {self.max_per_route}")
        if len(self._leases) >= self.max_leases:
            self._evict(self._leases.values(), now, f"the table holds {self.max_leases}")

    def _evict(self, oldest_first: Iterable[Lease], now: float, why: str) -> None:
        victim = next((lease for lease in oldest_first if not self.in_use(lease.key)), None)
        if victim is None:
            return
        self.evicted += 1
        if self.evicted == 1 or self.evicted % 1000 == 0:
            log.warning("lease table full (%s): evicted the least recently used lease of %r "
                        "(%d evictions so far)", why, victim.key.route, self.evicted)
        self._drop(victim, now, Reason.EVICTED, None)

    def _use(self, lease: Lease, now: float, save: bool = True) -> None:
        """The lease was used now. A turn of a conversation held by a request in flight need not
        be written: the request's end (`unhold`, or `save_use` after it) writes the later time
        anyway, so each turn costs the database one lease write instead of two."""
        lease.last_used = now
        self._leases.move_to_end(lease.key)
        self._by_route[lease.key.route].move_to_end(lease.key)
        if save:
            self._save(lease, touch=True)

    def _drop(self, lease: Lease, now: float, reason: Reason, to_host: str | None,
              idle_before: float | None = None) -> None:
        self._remove(lease)
        self._persist.delete_lease(lease.key.route, lease.key.fp, lease.key.model, idle_before)
        self._event(now, lease.key, lease.host, to_host, reason)

    def _save(self, lease: Lease, touch: bool = False) -> None:
        k = lease.key
        self._persist.save_lease(
            k.route, k.fp, k.model, lease.host, lease.state, lease.created, lease.last_used, touch=touch
        )

    def _event(self, now: float, key: Key, from_host: str | None, to_host: str | None,
               reason: Reason) -> None:
        event = LeaseEvent(now, key, from_host, to_host, reason)
        for listener in self._listeners:
            listener(event)


_ORDER = operator.attrgetter("key.route", "key.fp", "key.model")


def _copy(lease: Lease) -> Lease:
    # built directly: dataclasses.replace() costs several times more per lease
    return Lease(lease.key, lease.host, lease.state, lease.created, lease.last_used)


def _sorted_copies(leases: Iterable[Lease]) -> list[Lease]:
    return [_copy(lease) for lease in sorted(leases, key=_ORDER)]
