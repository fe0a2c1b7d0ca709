"""One instance's part in a fleet-wide truth shared through PostgreSQL with the other instances.

The router calls it at four points, and only when the database is PostgreSQL:

- around placement: a conversation this instance does not hold is looked up in the shared lease
  table first (`adopt_shared`); a new conversation is claimed with an upsert (`claim`), and so is
  a move off a failed host (`claim_move`); when another instance won, the winner's host is adopted
  and placement runs again. A turn that stays where its lease is costs no round trip.
- after the local slot: one of the host's `parallel` slots across every instance (`fleet_slot`),
  given back in the request's one ending.
- the change feed: leases created or moved, pins, releases and drains made here are published;
  those made elsewhere are applied here without being written or published again (`on_change`).
  After the feed reconnects, pins, leases and drains are read back from the database, which wins.
- housekeeping: slots held by running requests are renewed (`heartbeat`).

Whenever the database does not answer, `SharedUnavailable` is counted by `SharedState` and the
instance decides from what it holds in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from crossbar.decisions import Reason
from crossbar.hosts import Fleet
from crossbar.lease import Key, LeaseEvent, LeaseTable
from crossbar.limiter import unless_gone
from crossbar.shared import SLOT_TTL, Change, SharedUnavailable
from crossbar.store import Store
from crossbar.writebehind import one_line

log = logging.getLogger("crossbar.fleetwide")

HEARTBEAT_EVERY = SLOT_TTL / 3
RESYNC_ATTEMPTS = 5
FLEET_SLOT_WAIT = 30.0  # seconds a request that may queue waits for a slot held by another instance
# lease events that place a conversation on a host the other instances should learn
_PUBLISHED = frozenset({Reason.NEW, Reason.UNHEALTHY, Reason.RETRIED, Reason.CONTEXT})
# moves the database decides between instances (`claim_move`): those announced
CLAIMED_MOVES = _PUBLISHED - {Reason.NEW}


class Fleetwide:
    def __init__(self, store: Store, leases: LeaseTable, fleet: Fleet,
                 placeable: Callable[[str, str], bool], clock: Callable[[], float] = time.time) -> None:
        """`placeable(route, host)`: this instance's configuration, as it is now, lets the route's
        conversations run on the host (another instance's configuration may not agree yet)."""
        assert store.shared is not None
        self.store, self.shared = store, store.shared
        self.leases, self.fleet = leases, fleet
        self.placeable = placeable
        self.clock = clock
        self.drained_hosts: set[str] = set()  # hosts drained fleet-wide, configured here or not
        self.resyncs = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._heartbeats: asyncio.Task[None] | None = None

    def load_drains(self) -> None:
        """At start-up: hosts drained through any instance are drained here too."""
        self.drained_hosts = set(self.store.drained_hosts())
        self.apply_drains(self.fleet.conf)

    def apply_drains(self, hosts: Iterable[str]) -> None:
        """These configured hosts (all at start-up, those a reload added) take the fleet-wide drains."""
        for host in hosts:
            if host in self.fleet.conf:
                self.fleet.set_draining(host, host in self.drained_hosts)

    def start(self) -> None:
        """Listen to the other instances' changes (on this event loop) and renew held slots."""
        loop = asyncio.get_running_loop()
        self.shared.subscribe(self.on_change, loop)
        self._heartbeats = loop.create_task(self._heartbeat(), name="crossbar-slot-heartbeat")

    def stop(self) -> None:
        """Stop renewing; slot releases under way finish (the store gives back the rest)."""
        if self._heartbeats is not None:
            self._heartbeats.cancel()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ leases

    async def adopt_shared(self, key: Key) -> None:
        """A conversation not in memory: take over its shared lease, if another instance placed it."""
        if self.leases.has(key) or self.leases.pinned(key.route):
            return
        try:
            row = await self.shared.find_lease(key.route, key.fp, key.model)
        except SharedUnavailable:
            return
        if row is not None and not self.leases.has(key) and self.placeable(key.route, row.host):
            self.leases.adopt(key, row.host, float(row.created), float(row.last_used))

    async def claim(self, key: Key, host: str) -> str:
        """Place a new conversation on `host` unless another instance holds it: the host it is on
        (the winner is adopted). `host` itself when the database does not answer, or when the
        winner is a host this configuration does not give the route (this placement's lease is
        written over it)."""
        now = self.clock()
        try:
            winner = await self.shared.claim_lease(key.route, key.fp, key.model, host, now,
                                                   idle_before=now - self.leases.idle)
        except SharedUnavailable:
            return host
        if winner == host or not self.placeable(key.route, winner):
            return host
        self.leases.adopt(key, winner, now, now)
        return winner

    async def claim_move(self, key: Key, from_host: str, to_host: str) -> str:
        """Move a conversation off `from_host` to `to_host` unless another instance moved it first
        (the database names another host, written since the conversation came to `from_host`
        here): then the host it is on, adopted and announced (an instance that missed that move
        joins it). `to_host` itself when the database does not answer, or when the other
        instance's choice is a host this configuration does not give the route (this move's lease
        is written over it). An older row (a write of the conversation's host from before it came
        to `from_host`) is moved too."""
        now, since = self.clock(), self.leases.since(key)
        try:
            winner = await self.shared.move_lease(
                key.route, key.fp, key.model, from_host, to_host, now, idle_before=now - self.leases.idle,
                older_than=float("-inf") if since is None else since)
        except SharedUnavailable:
            return to_host
        if winner == to_host or not self.placeable(key.route, winner):
            return to_host
        self.leases.adopt(key, winner, now, now)
        self.store.publish(Change("lease", key.route, key.fp, key.model, winner))
        return winner

    def lease_event(self, event: LeaseEvent) -> None:
        """A lease table listener: a conversation placed or moved here is announced."""
        k = event.key
        if k.model and event.to_host and event.reason in _PUBLISHED:
            self.store.publish(Change("lease", k.route, k.fp, k.model, event.to_host))

    # ------------------------------------------------------------ operator actions

    def pinned(self, route: str, host: str) -> None:
        self.store.publish(Change("pin", route, host=host))  # host "" is an unpin

    def released(self, route: str) -> None:
        self.store.publish(Change("release", route))

    def drained(self, host: str, draining: bool) -> None:
        if draining:
            self.drained_hosts.add(host)
        else:
            self.drained_hosts.discard(host)
        self.store.save_drain(host, draining, self.clock())
        self.store.publish(Change("drain" if draining else "undrain", host=host))

    # ------------------------------------------------------------ the other instances' changes

    def on_change(self, change: Change) -> None:
        """On the event loop: apply what another instance did, without writing or publishing it."""
        now = self.clock()
        match change.kind:
            case "lease" if change.host and self.placeable(change.route, change.host):
                self.leases.adopt(Key(change.route, change.fp, change.model), change.host, now, now)
            case "pin" if not change.host or self.placeable(change.route, change.host):
                self.leases.apply_remote_pin(change.route, change.host, now)
            case "release":
                self.leases.apply_remote_release(change.route, now)
            case "drain" if change.host:
                self.drained_hosts.add(change.host)
                self.apply_drains((change.host,))
            case "undrain" if change.host:
                self.drained_hosts.discard(change.host)
                self.apply_drains((change.host,))
            case "resync":
                self._spawn(self.resync())

    async def resync(self) -> None:
        """After the feed was lost: let this instance's queued writes land, then take the database's
        pins, leases and drains (on a disagreement the database's lease wins)."""
        self.resyncs += 1
        if not await asyncio.to_thread(self.store.flush, 10.0):
            log.warning("fleetwide: writes still pending at resync; the database's leases win")
        for attempt in range(1, RESYNC_ATTEMPTS + 1):
            try:
                rows = await asyncio.to_thread(self.store.load_leases)
                drained = await asyncio.to_thread(self.store.drained_hosts)
                break
            except Exception as exc:  # a pooled connection the outage broke is replaced next time
                log.warning("fleetwide: resync attempt %d failed: %s", attempt, one_line(exc))
                await asyncio.sleep(attempt * 0.5)
        else:
            return  # the database went away again: the next reconnect resyncs
        # a lease or pin on a host this instance's configuration does not give its route stays out
        # (another instance's configuration may lag or lead this one's)
        self.leases.resync([row for row in rows if self.placeable(row.route, row.host)], self.clock())
        self.drained_hosts = set(drained)
        self.apply_drains(self.fleet.conf)
        log.info("fleetwide: resynced %d leases and %d drained hosts from %s", len(rows), len(drained),
                 self.store.label)

    # ------------------------------------------------------------ slots

    async def fleet_slot(self, host: str, slot_key: str, parallel: int, wait: float,
                         gone: asyncio.Event | None) -> str | None:
        """One of the host's `parallel` slots across every instance: a token for `release`, "" when
        the database does not answer (the local slot alone holds), None when all stay taken for
        `wait` seconds; `ClientGone` when the client leaves meanwhile."""
        try:  # when the client leaves, a grant made meanwhile is never renewed: it lapses
            return await unless_gone(self.shared.acquire_slot(host, slot_key, parallel, wait=wait), gone)
        except SharedUnavailable:
            return ""

    def release(self, token: str) -> None:
        """Give a fleet slot back (in the background: the request's ending does not wait)."""
        if token:
            self._spawn(self._release(token))

    async def _release(self, token: str) -> None:
        with contextlib.suppress(SharedUnavailable):
            await self.shared.release_slot(token)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_EVERY)
            with contextlib.suppress(SharedUnavailable):
                await self.shared.heartbeat()
