"""The store: the lease table (write-through copy) and the accounting log, in SQLite.

The proxy's event loop never waits on the database: every write is an operation put on the
write-behind queue (`crossbar.writebehind`), applied by one background writer thread in batches.
A lease's waiting writes collapse into its latest state and are never dropped; request rows,
health observations and lease events are shed (oldest first, counted) only when more than
`max_pending` operations wait; past that, change notices give way to one that has every instance
read the shared state back.

Reads (admin, usage, lease loading) use a second engine whose connections are `query_only`, so
they neither block nor are blocked by the writer (WAL). They are synchronous: the proxy calls them
through `asyncio.to_thread`. The tables are in `crossbar.schema`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from itertools import chain
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any

from sqlalchemy import (
    URL,
    ColumnElement,
    Engine,
    Integer,
    Select,
    String,
    Table,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal,
    or_,
    select,
    text,
    union_all,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.expression import Executable, Insert
from sqlalchemy.sql.functions import FunctionElement
from sqlmodel import Session

from crossbar import backend, tap
from crossbar.backend import Database, DatabaseError, parse_db
from crossbar.schema import (
    DAILY,
    DRAINS,
    EVENTS,
    HEALTH,
    LEASES,
    REQUEST_COLUMNS,
    REQUESTS,
    SECRET,
    SUMMED,
    LeaseEventRow,
    LeaseRow,
    RequestRow,
    RequestValues,
)
from crossbar.shared import CHANNEL, MAX_PAYLOAD, Change, SharedState
from crossbar.writebehind import Op, WriteBehind, one_line

log = logging.getLogger("crossbar.store")

USAGE_KEYS = ("route", "model", "host", "decision")
# request rows, health observations and lease events may be shed under pressure (oldest first,
# counted); lease rows never are: each lease's waiting writes collapse into its latest state. Change
# notices are not shed either (another instance would miss a change until it restarts): past
# max_pending waiting operations they give way to one notice that has every instance read the
# shared state back (`publish`).
_DROPPABLE = ("request", "health", "event")
# a request's row and a lease's last use ("touch") may wait a second to be written; every other
# operation, a lease change included, is written within a quarter of one
_LAZY = ("request", "touch")
_LEASE_OPS = frozenset({"lease", "touch", "unlease"})


class StoreError(Exception):
    """The database cannot be opened or created at all (start-up fails with this one line)."""


# Sane ranges of a request's figures: a context of a hundred million tokens or a request of a week
# is beyond any host crossbar fronts. Within them, sums stay exact far beyond any fleet's history.
MAX_TOKENS = tap.MAX_TOKENS  # the same bound the usage scanner applies
MAX_MS = 604_800_000
MAX_DAILY = 2**53  # one day's sum of sane figures in requests_daily stays far below this
_INT_COLUMNS = ("queued_ms", "total_ms")  # crossbar's own clock; NOT NULL
_FIGURES = {"ttfb_ms": MAX_MS, "status": 599, "prompt_tokens": MAX_TOKENS, "cached_tokens": MAX_TOKENS,
            "completion_tokens": MAX_TOKENS}
_NULLABLE_STR_COLUMNS = ("host", "err", "decision")
_IN_COLUMN_ORDER = itemgetter(*REQUEST_COLUMNS)


# ---------------------------------------------------------------------------------------------
# statements


class _utc_day(FunctionElement[str]):
    """The UTC day (YYYY-MM-DD) of a Unix time, in either dialect."""

    type = String()
    inherit_cache = True


@compiles(_utc_day, "sqlite")
def _utc_day_sqlite(element: _utc_day, compiler: Any, **kw: Any) -> str:
    return f"date({compiler.process(element.clauses, **kw)}, 'unixepoch')"


@compiles(_utc_day, "postgresql")
def _utc_day_postgresql(element: _utc_day, compiler: Any, **kw: Any) -> str:
    started = compiler.process(element.clauses, **kw)
    return f"to_char(to_timestamp({started}) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"


def _insert(conn: Connection, table: Table) -> Any:
    """INSERT with the dialect's ON CONFLICT support."""
    return pg_insert(table) if conn.dialect.name == "postgresql" else sqlite_insert(table)


