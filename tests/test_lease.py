from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from crossbar.choose import Candidate, Choice
from crossbar.decisions import Decision, Reason
from crossbar.lease import Key, Lease, LeaseEvent, LeaseTable, UnknownHost
from crossbar.placement import Ask, Change, LeaseChange, Placement, Refusal, Snapshot, place

R = "proj"
M = "ornith"
HOSTS = ["alpha", "beta", "gamma"]
IDLE_S = 1800.0
ROUTE_KEY = Key(R, "", M)
K1 = Key(R, "fp1", M)
K2 = Key(R, "fp2", M)


@dataclass
class FakePersister:
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    touched: list[tuple[str, str, str]] = field(default_factory=list)  # saves of a last use alone

    def save_lease(
        self, route: str, fp: str, model: str, host: str, state: str, created: float, last_used: float,
        *, touch: bool = False,
    ) -> None:
        self.calls.append(("save", route, fp, model, host, state, created, last_used))
        if touch:
            self.touched.append((route, fp, model))

    def delete_lease(self, route: str, fp: str, model: str, idle_before: float | None = None) -> None:
        self.calls.append(("delete", route, fp, model))

    def record_event(self, e: LeaseEvent) -> None:
        self.calls.append(("event", e.ts, e.key.route, e.key.fp, e.key.model, e.from_host, e.to_host,
                           str(e.reason)))

    def take(self) -> list[tuple[Any, ...]]:
        calls, self.calls = self.calls, []
        return calls


@dataclass
class FakeHosts:
    down: set[str] = field(default_factory=set)
    draining_hosts: set[str] = field(default_factory=set)

    def healthy(self, host: str) -> bool:
        return host not in self.down

    def draining(self, host: str) -> bool:
        return host in self.draining_hosts


@dataclass
class FakeChooser:
    """Picks the first host of `prefer` that is eligible; records what it was offered."""

    prefer: list[str] = field(default_factory=lambda: list(HOSTS))
    offered: list[tuple[list[str], str]] = field(default_factory=list)

    def __call__(self, eligible: Sequence[Candidate]) -> Choice | None:
        names = [c.name for c in eligible]
        self.offered.append((names, M))
        host = next((h for h in self.prefer if h in names), None)
        return Choice(host, loads_model=False) if host else None


class LeaseError(Exception):
    pass


class NoHost(LeaseError):
    pass


class PinnedDown(LeaseError):
    pass


@dataclass(frozen=True)
class Grant:
    host: str
    decision: Decision
    moved_from: str | None = None


def acquire(table: LeaseTable, hosts: FakeHosts, chooser: FakeChooser, key: Key, now: float,
            exclude: Sequence[str] = (), candidates: Sequence[str] = HOSTS) -> Grant:
    """Place through `crossbar.placement` and apply the lease change, as the router does."""
    snap = Snapshot({h: Candidate(h, hosts.healthy(h), hosts.draining(h), True, True, 1, 1.0, 0, i)
                     for i, h in enumerate(candidates)}, {})
    ask = Ask(key.route, key.model, tuple(candidates), fp=key.fp, excluded=frozenset(exclude))
    result = place(ask, snap, table.view(key), now, table.idle, pick=chooser)
    if isinstance(result, Refusal):
        raise (PinnedDown if "pinned" in result.message else NoHost)(result.message)
    assert isinstance(result, Placement)
    table.apply(key, result.change, now)
    return Grant(result.host, result.decision, result.change.from_host or None)


@dataclass
class Row:
    route: str
    fp: str
    model: str
    host: str
    state: str
    created: float
    last_used: float


@dataclass
class World:
    table: LeaseTable
    persist: FakePersister
    hosts: FakeHosts
    chooser: FakeChooser

    def acquire(self, key: Key, now: float, exclude: Sequence[str] = (),
                candidates: Sequence[str] = HOSTS) -> Grant:
        return acquire(self.table, self.hosts, self.chooser, key, now, exclude, candidates)


def make_table(persist: FakePersister, **caps: int) -> LeaseTable:
    table = LeaseTable(persist, IDLE_S, **caps)
    table.subscribe(persist.record_event)
    return table


