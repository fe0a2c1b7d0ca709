"""What several crossbar instances share through one database: the lease table, a change feed, and
fleet-wide request slots.

Instances pointed at the same PostgreSQL URL need nothing else configured: each makes up a random
instance id when it starts.

- Leases: `find_lease` reads the shared row of a conversation this instance does not hold;
  `claim_lease` places a new one with an upsert, so two instances placing the same new key at once
  both get the one host that won; `move_lease` moves one off a failed host only while the database
  still names that host (or holds an older write), so two instances moving it at once both get
  the one move that won.
- Change feed: changes an instance makes (pins, releases, drains, lease moves) are published with
  `Store.publish`, in the same transaction as the write they describe, and delivered to every other
  instance's `subscribe` callbacks (PostgreSQL LISTEN/NOTIFY; nothing to deliver on SQLite, where
  there is one instance). After the feed reconnects, subscribers get a `resync` change: whatever
  they missed must be read back from the tables.
- Fleet slots: `acquire_slot` grants one of `parallel` slots of a (host, model) across all
  instances, or nothing. A grant is a `fleet_slots` row with an expiry (database clock); the
  instance renews the rows it holds (`heartbeat`) while their requests run and deletes them at the
  end (`release_slot`). Grants on one (host, model) are serialised by a transaction-scoped advisory
  lock (`pg_advisory_xact_lock`; SQLite's write lock). An instance that dies holding slots holds
  them until they expire, at most `SLOT_TTL`.

Every call that a request would wait on is a coroutine that runs the database work on a small
thread pool of its own, bounded by `timeout`. When the database fails or is slow, the call raises
`SharedUnavailable` (counted in `errors`), and for `cooldown` seconds afterwards every call fails
at once without touching the database: the caller carries on from what it holds in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import psycopg
from sqlalchemy import (
    Engine,
    Float,
    bindparam,
    case,
    create_engine,
    delete,
    func,
    insert,
    literal,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from crossbar import backend
from crossbar.backend import Database
from crossbar.schema import LEASES, SLOTS, LeaseRow
from crossbar.writebehind import one_line

log = logging.getLogger("crossbar.shared")

CHANNEL = "crossbar_changes"
CHANGE_KINDS = ("pin", "release", "drain", "undrain", "lease", "unlease", "slot", "resync")
MAX_PAYLOAD = 7900  # PostgreSQL refuses a NOTIFY payload of 8000 bytes or more
TIMEOUT = 0.5  # seconds a request may wait on the shared database per call
COOLDOWN = 1.0  # seconds every call fails fast after a failure
SLOT_TTL = 15.0  # a slot not renewed for this long is free again
SLOT_RETRY = 0.25  # a waiting acquire asks again at least this often (sooner when the feed says)
PG_SHARED_TIMEOUT_MS = 1000
THREADS = 4

T = TypeVar("T")


class SharedUnavailable(Exception):
    """The shared database did not answer (in time); decide from memory."""


@dataclass(frozen=True, slots=True)
class Change:
    """One change an instance made, as the other instances receive it."""

    kind: str  # one of CHANGE_KINDS
    route: str = ""
    fp: str = ""
    model: str = ""
    host: str = ""
    instance: str = ""  # the instance that made it

    def payload(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def parse(cls, payload: str) -> Change | None:
        try:
            data = json.loads(payload)
            change = cls(**{k: str(data.get(k, "")) for k in cls.__slots__})  # type: ignore[attr-defined]
        except (ValueError, TypeError, AttributeError):
            return None
        return change if change.kind in CHANGE_KINDS else None


class _db_now(FunctionElement[float]):
    """The database server's clock in Unix seconds: every instance's expiries read one clock."""

    type = Float()
    inherit_cache = True


@compiles(_db_now, "postgresql")
def _db_now_postgresql(_element: _db_now, _compiler: Any, **_kw: Any) -> str:
    return "extract(epoch from clock_timestamp())::double precision"


@compiles(_db_now, "sqlite")
def _db_now_sqlite(_element: _db_now, _compiler: Any, **_kw: Any) -> str:
    return "((julianday('now') - 2440587.5) * 86400.0)"


# the payload is a Change of kind "slot", as Change.parse reads it
_RELEASE_AND_NOTIFY = text(
    "WITH gone AS (DELETE FROM fleet_slots WHERE token = ANY(CAST(:tokens AS text[])) RETURNING host, model) "
    "SELECT pg_notify(:channel, json_build_object('kind', 'slot', 'host', host, 'model', model, "
    "'instance', CAST(:instance AS text))::text) FROM (SELECT DISTINCT host, model FROM gone) AS freed"
)


def _slot_lock_key(host: str, model: str) -> str:
    return json.dumps([host, model])


class SharedState:
    """The shared-database side of one instance; see the module docstring."""

    def __init__(
        self,
        db: Database,
        *,
        timeout: float = TIMEOUT,
        cooldown: float = COOLDOWN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.db = db
        self.instance = uuid.uuid4().hex[:16]
        self.timeout = timeout
        self.cooldown = cooldown
        self.clock = clock
        self.errors = 0  # calls that failed or timed out
        self.refused = 0  # calls refused at once during a cooldown
        self.feed_errors = 0  # the change feed's lost connections and failed reconnects
        self.last_error = ""
        self._down_until = 0.0
        self._engine: Engine | None = None
        self._pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="crossbar-shared")
        self._held: set[str] = set()  # slot tokens this instance holds
        self._subscribers: list[tuple[Callable[[Change], None], asyncio.AbstractEventLoop | None]] = []
        self._slot_waiters: dict[str, set[asyncio.Event]] = {}
        self._waiters_lock = threading.Lock()  # the feed's thread reads what the loop changes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._feed: threading.Thread | None = None
        self._stop = threading.Event()

    # -- lifecycle ------------------------------------------------------------------------------

    def open(self) -> None:
        """Create the engine and, on PostgreSQL, start the change feed's listener thread."""
        if self._engine is not None:
            return
        if self.db.postgres:
            args = backend.pg_connect_args(PG_SHARED_TIMEOUT_MS)
            self._engine = create_engine(
                self.db.url, connect_args=args, pool_size=THREADS, max_overflow=0, pool_timeout=self.timeout
            )
            self._feed = threading.Thread(target=self._listen, name="crossbar-feed", daemon=True)
            self._feed.start()
        else:
            self._engine = backend.writer_engine(self.db)
        self.subscribe(self._wake_slot_waiters)

    def close(self) -> None:
        """Stop the feed, give back every slot this instance holds, dispose the engine."""
        self._stop.set()
        if self._feed is not None:
            self._feed.join(5)
        if self._engine is not None:
            held = list(self._held)
            self._held.clear()
            if held:
                try:
                    self._release(held)
                except Exception as exc:
                    log.warning("shared: could not give back %d slots: %s", len(held), one_line(exc))
            self._engine.dispose()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- calls bounded in time ------------------------------------------------------------------

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._engine is None:
            raise SharedUnavailable("shared state used before open()")
        if self.clock() < self._down_until:
            self.refused += 1
            raise SharedUnavailable(f"shared database unavailable: {self.last_error}")
        loop = asyncio.get_running_loop()
        self._loop = loop
        try:
            result = await asyncio.wait_for(loop.run_in_executor(self._pool, fn, *args), self.timeout)
        except TimeoutError as exc:
            self._failed(f"no answer within {self.timeout:g} s")
            raise SharedUnavailable(self.last_error) from exc
        except Exception as exc:
            self._failed(one_line(exc))
            raise SharedUnavailable(self.last_error) from exc
        if self.last_error:
            log.info("shared: %s answers again (%d failed calls so far)", self.db.label, self.errors)
            self.last_error = ""
        return result

    def _failed(self, message: str) -> None:
        first = not self.last_error  # one warning per failure burst
        self.errors += 1
        self.last_error = message
        self._down_until = self.clock() + self.cooldown
        log_at = log.warning if first else log.debug
        log_at("shared: %s (%s); serving from memory", message, self.db.label)

    def _connect(self) -> Connection:
        assert self._engine is not None
        return self._engine.connect()

    # -- leases ---------------------------------------------------------------------------------

    async def find_lease(self, route: str, fp: str, model: str) -> LeaseRow | None:
        """The shared lease of (route, fp, model), or None."""
        return await self._call(self._find_lease, route, fp, model)

    def _find_lease(self, route: str, fp: str, model: str) -> LeaseRow | None:
        stmt = select(LEASES).where(LEASES.c.route == route, LEASES.c.fp == fp, LEASES.c.model == model)
        with self._connect() as conn:
            row = conn.execute(stmt).first()
        return None if row is None else LeaseRow(**row._mapping)

    async def claim_lease(
        self, route: str, fp: str, model: str, host: str, now: float, idle_before: float = float("-inf")
    ) -> str:
        """Place (route, fp, model) on `host` unless another instance holds it: the host it is on
        afterwards. A held lease idle since before `idle_before` is taken over."""
        return await self._call(self._take_lease, route, fp, model, host, now, idle_before, None)

    async def move_lease(
        self, route: str, fp: str, model: str, from_host: str, to_host: str, now: float,
        idle_before: float = float("-inf"), older_than: float = float("-inf"),
    ) -> str:
        """Move (route, fp, model) from `from_host` to `to_host` unless another instance moved it
        first (the database names a host other than `from_host`, placed there at `older_than` or
        later): the host it is on afterwards. A lease the database does not hold yet, or one idle
        since before `idle_before`, is taken too."""
        return await self._call(self._take_lease, route, fp, model, to_host, now, idle_before,
                                (from_host, older_than))

    def _take_lease(
        self, route: str, fp: str, model: str, host: str, now: float, idle_before: float,
        move: tuple[str, float] | None,
    ) -> str:
        with self._connect() as conn:
            insert = pg_insert(LEASES) if conn.dialect.name == "postgresql" else sqlite_insert(LEASES)
            stmt = insert.values(route=route, fp=fp, model=model, host=host, state="active",
                                 created=now, last_used=now)
            params: dict[str, Any] = {"idle_before": idle_before}
            taken = LEASES.c.last_used < bindparam("idle_before")
            if move is not None:
                params["from_host"], params["older_than"] = move
                taken = or_(taken, LEASES.c.host == bindparam("from_host"),
                            LEASES.c.created < bindparam("older_than"))
            upsert = stmt.on_conflict_do_update(
                index_elements=["route", "fp", "model"],
                set_={
                    "host": case((taken, stmt.excluded.host), else_=LEASES.c.host),
                    "state": case((taken, stmt.excluded.state), else_=LEASES.c.state),
                    "created": case((taken, stmt.excluded.created), else_=LEASES.c.created),
                    "last_used": case((LEASES.c.last_used < stmt.excluded.last_used, stmt.excluded.last_used),
                                      else_=LEASES.c.last_used),
                },
            ).returning(LEASES.c.host)
            with conn.begin():
                return str(conn.execute(upsert, params).scalar_one())

    # -- fleet slots ----------------------------------------------------------------------------

    async def acquire_slot(
        self, host: str, model: str, parallel: int, *, wait: float = 0.0, ttl: float = SLOT_TTL
    ) -> str | None:
        """One of `parallel` slots of (host, model) across every instance: a token for
        `release_slot`, or None when all are taken for `wait` seconds."""
        deadline = time.monotonic() + wait
        key = _slot_lock_key(host, model)
        while True:
            freed = asyncio.Event()
            with self._waiters_lock:
                self._slot_waiters.setdefault(key, set()).add(freed)
            try:
                token = await self._call(self._acquire, host, model, parallel, ttl)
                if token is not None:
                    # only now: a grant that came after its call timed out is never renewed, so it
                    # lapses within `ttl`
                    self._held.add(token)
                    return token
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(freed.wait(), min(remaining, SLOT_RETRY))
            finally:
                with self._waiters_lock:
                    waiters = self._slot_waiters.get(key, set())
                    waiters.discard(freed)
                    if not waiters:
                        self._slot_waiters.pop(key, None)

    def _acquire(self, host: str, model: str, parallel: int, ttl: float) -> str | None:
        """Four round trips: BEGIN, the (host, model) lock, the insert of a slot when fewer than
        `parallel` unexpired ones exist, COMMIT."""
        token = uuid.uuid4().hex
        s = SLOTS
        live = (
            select(func.count())
            .select_from(s)
            .where(s.c.host == host, s.c.model == model, s.c.expires >= _db_now())
            .scalar_subquery()
        )
        row = select(literal(token), literal(host), literal(model), literal(self.instance), _db_now() + ttl)
        columns = ["token", "host", "model", "instance", "expires"]
        grant = insert(s).from_select(columns, row.where(live < parallel)).returning(s.c.token)
        with self._connect() as conn, conn.begin():
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"),
                             {"k": _slot_lock_key(host, model)})
            if conn.execute(grant).scalar_one_or_none() is None:
                return None
        return token

    async def release_slot(self, token: str) -> None:
        """Give the slot back (waiters on every instance are woken). When the database cannot be
        reached the slot stays taken until it expires."""
        self._held.discard(token)
        await self._call(self._release, [token])

    def _release(self, tokens: Sequence[str]) -> None:
        with self._connect() as conn:
            if conn.dialect.name == "postgresql":  # one statement: delete, and wake every waiter
                conn.execution_options(isolation_level="AUTOCOMMIT").execute(_RELEASE_AND_NOTIFY, {
                    "tokens": list(tokens), "channel": CHANNEL, "instance": self.instance})
            else:
                with conn.begin():
                    conn.execute(delete(SLOTS).where(SLOTS.c.token.in_(tokens)))

    async def heartbeat(self, ttl: float = SLOT_TTL) -> int:
        """Renew every slot this instance holds (call at least every ttl / 3); how many were still
        held. A slot that expired meanwhile (the database was unreachable) is not renewed."""
        held = list(self._held)
        if not held:
            return 0
        renewed = await self._call(self._renew, held, ttl)
        self._held.difference_update(set(held) - renewed)
        return len(renewed)

    def _renew(self, tokens: Sequence[str], ttl: float) -> set[str]:
        with self._connect() as conn, conn.begin():
            stmt = update(SLOTS).where(SLOTS.c.token.in_(tokens)).values(expires=_db_now() + ttl)
            renewed = conn.execute(stmt.returning(SLOTS.c.token)).scalars().all()
            conn.execute(delete(SLOTS).where(SLOTS.c.expires < _db_now()))  # anyone's lapsed slots
        return set(renewed)

    @property
    def held(self) -> int:
        return len(self._held)

    # -- the change feed ------------------------------------------------------------------------

    def subscribe(
        self, callback: Callable[[Change], None], loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        """Call `callback(change)` for every change another instance publishes: on `loop` when
        given (thread-safe), else on the feed's thread. Never called on SQLite."""
        self._subscribers.append((callback, loop))

    def _deliver(self, change: Change) -> None:
        for callback, loop in self._subscribers:
            try:
                if loop is not None:
                    loop.call_soon_threadsafe(callback, change)
                else:
                    callback(change)
            except Exception:
                log.exception("shared: a change subscriber failed")

    def _wake_slot_waiters(self, change: Change) -> None:
        """On the feed's thread: a slot was given back somewhere, or the feed restarted."""
        loop = self._loop
        if loop is None or change.kind not in ("slot", "resync"):
            return
        with self._waiters_lock:
            if change.kind == "resync":
                woken = [e for waiters in self._slot_waiters.values() for e in waiters]
            else:
                woken = list(self._slot_waiters.get(_slot_lock_key(change.host, change.model), ()))
        for freed in woken:
            loop.call_soon_threadsafe(freed.set)

    def _listen(self) -> None:
        """The feed's thread: LISTEN, deliver, reconnect with backoff until closed."""
        delay, connected_before = 0.5, False
        conninfo = self.db.url.set(drivername="postgresql").render_as_string(hide_password=False)
        while not self._stop.is_set():
            try:
                with psycopg.connect(
                    conninfo, autocommit=True, connect_timeout=backend.PG_CONNECT_TIMEOUT_S,
                    application_name="crossbar-feed",
                ) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    if connected_before:
                        log.info("shared: change feed reconnected")
                        self._deliver(Change("resync"))
                    connected_before, delay = True, 0.5
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            change = Change.parse(note.payload)
                            if change is not None and change.instance != self.instance:
                                self._deliver(change)
            except psycopg.Error as exc:
                self.feed_errors += 1
                log.warning("shared: change feed: %s; reconnecting in %.1f s", one_line(exc), delay)
                self._stop.wait(delay)
                delay = min(delay * 2, 5.0)
