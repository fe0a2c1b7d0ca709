"""crossbar.shared against the real PostgreSQL of tests/pg.py: two instances (two stores on one
database, each with its own instance id) agree on leases, hear each other's changes, and never run
more than `parallel` requests on one (host, model) together."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from pg import PgServer

from crossbar.shared import Change, SharedState, SharedUnavailable
from crossbar.store import Store

T0 = 1_780_000_000.0
Pair = tuple[Store, Store]


def open_store(db: str) -> Store:
    s = Store(db)
    s.open()
    s.start()
    return s


@pytest.fixture
def pair(pg_url: str) -> Iterator[tuple[Store, Store]]:
    a, b = open_store(pg_url), open_store(pg_url)
    yield a, b
    a.close()
    b.close()


def shared(s: Store) -> SharedState:
    assert s.shared is not None
    return s.shared


# -- leases -----------------------------------------------------------------------------------


async def test_two_instances_racing_on_new_conversations_agree_on_one_host(pair: Pair) -> None:
    a, b = pair
    keys = [("r1", f"fp{i}", "m1") for i in range(40)]
    got_a, got_b = await asyncio.gather(
        asyncio.gather(*[shared(a).claim_lease(*k, "alpha", T0) for k in keys]),
        asyncio.gather(*[shared(b).claim_lease(*k, "beta", T0) for k in keys]),
    )
    assert got_a == got_b  # every key: both instances were told the same host
    stored = {(r.route, r.fp, r.model): r.host for r in a.leases()}
    assert [stored[k] for k in keys] == list(got_a)


async def test_a_miss_finds_the_lease_another_instance_placed(pair: Pair) -> None:
    a, b = pair
    assert await shared(b).find_lease("r1", "fp1", "m1") is None
    a.save_lease("r1", "fp1", "m1", "gamma", "active", T0, T0 + 5)  # the write-through path
    assert a.flush()
    row = await shared(b).find_lease("r1", "fp1", "m1")
    assert row is not None and (row.host, row.last_used) == ("gamma", T0 + 5)
    # a claim never moves a lease in use; an idle one is taken over
    assert await shared(b).claim_lease("r1", "fp1", "m1", "delta", T0 + 6, idle_before=T0) == "gamma"
    assert await shared(b).claim_lease("r1", "fp1", "m1", "delta", T0 + 99, idle_before=T0 + 50) == "delta"


async def test_two_instances_moving_conversations_off_one_host_at_once_agree(pair: Pair) -> None:
    a, b = pair
    keys = [("r1", f"fp{i}", "m1") for i in range(40)]
    await asyncio.gather(*[shared(a).claim_lease(*k, "alpha", T0) for k in keys])
    got_a, got_b = await asyncio.gather(
        asyncio.gather(*[shared(a).move_lease(*k, "alpha", "beta", T0 + 1) for k in keys]),
        asyncio.gather(*[shared(b).move_lease(*k, "alpha", "gamma", T0 + 1) for k in keys]),
    )
    assert got_a == got_b
    assert set(got_a) <= {"beta", "gamma"}
    stored = {(r.route, r.fp, r.model): (r.host, r.state) for r in a.leases()}
    assert [stored[k] for k in keys] == [(host, "active") for host in got_a]


@pytest.mark.parametrize(("row", "expected"), [
    (None, "beta"),  # the database never heard of it: the move writes it
    (("alpha", "active", T0), "beta"),  # still where the mover saw it
    (("alpha", "pinned", T0), "beta"),
    (("gamma", "active", T0), "gamma"),  # moved by another instance first
    (("gamma", "active", T0 - 100), "beta"),  # idle there since before idle_before: taken over
])
async def test_a_move_is_taken_only_from_the_host_it_leaves(
        pair: Pair, row: tuple[str, str, float] | None, expected: str) -> None:
    a, b = pair
    if row is not None:
        host, state, last_used = row
        a.save_lease("r1", "fp1", "m1", host, state, T0 - 200, last_used)
        assert a.flush()
    moved = await shared(b).move_lease("r1", "fp1", "m1", "alpha", "beta", T0 + 1, idle_before=T0 - 50)
    assert moved == expected
    (stored,) = a.leases()
    assert stored.host == expected
    assert stored.state == ("active" if expected == "beta" else row[1])


async def test_claims_work_on_sqlite_too(tmp_path: Path) -> None:
    s = open_store(str(tmp_path / "one.db"))
    try:
        assert await shared(s).claim_lease("r1", "fp1", "m1", "alpha", T0) == "alpha"
        assert await shared(s).claim_lease("r1", "fp1", "m1", "beta", T0 + 1) == "alpha"
        row = await shared(s).find_lease("r1", "fp1", "m1")
        assert row is not None and (row.host, row.last_used) == ("alpha", T0 + 1)
        assert await shared(s).move_lease("r1", "fp1", "m1", "gamma", "beta", T0 + 2) == "alpha"
        assert await shared(s).move_lease("r1", "fp1", "m1", "alpha", "beta", T0 + 3) == "beta"
    finally:
        s.close()


# -- the change feed --------------------------------------------------------------------------


class Inbox:
    def __init__(self) -> None:
        self.changes: list[Change] = []
        self.arrived = asyncio.Event()

    def __call__(self, change: Change) -> None:
        self.changes.append(change)
        self.arrived.set()

    async def next(self, timeout: float = 1.0) -> Change:
        await asyncio.wait_for(self.arrived.wait(), timeout)
        self.arrived.clear()
        return self.changes[-1]


async def test_a_pin_made_on_one_instance_reaches_the_other_within_a_second(pair: Pair) -> None:
    a, b = pair
    loop = asyncio.get_running_loop()
    inbox_a, inbox_b = Inbox(), Inbox()
    shared(a).subscribe(inbox_a, loop)
    shared(b).subscribe(inbox_b, loop)
    await asyncio.sleep(0.3)  # both feeds are listening
    begin = time.monotonic()
    a.save_lease("r1", "", "", "beta", "pinned", T0, T0)
    a.publish(Change("pin", route="r1", host="beta"))
    change = await inbox_b.next(timeout=1.0)
    assert time.monotonic() - begin < 1.0
    assert (change.kind, change.route, change.host) == ("pin", "r1", "beta")
    assert change.instance == shared(a).instance
    # the write it describes is visible when the change arrives
    row = await shared(b).find_lease("r1", "", "")
    assert row is not None and row.state == "pinned"
    b.publish(Change("drain", host="alpha"))
    assert (await inbox_a.next()).kind == "drain"
    assert [c.kind for c in inbox_a.changes] == ["drain"]  # nobody hears its own changes
    assert [c.kind for c in inbox_b.changes] == ["pin"]


async def test_the_feed_reconnects_and_asks_for_a_resync(pg_server: PgServer, pair: Pair) -> None:
    a, b = pair
    inbox = Inbox()
    shared(b).subscribe(inbox, asyncio.get_running_loop())
    await asyncio.sleep(0.3)
    with pg_server.admin() as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = "
                     "'crossbar-feed' AND pid <> pg_backend_pid()")
    assert (await inbox.next(timeout=5.0)).kind == "resync"
    await asyncio.sleep(0.2)
    a.publish(Change("release", route="r1"))
    deadline = time.monotonic() + 2
    while not any(c.kind == "release" for c in inbox.changes) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert any(c.kind == "release" for c in inbox.changes)


def test_a_change_is_never_published_on_sqlite(tmp_path: Path) -> None:
    s = open_store(str(tmp_path / "one.db"))
    try:
        s.publish(Change("pin", route="r1", host="a"))
        assert s.pending == 0 and s.flush()
    finally:
        s.close()


def test_changes_from_the_wire_are_parsed_strictly() -> None:
    assert Change.parse('{"kind":"pin","route":"r1","host":"a","instance":"x","extra":1}') == Change(
        "pin", route="r1", host="a", instance="x")
    for bad in ("not json", "[]", "null", '{"kind":"explode"}', '{"route":"r1"}'):
        assert Change.parse(bad) is None, bad


# -- fleet slots ------------------------------------------------------------------------------


async def test_parallel_holds_across_instances(pair: Pair) -> None:
    a, b = pair
    running, most = 0, 0
    lock = threading.Lock()

    async def turn(s: Store) -> None:
        nonlocal running, most
        token = await shared(s).acquire_slot("alpha", "m1", 2, wait=20)
        assert token is not None
        with lock:
            running += 1
            most = max(most, running)
        await asyncio.sleep(0.02)
        with lock:
            running -= 1
        await shared(s).release_slot(token)

    await asyncio.gather(*[turn(s) for s in (a, b) for _ in range(10)])
    assert most == 2
    assert shared(a).held == shared(b).held == 0


async def test_a_waiting_instance_gets_the_slot_as_soon_as_it_is_given_back(pair: Pair) -> None:
    a, b = pair
    token = await shared(a).acquire_slot("alpha", "m1", 1)
    assert token is not None
    assert await shared(b).acquire_slot("alpha", "m1", 1) is None  # no wait: refused at once
    assert await shared(b).acquire_slot("beta", "m1", 1) is not None  # another host is its own limit

    async def give_back() -> None:
        await asyncio.sleep(0.3)
        await shared(a).release_slot(token)

    begin = time.monotonic()
    waiting = asyncio.create_task(shared(b).acquire_slot("alpha", "m1", 1, wait=5))
    await give_back()
    assert await waiting is not None
    assert time.monotonic() - begin < 1.5


async def test_slots_of_a_killed_instance_expire_and_held_ones_are_renewed(pair: Pair) -> None:
    a, b = pair
    kept = await shared(a).acquire_slot("alpha", "m1", 1, ttl=1.0)
    assert kept is not None
    for _ in range(4):  # renewed past its first expiry
        await asyncio.sleep(0.4)
        assert await shared(a).heartbeat(ttl=1.0) == 1
    assert await shared(b).acquire_slot("alpha", "m1", 1) is None
    # an instance that dies (no release, no heartbeat): its slot comes free after the ttl
    lost = await shared(a).acquire_slot("beta", "m1", 1, ttl=0.5)
    assert lost is not None
    begin = time.monotonic()
    assert await shared(b).acquire_slot("beta", "m1", 1, wait=5) is not None
    assert 0.2 < time.monotonic() - begin < 3


async def test_a_slot_granted_during_a_heartbeat_stays_held(pair: Pair) -> None:
    """The heartbeat renews the slots held when it began; one granted meanwhile is still held (and
    renewed next time), not forgotten and left to lapse under its running request."""
    a, _ = pair
    sh = shared(a)
    first = await sh.acquire_slot("alpha", "m1", 2)
    renew = sh._renew
    late: list[str] = []

    def renew_while_another_is_granted(tokens: list[str], ttl: float) -> set[str]:
        late.append(sh._acquire("alpha", "m1", 2, ttl))  # type: ignore[arg-type]
        sh._held.add(late[0])  # what acquire_slot does on the loop meanwhile
        return renew(tokens, ttl)

    sh._renew = renew_while_another_is_granted  # type: ignore[method-assign]
    assert await sh.heartbeat() == 1
    sh._renew = renew  # type: ignore[method-assign]
    assert first is not None and late[0] is not None and sh.held == 2
    assert await sh.heartbeat() == 2


async def test_closing_an_instance_gives_its_slots_back(pg_url: str) -> None:
    a, b = open_store(pg_url), open_store(pg_url)
    try:
        assert await shared(a).acquire_slot("alpha", "m1", 1) is not None
        await asyncio.to_thread(a.close)
        assert await shared(b).acquire_slot("alpha", "m1", 1) is not None
    finally:
        a.close()
        b.close()


# -- an unreachable database ------------------------------------------------------------------


@pytest.fixture
async def unreachable(pg_server: PgServer, pg_url: str) -> AsyncIterator[Store]:
    s = await asyncio.to_thread(open_store, pg_url)
    database = pg_url.rsplit("/", 1)[1]
    with pg_server.admin() as conn:
        conn.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (database,))
    yield s
    with pg_server.admin() as conn:
        conn.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
    await asyncio.to_thread(s.close)


async def test_every_call_fails_fast_and_is_counted_when_the_database_is_gone(unreachable: Store) -> None:
    sh = shared(unreachable)
    calls = [
        lambda: sh.find_lease("r1", "fp", "m1"),
        lambda: sh.claim_lease("r1", "fp", "m1", "alpha", T0),
        lambda: sh.acquire_slot("alpha", "m1", 1, wait=5),
    ]
    for call in calls:
        begin = time.monotonic()
        with pytest.raises(SharedUnavailable):
            await call()
        assert time.monotonic() - begin < sh.timeout + 0.5
    assert sh.errors >= 1 and sh.errors + sh.refused == len(calls)
    assert sh.refused >= 1  # within the cooldown nothing even tries
    assert sh.last_error


async def test_calls_succeed_again_after_the_cooldown(pg_server: PgServer, pg_url: str) -> None:
    s = await asyncio.to_thread(open_store, pg_url)
    sh = shared(s)
    sh.cooldown = 0.2
    try:
        sh.timeout, saved = 0.0001, sh.timeout  # nothing answers that fast: a failure
        with pytest.raises(SharedUnavailable, match="no answer"):
            await sh.find_lease("r1", "fp", "m1")
        sh.timeout = saved
        await asyncio.sleep(0.3)
        assert await sh.find_lease("r1", "fp", "m1") is None
        assert sh.last_error == ""  # the next failure warns again
    finally:
        await asyncio.to_thread(s.close)