@pytest.fixture
def w() -> World:
    persist, hosts, chooser = FakePersister(), FakeHosts(), FakeChooser()
    return World(make_table(persist), persist, hosts, chooser)


def save(key: Key, host: str, created: float, last_used: float, state: str = "active") -> tuple[Any, ...]:
    return ("save", key.route, key.fp, key.model, host, state, created, last_used)


def event(ts: float, key: Key, from_host: str | None, to_host: str | None, reason: str) -> tuple[Any, ...]:
    return ("event", ts, key.route, key.fp, key.model, from_host, to_host, reason)


def delete(key: Key) -> tuple[Any, ...]:
    return ("delete", key.route, key.fp, key.model)


def pin_row(host: str, now: float) -> tuple[Any, ...]:
    return ("save", R, "", "", host, "pinned", now, now)


def hosts_of(w: World) -> dict[Key, str]:
    return {lease.key: lease.host for lease in w.table.snapshot()}


# ---- new, reuse, move -------------------------------------------------------------------------


def test_new_lease_is_placed_by_choose(w: World) -> None:
    assert w.acquire(K1, 100.0) == Grant("alpha", Decision.NEW)
    assert w.chooser.offered == [(HOSTS, M)]
    assert w.persist.take() == [save(K1, "alpha", 100.0, 100.0), event(100.0, K1, None, "alpha", "new")]
    assert w.table.count() == 1


def test_next_turn_reuses_the_host_even_when_choose_prefers_another(w: World) -> None:
    w.acquire(K1, 100.0)
    w.persist.take()
    w.chooser.prefer = ["gamma", "beta", "alpha"]
    assert w.acquire(K1, 200.0) == Grant("alpha", Decision.REUSED)
    assert len(w.chooser.offered) == 1
    assert w.persist.take() == [save(K1, "alpha", 100.0, 200.0)]


def test_the_end_of_a_request_records_last_use(w: World) -> None:
    w.acquire(K1, 100.0)
    w.persist.take()
    w.table.hold(K1)
    w.table.unhold(K1, 150.0)
    w.table.hold(K2)
    w.table.unhold(K2, 150.0)  # no lease: nothing happens
    assert w.persist.take() == [save(K1, "alpha", 100.0, 150.0)]
    assert w.table.snapshot()[0].last_used == 150.0


def test_a_last_use_is_a_touch_and_every_change_is_not(w: World) -> None:
    """The store may write a lease's last use up to a second late; never a change."""
    w.acquire(K1, 100.0)  # created
    w.chooser.prefer = ["beta"]
    w.hosts.down.add("alpha")
    w.acquire(K1, 110.0)  # moved
    assert w.persist.touched == []
    w.table.hold(K1)
    w.table.unhold(K1, 150.0)
    assert w.persist.touched == [(R, K1.fp, M)]
    w.persist.touched.clear()
    w.table.pin(R, "beta", HOSTS, 200.0)  # the lease turns pinned; the pin row
    w.table.unpin(R, 210.0)
    assert w.persist.touched == [] and w.persist.take()


def test_a_turn_in_flight_is_written_once_when_it_ends(w: World) -> None:
    w.acquire(K1, 100.0)
    w.persist.take()
    w.table.hold(K1)  # the router holds a completion's conversation before placing it
    assert w.acquire(K1, 200.0) == Grant("alpha", Decision.REUSED)
    assert w.persist.take() == []  # the touch stays in memory ...
    assert w.table.snapshot()[0].last_used == 200.0
    w.table.unhold(K1, 260.0)
    assert w.persist.take() == [save(K1, "alpha", 100.0, 260.0)]  # ... and the end writes the later time


def test_unhealthy_host_moves_the_lease_with_an_event(w: World) -> None:
    w.acquire(K1, 100.0)
    w.persist.take()
    w.hosts.down.add("alpha")
    assert w.acquire(K1, 200.0) == Grant("beta", Decision.MOVED, moved_from="alpha")
    assert w.chooser.offered[-1] == (["beta", "gamma"], M)
    assert w.persist.take() == [
        save(K1, "beta", 200.0, 200.0),
        event(200.0, K1, "alpha", "beta", "unhealthy"),
    ]