def _lease_upsert(conn: Connection) -> Any:
    stmt = _insert(conn, LEASES)
    return stmt.on_conflict_do_update(
        index_elements=["route", "fp", "model"],
        set_={c: stmt.excluded[c] for c in ("host", "state", "created", "last_used")},
    )


def _lease_delete() -> Any:
    return delete(LEASES).where(
        LEASES.c.route == bindparam("k_route"),
        LEASES.c.fp == bindparam("k_fp"),
        LEASES.c.model == bindparam("k_model"),
        LEASES.c.last_used < bindparam("k_before"),
    )


def _is_error(t: Table) -> ColumnElement[int]:
    failed = or_(t.c.status.is_(None), t.c.status >= 400, t.c.err.is_not(None))
    return case((failed, 1), else_=0)


def _day_of(started: ColumnElement[Any]) -> ColumnElement[str]:
    return _utc_day(started)


def _safe_sum(column: ColumnElement[Any], high: int) -> ColumnElement[Any]:
    """SUM over the values within [0, high]: rows an older crossbar stored with absurd figures (or
    written by hand) are left out instead of overflowing the sum (SQLite raises on it)."""
    return func.sum(case((column.between(0, high), column), else_=None))


def _key_column(t: Table, key: str) -> ColumnElement[str]:
    """The grouping column of `requests` for a usage key; NULL host/decision group as ""."""
    return func.coalesce(t.c[key], "") if key in ("host", "decision") else t.c[key]


_DAILY_KEYS = ("route", "model", "host", "decision")
_USAGE_SUMS = ("requests", "errors", *SUMMED)
# what `requests` contributes to each summed column, and the bound of a sane value
_REQUEST_SUMS = {
    "busy_ms": ("total_ms", MAX_MS),
    "queued_ms": ("queued_ms", MAX_MS),
    "prompt_tokens": ("prompt_tokens", MAX_TOKENS),
    "cached_tokens": ("cached_tokens", MAX_TOKENS),
    "completion_tokens": ("completion_tokens", MAX_TOKENS),
}


def _requests_rollup(older_than: float) -> Select[Any]:
    r = REQUESTS
    keys = [_key_column(r, k) for k in _DAILY_KEYS]
    return (
        select(
            _day_of(r.c.started),
            *keys,
            func.count(),
            func.sum(_is_error(r)),
            *[func.coalesce(_safe_sum(r.c[col], high), 0) for col, high in _REQUEST_SUMS.values()],
        )
        .where(r.c.started < older_than)
        .group_by(_day_of(r.c.started), *keys)
    )


def _daily_upsert(conn: Connection, older_than: float) -> Any:
    cols = ["day", *_DAILY_KEYS, "requests", "errors", *SUMMED]
    stmt = _insert(conn, DAILY).from_select(cols, _requests_rollup(older_than))
    added = ["requests", "errors", *SUMMED]
    return stmt.on_conflict_do_update(
        index_elements=["day", *_DAILY_KEYS],
        set_={c: DAILY.c[c] + stmt.excluded[c] for c in added},
    )


def _request_usage(key: str, since: float) -> Select[Any]:
    r = REQUESTS
    col = _key_column(r, key)
    return (
        select(
            col.label("key"),
            func.count().label("requests"),
            func.sum(_is_error(r)).label("errors"),
            *[_safe_sum(r.c[col], high).label(name) for name, (col, high) in _REQUEST_SUMS.items()],
        )
        .where(r.c.started >= since)
        .group_by(col)
    )


def _daily_usage(key: str, since: float) -> Select[Any]:
    d = DAILY
    day = datetime.fromtimestamp(since, UTC).strftime("%Y-%m-%d")
    sums = [_safe_sum(d.c[c], MAX_DAILY).label(c) for c in _USAGE_SUMS]
    return select(d.c[key].label("key"), *sums).where(d.c.day >= day).group_by(d.c[key])


def _usage(key: str, since: float) -> Select[Any]:
    both = union_all(_request_usage(key, since), _daily_usage(key, since)).subquery()
    sums = [func.coalesce(func.sum(both.c[c]), literal(0)).label(c) for c in _USAGE_SUMS]
    return select(both.c.key, *sums).group_by(both.c.key)


# ---------------------------------------------------------------------------------------------
# the writer's operations


