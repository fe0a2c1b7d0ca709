"""What an instance does with what other instances sharing its database did (crossbar.fleetwide and
the lease table's remote side), with a recording store; and the idle sweep against a real SQLite
store. The real thing, two instances on PostgreSQL, is tests/test_multi_pg.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from crossbar.config import HostConf, parse_config
from crossbar.decisions import Reason
from crossbar.fleetwide import Fleetwide
from crossbar.hosts import Fleet
from crossbar.lease import ACTIVE, PINNED, Key, LeaseEvent, LeaseTable
from crossbar.placement import Change as Placed
from crossbar.placement import LeaseChange
from crossbar.shared import Change
from crossbar.store import Store

T0 = 1_780_000_000.0
K1, K2 = Key("r", "fp1", "m"), Key("r", "fp2", "m")


@dataclass
class RecordingStore:
    """The store's write-through and publish calls, recorded."""

    calls: list[tuple[Any, ...]] = field(default_factory=list)
    shared: Any = field(default_factory=lambda: SimpleNamespace(subscribe=lambda *a: None))
    drains: set[str] = field(default_factory=set)

    def save_lease(self, *args: Any, **_kw: Any) -> None:
        self.calls.append(("save", *args))

    def delete_lease(self, *args: Any) -> None:
        self.calls.append(("delete", *args))

    def publish(self, change: Change) -> None:
        self.calls.append(("publish", change))

    def save_drain(self, host: str, draining: bool, now: float) -> None:
        self.calls.append(("drain", host, draining))

    def drained_hosts(self) -> set[str]:
        return self.drains

    def take(self) -> list[tuple[Any, ...]]:
        calls, self.calls = self.calls, []
        return calls


def hosts() -> dict[str, HostConf]:
    cfg = parse_config({"hosts": {n: {"base_url": f"http://127.0.0.1:{9000 + i}", "models": ["m"]}
                                  for i, n in enumerate(("a", "b"))},
                        "routes": {"r": {"hosts": ["a", "b"]}}, "listen": "127.0.0.1:0"})
    return cfg.hosts


@pytest.fixture
def parts() -> tuple[RecordingStore, LeaseTable, Fleet, Fleetwide]:
    store = RecordingStore()
    table = LeaseTable(store, idle=60.0)
    fleet = Fleet(hosts())
    fw = Fleetwide(store, table, fleet, lambda _route, host: host in fleet.conf,  # type: ignore[arg-type]
                   clock=lambda: T0)
    table.subscribe(fw.lease_event)
    return store, table, fleet, fw


def event(key: Key, to: str | None, reason: Reason) -> LeaseEvent:
    return LeaseEvent(T0, key, None, to, reason)


@pytest.mark.parametrize(("ev", "published"), [
    (event(K1, "a", Reason.NEW), Change("lease", "r", "fp1", "m", "a")),
    (event(K1, "b", Reason.UNHEALTHY), Change("lease", "r", "fp1", "m", "b")),
    (event(K1, "b", Reason.RETRIED), Change("lease", "r", "fp1", "m", "b")),
    (event(K1, "b", Reason.CONTEXT), Change("lease", "r", "fp1", "m", "b")),
    (event(K1, None, Reason.IDLE), None),  # each instance sweeps on its own
    (event(K1, None, Reason.EVICTED), None),  # memory bounds are per instance
    (event(K1, "a", Reason.PIN), None),  # the pin itself is published
    (event(K1, None, Reason.RELEASE), None),  # likewise the release
    (event(Key("r", "", ""), "a", Reason.PIN), None),  # the pin row's event
])
def test_which_lease_events_are_announced(parts: Any, ev: LeaseEvent, published: Change | None) -> None:
    store, _, _, fw = parts
    fw.lease_event(ev)
    assert store.take() == ([("publish", published)] if published else [])


def test_a_conversation_placed_here_is_written_and_announced(parts: Any) -> None:
    store, table, _, _ = parts
    table.apply(K1, LeaseChange(Placed.CREATE, "a"), T0)
    calls = store.take()
    assert calls[0][:6] == ("save", "r", "fp1", "m", "a", ACTIVE)
    assert calls[-1] == ("publish", Change("lease", "r", "fp1", "m", "a"))