def test_recovery_does_not_move_the_lease_back(w: World) -> None:
    w.acquire(K1, 100.0)
    w.hosts.down.add("alpha")
    w.acquire(K1, 200.0)
    w.hosts.down.clear()
    w.persist.take()
    assert w.acquire(K1, 300.0) == Grant("beta", Decision.REUSED)
    assert w.persist.take() == [save(K1, "beta", 200.0, 300.0)]


def test_exclude_behaves_like_unhealthy(w: World) -> None:
    w.acquire(K1, 100.0)
    w.persist.take()
    assert w.acquire(K1, 101.0, exclude=["alpha"]) == Grant("beta", Decision.RETRIED, moved_from="alpha")
    assert w.persist.take() == [
        save(K1, "beta", 101.0, 101.0),
        event(101.0, K1, "alpha", "beta", "unhealthy"),
    ]
    assert w.acquire(K2, 102.0, exclude=["alpha", "beta"]) == Grant("gamma", Decision.RETRIED)
    assert w.chooser.offered[-1] == (["gamma"], M)


def test_lease_on_a_host_no_longer_in_the_route_moves(w: World) -> None:
    w.acquire(K1, 100.0)
    grant = w.acquire(K1, 200.0, candidates=["beta", "gamma"])
    assert grant == Grant("beta", Decision.MOVED, moved_from="alpha")


def test_no_host_creates_nothing(w: World) -> None:
    w.hosts.down.update(HOSTS)
    with pytest.raises(NoHost):
        w.acquire(K1, 100.0)
    assert w.table.count() == 0
    assert w.persist.take() == []


def test_no_host_when_choose_declines(w: World) -> None:
    w.chooser.prefer = []
    with pytest.raises(NoHost, match="ornith"):
        w.acquire(K1, 100.0)
    assert w.table.count() == 0
    assert w.persist.take() == []


def test_no_host_after_unhealthy_keeps_the_old_lease(w: World) -> None:
    w.acquire(K1, 100.0)
    w.persist.take()
    w.hosts.down.update(HOSTS)
    with pytest.raises(NoHost):
        w.acquire(K1, 200.0)
    assert w.persist.take() == []
    w.hosts.down.clear()
    assert w.acquire(K1, 300.0) == Grant("alpha", Decision.REUSED)


# ---- fingerprint inheritance ----------------------------------------------------------------


def test_fingerprint_inherits_the_route_lease(w: World) -> None:
    w.chooser.prefer = ["beta"]
    w.acquire(ROUTE_KEY, 100.0)
    w.chooser.prefer = ["alpha"]
    w.persist.take()
    assert w.acquire(K1, 200.0) == Grant("beta", Decision.INHERITED)
    assert len(w.chooser.offered) == 1
    assert w.persist.take() == [save(K1, "beta", 200.0, 200.0), event(200.0, K1, None, "beta", "new")]
    assert hosts_of(w) == {ROUTE_KEY: "beta", K1: "beta"}


@pytest.mark.parametrize("trouble", ["down", "draining", "excluded"])
def test_no_inheritance_from_an_unusable_route_lease(w: World, trouble: str) -> None:
    w.chooser.prefer = ["beta", "alpha"]
    w.acquire(ROUTE_KEY, 100.0)
    exclude = ["beta"] if trouble == "excluded" else []
    if trouble == "down":
        w.hosts.down.add("beta")
    if trouble == "draining":
        w.hosts.draining_hosts.add("beta")
    expected = Decision.RETRIED if exclude else Decision.NEW  # re-placed after a failure
    assert w.acquire(K1, 200.0, exclude=exclude) == Grant("alpha", expected)


def test_route_lease_does_not_inherit_from_itself(w: World) -> None:
    assert w.acquire(ROUTE_KEY, 100.0).decision == Decision.NEW


# ---- pins ------------------------------------------------------------------------------------