@dataclass(frozen=True, slots=True)
class _Compiled:
    sql: str
    order: tuple[str, ...]  # the parameters' names in the order the statement takes them
    rows_at: int = -1  # where the VALUES row `row` sits in `sql` (an INSERT), else -1
    row: str = ""

    def many_rows(self, n: int) -> str:
        """The INSERT with n rows of values."""
        return self.sql[:self.rows_at] + ", ".join([self.row] * n) + self.sql[self.rows_at + len(self.row):]

    def values(self, rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        """Each row's values in the order the statement takes them."""
        if len(self.order) == 1:  # itemgetter of one key gives the value, not a tuple
            return [(row[self.order[0]],) for row in rows]
        return list(map(itemgetter(*self.order), rows))


_COMPILED: dict[tuple[str, tuple[str, ...]], _Compiled] = {}
ROWS_PER_INSERT = 256
_LEAST_VARIABLE_LIMIT = 999  # SQLite's limit on a statement's parameters before 3.32


def _execute_many(conn: Connection, name: str, build: Callable[[Connection], Executable],
                  rows: list[dict[str, Any]]) -> None:
    """`conn.execute(build(conn), rows)`. On SQLite the statement is compiled once per set of keys
    and handed to the driver as it is, and an INSERT goes as one statement of many rows.
    SQLAlchemy's processing of each row's parameters took more of the writer thread (and of the
    interpreter lock the event loop needs) than the database did; and the driver lets go of the
    lock for every statement it runs, so with one statement per row the writer, under load, took
    the lock back from the event loop once per row. Values are the driver's native types already
    (the enqueueing side normalises them), so no type conversion is skipped."""
    if conn.dialect.name != "sqlite":
        conn.execute(build(conn), rows)
        return
    for keys, same in _by_keys(rows).items():
        found = _compiled(conn, name, build, keys)
        _execute_compiled(conn, found, found.values(same))


def _by_keys(rows: list[dict[str, Any]]) -> dict[tuple[str, ...], list[dict[str, Any]]]:
    """The rows grouped by their keys, in order; usually they all have the same."""
    shapes = set(map(tuple, rows))
    if len(shapes) == 1:
        return {shapes.pop(): rows}
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row), []).append(row)
    return groups


def _insert_requests(conn: Connection, rows: list[RequestValues]) -> None:
    """INSERT `requests` rows given as values in REQUEST_COLUMNS order (see `_execute_many`)."""
    if conn.dialect.name != "sqlite":
        conn.execute(insert(REQUESTS), [dict(zip(REQUEST_COLUMNS, row, strict=True)) for row in rows])
        return
    found = _compiled(conn, "request", lambda _: insert(REQUESTS), REQUEST_COLUMNS)
    if found.order != REQUEST_COLUMNS:
        raise RuntimeError(f"store: the requests INSERT takes {found.order}, not {REQUEST_COLUMNS}")
    _execute_compiled(conn, found, rows)


def _compiled(conn: Connection, name: str, build: Callable[[Connection], Executable],
              keys: tuple[str, ...]) -> _Compiled:
    found = _COMPILED.get((name, keys))
    if found is None:
        found = _COMPILED[(name, keys)] = _compile(conn, build(conn), keys)
    return found


def _execute_compiled(conn: Connection, found: _Compiled, rows: list[tuple[Any, ...]]) -> None:
    """Run `found` for rows of values in `found.order`."""
    if found.rows_at < 0:
        conn.exec_driver_sql(found.sql, rows)
        return
    at = 0
    for size in chunk_sizes(len(rows), _rows_per_insert(conn, len(found.order))):
        chunk = rows[at:at + size]
        at += size
        conn.exec_driver_sql(found.many_rows(size), tuple(chain.from_iterable(chunk)))


