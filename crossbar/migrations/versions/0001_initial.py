"""The schema as crossbar first wrote it (requests_daily keyed without the lease decision).

A database created before crossbar used Alembic has no version table and runs this revision too:
the tables it already has are kept as they are, only missing ones are created.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import DOUBLE_PRECISION

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

EPOCH = sa.REAL().with_variant(DOUBLE_PRECISION(), "postgresql")
BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
SUMS = ("requests", "errors", "busy_ms", "queued_ms", "prompt_tokens", "cached_tokens", "completion_tokens")


def _id() -> sa.Column:
    return sa.Column("id", BIGINT, primary_key=True, nullable=False)


def upgrade() -> None:
    existing = set(sa.inspect(op.get_bind()).get_table_names())
    for create in (_leases, _lease_events, _requests, _host_health, _requests_daily):
        if create.__name__.lstrip("_") not in existing:
            create()


def _leases() -> None:
    op.create_table(
        "leases",
        sa.Column("route", sa.String(), primary_key=True, nullable=False),
        sa.Column("fp", sa.String(), primary_key=True, nullable=False),
        sa.Column("model", sa.String(), primary_key=True, nullable=False),
        sa.Column("host", sa.String(), nullable=False),
        sa.Column("state", sa.String(), nullable=False),
        sa.Column("created", EPOCH, nullable=False),
        sa.Column("last_used", EPOCH, nullable=False),
    )


def _lease_events() -> None:
    op.create_table(
        "lease_events",
        _id(),
        sa.Column("ts", EPOCH, nullable=False),
        sa.Column("route", sa.String(), nullable=False),
        sa.Column("fp", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("from_host", sa.String(), nullable=True),
        sa.Column("to_host", sa.String(), nullable=True),
        sa.Column("reason", sa.String(), nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_lease_events_ts", "lease_events", ["ts"])


def _requests() -> None:
    op.create_table(
        "requests",
        _id(),
        sa.Column("route", sa.String(), nullable=False),
        sa.Column("fp", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("host", sa.String(), nullable=True),
        sa.Column("started", EPOCH, nullable=False),
        sa.Column("queued_ms", sa.Integer(), nullable=False),
        sa.Column("ttfb_ms", sa.Integer(), nullable=True),
        sa.Column("total_ms", sa.Integer(), nullable=False),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.Column("streamed", sa.Boolean(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("cached_tokens", sa.Integer(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("err", sa.String(), nullable=True),
        sa.Column("decision", sa.String(), nullable=True),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_requests_started", "requests", ["started"])
    op.create_index("ix_requests_route_started", "requests", ["route", "started"])
    op.create_index("ix_requests_host_started", "requests", ["host", "started"])


def _host_health() -> None:
    op.create_table(
        "host_health",
        _id(),
        sa.Column("ts", EPOCH, nullable=False),
        sa.Column("host", sa.String(), nullable=False),
        sa.Column("healthy", sa.Boolean(), nullable=False),
        sa.Column("loaded_models", sa.String(), nullable=False),
    )
    op.create_index("ix_host_health_ts", "host_health", ["ts"])


def _requests_daily() -> None:
    op.create_table(
        "requests_daily",
        sa.Column("day", sa.String(), nullable=False),
        sa.Column("route", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("host", sa.String(), nullable=False),
        *[sa.Column(name, BIGINT, nullable=False) for name in SUMS],
        sa.PrimaryKeyConstraint("day", "route", "model", "host", name="requests_daily_pkey"),
    )