def test_pin_sends_the_route_to_the_pin_and_drops_leases_elsewhere(w: World) -> None:
    w.acquire(K1, 100.0)  # alpha
    w.chooser.prefer = ["beta"]
    w.acquire(K2, 101.0)  # beta
    other = Key("other", "fp", M)
    w.acquire(other, 102.0)
    w.persist.take()

    w.table.pin(R, "beta", HOSTS, 200.0)
    assert w.table.pinned(R) == "beta"
    assert w.persist.take() == [
        event(200.0, Key(R, "", ""), None, "beta", "pin"),
        delete(K1),
        event(200.0, K1, "alpha", "beta", "pin"),
        save(K2, "beta", 101.0, 101.0, "pinned"),
        pin_row("beta", 200.0),
    ]
    assert hosts_of(w) == {K2: "beta", other: "beta"}

    assert w.acquire(K1, 300.0) == Grant("beta", Decision.PINNED)
    assert w.persist.take() == [
        save(K1, "beta", 300.0, 300.0, "pinned"),
        event(300.0, K1, None, "beta", "new"),
    ]
    assert w.acquire(K2, 301.0) == Grant("beta", Decision.PINNED)
    assert w.persist.take() == [save(K2, "beta", 101.0, 301.0, "pinned")]


def test_pin_outranks_a_healthier_choice_and_the_lease_state(w: World) -> None:
    w.table.pin(R, "gamma", HOSTS, 100.0)
    w.chooser.prefer = ["alpha"]
    assert w.acquire(K1, 200.0) == Grant("gamma", Decision.PINNED)
    assert [lease.state for lease in w.table.leases_of(R)] == ["pinned"]


def test_repinning_to_the_same_host_changes_nothing(w: World) -> None:
    w.table.pin(R, "beta", HOSTS, 100.0)
    w.persist.take()
    w.table.pin(R, "beta", HOSTS, 200.0)
    assert w.persist.take() == []


def test_repinning_moves_the_route_to_the_new_pin(w: World) -> None:
    w.table.pin(R, "beta", HOSTS, 100.0)
    w.acquire(K1, 101.0)
    w.persist.take()
    w.table.pin(R, "gamma", HOSTS, 200.0)
    assert w.persist.take() == [
        event(200.0, Key(R, "", ""), "beta", "gamma", "pin"),
        delete(K1),
        event(200.0, K1, "beta", "gamma", "pin"),
        pin_row("gamma", 200.0),
    ]


def test_pin_to_an_unknown_host_is_refused(w: World) -> None:
    with pytest.raises(UnknownHost):
        w.table.pin(R, "delta", HOSTS, 100.0)
    assert w.table.pinned(R) == ""
    assert w.persist.take() == []


@pytest.mark.parametrize("trouble", ["down", "excluded"])
def test_pinned_host_down_is_an_error_and_nothing_moves(w: World, trouble: str) -> None:
    w.table.pin(R, "beta", HOSTS, 100.0)
    w.acquire(K1, 101.0)
    w.persist.take()
    exclude = ["beta"] if trouble == "excluded" else []
    if trouble == "down":
        w.hosts.down.add("beta")
    with pytest.raises(PinnedDown, match=r"proj.*beta"):
        w.acquire(K1, 200.0, exclude=exclude)
    with pytest.raises(LeaseError):
        w.acquire(K2, 200.0, exclude=exclude)
    assert w.persist.take() == []
    assert hosts_of(w) == {K1: "beta"}


def test_pinned_route_moves_a_stray_lease_to_the_pin(w: World) -> None:
    w.table.load(
        [
            Row(R, "fp1", M, "alpha", "active", 10.0, 20.0),
            Row(R, "", "", "beta", "pinned", 5.0, 5.0),
        ]
    )
    assert w.acquire(K1, 100.0) == Grant("beta", Decision.PINNED, moved_from="alpha")
    assert w.persist.take() == [
        save(K1, "beta", 100.0, 100.0, "pinned"),
        event(100.0, K1, "alpha", "beta", "pin"),
    ]


def test_pin_serves_even_a_draining_pinned_host(w: World) -> None:
    w.table.pin(R, "beta", HOSTS, 100.0)
    w.hosts.draining_hosts.add("beta")
    assert w.acquire(K1, 200.0) == Grant("beta", Decision.PINNED)


