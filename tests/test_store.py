"""crossbar.store against real SQLite files and a real writer thread."""

from __future__ import annotations

import logging
import shutil
import sqlite3
import threading
import time
from collections import namedtuple
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from rows_util import NOW, REFUSED, ROW_CASES, STORED, T0, Partial, as_given, request
from sqlalchemy import URL, event, insert

import crossbar.backend as backend_mod
from crossbar.config import RouteConf
from crossbar.decisions import Decision
from crossbar.exchange import Exchange
from crossbar.lease import Key
from crossbar.schema import EVENTS, REQUEST_COLUMNS
from crossbar.store import Store, StoreError, _execute_many, _request_values, chunk_sizes
from crossbar.tap import Usage

DAY = 86400.0


def raw(path: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "crossbar.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    s = Store(str(db_path))
    s.open()
    s.start()
    yield s
    s.close()


@pytest.fixture
def fast_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A short busy timeout so lock tests see several failed attempts quickly."""
    monkeypatch.setattr(backend_mod, "BUSY_TIMEOUT_MS", 50)


# -- schema -----------------------------------------------------------------------------------


def test_open_creates_directory_tables_and_wal(store: Store, db_path: Path) -> None:
    names = {r[0] for r in raw(db_path, "SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"leases", "lease_events", "requests", "host_health", "requests_daily"} <= names
    assert raw(db_path, "PRAGMA journal_mode") == [("wal",)]
    indexes = {r[0] for r in raw(db_path, "SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"ix_lease_events_ts", "ix_requests_started", "ix_requests_route_started"} <= indexes
    assert "ix_requests_host_started" in indexes


def test_no_table_has_a_body_column(store: Store, db_path: Path) -> None:
    for table in ("leases", "lease_events", "requests", "host_health", "requests_daily"):
        columns = {r[1] for r in raw(db_path, f"PRAGMA table_info({table})")}
        assert not {c for c in columns if "body" in c or "content" in c or "messages" in c}


def test_open_on_impossible_path_raises_store_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="cannot create directory") as info:
        Store(str(blocker / "sub" / "crossbar.db")).open()
    assert "\n" not in str(info.value)
    with pytest.raises(StoreError, match="cannot open database"):
        Store(str(tmp_path)).open()  # a directory is not a database file


# -- leases -----------------------------------------------------------------------------------


def test_leases_round_trip_including_pin_rows(store: Store) -> None:
    store.save_lease("r1", "fp1", "m1", "alpha", "active", T0, T0 + 1)
    store.save_lease("r1", "", "", "beta", "pinned", T0, T0)
    assert store.flush()
    rows = {(r.route, r.fp, r.model): r for r in store.load_leases()}
    assert set(rows) == {("r1", "fp1", "m1"), ("r1", "", "")}
    pin = rows["r1", "", ""]
    assert (pin.host, pin.state, pin.created) == ("beta", "pinned", T0)
    lease = rows["r1", "fp1", "m1"]
    assert (lease.host, lease.state, lease.last_used) == ("alpha", "active", T0 + 1)


def test_lease_names_are_stored_as_text_without_nul(store: Store) -> None:
    store.save_lease("r\x00", 5, "m1", "alpha", "active", T0, T0)  # type: ignore[arg-type]
    store.save_lease("r1", "fp1", "m\x00", "alpha", "active", T0, T0)
    store.save_lease("r1", "fp1", "m1", "alpha", "active", T0, T0)
    assert store.flush()
    names = [(r.route, r.fp, r.model) for r in store.leases()]
    assert names == [("r1", "fp1", "m1"), ("r1", "fp1", "m\ufffd"), ("r\ufffd", "5", "m1")]


def test_upsert_updates_last_used_and_host(store: Store) -> None:
    store.save_lease("r1", "fp1", "m1", "alpha", "active", T0, T0)
    assert store.flush()
    store.save_lease("r1", "fp1", "m1", "beta", "active", T0, T0 + 60)
    assert store.flush()
    [row] = store.leases()
    assert (row.host, row.created, row.last_used) == ("beta", T0, T0 + 60)


def test_delete_lease(store: Store) -> None:
    store.save_lease("r1", "fp1", "m1", "alpha", "active", T0, T0)
    store.save_lease("r1", "fp2", "m1", "alpha", "active", T0, T0)
    assert store.flush()
    store.delete_lease("r1", "fp1", "m1")
    assert store.flush()
    assert [(r.route, r.fp) for r in store.leases()] == [("r1", "fp2")]


def test_last_operation_on_a_key_wins_within_one_batch(db_path: Path) -> None:
    s = Store(str(db_path))
    s.open()
    # enqueued before the writer starts, so all of them land in one batch
    for i in range(5):
        s.save_lease("r1", "gone", "m1", "alpha", "active", T0, T0 + i)
    s.delete_lease("r1", "gone", "m1")
    s.delete_lease("r1", "back", "m1")
    s.save_lease("r1", "back", "m1", "beta", "active", T0, T0 + 9)
    s.start()
    assert s.flush()
    assert [(r.fp, r.host, r.last_used) for r in s.leases()] == [("back", "beta", T0 + 9)]
    s.close()


def test_last_drain_on_a_host_wins_within_one_batch(db_path: Path) -> None:
    s = Store(str(db_path))
    s.open()
    s.save_drain("a", True, T0)
    s.save_drain("b", True, T0)
    s.save_drain("a", False, T0 + 1)
    s.save_drain("c", False, T0)
    s.save_drain("c", True, T0 + 2)
    s.start()
    assert s.flush()
    assert s.drained_hosts() == {"b", "c"}
    assert raw(db_path, "SELECT host, since FROM host_drains ORDER BY host") == [("b", T0), ("c", T0 + 2)]
    s.close()


def test_a_rollup_within_a_batch_sees_the_rows_before_it_and_not_those_after(db_path: Path) -> None:
    s = Store(str(db_path))
    s.open()
    s.record_request(request(route="before", started=T0))
    s.save_lease("r1", "fp1", "m1", "alpha", "active", T0, T0)
    s.schedule_rollup(T0 + DAY)
    s.record_request(request(route="after", started=T0 + 1))
    s.delete_lease("r1", "fp1", "m1")
    s.start()
    assert s.flush()
    assert s.last_rollup == 1
    assert [r.route for r in s.requests_since(0)] == ["after"]
    assert [r["key"] for r in s.usage(0, "route")] == ["after", "before"]
    assert s.leases() == []
    s.close()


def test_close_flushes_and_a_new_store_loads_the_leases(db_path: Path) -> None:
    first = Store(str(db_path))
    first.open()
    first.start()
    first.save_lease("r1", "fp1", "m1", "alpha", "active", T0, T0 + 5)
    first.save_lease("r2", "", "", "beta", "pinned", T0, T0)
    first.record_request(request())
    first.close()
    first.close()  # idempotent
    assert first.pending == 0

    second = Store(str(db_path))
    second.open()
    loaded = sorted((r.route, r.fp, r.model, r.host, r.state) for r in second.load_leases())
    assert loaded == [("r1", "fp1", "m1", "alpha", "active"), ("r2", "", "", "beta", "pinned")]
    assert len(second.requests_since(0)) == 1
    second.close()


def test_close_without_start_writes_what_was_enqueued(db_path: Path) -> None:
    s = Store(str(db_path))
    s.open()
    s.save_lease("r1", "fp1", "m1", "alpha", "active", T0, T0)
    s.close()
    assert raw(db_path, "SELECT host FROM leases") == [("alpha",)]


# -- events, requests, health -----------------------------------------------------------------


def test_lease_events_newest_first(store: Store) -> None:
    for i in range(5):
        store.record_event(T0 + i, "r1", "fp1", "m1", None if i == 0 else "alpha", "beta", "new")
    assert store.flush()
    events = store.lease_events(limit=3)
    assert [e.ts for e in events] == [T0 + 4, T0 + 3, T0 + 2]
    assert store.lease_events()[-1].from_host is None


def test_ten_thousand_requests_from_several_threads_all_land(store: Store, db_path: Path) -> None:
    per_thread, threads = 2500, 4
    spent: list[float] = []

    def work(n: int) -> None:
        begin = time.perf_counter()
        for i in range(per_thread):
            store.record_request(request(route=f"r{n}", started=T0 + i))
        spent.append(time.perf_counter() - begin)

    workers = [threading.Thread(target=work, args=(n,)) for n in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert store.flush(timeout=30)
    assert raw(db_path, "SELECT count(*) FROM requests") == [(10_000,)]
    assert store.written >= 10_000 and store.errors == 0 and store.pending == 0
    assert sum(spent) / 10_000 < 0.001  # generous: an enqueue is a lock and an append


def test_null_token_figures_stay_null(store: Store) -> None:
    store.record_request(
        request(prompt_tokens=None, cached_tokens=None, completion_tokens=None, ttfb_ms=None, status=None)
    )
    store.record_request({"route": "r2", "fp": "", "model": "m1", "started": T0, "total_ms": 5})
    assert store.flush()
    first, second = store.requests_since(0)
    assert (first.prompt_tokens, first.cached_tokens, first.completion_tokens) == (None, None, None)
    assert (first.ttfb_ms, first.status) == (None, None)
    assert (second.host, second.prompt_tokens, second.err, second.decision) == (None, None, None, None)
    assert (second.queued_ms, second.streamed) == (0, False)


def test_requests_since_filters(store: Store) -> None:
    store.record_request(request(started=T0 - 10))
    store.record_request(request(started=T0))
    assert store.flush()
    assert [r.started for r in store.requests_since(T0)] == [T0]


def test_a_bad_row_never_raises_and_is_counted(store: Store) -> None:
    store.record_request(request(started="not a time"))
    assert store.dropped == 1
    assert store.flush()
    assert store.requests_since(0) == []


def test_a_row_the_database_refuses_is_isolated_and_the_rest_land(db_path: Path) -> None:
    s = Store(str(db_path))
    s.open()
    s.record_request(request(route="before"))
    s.save_lease("r1", "fp1", "m1", None, "active", T0, T0)  # type: ignore[arg-type]  # NOT NULL
    s.record_request(request(route="after"))
    s.start()
    assert s.flush()
    assert sorted(r.route for r in s.requests_since(0)) == ["after", "before"]
    assert (s.dropped, s.errors >= 1, s.leases()) == (1, True, [])
    s.close()


def test_health_and_uptime(store: Store) -> None:
    for i, ok in enumerate([True, True, True, False]):
        store.record_health(T0 + i, "alpha", ok, ["m1", "m2"])
    store.record_health(T0, "beta", False, [])
    store.record_health(T0 - 100, "gamma", True, [])
    assert store.flush()
    assert store.host_uptime(T0) == {"alpha": 0.75, "beta": 0.0}
    assert raw(store_path(store), "SELECT loaded_models FROM host_health LIMIT 1") == [('["m1", "m2"]',)]


def store_path(s: Store) -> Path:
    return Path(s.path)


# -- a failing database -----------------------------------------------------------------------


def test_locked_database_never_blocks_callers_and_nothing_is_lost(
    monkeypatch: pytest.MonkeyPatch, db_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(backend_mod, "BUSY_TIMEOUT_MS", 1000)  # the writer waits 1 s per attempt
    caplog.set_level(logging.WARNING, logger="crossbar.store")
    store = Store(str(db_path))
    store.open()
    store.start()
    locker = sqlite3.connect(db_path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        slowest, total = 0.0, 0.0
        for i in range(200):
            begin = time.perf_counter()
            store.record_request(request(started=T0 + i))
            store.save_lease("r1", f"fp{i}", "m1", "alpha", "active", T0, T0)
            spent = time.perf_counter() - begin
            slowest, total = max(slowest, spent), total + spent
        assert total / 400 < 0.001 and slowest < 0.25  # callers never wait out the busy timeout
        assert wait_until(lambda: store.errors >= 2)
        assert not store.flush(timeout=0.2)
        assert store.pending > 0
        assert "locked" in store.last_error
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert store.flush(timeout=10)
    assert raw(db_path, "SELECT count(*) FROM requests") == [(200,)]
    assert len(store.leases()) == 200
    assert store.dropped == 0
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1  # one warning per failure burst, not per attempt or row
    store.close()


def test_read_only_database_counts_errors_without_raising(fast_busy: None, db_path: Path) -> None:
    Store(str(db_path)).open()  # the file exists, with its tables
    s = Store(str(db_path))
    # root ignores chmod, so open the writer's connection read-only instead (the test hook)
    s._writer_url = lambda: URL.create(  # type: ignore[method-assign]
        "sqlite", database=f"file:{db_path}", query={"mode": "ro", "uri": "true"}
    )
    s.open()
    s.start()
    s.record_request(request())
    s.save_lease("r1", "fp1", "m1", "alpha", "active", T0, T0)
    assert wait_until(lambda: s.errors >= 2)
    assert "readonly" in s.last_error
    assert not s.flush(timeout=0.2)
    assert s.pending == 2 and s.dropped == 0
    s.close(timeout=0.5)  # gives up on the rows, never raises
    s.record_request(request())  # after close: still no exception
    assert raw(db_path, "SELECT count(*) FROM requests") == [(0,)]


def test_directory_gone_then_back(fast_busy: None, store: Store, db_path: Path) -> None:
    store.save_lease("r1", "fp1", "m1", "alpha", "active", T0, T0)
    assert store.flush()
    shutil.rmtree(db_path.parent)
    store.record_request(request())
    store.save_lease("r1", "fp2", "m1", "alpha", "active", T0, T0)
    assert wait_until(lambda: store.errors >= 2)
    assert "gone" in store.last_error or "unable to open" in store.last_error
    assert not store.flush(timeout=0.2)
    db_path.parent.mkdir()
    assert store.flush(timeout=10)  # the schema is recreated and the kept rows land
    assert raw(db_path, "SELECT count(*) FROM requests") == [(1,)]
    assert raw(db_path, "SELECT fp FROM leases") == [("fp2",)]
    assert raw(db_path, "PRAGMA journal_mode") == [("wal",)]


def test_beyond_max_pending_oldest_rows_are_dropped_never_leases(db_path: Path) -> None:
    s = Store(str(db_path), max_pending=10)
    s.open()  # writer not started: everything stays pending
    for i in range(5):
        s.save_lease("r1", f"fp{i}", "m1", "alpha", "active", T0, T0)
    for i in range(20):
        s.record_request(request(started=T0 + i))
    for i in range(5, 12):
        s.save_lease("r1", f"fp{i}", "m1", "alpha", "active", T0, T0)
    assert (s.pending, s.dropped) == (12, 20)  # leases alone may exceed the cap
    s.record_request(request(started=T0 + 99))  # with no room left, even the newest row goes
    assert (s.pending, s.dropped) == (12, 21)
    s.start()
    assert s.flush()
    assert len(s.leases()) == 12
    assert s.requests_since(0) == []
    s.close()


def test_dropping_keeps_the_newest_rows(db_path: Path) -> None:
    s = Store(str(db_path), max_pending=8)
    s.open()
    for i in range(3):
        s.save_lease("r1", f"fp{i}", "m1", "alpha", "active", T0, T0)
    for i in range(20):
        s.record_request(request(started=T0 + i))
    assert (s.pending, s.dropped) == (8, 15)
    s.start()
    assert s.flush()
    assert [r.started for r in s.requests_since(0)] == [T0 + i for i in range(15, 20)]
    assert len(s.leases()) == 3
    s.close()


# -- accounting -------------------------------------------------------------------------------


def fill_usage(s: Store) -> None:
    s.record_request(request(route="r1", model="m1", host="alpha", started=T0))
    s.record_request(request(route="r1", model="m2", host="beta", started=T0 + 1, status=500))
    s.record_request(request(route="r2", model="m1", host="alpha", started=T0 + 2, err="cut"))
    s.record_request(
        request(route="r2", model="m1", host=None, started=T0 + 3, status=None, prompt_tokens=None)
    )
    s.record_request(request(route="r3", model="m1", host="alpha", started=T0 - DAY))  # older
    assert s.flush()


def by_key(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["key"]: {k: v for k, v in r.items() if k != "key"} for r in rows}


def test_usage_by_route_model_and_host(store: Store) -> None:
    fill_usage(store)
    routes = store.usage(T0, "route")
    assert [r["key"] for r in routes] == ["r1", "r2"]
    assert by_key(routes)["r1"] == {
        "requests": 2,
        "errors": 1,
        "busy_ms": 200,
        "queued_ms": 4,
        "prompt_tokens": 100,
        "cached_tokens": 80,
        "completion_tokens": 20,
    }
    assert by_key(routes)["r2"]["errors"] == 2
    assert by_key(routes)["r2"]["prompt_tokens"] == 50  # NULL counts as 0 in sums
    models = by_key(store.usage(T0, "model"))
    assert {k: v["requests"] for k, v in models.items()} == {"m1": 3, "m2": 1}
    hosts = store.usage(T0, "host")
    assert [r["key"] for r in hosts] == ["", "alpha", "beta"]
    assert by_key(hosts)[""]["errors"] == 1
    assert by_key(store.usage(0, "route"))["r3"]["requests"] == 1
    with pytest.raises(ValueError, match="by must be"):
        store.usage(0, "fp")


def test_usage_of_an_empty_store(store: Store) -> None:
    assert store.usage(0, "host") == []
    assert store.host_uptime(0) == {}


def totals(s: Store, since: float, by: str) -> dict[str, dict[str, Any]]:
    return by_key(s.usage(since, by))


def test_rollup_moves_rows_and_keeps_usage_totals(store: Store) -> None:
    fill_usage(store)
    before = {by: totals(store, 0, by) for by in ("route", "model", "host")}
    assert store.rollup(T0 + 2) == 3  # the older row and the first two of T0's day
    assert len(store.requests_since(0)) == 2
    assert {by: totals(store, 0, by) for by in ("route", "model", "host")} == before
    # the day of `since` is included whole once rolled up
    assert totals(store, T0 + 1, "route")["r1"]["requests"] == 2

    store.record_request(request(route="r1", model="m1", host="alpha", started=T0 + 5))
    store.schedule_rollup(T0 + DAY)  # on the writer thread, after the row above
    assert store.flush()
    assert store.last_rollup == 3 and store.requests_since(0) == []
    after = totals(store, 0, "route")
    assert after["r1"]["requests"] == before["route"]["r1"]["requests"] + 1
    assert after["r2"] == before["route"]["r2"]
    assert totals(store, 0, "host")[""]["errors"] == 1


def test_rollup_of_nothing(store: Store) -> None:
    assert store.rollup(T0) == 0



# -- hostile figures, file modes, pruning ------------------------------------------------------


def test_absurd_figures_are_stored_as_null_and_counted(store: Store) -> None:
    store.record_request(request(prompt_tokens=2**70, completion_tokens=1e308, cached_tokens=-5))
    store.record_request(request(prompt_tokens=10, cached_tokens=40, ttfb_ms=float("nan"), status=70000))
    store.record_request(request(queued_ms=float("inf"), total_ms=-3))
    assert store.flush()
    rows = store.requests_since(0)
    assert len(rows) == 3 and store.dropped == 0
    first, second, third = rows
    assert (first.prompt_tokens, first.cached_tokens, first.completion_tokens) == (None, None, None)
    assert (second.prompt_tokens, second.cached_tokens) == (10, None)  # cached beyond the prompt
    assert (second.ttfb_ms, second.status) == (None, None)
    assert (third.queued_ms, third.total_ms) == (0, 0)  # NOT NULL columns: unknown is 0
    assert store.bad_figures == 8
    assert by_key(store.usage(0, "route"))["r1"]["prompt_tokens"] == 10 + 50


def insert_raw_requests(path: Path, figure: int, count: int, started: float) -> None:
    conn = sqlite3.connect(path)
    with conn:
        for _ in range(count):
            conn.execute(
                "INSERT INTO requests (route, fp, model, host, started, queued_ms, total_ms, streamed,"
                " prompt_tokens, decision) VALUES ('r1', 'f', 'm1', 'alpha', ?, 0, 1, 0, ?, 'new')",
                (started, figure),
            )
    conn.close()


def test_sums_of_absurd_stored_figures_cannot_overflow(store: Store, db_path: Path) -> None:
    """Rows written by an older crossbar (or by hand) with figures near 2**63: usage still answers."""
    insert_raw_requests(db_path, 2**62, 3, T0)
    store.record_request(request(prompt_tokens=7, started=T0))
    assert store.flush()
    assert by_key(store.usage(0, "route"))["r1"]["prompt_tokens"] == 7


def test_a_rollup_the_database_refuses_never_wedges_the_writer(db_path: Path) -> None:
    """Absurd rows already in the file: the rollup is refused or sums safely, and every lease and row
    behind it still lands, in this run and after a restart."""
    first = Store(str(db_path))
    first.open()
    first.close()
    insert_raw_requests(db_path, 2**62, 3, T0 - DAY)
    for _ in range(2):  # the second round is the restart
        s = Store(str(db_path))
        s.open()
        s.start()
        s.schedule_rollup(T0)
        s.save_lease("r1", "behind", "m1", "alpha", "active", T0, T0)
        s.record_request(request(started=T0 + 1))
        assert s.flush(timeout=5)
        assert [r.fp for r in s.leases()] == ["behind"]
        s.close()


def test_database_wal_and_shm_are_private(db_path: Path) -> None:
    s = Store(str(db_path))
    s.open()
    s.start()
    s.save_lease("r1", "fp1", "m1", "alpha", "active", T0, T0)
    assert s.flush()
    for suffix in ("", "-wal", "-shm"):
        mode = (db_path.parent / (db_path.name + suffix)).stat().st_mode & 0o777
        assert mode == 0o600, (suffix, oct(mode))
    s.close()


def test_rollup_prunes_lease_events_older_than_retention(store: Store) -> None:
    for i in range(4):
        store.record_event(T0 + i * DAY, "r1", f"fp{i}", "m1", None, "alpha", "new")
    assert store.flush()
    store.rollup(T0 + 2 * DAY)
    assert sorted(e.fp for e in store.lease_events()) == ["fp2", "fp3"]


def test_rows_go_to_the_driver_as_sqlalchemy_would_write_them(store: Store) -> None:
    """The writer hands compiled statements to the driver's executemany: rows with different keys
    in one batch, NULLs, booleans and floats land as SQLAlchemy's own execute would store them."""
    assert store._writer is not None
    events = [{"ts": T0, "route": "r", "fp": "a", "model": "m", "reason": "new", "from_host": None,
               "to_host": "x"},
              {"ts": T0 + 0.25, "route": "r", "fp": "b", "model": "m", "reason": "idle"}]
    with store._writer.begin() as conn:
        _execute_many(conn, "event", lambda _: insert(EVENTS), events)
    got = sorted((e.ts, e.fp, e.from_host, e.to_host, e.reason) for e in store.lease_events())
    assert got == [(T0, "a", None, "x", "new"), (T0 + 0.25, "b", None, None, "idle")]
    store.record_request({"route": "r", "fp": "f", "model": "m", "host": None, "started": T0 + 0.5,
                          "queued_ms": 3, "total_ms": 9, "streamed": True, "prompt_tokens": 7})
    assert store.flush()
    [row] = store.requests_since(T0)
    assert (row.started, row.streamed, row.queued_ms, row.prompt_tokens, row.cached_tokens, row.host) == (
        T0 + 0.5, True, 3, 7, None, None)


def test_a_batch_of_request_rows_is_one_statement_not_one_per_row(db_path: Path) -> None:
    """SQLite's driver lets go of the interpreter lock for every statement it runs: one statement per
    row made the writer take the lock back from the event loop once per row under load."""
    s = Store(str(db_path))
    s.open()
    inserts: list[tuple[bool, int]] = []

    def seen(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if statement.startswith("INSERT INTO requests"):
            inserts.append((many, statement.count("(?")))

    assert s._writer is not None
    event.listen(s._writer, "before_cursor_execute", seen)
    for i in range(300):  # enqueued before the writer starts: one batch
        s.record_request({"route": "r", "fp": f"f{i}", "model": "m", "started": T0 + i, "queued_ms": 0,
                          "total_ms": 1, "streamed": False})
    s.start()
    assert s.flush()
    assert inserts == [(False, 256), (False, 32), (False, 8), (False, 4)]
    assert [r.fp for r in s.requests_since(T0)] == [f"f{i}" for i in range(300)]
    s.close()


def test_batches_of_every_size_prepare_a_few_statements_not_one_per_size(db_path: Path) -> None:
    """The driver keeps every distinct statement it ran prepared, up to 128 per connection: one
    INSERT per batch size made a writer under load hold about 30 MB of them (RSS grew steadily)."""
    s = Store(str(db_path))
    s.open()
    texts: set[str] = set()

    def seen(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        if statement.startswith("INSERT INTO requests"):
            texts.add(statement)

    assert s._writer is not None
    event.listen(s._writer, "before_cursor_execute", seen)
    s.start()
    written = 0
    for size in range(1, 301):
        for i in range(written, written + size):
            s.record_request({"route": "r", "fp": f"f{i}", "model": "m", "started": T0 + i,
                              "queued_ms": 0, "total_ms": 1, "streamed": False})
        written += size
        assert s.flush()
    assert len(texts) <= 9
    assert [r.fp for r in s.requests_since(T0)] == [f"f{i}" for i in range(written)]
    s.close()


@pytest.mark.parametrize(("n", "most", "sizes"), [
    (0, 256, []), (1, 256, [1]), (255, 256, [128, 64, 32, 16, 8, 4, 2, 1]), (256, 256, [256]),
    (300, 256, [256, 32, 8, 4]), (600, 256, [256, 256, 64, 16, 8]), (120, 55, [55, 55, 8, 2]),
    (3, 1, [1, 1, 1])])
def test_chunk_sizes(n: int, most: int, sizes: list[int]) -> None:
    assert chunk_sizes(n, most) == sizes
    assert sum(sizes) == n and all(0 < size <= most for size in sizes)


@pytest.mark.parametrize(("limit", "rows"), [(999, 300), (100, 20)])
def test_a_batch_stays_within_the_connections_parameter_limit(limit: int, rows: int, db_path: Path) -> None:
    """SQLite builds before 3.32 take 999 parameters per statement, and a build or a connection
    may set fewer: a multi-row INSERT is cut to fit, instead of failing and being retried a row at
    a time."""
    s = Store(str(db_path))
    s.open()
    assert s._writer is not None

    def small_limit(dbapi_conn: Any, record: Any) -> None:
        dbapi_conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, limit)

    event.listen(s._writer, "connect", small_limit)
    s._writer.dispose()  # connections made from now on take the limit
    for i in range(rows):
        s.record_request({"route": "r", "fp": f"f{i}", "model": "m", "started": T0 + i, "queued_ms": 0,
                          "total_ms": 1, "streamed": False})
    s.start()
    assert s.flush()
    assert s.errors == 0 and len(s.requests_since(T0)) == rows
    s.close()


def test_a_row_given_as_a_named_tuple_is_stored_as_a_plain_tuple_is(db_path: Path) -> None:
    row_type = namedtuple("row_type", REQUEST_COLUMNS)  # type: ignore[misc]
    s = Store(str(db_path), clock=lambda: NOW)
    s.open()
    values = ("r", "f", "m", "a", T0, 0, 5, 9, 200, False, 10, 4, 2, None, "new")
    s.record_request(row_type(*values))
    s.record_request(values)
    s.start()
    assert s.flush()
    assert s.errors == 0 and s.dropped == 0
    stored = raw(db_path, f"SELECT {', '.join(REQUEST_COLUMNS)} FROM requests ORDER BY id")
    assert stored == [values, values]
    s.close()


# -- a request row's values: stored exactly as the dict-based normaliser stored them ------------

@pytest.mark.parametrize("form", ["mapping", "tuple"])
def test_request_rows_are_stored_exactly_as_before(form: str, db_path: Path) -> None:
    s = Store(str(db_path), clock=lambda: NOW)
    s.open()
    counted = []
    for over, _, _, _ in ROW_CASES:
        bad, dropped = s.bad_figures, s.dropped
        s.record_request(as_given(over, form))
        counted.append((s.bad_figures - bad, s.dropped - dropped))
    s.start()
    assert s.flush()
    s.close()
    types = "typeof(started), typeof(queued_ms), typeof(total_ms)"
    stored = raw(db_path, f"SELECT {', '.join(REQUEST_COLUMNS)}, {types} FROM requests ORDER BY id")
    expected = [(over, tuple({**STORED, **want}.values())) for over, want, _, _ in ROW_CASES
                if want is not None]
    assert len(stored) == len(expected)
    for (over, want), got in zip(expected, stored, strict=True):
        assert got[:-3] == want, over
    assert {row[-3:] for row in stored} == {("real", "integer", "integer")}
    assert counted == [(bad, dropped) for _, _, bad, dropped in ROW_CASES]
    refused = sum(1 for _, want, _, dropped in ROW_CASES if want is REFUSED and not dropped)
    assert s.bad_figures == sum(case[2] for case in ROW_CASES)
    assert s.dropped == sum(case[3] for case in ROW_CASES) + refused


def test_the_usual_row_is_stored_as_it_is_given() -> None:
    """The proxy's rows skip the normalising rebuild: the tuple enqueued is the one given."""
    row = tuple(request()[c] for c in REQUEST_COLUMNS)
    values, bad = _request_values(row, NOW)
    assert values is row and bad == 0
    unusual = tuple(request(status=99)[c] for c in REQUEST_COLUMNS)
    assert _request_values(unusual, NOW) == ((*unusual[:8], None, *unusual[9:]), 1)


def test_a_tuple_enqueues_the_values_and_types_a_mapping_does() -> None:
    """What goes to the writer, not only what SQLite makes of it: PostgreSQL's driver may bind a
    str or int subclass (an enum) or an int start by other rules than SQLite's."""
    for over, _, bad, dropped in ROW_CASES:
        if isinstance(over, Partial) or dropped:  # a partial row is no tuple; a dropped one raises
            continue
        row = request(**over)
        as_tuple = _request_values(tuple(row[c] for c in REQUEST_COLUMNS), NOW)
        as_mapping = _request_values(row, NOW)
        assert [(type(v), v) for v in as_tuple[0]] == [(type(v), v) for v in as_mapping[0]], over
        assert as_tuple[1] == as_mapping[1] == bad, over


@pytest.mark.parametrize("form", ["mapping", "tuple", "named tuple"])
def test_record_request_enqueues_what_the_normaliser_gives(form: str, db_path: Path) -> None:
    """`record_request` takes the usual row's shortcut itself: every row still goes to the writer
    as `_request_values` makes it (the very tuple given, when it is the usual one)."""
    row_type = namedtuple("row_type", REQUEST_COLUMNS)  # type: ignore[misc]
    s = Store(str(db_path), clock=lambda: NOW)
    enqueued: list[tuple[str, Any]] = []
    s._queue.put = lambda kind, data: enqueued.append((kind, data))  # type: ignore[method-assign]
    for over, _, _, dropped in ROW_CASES:
        row = as_given(over, "tuple" if form == "named tuple" else form)
        if form == "named tuple" and isinstance(row, tuple):
            row = row_type(*row)
        bad_before, enqueued_before = s.bad_figures, len(enqueued)
        s.record_request(row)
        if dropped:
            assert len(enqueued) == enqueued_before, over
            continue
        values, bad = _request_values(row, NOW)
        assert enqueued[-1][0] == "request" and s.bad_figures - bad_before == bad, over
        assert [(type(v), v) for v in enqueued[-1][1]] == [(type(v), v) for v in values], over
        assert (enqueued[-1][1] is row) == (values is row), over


def test_a_row_of_the_wrong_length_is_dropped_and_counted(store: Store) -> None:
    store.record_request(("r1", "fp1", "m1"))
    assert store.dropped == 1 and store.pending == 0


def test_an_exchange_row_has_the_columns_in_order() -> None:
    route = RouteConf(name="r1", hosts=("alpha",))
    usage = Usage(prompt_tokens=50, cached_tokens=40, completion_tokens=10)
    ex = Exchange(route=route, key=Key("r1", "fp1", "m1"), path="/v1/chat/completions", completion=True,
                  stream=True, started=T0, host="alpha", decision=Decision.REUSED, queued_ms=2, ttfb_ms=30,
                  status=200, err="cut", usage=usage)
    ex.t0 -= 0.1
    row = dict(zip(REQUEST_COLUMNS, ex.row(), strict=True))
    assert 100 <= row.pop("total_ms") < 1000
    assert row == {"route": "r1", "fp": "fp1", "model": "m1", "host": "alpha", "started": T0, "queued_ms": 2,
                   "ttfb_ms": 30, "status": 200, "streamed": True, "prompt_tokens": 50, "cached_tokens": 40,
                   "completion_tokens": 10, "err": "cut", "decision": "reused"}
    assert type(row["decision"]) is str
    bare = Exchange(route=route, key=Key("r1", "", "m1"), path="/v1/models", completion=False)
    row = dict(zip(REQUEST_COLUMNS, bare.row(), strict=True))
    absent = ("host", "prompt_tokens", "cached_tokens", "completion_tokens", "decision")
    assert [row[c] for c in absent] == [None] * 5


def test_an_absent_database_holds_each_lease_once_and_sheds_the_oldest_events(tmp_path: Path) -> None:
    """While the database refuses every write, a conversation's turns keep one write of its lease
    waiting (not one per turn), and lease events beyond max_pending are shed oldest first, counted."""
    from crossbar.lease import LeaseTable
    from crossbar.placement import Change, LeaseChange

    db = tmp_path / "crossbar.db"
    Store(str(db)).open()  # the file and its tables
    store = Store(str(db), max_pending=1000)
    store._writer_url = lambda: URL.create(  # type: ignore[method-assign]  # every write refused
        "sqlite", database=f"file:{db}", query={"mode": "ro", "uri": "true"})
    store.open()
    store.start()
    try:
        table = LeaseTable(store, idle=1800)
        table.subscribe(lambda e: store.record_event(e.ts, e.key.route, e.key.fp, e.key.model, e.from_host,
                                                     e.to_host, str(e.reason)))  # as the router does
        key = Key("r", "f" * 64, "m")
        table.apply(key, LeaseChange(Change.CREATE, "alpha"), T0)
        for i in range(20_000):  # one conversation's turns
            table.hold(key)
            table.apply(key, LeaseChange(Change.USE, "alpha"), T0 + i)
            table.unhold(key, T0 + i)
        assert store.pending <= 4 and store.dropped == 0  # its lease (written, waiting) and event
        for i in range(2_000):  # new conversations: a lease and an event each
            table.apply(Key("r", f"{i:064x}", "m"), LeaseChange(Change.CREATE, "alpha"), T0 + i)
        # every lease's latest write still waits (never shed: as many as the leases); the events
        # beyond max_pending were shed, oldest first. (A batch the writer took before these is in
        # flight, being retried: a lease of it may wait once more behind it.)
        queue = store._queue
        with queue._lock:
            waiting = len(queue._ordered) + len(queue._rows) + len(queue._lasts)
        assert table.count() == 2001 and waiting <= 2001 + 2
        assert store.dropped >= 1000
    finally:
        store.close(timeout=0.2)


def test_past_max_pending_change_notices_give_way_to_one_resync(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Instances sharing a database tell each other their changes; a notice is never shed (another
    instance would miss that change until it restarts), and past max_pending waiting operations
    one notice asking every instance to read the shared state back stands for the rest, written
    after every operation enqueued before the last notice it stands for."""
    from types import SimpleNamespace

    from crossbar.shared import Change

    monkeypatch.setattr(Store, "postgres", property(lambda self: True))
    store = Store(str(tmp_path / "crossbar.db"), max_pending=100)  # never started: everything waits
    store.shared = SimpleNamespace(instance="me", close=lambda: None)  # type: ignore[assignment]
    for i in range(1_000):
        store.save_lease("r", f"{i:064x}", "m", "a", "active", 1.0, 1.0)
        store.publish(Change("lease", route="r", fp=f"{i:064x}", model="m", host="a"))
    queue = store._queue
    assert [op.kind for op in queue._ordered][:100] == ["lease", "notify"] * 50
    first, latest = queue._lasts  # the first keeps its place; the latest stands for the rest
    assert latest.seq == queue._seq  # behind every lease write
    assert Change.parse(first.data["p"]) == Change.parse(latest.data["p"]) == Change("resync", instance="me")
    assert store.pending == 1_000 + 50 + 2 and store.dropped == 0
    store.close(timeout=0)
