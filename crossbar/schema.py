"""The tables crossbar keeps (SQLModel): the lease table, lease events, the accounting log, and what
instances that share one PostgreSQL database share besides: fleet-wide slot claims, drained hosts
and the fingerprint secret.

The same tables on SQLite and PostgreSQL; their versions are Alembic revisions in
`crossbar/migrations/versions` (a change here needs a new revision there). Request bodies are never
stored: no table has a body column.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import REAL, BigInteger, Index, Integer, Table
from sqlalchemy.dialects.postgresql import DOUBLE_PRECISION
from sqlmodel import Field, SQLModel

# Unix time in seconds: REAL on SQLite (as it always was), double precision on PostgreSQL (its REAL
# is single precision, two minutes of resolution at today's epoch).
EPOCH = REAL().with_variant(DOUBLE_PRECISION(), "postgresql")
# Counters and sums: 64 bits on PostgreSQL; SQLite's INTEGER is 64 bits already (and an INTEGER
# PRIMARY KEY must stay spelled that way to be the rowid).
BIGINT = BigInteger().with_variant(Integer(), "sqlite")


class LeaseRow(SQLModel, table=True):
    """One lease; a route pin is a row with fp = "" and model = "" and state = "pinned"."""

    __tablename__ = "leases"

    route: str = Field(primary_key=True)
    fp: str = Field(primary_key=True)
    model: str = Field(primary_key=True)
    host: str
    state: str  # "active" | "pinned"
    created: float = Field(sa_type=EPOCH)
    last_used: float = Field(sa_type=EPOCH)


class LeaseEventRow(SQLModel, table=True):
    """Why a session moved (new|unhealthy|idle|pin|release|drain|retried...)."""

    __tablename__ = "lease_events"
    __table_args__ = ({"sqlite_autoincrement": True},)

    id: int | None = Field(default=None, primary_key=True, sa_type=BIGINT)
    ts: float = Field(sa_type=EPOCH, index=True)
    route: str
    fp: str
    model: str
    from_host: str | None = None
    to_host: str | None = None
    reason: str


class RequestRow(SQLModel, table=True):
    """One proxied request. Absent token figures are NULL, never 0."""

    __tablename__ = "requests"
    __table_args__ = (
        Index("ix_requests_route_started", "route", "started"),
        Index("ix_requests_host_started", "host", "started"),
        {"sqlite_autoincrement": True},
    )

    id: int | None = Field(default=None, primary_key=True, sa_type=BIGINT)
    route: str
    fp: str
    model: str
    host: str | None = None
    started: float = Field(sa_type=EPOCH, index=True)
    queued_ms: int
    ttfb_ms: int | None = None
    total_ms: int
    status: int | None = None
    streamed: bool
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    err: str | None = None
    decision: str | None = None  # reused|new|inherited|pinned|moved:unhealthy|moved:idle|retried


class HostHealthRow(SQLModel, table=True):
    """One poller observation of a host."""

    __tablename__ = "host_health"

    id: int | None = Field(default=None, primary_key=True, sa_type=BIGINT)
    ts: float = Field(sa_type=EPOCH, index=True)
    host: str
    healthy: bool
    loaded_models: str  # JSON list


class RequestDailyRow(SQLModel, table=True):
    """Per-day rollup of `requests` (host and decision "" when NULL), filled by `Store.rollup`."""

    __tablename__ = "requests_daily"

    day: str = Field(primary_key=True)  # YYYY-MM-DD, UTC
    route: str = Field(primary_key=True)
    model: str = Field(primary_key=True)
    host: str = Field(primary_key=True)
    decision: str = Field(default="", primary_key=True)
    requests: int = Field(default=0, sa_type=BIGINT)
    errors: int = Field(default=0, sa_type=BIGINT)
    busy_ms: int = Field(default=0, sa_type=BIGINT)
    queued_ms: int = Field(default=0, sa_type=BIGINT)
    prompt_tokens: int = Field(default=0, sa_type=BIGINT)
    cached_tokens: int = Field(default=0, sa_type=BIGINT)
    completion_tokens: int = Field(default=0, sa_type=BIGINT)


class FleetSlotRow(SQLModel, table=True):
    """A request running on `host` for `model`, claimed by one crossbar instance; the claim lapses at
    `expires` (database clock) unless its instance renews it."""

    __tablename__ = "fleet_slots"
    __table_args__ = (Index("ix_fleet_slots_host_model", "host", "model"),)

    token: str = Field(primary_key=True)
    host: str
    model: str
    instance: str
    expires: float = Field(sa_type=EPOCH)


class HostDrainRow(SQLModel, table=True):
    """A host an operator drained: it takes no new conversations, on every instance."""

    __tablename__ = "host_drains"

    host: str = Field(primary_key=True)
    since: float = Field(sa_type=EPOCH)


class InstallSecretRow(SQLModel, table=True):
    """The one key that keys fingerprints on a PostgreSQL database: every instance reads the same."""

    __tablename__ = "install_secret"

    id: int = Field(default=1, primary_key=True)
    key: str  # hex


def _table(model: type[SQLModel]) -> Table:
    return cast(Table, model.__table__)  # type: ignore[attr-defined]


LEASES = _table(LeaseRow)
EVENTS = _table(LeaseEventRow)
REQUESTS = _table(RequestRow)
HEALTH = _table(HostHealthRow)
DAILY = _table(RequestDailyRow)
SLOTS = _table(FleetSlotRow)
DRAINS = _table(HostDrainRow)
SECRET = _table(InstallSecretRow)
TABLES = [LEASES, EVENTS, REQUESTS, HEALTH, DAILY, SLOTS, DRAINS, SECRET]

# The values of a `requests` row in the order of its columns (the id aside): a row travels from the
# proxy to the writer thread as a tuple in this order.
REQUEST_COLUMNS = tuple(c.name for c in REQUESTS.columns if c.name != "id")
RequestValues = tuple[Any, ...]

SUMMED = ("busy_ms", "queued_ms", "prompt_tokens", "cached_tokens", "completion_tokens")