def test_a_lease_placed_elsewhere_is_adopted_without_a_write_or_an_event(parts: Any) -> None:
    store, table, _, fw = parts
    table.apply(K1, LeaseChange(Placed.CREATE, "a"), T0)
    store.take()
    fw.on_change(Change("lease", "r", "fp1", "m", "b", instance="other"))
    fw.on_change(Change("lease", "r", "fp2", "m", "a", instance="other"))
    assert {(ls.key, ls.host) for ls in table.snapshot()} == {(K1, "b"), (K2, "a")}
    assert store.take() == []


def test_a_pin_and_a_release_made_elsewhere_apply_here_unwritten(parts: Any) -> None:
    store, table, _, fw = parts
    table.apply(K1, LeaseChange(Placed.CREATE, "a"), T0)
    table.apply(K2, LeaseChange(Placed.CREATE, "b"), T0)
    store.take()
    fw.on_change(Change("pin", "r", host="b"))
    assert table.pinned("r") == "b"
    assert [(ls.key, ls.state) for ls in table.snapshot()] == [(K2, PINNED)]  # a's lease dropped
    fw.on_change(Change("pin", "r", host=""))
    assert table.pinned("r") == "" and table.snapshot()[0].state == ACTIVE
    fw.on_change(Change("release", "r"))
    assert table.count() == 0
    assert store.take() == []


def test_drains_made_elsewhere_apply_here_and_are_read_at_start(parts: Any) -> None:
    store, _, fleet, fw = parts
    fw.on_change(Change("drain", host="a"))
    assert fleet.draining("a")
    fw.on_change(Change("undrain", host="a"))
    fw.on_change(Change("drain", host="nosuchhost"))  # another instance's config: ignored
    assert not fleet.draining("a")
    store.drains = {"b", "gone"}
    fw.load_drains()
    assert fleet.draining("b") and not fleet.draining("a")


def test_a_drain_here_is_written_and_announced(parts: Any) -> None:
    store, _, _, fw = parts
    fw.drained("a", True)
    assert store.take() == [("drain", "a", True), ("publish", Change("drain", host="a"))]


def test_resync_takes_the_databases_pins_and_leases(parts: Any) -> None:
    store, table, _, _ = parts
    table.apply(K1, LeaseChange(Placed.CREATE, "a"), T0)
    table.pin("other", "a", ("a", "b"), T0)
    store.take()
    row = SimpleNamespace
    table.resync([row(route="r", fp="fp1", model="m", host="b", state=ACTIVE, created=T0, last_used=T0),
                  row(route="r", fp="", model="", host="a", state=PINNED, created=T0, last_used=T0)], T0)
    assert table.pinned("r") == "a" and table.pinned("other") == ""
    assert [(ls.key, ls.host) for ls in table.snapshot()] == [(K1, "b")]  # the database's lease
    table.resync([row(route="r", fp="fp1", model="m", host="a", state=ACTIVE, created=T0,
                      last_used=T0)], T0)
    assert table.pinned("r") == "" and [(ls.key, ls.host) for ls in table.snapshot()] == [(K1, "a")]
    assert store.take() == []


def test_the_idle_sweep_keeps_a_row_another_instance_used_since(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "x.db"))
    store.open()
    store.start()
    try:
        table = LeaseTable(store, idle=60.0)
        table.apply(K1, LeaseChange(Placed.CREATE, "a"), T0)
        table.apply(K2, LeaseChange(Placed.CREATE, "a"), T0)
        assert store.flush()
        store.save_lease("r", "fp1", "m", "a", ACTIVE, T0, T0 + 100)  # another instance used fp1
        assert store.flush()
        table.expire_idle(T0 + 120)  # both idle here; fp1 not in the database
        assert store.flush()
        assert [row.fp for row in store.leases()] == ["fp1"]
    finally:
        store.close()
