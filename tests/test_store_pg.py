"""crossbar.store on a real PostgreSQL server (tests/pg.py): the same schema, the same answers as
SQLite from every read the admin views make, and a writer that survives the server going away."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from pg import PgServer
from rows_util import NOW, ROW_CASES, STORED, as_given
from sqlalchemy import create_engine
from sqlmodel import SQLModel

from crossbar.backend import VERSION_TABLE, alembic_config, head_revision, parse_db
from crossbar.schema import REQUEST_COLUMNS
from crossbar.store import Store, StoreError

T0 = 1_780_000_000.0
DAY = 86400.0


@pytest.fixture
def pg_store(pg_url: str) -> Iterator[Store]:
    s = Store(pg_url)
    s.open()
    s.start()
    yield s
    s.close()


def test_revisions_build_the_declared_tables_on_postgresql(pg_url: str) -> None:
    store = Store(pg_url)
    store.open()
    store.close()
    engine = create_engine(parse_db(pg_url).url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        assert compare_metadata(ctx, SQLModel.metadata) == []
        assert conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}").scalar() == head_revision()
    engine.dispose()
    again = Store(pg_url)  # a second open finds the schema current and changes nothing
    again.open()
    again.close()


def test_the_url_is_never_logged_with_its_password(pg_server: PgServer) -> None:
    url = pg_server.url("nowhere").replace("crossbar@", "crossbar:s3cret@")
    store = Store(url)
    assert "s3cret" not in store.label and "***" in store.label


def fill(s: Store) -> None:
    s.save_lease("r1", "fp1", "m1", "alpha", "active", T0, T0 + 1)
    s.save_lease("r1", "", "", "beta", "pinned", T0, T0)
    s.save_lease("R0", "fp2", "m1", "beta", "active", T0, T0 + 2)  # upper case sorts first in binary order
    s.save_lease("r1", "fp3", "m1", "alpha", "active", T0, T0)
    s.delete_lease("r1", "fp3", "m1")
    for i in range(3):
        s.record_event(T0 + i, "r1", f"fp{i}", "m1", None if i == 0 else "alpha", "beta", "new")
    rows: list[dict[str, Any]] = [
        {"route": "r1", "model": "m1", "host": "alpha", "started": T0 - 2 * DAY, "decision": "new"},
        {"route": "r1", "model": "m2", "host": "beta", "started": T0 - DAY, "status": 500},
        {"route": "r2", "model": "m1", "host": "alpha", "started": T0, "err": "cut", "decision": "reused"},
        {"route": "r2", "model": "m1", "host": None, "started": T0 + 1, "status": None,
         "prompt_tokens": None},
        {"route": "_x", "model": "m1", "host": "alpha", "started": T0 + 2, "prompt_tokens": 2**70},
    ]
    for row in rows:
        base = {"fp": "f", "queued_ms": 3, "ttfb_ms": 20, "total_ms": 100, "status": 200, "streamed": True,
                "prompt_tokens": 50, "cached_tokens": 40, "completion_tokens": 10}
        s.record_request({**base, **row})
    for i, ok in enumerate([True, True, False]):
        s.record_health(T0 + i, "alpha", ok, ["m1"])
    s.record_health(T0, "beta", True, [])
    assert s.flush()


def answers(s: Store) -> dict[str, Any]:
    """Everything the admin views read from the store."""
    out: dict[str, Any] = {
        "leases": [(r.route, r.fp, r.model, r.host, r.state, r.created, r.last_used) for r in s.leases()],
        "events": [(e.ts, e.route, e.fp, e.from_host, e.to_host, e.reason) for e in s.lease_events(2)],
        "requests": [(r.route, r.model, r.host, r.status, r.prompt_tokens, r.err, r.decision, r.started)
                     for r in s.requests_since(T0 - DAY)],
        "uptime": s.host_uptime(0),
    }
    for by in ("route", "model", "host", "decision"):
        for since in (0, T0 - DAY + 1, T0):
            out[f"usage {by} {since}"] = s.usage(since, by)
    return out


def test_every_read_answers_the_same_on_sqlite_and_postgresql(pg_store: Store, tmp_path: Path) -> None:
    sqlite = Store(str(tmp_path / "same.db"))
    sqlite.open()
    sqlite.start()
    try:
        for s in (sqlite, pg_store):
            fill(s)
        assert answers(pg_store) == answers(sqlite)
        assert pg_store.bad_figures == sqlite.bad_figures == 1
        for s in (sqlite, pg_store):
            assert s.rollup(T0 - DAY / 2) == 2
        assert answers(pg_store) == answers(sqlite)
        for s in (sqlite, pg_store):
            s.schedule_rollup(T0 + DAY)
            assert s.flush()
        assert answers(pg_store) == answers(sqlite)
        assert pg_store.requests_since(0) == [] and pg_store.lease_events() == []
    finally:
        sqlite.close()


def test_timestamps_keep_sub_second_precision(pg_store: Store) -> None:
    pg_store.save_lease("r1", "fp1", "m1", "alpha", "active", T0 + 0.123456, T0 + 0.654321)
    assert pg_store.flush()
    [row] = pg_store.leases()
    assert (row.created, row.last_used) == (T0 + 0.123456, T0 + 0.654321)


def set_connections(server: PgServer, database: str, allowed: bool) -> None:
    with server.admin() as conn:
        conn.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS {str(allowed).lower()}')
        if not allowed:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                         (database,))


def test_server_gone_then_back_keeps_every_row(pg_server: PgServer, pg_url: str) -> None:
    database = pg_url.rsplit("/", 1)[1]
    store = Store(pg_url)
    store.open()
    store.start()
    try:
        store.save_lease("r1", "fp0", "m1", "alpha", "active", T0, T0)
        assert store.flush()
        set_connections(pg_server, database, False)
        begin = time.perf_counter()
        for i in range(50):
            store.record_request({"route": "r1", "fp": "f", "model": "m1", "started": T0 + i, "total_ms": 1})
            store.save_lease("r1", f"fp{i}", "m1", "alpha", "active", T0, T0)
        assert time.perf_counter() - begin < 0.5  # callers never wait on the database
        deadline = time.monotonic() + 10
        while store.errors < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.errors >= 2 and not store.flush(timeout=0.3)
        set_connections(pg_server, database, True)
        assert store.flush(timeout=15)
        assert len(store.requests_since(0)) == 50 and len(store.leases()) == 50
        assert store.dropped == 0
    finally:
        store.close()


def test_postgresql_errors_are_one_line_at_open(pg_server: PgServer) -> None:
    with pytest.raises(StoreError, match="cannot open database") as info:
        Store(pg_server.url("no_such_database")).open()
    assert "\n" not in str(info.value)


def test_a_nul_in_a_client_chosen_name_never_costs_the_row(pg_store: Store) -> None:
    """PostgreSQL refuses NUL in text: the row would be dropped as refused."""
    pg_store.record_request({"route": "r1", "fp": "f", "model": "m\x00x", "started": T0, "total_ms": 1})
    pg_store.save_lease("r1", "f", "m\x00x", "alpha", "active", T0, T0)
    pg_store.record_event(T0, "r1", "f", "m\x00x", None, "alpha", "new")
    assert pg_store.flush()
    assert [r.model for r in pg_store.requests_since(0)] == ["m\ufffdx"]
    assert [r.model for r in pg_store.leases()] == ["m\ufffdx"]
    assert pg_store.dropped == 0 and len(pg_store.lease_events()) == 1


def test_a_postgresql_database_at_an_older_revision_upgrades_keeping_its_rows(pg_url: str) -> None:
    engine = create_engine(parse_db(pg_url).url)
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), "0001")  # requests_daily keyed without `decision`
        conn.exec_driver_sql(
            "INSERT INTO requests_daily VALUES ('2026-05-27', 'r', 'm', 'a', 4, 1, 40, 0, 400, 300, 20)")
    engine.dispose()
    store = Store(pg_url)
    store.open()
    try:
        assert store.usage(0, "decision") == [{"key": "", "requests": 4, "errors": 1, "busy_ms": 40,
                                               "queued_ms": 0, "prompt_tokens": 400, "cached_tokens": 300,
                                               "completion_tokens": 20}]
    finally:
        store.close()


def test_request_rows_land_as_on_sqlite_in_either_form(pg_url: str) -> None:
    """The writer turns value tuples back into the mappings SQLAlchemy's executemany takes: both
    forms store on PostgreSQL what SQLite stores (a boolean being a boolean)."""
    s = Store(pg_url, clock=lambda: NOW)
    s.open()
    s.start()
    for form in ("mapping", "tuple"):
        for over, _, _, _ in ROW_CASES:
            s.record_request(as_given(over, form))
    assert s.flush()
    stored = [tuple(getattr(r, c) for c in REQUEST_COLUMNS) for r in s.requests_since(-math.inf)]
    expected = [tuple({**STORED, **want}.values()) for _, want, _, _ in ROW_CASES if want is not None]
    as_sqlite = [(*row[:9], int(row[9]), *row[10:]) for row in stored]
    assert as_sqlite == expected + expected
    assert s.dropped == 2 * sum(1 for _, want, _, _ in ROW_CASES if want is None)  # not enqueued, or refused
    s.close()