def test_unpin_keeps_the_leases(w: World) -> None:
    w.table.pin(R, "beta", HOSTS, 100.0)
    w.acquire(K1, 101.0)
    w.persist.take()
    w.table.unpin(R, 200.0)
    assert w.table.pinned(R) == ""
    assert w.persist.take() == [
        delete(Key(R, "", "")),
        event(200.0, Key(R, "", ""), "beta", None, "release"),
        save(K1, "beta", 101.0, 101.0, "active"),
    ]
    w.chooser.prefer = ["alpha"]
    assert w.acquire(K1, 300.0) == Grant("beta", Decision.REUSED)
    w.persist.take()
    w.table.unpin(R, 400.0)  # not pinned: nothing
    assert w.persist.take() == []


def test_release_drops_every_lease_of_the_route_and_the_pin(w: World) -> None:
    other = Key("other", "fp", M)
    w.acquire(other, 90.0)
    w.table.pin(R, "beta", HOSTS, 100.0)
    w.acquire(K1, 101.0)
    w.acquire(K2, 102.0)
    w.persist.take()
    assert w.table.release(R, 200.0) == 2
    assert w.persist.take() == [
        delete(K1),
        event(200.0, K1, "beta", None, "release"),
        delete(K2),
        event(200.0, K2, "beta", None, "release"),
        delete(Key(R, "", "")),
        event(200.0, Key(R, "", ""), "beta", None, "release"),
    ]
    assert w.table.pinned(R) == ""
    assert w.table.leases_of(R) == []
    assert hosts_of(w) == {other: "alpha"}
    assert w.acquire(K1, 300.0) == Grant("alpha", Decision.NEW)
    assert w.table.release("nobody", 300.0) == 0


# ---- drain ---------------------------------------------------------------------------------


def test_draining_host_keeps_existing_leases_but_takes_no_new_ones(w: World) -> None:
    w.acquire(K1, 100.0)
    w.persist.take()
    w.hosts.draining_hosts.add("alpha")
    assert w.table.drain("alpha", 150.0) == 1
    assert w.persist.take() == [event(150.0, K1, "alpha", None, "drain")]
    assert w.acquire(K1, 200.0) == Grant("alpha", Decision.REUSED)
    assert w.acquire(K2, 201.0) == Grant("beta", Decision.NEW)
    assert w.chooser.offered[-1] == (["beta", "gamma"], M)
    assert w.table.drain("gamma", 300.0) == 0


# ---- idle ----------------------------------------------------------------------------------


def test_expire_idle_drops_only_stale_leases(w: World) -> None:
    w.acquire(K1, 0.0)
    w.acquire(K2, 1000.0)
    w.persist.take()
    assert w.table.expire_idle(IDLE_S) == 0  # exactly idle: not yet
    assert w.table.expire_idle(IDLE_S + 1) == 1
    assert w.persist.take() == [delete(K1), event(IDLE_S + 1, K1, "alpha", None, "idle")]
    assert hosts_of(w) == {K2: "alpha"}


def test_idle_lease_is_replaced_lazily_in_acquire(w: World) -> None:
    w.acquire(K1, 0.0)
    w.persist.take()
    w.chooser.prefer = ["gamma"]
    now = IDLE_S + 10
    assert w.acquire(K1, now) == Grant("gamma", Decision.IDLE, moved_from="alpha")
    assert w.persist.take() == [
        delete(K1),
        event(now, K1, "alpha", None, "idle"),
        save(K1, "gamma", now, now),
        event(now, K1, None, "gamma", "new"),
    ]


def test_pins_never_expire(w: World) -> None:
    w.table.pin(R, "beta", HOSTS, 0.0)
    w.acquire(K1, 0.0)
    later = 10 * IDLE_S
    assert w.table.expire_idle(later) == 1
    assert w.table.pinned(R) == "beta"
    assert w.acquire(K1, later) == Grant("beta", Decision.PINNED)
    assert w.acquire(K2, later + 10 * IDLE_S) == Grant("beta", Decision.PINNED)


# ---- restart, views ----------------------------------------------------------------------------