def chunk_sizes(n: int, most: int) -> list[int]:
    """How `n` rows are cut into multi-row INSERTs of at most `most` rows: as many of `most` as
    fit, then the rest as powers of two, largest first. The driver keeps each distinct statement
    it ran prepared (128 of them per connection): with one statement per batch size, a writer
    under load came to hold that many INSERTs of up to 256 rows, about 30 MB, and prepared a new
    one for most batches. Cut this way, at most `(most - 1).bit_length() + 1` statements ever exist."""
    sizes = [most] * (n // most)
    rest = n % most
    while rest:
        size = 1 << (rest.bit_length() - 1)
        sizes.append(size)
        rest -= size
    return sizes


def _rows_per_insert(conn: Connection, width: int) -> int:
    """How many rows of `width` values one INSERT takes: within the connection's parameter limit
    (a build or a connection may set it lower than SQLite's default)."""
    return max(1, min(ROWS_PER_INSERT, _variable_limit(conn) // width))


def _variable_limit(conn: Connection) -> int:
    """How many parameters one statement may take on this SQLite connection (999 on builds
    before 3.32)."""
    try:
        return int(conn.connection.driver_connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER))
    except (AttributeError, sqlite3.Error):
        return _LEAST_VARIABLE_LIMIT


def _compile(conn: Connection, stmt: Executable, keys: tuple[str, ...]) -> _Compiled:
    """`stmt` compiled for SQLite (parameters by position) for rows with `keys`."""
    compiled = stmt.compile(dialect=conn.dialect, column_keys=list(keys))
    sql, order = str(compiled), tuple(compiled.positiontup or ())
    row = "(" + ", ".join("?" * len(order)) + ")"
    at = sql.find(" VALUES " + row) if isinstance(stmt, Insert) and sql.count("?") == len(order) else -1
    return _Compiled(sql, order, at + len(" VALUES ") if at >= 0 else -1, row)


_KIND = attrgetter("kind")  # of an operation
_LEASE_KEY = itemgetter("route", "fp", "model")  # of a lease operation's data



def _figure(value: Any, low: int, high: int) -> int | None:
    """A whole figure within [low, high], else None (unknown): an upstream's absurd usage
    (2**70 tokens, 1e308, NaN) is never stored, so no sum of stored figures can overflow."""
    if type(value) is int:  # the usual case, first
        return value if low <= value <= high else None
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    figure = round(value)
    return figure if low <= figure <= high else None


def _text(value: Any) -> str:
    """A string every backend stores as given: PostgreSQL refuses NUL in text, so it becomes U+FFFD
    (on every backend, so that both keep the same keys)."""
    if type(value) is str and "\x00" not in value:  # the usual case, first
        return value
    return str(value).replace("\x00", "\ufffd")


def _request_values(row: RequestValues | Mapping[str, Any], now: float) -> tuple[RequestValues, int]:
    """Normalise a request row at enqueue time so the writer never meets an unbindable value: the
    row's values in REQUEST_COLUMNS order, and how many figures were out of range (stored as NULL,
    or 0 where the column cannot be NULL). A tuple is in REQUEST_COLUMNS order; a mapping may leave
    columns out."""
    if isinstance(row, tuple):
        if _usual(row):
            return row, 0
        row = dict(zip(REQUEST_COLUMNS, row, strict=True))
    out, bad = _normalised(row, now)
    return _IN_COLUMN_ORDER(out), bad


def _plain_key(route: Any, fp: Any, model: Any) -> bool:
    """A conversation key `_text` would keep as it is: three strings without NUL."""
    return type(route) is type(fp) is type(model) is str and "\x00" not in route + fp + model


def _usual(row: RequestValues) -> bool:
    """True when `_normalised` would keep every value of `row` as it is, as it does for nearly every
    row the proxy writes: then the row is stored without being rebuilt."""
    (route, fp, model, host, started, queued_ms, ttfb_ms, total_ms, status, streamed,
     prompt, cached, completion, err, decision) = row
    # one guard a line: measured faster than one condition spread over many lines
    if not _plain_key(route, fp, model):
        return False
    if not (host is None or (type(host) is str and "\x00" not in host)):
        return False
    if not (err is None or (type(err) is str and "\x00" not in err)):
        return False
    if not (decision is None or (type(decision) is str and "\x00" not in decision)):
        return False
    if not (type(started) is float and math.isfinite(started) and type(streamed) is bool):
        return False
    if not (type(queued_ms) is int and 0 <= queued_ms <= MAX_MS):
        return False
    if not (type(total_ms) is int and 0 <= total_ms <= MAX_MS):
        return False
    if not (ttfb_ms is None or (type(ttfb_ms) is int and 0 <= ttfb_ms <= MAX_MS)):
        return False
    if not (status is None or (type(status) is int and 100 <= status <= 599)):
        return False
    if not (completion is None or (type(completion) is int and 0 <= completion <= MAX_TOKENS)):
        return False
    if not (prompt is None or (type(prompt) is int and 0 <= prompt <= MAX_TOKENS)):
        return False
    most_cached = MAX_TOKENS if prompt is None else prompt
    return cached is None or (type(cached) is int and 0 <= cached <= most_cached)


def _normalised(row: Mapping[str, Any], now: float) -> tuple[dict[str, Any], int]:
    """Every value of a request row made storable (see `_request_values`); absent columns take
    their defaults."""
    started = float(row.get("started", now))
    out: dict[str, Any] = {
        "route": _text(row.get("route", "")),
        "fp": _text(row.get("fp", "")),
        "model": _text(row.get("model", "")),
        "started": started if math.isfinite(started) else now,
        "streamed": bool(row.get("streamed", False)),
    }
    bad = 0 if math.isfinite(started) else 1
    for col, high in _FIGURES.items():
        raw = row.get(col)
        out[col] = _figure(raw, 100 if col == "status" else 0, high)
        bad += raw is not None and out[col] is None
    prompt, cached = out["prompt_tokens"], out["cached_tokens"]
    if cached is not None and prompt is not None and cached > prompt:
        out["cached_tokens"], bad = None, bad + 1
    for col in _INT_COLUMNS:
        raw = row.get(col) or 0
        out[col] = _figure(raw, 0, MAX_MS)
        if out[col] is None:
            out[col], bad = 0, bad + 1
    for col in _NULLABLE_STR_COLUMNS:
        out[col] = None if row.get(col) is None else _text(row[col])
    return out, bad


class Store:
    """The SQLite-backed store; see the module docstring."""

    def __init__(
        self, db: str, *, max_pending: int = 1_000_000, clock: Callable[[], float] = time.time
    ) -> None:
        try:
            self.db: Database | None = parse_db(db)
        except DatabaseError as exc:
            self.db, self._bad_db = None, str(exc)
        self.path = self.db.path if self.db else ""  # the SQLite file ("" for PostgreSQL)
        self.label = self.db.label if self.db else db  # for log lines: never a password
        self.clock = clock
        self.last_rollup = 0
        self.bad_figures = 0  # figures out of their sane range, stored as unknown
        self._bad_lock = threading.Lock()
        self._queue = WriteBehind(
            self, name=self.label, droppable=_DROPPABLE, lazy=_LAZY, max_pending=max_pending, log=log,
            coalesce=dict.fromkeys(_LEASE_OPS, _LEASE_KEY),
        )
        self._writer: Engine | None = None
        self._reader: Engine | None = None
        self.shared: SharedState | None = None  # what instances sharing the database share; set by open()
        self._event_listeners: list[Callable[[str], None]] = []

    # -- the queue's counters -------------------------------------------------------------------

    @property
    def errors(self) -> int:
        return self._queue.errors

    @property
    def dropped(self) -> int:
        return self._queue.dropped

    @property
    def written(self) -> int:
        return self._queue.written

    @property
    def last_error(self) -> str:
        return self._queue.last_error

    @property
    def pending(self) -> int:
        return self._queue.pending

    # -- lifecycle ------------------------------------------------------------------------------

    def _writer_url(self) -> URL | None:
        """The writer's database URL when it is not the database's own; tests replace it (e.g. with
        SQLite's `mode=ro`) to make writes fail."""
        return None

    @property
    def postgres(self) -> bool:
        return self.db is not None and self.db.postgres

    def open(self) -> None:
        """Create the database (directory, private file, WAL for SQLite) and bring its schema to the
        newest revision; raise StoreError (one line) when that is impossible."""
        if self._writer is not None:
            return
        if self.db is None:
            raise StoreError(self._bad_db)
        if not self.db.postgres:
            parent = Path(self.path).parent
            try:
                parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"store: cannot create directory {parent}: {exc.strerror or exc}") from exc
        try:
            backend.prepare(self.db)
        except (SQLAlchemyError, OSError) as exc:
            raise StoreError(f"store: cannot open database {self.label}: {one_line(exc)}") from exc
        self._writer = backend.writer_engine(self.db, self._writer_url())
        self._reader = backend.reader_engine(self.db)
        self.shared = SharedState(self.db)

    def start(self) -> None:
        """Start the writer thread (daemon, "crossbar-store")."""
        if self._writer is None:
            raise StoreError("store: start() before open()")
        self._queue.start("crossbar-store")
        assert self.shared is not None
        self.shared.open()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything enqueued before the call is committed; False on timeout."""
        return self._queue.flush(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Flush, stop the writer and dispose the engines; idempotent."""
        if self._queue.closed:
            return
        if not self._queue.started and self._writer is not None and self.pending:
            self.start()
        self._queue.stop(timeout)
        if self.shared is not None:
            self.shared.close()
        if self.pending:
            log.warning("store: closed with %d operations not written to %s", self.pending, self.label)
        for engine in (self._writer, self._reader):
            if engine is not None:
                engine.dispose()

    # -- enqueue (never blocks on I/O, never raises) ----------------------------------------------

    def save_lease(
        self, route: str, fp: str, model: str, host: str, state: str, created: float, last_used: float,
        *, touch: bool = False,
    ) -> None:
        """Upsert the lease row. `touch`: only its last use moved, which may be written up to a
        second later than a change."""
        if not _plain_key(route, fp, model):
            route, fp, model = _text(route), _text(fp), _text(model)
        data = {"route": route, "fp": fp, "model": model, "host": host, "state": state,
                "created": float(created), "last_used": float(last_used)}
        self._queue.put("touch" if touch else "lease", data)

    def delete_lease(self, route: str, fp: str, model: str, idle_before: float | None = None) -> None:
        """Delete the lease row; with `idle_before`, only while it was last used before then."""
        before = math.inf if idle_before is None else float(idle_before)
        self._queue.put("unlease", {"route": _text(route), "fp": _text(fp), "model": _text(model),
                                    "before": before})

    def record_event(
        self,
        ts: float,
        route: str,
        fp: str,
        model: str,
        from_host: str | None,
        to_host: str | None,
        reason: str,
    ) -> None:
        data = {"ts": float(ts), "route": _text(route), "fp": _text(fp), "model": _text(model)}
        data["reason"] = reason
        self._queue.put("event", {**data, "from_host": from_host, "to_host": to_host})
        for listener in self._event_listeners:
            try:
                listener(reason)
            except Exception:
                log.exception("store: a lease event listener failed")

    def on_event(self, listener: Callable[[str], None]) -> None:
        """Call `listener(reason)` for every lease event recorded (metrics count them)."""
        self._event_listeners.append(listener)

    def record_request(self, row: RequestValues | Mapping[str, Any]) -> None:
        """Enqueue a `requests` row: its values in REQUEST_COLUMNS order, or a mapping of columns
        (absent ones take their defaults). A row with values that cannot be stored is counted as
        dropped, never raised."""
        try:
            values, bad = _request_values(row, self.clock())
        except (TypeError, ValueError, OverflowError) as exc:
            log.warning("store: request row not recorded: %s", exc)
            self._queue.count_dropped()
            return
        if bad:
            self._count_bad_figures(bad)
        self._queue.put("request", values)

    def _count_bad_figures(self, n: int) -> None:
        with self._bad_lock:
            first = self.bad_figures == 0
            self.bad_figures += n
        if first:
            log.warning("store: a request row had figures out of range; they are stored as unknown (NULL)")

    def record_health(self, ts: float, host: str, healthy: bool, loaded_models: Sequence[str]) -> None:
        models = json.dumps([str(m) for m in loaded_models])
        data = {"ts": float(ts), "host": host, "healthy": bool(healthy)}
        self._queue.put("health", {**data, "loaded_models": models})

    def save_drain(self, host: str, draining: bool, now: float) -> None:
        """Write a drain (or its end) through, so instances sharing the database agree on it."""
        self._queue.put("drain", {"host": host, "draining": bool(draining), "since": float(now)})

    def publish(self, change: Change) -> None:
        """Tell the other instances sharing the database about `change`, in the transaction of the
        writes enqueued before it (a no-op on SQLite: there is no other instance)."""
        if not self.postgres:
            return
        change = replace(change, instance=self.shared.instance if self.shared else "")
        payload = change.payload()
        if len(payload.encode()) > MAX_PAYLOAD:
            log.warning("store: a %s change is too large to publish (%d bytes)", change.kind, len(payload))
            self._queue.count_dropped()
            return
        if self._queue.pending >= self._queue.max_pending:  # the database is long away: one notice
            # for all, behind every write so far, asking every instance to read the shared state
            # back, stands for this one and those before it
            resync = Change("resync", instance=change.instance)
            self._queue.put_last("notify", {"c": CHANNEL, "p": resync.payload()})
            return
        self._queue.put("notify", {"c": CHANNEL, "p": payload})

    def schedule_rollup(self, older_than: float) -> None:
        """Have the writer thread run `rollup(older_than)` after everything enqueued so far."""
        self._queue.put("rollup", {"older_than": float(older_than)})

    # -- the writer thread's sink ---------------------------------------------------------------

    def commit(self, ops: list[Op]) -> None:
        assert self._writer is not None
        if self.path and not os.path.exists(self.path):  # deleted under an open connection

            gone = sqlite3.OperationalError(f"database file {self.path} is gone")
            raise OperationalError("commit", None, gone)
        with self._writer.begin() as conn:
            self._apply(conn, ops)

    @staticmethod
    def transient(exc: Exception) -> bool:
        return backend.transient(exc)

    def recover(self, exc: Exception) -> None:
        """Drop pooled connections (the file may have been replaced); recreate a vanished file.

        A missing directory is not recreated (it may be an unmounted disk): rows wait for it.
        """
        assert self._writer is not None and self.db is not None
        self._writer.dispose()
        if "no such table" in one_line(exc) or (self.path and not os.path.exists(self.path)):
            try:
                backend.prepare(self.db, self._writer_url())
            except (SQLAlchemyError, OSError) as again:
                log.debug("store: cannot recreate schema: %s", one_line(again))

    # -- applying a batch -----------------------------------------------------------------------

    def _apply(self, conn: Connection, ops: list[Op]) -> None:
        """Write ops in order; a rollup sees every row enqueued before it."""
        if "rollup" not in map(_KIND, ops):  # the usual batch
            self._apply_segment(conn, ops)
            return
        segment: list[Op] = []
        for op in ops:
            if op.kind != "rollup":
                segment.append(op)
                continue
            self._apply_segment(conn, segment)
            segment = []
            self.last_rollup = self._rollup(conn, op.data["older_than"])
            log.info("store: rolled %d request rows up into requests_daily", self.last_rollup)
        self._apply_segment(conn, segment)

    def _apply_segment(self, conn: Connection, ops: list[Op]) -> None:
        leases: dict[tuple[str, str, str], Op] = {}
        rows: dict[str, list[Any]] = {"request": [], "drain": [], "event": [], "health": [], "notify": []}
        for op in ops:
            kind = op.kind
            if kind in _LEASE_OPS:
                leases[_LEASE_KEY(op.data)] = op  # the last operation on a key wins
            else:
                rows[kind].append(op.data)
        self._apply_leases(conn, list(leases.values()))
        self._apply_drains(conn, list({d["host"]: d for d in rows["drain"]}.values()))  # likewise per host
        for kind, table in (("event", EVENTS), ("health", HEALTH)):
            if rows[kind]:
                _execute_many(conn, kind, lambda _, t=table: insert(t), rows[kind])
        if rows["request"]:
            _insert_requests(conn, rows["request"])
        for notify in rows["notify"]:  # delivered when this transaction commits
            conn.execute(text("SELECT pg_notify(:c, :p)"), notify)

    @staticmethod
    def _apply_leases(conn: Connection, ops: Sequence[Op]) -> None:
        saves = [op.data for op in ops if op.kind != "unlease"]
        deletes = [{f"k_{k}": v for k, v in op.data.items()} for op in ops if op.kind == "unlease"]
        if saves:
            _execute_many(conn, "lease", _lease_upsert, saves)
        if deletes:
            _execute_many(conn, "unlease", lambda _: _lease_delete(), deletes)

    @staticmethod
    def _apply_drains(conn: Connection, drains: Sequence[dict[str, Any]]) -> None:
        for d in drains:
            conn.execute(delete(DRAINS).where(DRAINS.c.host == d["host"]))
            if d["draining"]:
                conn.execute(insert(DRAINS).values(host=d["host"], since=d["since"]))

    @staticmethod
    def _rollup(conn: Connection, older_than: float) -> int:
        conn.execute(_daily_upsert(conn, older_than))
        conn.execute(delete(HEALTH).where(HEALTH.c.ts < older_than))
        conn.execute(delete(EVENTS).where(EVENTS.c.ts < older_than))
        return conn.execute(delete(REQUESTS).where(REQUESTS.c.started < older_than)).rowcount

    def rollup(self, older_than: float) -> int:
        """Move `requests` rows older than `older_than` into `requests_daily`, in one transaction;
        health observations and lease events that old are deleted (uptime and the event log cover
        at most the retention period).

        The synchronous implementation (tests call it directly); the proxy uses `schedule_rollup`.
        """
        if self._writer is None:
            raise StoreError("store: rollup() before open()")
        with self._writer.begin() as conn:
            return self._rollup(conn, older_than)

    # -- reads (sync; callers run them in a thread) -----------------------------------------------

    def _session(self) -> Session:
        if self._reader is None:
            raise StoreError("store: read before open()")
        return Session(self._reader)

    def load_leases(self) -> list[LeaseRow]:
        """The stored lease table, at start-up (detached rows)."""
        return self.leases()

    def leases(self) -> list[LeaseRow]:
        with self._session() as session:
            rows = list(session.scalars(select(LeaseRow)))
        # sorted here: PostgreSQL's collation need not order text the way SQLite's binary one does
        return sorted(rows, key=lambda r: (r.route, r.fp, r.model))

    def install_secret(self, candidate: str) -> str:
        """The fingerprint secret stored in the database: `candidate` is stored when none is yet
        (two instances starting at once both read the one that was stored first)."""
        if self._writer is None:
            raise StoreError("store: install_secret() before open()")
        with self._writer.begin() as conn:
            conn.execute(_insert(conn, SECRET).values(id=1, key=candidate).on_conflict_do_nothing())
        with self._writer.connect() as conn:
            return str(conn.execute(select(SECRET.c.key).where(SECRET.c.id == 1)).scalar_one())

    def drained_hosts(self) -> set[str]:
        """The hosts drained through any instance sharing the database."""
        with self._session() as session:
            return {str(host) for host in session.execute(select(DRAINS.c.host)).scalars()}

    def lease_events(self, limit: int = 100) -> list[LeaseEventRow]:
        """The newest `limit` lease events, newest first."""
        with self._session() as session:
            stmt = select(LeaseEventRow).order_by(EVENTS.c.ts.desc(), EVENTS.c.id.desc()).limit(limit)
            return list(session.scalars(stmt))

    def requests_since(self, since: float) -> list[RequestRow]:
        with self._session() as session:
            stmt = select(RequestRow).where(REQUESTS.c.started >= since).order_by(REQUESTS.c.id)
            return list(session.scalars(stmt))

    def usage(self, since: float, by: str) -> list[dict[str, Any]]:
        """Per-key sums (by route, model, host or decision) of requests since `since`.

        Rolled-up days are included whole from the day `since` falls on (UTC): once rows are rolled
        up, the day is the smallest unit. A NULL host or decision is the key "".
        """
        if by not in USAGE_KEYS:
            raise ValueError(f"usage: by must be one of {', '.join(USAGE_KEYS)}, not {by!r}")
        with self._session() as session:
            rows = session.execute(_usage(by, since)).all()
        # PostgreSQL sums bigints as numeric: every backend answers plain ints, in binary key order
        return sorted(({"key": key, **{c: int(v) for c, v in zip(_USAGE_SUMS, sums, strict=True)}}
                       for key, *sums in rows), key=lambda r: r["key"])

    def host_uptime(self, since: float) -> dict[str, float]:
        """Share of healthy poller observations per host since `since`."""
        h = HEALTH
        stmt = (
            select(h.c.host, func.avg(h.c.healthy.cast(Integer)))
            .where(h.c.ts >= since)
            .group_by(h.c.host)
        )
        with self._session() as session:
            return {host: float(share) for host, share in sorted(session.execute(stmt))}
