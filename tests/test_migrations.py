"""Schema versions: a fresh database is built by the Alembic revisions, and a database written by
the crossbar before them (main at 9ecac75, dumped in tests/fixtures) upgrades without losing rows."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine
from sqlmodel import SQLModel

from crossbar import schema  # noqa: F401  (registers the tables on SQLModel.metadata)
from crossbar.backend import VERSION_TABLE, head_revision
from crossbar.store import Store

FIXTURE = Path(__file__).parent / "fixtures" / "store-main-9ecac75.sql"
T0 = 1_780_000_000.0


def restore(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(FIXTURE.read_text())
    conn.close()


def test_revisions_build_exactly_the_tables_the_code_declares(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "fresh.db"))
    store.open()
    store.close()
    engine = create_engine(f"sqlite:///{tmp_path / 'fresh.db'}")
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}),
                                SQLModel.metadata) == []
        assert conn.exec_driver_sql(f"SELECT version_num FROM {VERSION_TABLE}").scalar() == head_revision()
    engine.dispose()


def test_a_database_from_before_schema_versions_upgrades_keeping_every_row(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    restore(path)
    store = Store(str(path))
    store.open()
    store.start()
    try:
        leases = [(r.route, r.fp, r.model, r.host, r.state, r.last_used) for r in store.leases()]
        assert leases == [("r1", "", "", "beta", "pinned", T0),
                          ("r1", "fp1", "m1", "alpha", "active", T0 + 5)]
        assert [(e.reason, e.to_host) for e in store.lease_events()] == [
            ("moved:unhealthy", "beta"), ("new", "alpha")]
        assert [(r.route, r.prompt_tokens, r.err) for r in store.requests_since(0)] == [
            ("r2", None, "no healthy host"), ("r1", 120, None)]
        routes = {r["key"]: r for r in store.usage(0, "route")}
        r1 = routes["r1"]
        assert (r1["requests"], r1["prompt_tokens"], r1["busy_ms"]) == (4, 420, 390)
        assert routes["r2"]["errors"] == 1
        assert {r["key"]: r["requests"] for r in store.usage(0, "decision")} == {"": 1, "reused": 4}
        assert store.host_uptime(0) == {"alpha": 1.0, "beta": 0.0}
        # and it keeps working: new rows, a roll-up into the migrated requests_daily
        store.save_lease("r1", "fp9", "m1", "alpha", "active", T0, T0)
        store.record_request({"route": "r1", "fp": "fp9", "model": "m1", "started": T0 + 3, "total_ms": 1})
        store.schedule_rollup(T0 + 10)
        assert store.flush()
        assert store.requests_since(0) == []
        assert {r["key"]: r["requests"] for r in store.usage(0, "route")} == {"r1": 5, "r2": 1}
    finally:
        store.close()
    version = sqlite3.connect(path).execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall()
    assert version == [(head_revision(),)]


def test_upgrading_clears_absurd_figures_an_older_crossbar_stored(tmp_path: Path) -> None:
    """Rows with figures no host can report made every sum overflow (usage answered 500, the
    roll-up failed on every start): the upgrade stores them as unknown."""
    path = tmp_path / "old.db"
    restore(path)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("UPDATE requests SET prompt_tokens = ?, completion_tokens = 1e308, ttfb_ms = -1"
                     " WHERE route = 'r1'", (2**62,))
        conn.execute("UPDATE requests_daily SET prompt_tokens = ?", (2**62,))
    conn.close()
    store = Store(str(path))
    store.open()
    store.start()
    try:
        [row] = [r for r in store.requests_since(0) if r.route == "r1"]
        assert (row.prompt_tokens, row.completion_tokens, row.ttfb_ms) == (None, None, None)
        assert row.cached_tokens == 100  # a sane figure stays
        assert {r["key"]: r["prompt_tokens"] for r in store.usage(0, "route")} == {"r1": 0, "r2": 0}
        store.schedule_rollup(T0 + 10)
        store.save_lease("r9", "fp", "m1", "alpha", "active", T0, T0)
        assert store.flush()
        assert store.requests_since(0) == [] and [r.route for r in store.leases()][-1] == "r9"
    finally:
        store.close()
