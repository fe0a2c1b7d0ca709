"""Where the store lives: a file path means an embedded SQLite database, a `postgresql://` URL a
PostgreSQL server (psycopg 3). This module builds the engines for either, creates and upgrades the
schema (Alembic revisions shipped in `crossbar/migrations`, run at open), and tells a database that
is unavailable (retry later) from one that refuses what it was given.

SQLite: the file (and so its WAL and shared-memory files, which SQLite creates with the file's
mode) is created 0600; WAL journal; the writer takes the write lock at BEGIN; readers are
`query_only`. PostgreSQL: every connection has a connect timeout, TCP keepalives and a statement
timeout, so a server that vanishes costs a bounded wait, never a hung thread.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import URL, Engine, create_engine, event, make_url, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError
from sqlalchemy.pool import NullPool

BUSY_TIMEOUT_MS = 2000
VERSION_TABLE = "crossbar_version"
POSTGRES_SCHEMES = ("postgresql", "postgres", "postgresql+psycopg")
PG_CONNECT_TIMEOUT_S = 3  # libpq's minimum that means anything is 2
# statement timeouts (ms): the writer may roll up a day of rows; reads serve admin views
PG_WRITER_TIMEOUT_MS = 60_000
PG_READER_TIMEOUT_MS = 15_000
# taken by every instance upgrading the schema, so that two starting at once do not race
_MIGRATION_LOCK = 0x63726F73  # "cros"
log = logging.getLogger("crossbar.store")
# SQLite errors that are about the data, not the database's availability: retrying cannot help
_SQLITE_REFUSALS = ("integer overflow", "too big", "datatype mismatch", "too many")


class DatabaseError(Exception):
    """`db` names nothing crossbar can use (a bad URL, an unsupported scheme)."""


@dataclass(frozen=True)
class Database:
    """A parsed `db` setting."""

    url: URL
    path: str  # the SQLite file, "" for PostgreSQL

    @property
    def postgres(self) -> bool:
        return self.url.get_backend_name() == "postgresql"

    @property
    def label(self) -> str:
        """For log lines and errors: the file, or the URL without its password."""
        return self.path or self.url.render_as_string(hide_password=True)


def parse_db(db: str) -> Database:
    """A file path (SQLite) or a `postgresql://user:pw@host:port/name?…` URL (psycopg 3)."""
    scheme, sep, _ = db.partition("://")
    if not sep:
        path = str(Path(db).expanduser())
        return Database(URL.create("sqlite", database=path), path)
    if scheme not in POSTGRES_SCHEMES:
        raise DatabaseError(f"db: {scheme}:// is not supported (a file path for SQLite or postgresql://…)")
    try:
        url = make_url(db).set(drivername="postgresql+psycopg")
    except ArgumentError as exc:
        raise DatabaseError(f"db: not a database URL: {exc}") from exc
    return Database(url, "")


# ---------------------------------------------------------------------------------------------
# engines


def _on_sqlite_writer_connect(dbapi_conn: Any, _record: Any) -> None:
    dbapi_conn.isolation_level = None  # the "begin" hook below emits BEGIN IMMEDIATE instead
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA synchronous = NORMAL")
    cur.close()


def _on_sqlite_writer_begin(conn: Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def _on_sqlite_reader_connect(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA query_only = ON")
    cur.close()


def _sqlite_engine(url: URL, writer: bool, **kw: Any) -> Engine:
    args = {"timeout": BUSY_TIMEOUT_MS / 1000, "check_same_thread": False}
    engine = create_engine(url, connect_args=args, **kw)
    if writer:
        event.listen(engine, "connect", _on_sqlite_writer_connect)
        event.listen(engine, "begin", _on_sqlite_writer_begin)
    else:
        event.listen(engine, "connect", _on_sqlite_reader_connect)
    return engine


def pg_connect_args(statement_timeout_ms: int, *, read_only: bool = False) -> dict[str, Any]:
    options = f"-c statement_timeout={statement_timeout_ms} -c lock_timeout={statement_timeout_ms}"
    if read_only:
        options += " -c default_transaction_read_only=on"
    return {
        "connect_timeout": PG_CONNECT_TIMEOUT_S,
        "application_name": "crossbar",
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 5,
        "keepalives_count": 3,
        "options": options,
    }


def writer_engine(db: Database, url: URL | None = None) -> Engine:
    """The writer thread's engine (`url` replaces the database's own URL; tests use it)."""
    if db.postgres:
        args = pg_connect_args(PG_WRITER_TIMEOUT_MS)
        return create_engine(url or db.url, connect_args=args, pool_size=1, max_overflow=1)
    return _sqlite_engine(url or db.url, True, pool_size=1, max_overflow=4)


def reader_engine(db: Database) -> Engine:
    if db.postgres:
        args = pg_connect_args(PG_READER_TIMEOUT_MS, read_only=True)
        return create_engine(db.url, connect_args=args, pool_size=2, max_overflow=4, pool_timeout=5)
    return _sqlite_engine(db.url, False)


# ---------------------------------------------------------------------------------------------
# creating and upgrading


def create_private_file(path: str) -> None:
    """Create the database file 0600 before SQLite does (it would use 0644 under a usual umask);
    SQLite gives its WAL and shared-memory files the database file's mode."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)