def test_load_restores_leases_and_pins(w: World) -> None:
    other = Key("other", "", M)
    w.table.load(
        [
            Row(R, "fp1", M, "gamma", "active", 10.0, 20.0),
            Row("other", "", M, "beta", "pinned", 11.0, 21.0),
            Row("other", "", "", "beta", "pinned", 5.0, 5.0),
        ]
    )
    assert w.persist.take() == []
    assert w.table.count() == 2
    assert w.table.pinned("other") == "beta"
    assert w.table.snapshot() == [
        Lease(other, "beta", "pinned", 11.0, 21.0),
        Lease(K1, "gamma", "active", 10.0, 20.0),
    ]
    w.chooser.prefer = ["alpha"]
    assert w.acquire(K1, 100.0) == Grant("gamma", Decision.REUSED)
    assert w.acquire(other, 100.0) == Grant("beta", Decision.PINNED)


def test_load_replaces_what_was_in_memory(w: World) -> None:
    w.acquire(K1, 100.0)
    w.table.pin("x", "alpha", HOSTS, 100.0)
    w.table.load([])
    assert w.table.count() == 0
    assert w.table.pinned("x") == ""


def test_snapshot_is_sorted_pin_free_and_copied(w: World) -> None:
    keys = [Key("b", "", M), Key("a", "z", M), Key("a", "", "m2"), Key("a", "", "m1")]
    for i, key in enumerate(keys):
        w.acquire(key, float(i))
    w.table.pin("a", "alpha", HOSTS, 10.0)
    snap = w.table.snapshot()
    assert [lease.key for lease in snap] == [
        Key("a", "", "m1"),
        Key("a", "", "m2"),
        Key("a", "z", M),
        keys[0],
    ]
    snap[0].host = "mutated"
    assert w.table.snapshot()[0].host == "alpha"
    assert sorted(lease.key.fp + lease.key.model for lease in w.table.leases_of("a")) == sorted(
        lease.key.fp + lease.key.model for lease in snap[:3])
    assert [lease.key for lease in w.table.leases_of("a", limit=1)] == [keys[3]]  # most recent first
    assert w.table.leases_of("nobody") == []


def test_model_less_route_lease_does_not_clobber_the_pin_row(w: World) -> None:
    bare = Key(R, "", "")
    w.table.apply(bare, LeaseChange(Change.CREATE, "alpha"), 100.0)  # placement refuses a missing model
    w.persist.take()
    w.table.pin(R, "alpha", HOSTS, 200.0)
    calls = w.persist.take()
    assert calls[-1] == pin_row("alpha", 200.0)
    assert delete(bare) not in calls


# ---- cost per request --------------------------------------------------------------------------


class CountingKey(Key):
    """A Key whose hashing and comparisons are counted, to see how much an acquire touches."""

    __slots__ = ()
    ops = 0

    def __hash__(self) -> int:
        CountingKey.ops += 1
        return Key.__hash__(self)

    def __eq__(self, other: object) -> bool:
        CountingKey.ops += 1
        return Key.__eq__(self, other)


def ops_per_acquire(n_leases: int) -> int:
    persist, hosts, chooser = FakePersister(), FakeHosts(), FakeChooser()
    table = make_table(persist, max_leases=10 * n_leases, max_per_route=10 * n_leases)
    for i in range(n_leases):
        acquire(table, hosts, chooser, CountingKey(R, f"fp{i}", M), 0.0)
    probe = CountingKey(R, "fp0", M)
    fresh = CountingKey(R, "new", M)
    CountingKey.ops = 0
    acquire(table, hosts, chooser, probe, 1.0)
    acquire(table, hosts, chooser, fresh, 1.0)
    table.hold(probe)
    table.unhold(probe, 2.0)
    table.view(probe, read=True)
    return CountingKey.ops


def test_acquire_cost_does_not_grow_with_the_table() -> None:
    assert ops_per_acquire(10_000) == ops_per_acquire(10)