def prepare(db: Database, url: URL | None = None) -> None:
    """Create the database (a private file and WAL mode for SQLite) and bring its schema to the
    newest revision; raises SQLAlchemyError (or OSError for a file that cannot be created)."""
    if db.postgres:
        engine = create_engine(url or db.url, poolclass=NullPool,
                               connect_args=pg_connect_args(PG_WRITER_TIMEOUT_MS))
    else:
        if not os.path.exists(db.path):
            create_private_file(db.path)
        engine = _sqlite_engine(url or db.url, True, poolclass=NullPool)
    try:
        if not db.postgres:
            _sqlite_wal(url or db.url)
        with engine.begin() as conn:
            if db.postgres:
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
            migrate(conn)
    finally:
        engine.dispose()


def _sqlite_wal(url: URL) -> None:
    engine = create_engine(url, poolclass=NullPool, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000})
    try:
        with engine.connect() as conn:
            mode = conn.exec_driver_sql("PRAGMA journal_mode = WAL").scalar()
    finally:
        engine.dispose()
    if str(mode).lower() != "wal":
        raise OperationalError("PRAGMA journal_mode = WAL", {}, Exception(f"journal mode {mode}"))


def alembic_config(conn: Connection) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", "crossbar:migrations")
    cfg.set_main_option("version_table", VERSION_TABLE)
    cfg.attributes["connection"] = conn
    return cfg


def migrate(conn: Connection) -> None:
    """Upgrade to the newest revision inside the caller's transaction. A database created before
    crossbar used Alembic has no version table: its first revisions keep the tables it has."""
    current = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()
    head = head_revision()
    if current == head:
        return
    log.info("store: upgrading the schema from revision %s to %s", current or "none", head)
    alembic_log = logging.getLogger("alembic")
    level = alembic_log.level
    alembic_log.setLevel(logging.WARNING)  # its plugin and per-revision lines would flood the log
    try:
        command.upgrade(alembic_config(conn), "head")
    finally:
        alembic_log.setLevel(level)


def head_revision() -> str | None:
    """The newest revision shipped with this crossbar."""
    cfg = Config()
    cfg.set_main_option("script_location", "crossbar:migrations")
    return ScriptDirectory.from_config(cfg).get_current_head()


# ---------------------------------------------------------------------------------------------
# failures


def transient(exc: BaseException) -> bool:
    """True when the database is unavailable (locked, read-only, disk full, gone, unreachable):
    the same work may succeed later. False when it refuses the work itself (a constraint, a value
    out of range, an overflow): retrying would wedge everything queued behind it."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    if not isinstance(exc, OperationalError):
        return False
    orig = exc.orig
    if isinstance(orig, sqlite3.OperationalError):
        message = str(orig).lower()
        return not any(refusal in message for refusal in _SQLITE_REFUSALS)
    return True