def test_a_read_costs_the_same_whatever_the_route_holds() -> None:
    persist = FakePersister()
    table = make_table(persist)
    hosts, chooser = FakeHosts(), FakeChooser()
    for i in range(2000):
        acquire(table, hosts, chooser, Key(R, f"fp{i}", M), float(i))
    assert table.route_hosts(R, M) == ("alpha",)
    assert table.route_hosts(R, "") == ("alpha",)
    assert table.route_hosts(R, "other-model") == ()


# ---- in use, caps ------------------------------------------------------------------------------


def test_a_lease_in_use_never_idles_out_and_idles_from_its_last_end(w: World) -> None:
    w.acquire(K1, 0.0)
    w.table.hold(K1)  # a long request runs
    assert w.table.expire_idle(10 * IDLE_S) == 0
    assert w.acquire(K1, 10 * IDLE_S).decision == Decision.REUSED  # the next turn, queued meanwhile
    end = 10 * IDLE_S + 5
    w.table.unhold(K1, end)
    assert w.table.expire_idle(end + IDLE_S) == 0
    assert w.table.expire_idle(end + IDLE_S + 1) == 1


def test_a_full_route_evicts_its_least_recently_used_idle_lease() -> None:
    persist = FakePersister()
    table = make_table(persist, max_per_route=2)
    hosts, chooser = FakeHosts(), FakeChooser()
    acquire(table, hosts, chooser, K1, 1.0)
    acquire(table, hosts, chooser, K2, 2.0)
    table.hold(K1)  # in use: never evicted
    k3 = Key(R, "fp3", M)
    persist.take()
    acquire(table, hosts, chooser, k3, 3.0)
    assert {lease.key for lease in table.snapshot()} == {K1, k3}
    assert persist.take()[:2] == [delete(K2), event(3.0, K2, "alpha", None, "evicted")]
    assert table.evicted == 1
    acquire(table, hosts, chooser, Key("other", "x", M), 4.0)  # another route has room
    assert table.count() == 3


def test_a_full_table_evicts_across_routes() -> None:
    table = make_table(FakePersister(), max_leases=2)
    hosts, chooser = FakeHosts(), FakeChooser()
    for i, route in enumerate(("r1", "r2", "r3")):
        acquire(table, hosts, chooser, Key(route, "f", M), float(i))
    assert sorted(lease.key.route for lease in table.snapshot()) == ["r2", "r3"]
    assert table.count() == 2


def test_listeners_hear_every_event_in_order(w: World) -> None:
    heard: list[Reason] = []
    w.table.subscribe(lambda e: heard.append(e.reason))
    w.acquire(K1, 1.0)
    w.table.drain("alpha", 2.0)
    w.hosts.down.add("alpha")
    w.acquire(K1, 3.0)
    assert heard == [Reason.NEW, Reason.DRAIN, Reason.UNHEALTHY]


def test_the_asking_request_does_not_keep_its_own_lease_from_idling(w: World) -> None:
    w.acquire(K1, 0.0)
    w.table.hold(K1)  # the new turn itself, admitted before it is placed
    assert not w.table.view(K1, own=True).busy
    assert w.table.view(K1).busy
    w.table.hold(K1)  # and another turn of it in flight
    assert w.table.view(K1, own=True).busy


def test_active_on_counts_each_hosts_leases_as_they_come_and_go(w: World) -> None:
    w.acquire(K1, 100.0)
    w.acquire(K2, 100.0)
    w.acquire(ROUTE_KEY, 100.0)
    assert [w.table.active_on(h) for h in HOSTS] == [3, 0, 0]
    w.hosts.down.add("alpha")
    w.acquire(K1, 200.0)  # moves to beta
    assert [w.table.active_on(h) for h in HOSTS] == [2, 1, 0]
    w.table.expire_idle(100.0 + IDLE_S + 1)  # K2 and the route lease idled out; K1 was used at 200
    assert [w.table.active_on(h) for h in HOSTS] == [0, 1, 0]
    w.table.release(R, 300.0)
    assert [w.table.active_on(h) for h in HOSTS] == [0, 0, 0]
    w.table.load([Row(R, fp, M, "gamma", "active", 1.0, 2.0) for fp in ("fp1", "fp2")])
    assert [w.table.active_on(h) for h in HOSTS] == [0, 0, 2]
