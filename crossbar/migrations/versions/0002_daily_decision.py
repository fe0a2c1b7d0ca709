"""requests_daily keeps the lease decision of its rows: `decision` joins its key ("" for old days).

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

BIGINT = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
KEY = ("day", "route", "model", "host", "decision")
SUMS = ("requests", "errors", "busy_ms", "queued_ms", "prompt_tokens", "cached_tokens", "completion_tokens")


def upgrade() -> None:
    columns = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("requests_daily")}
    if "decision" in columns:  # created by a crossbar that had it, before schema versions were kept
        return
    if op.get_bind().dialect.name == "sqlite":
        _rebuild_on_sqlite()
        return
    op.add_column("requests_daily", sa.Column("decision", sa.String(), nullable=False, server_default=""))
    op.drop_constraint("requests_daily_pkey", "requests_daily", type_="primary")
    op.create_primary_key("requests_daily_pkey", "requests_daily", list(KEY))


def _rebuild_on_sqlite() -> None:
    """SQLite cannot change a primary key in place: copy the rows into a table keyed anew."""
    op.rename_table("requests_daily", "requests_daily_old")
    op.create_table(
        "requests_daily",
        sa.Column("day", sa.String(), nullable=False),
        sa.Column("route", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("host", sa.String(), nullable=False),
        sa.Column("decision", sa.String(), nullable=False),
        *[sa.Column(name, BIGINT, nullable=False) for name in SUMS],
        sa.PrimaryKeyConstraint(*KEY),
    )
    names = ", ".join(["day", "route", "model", "host", *SUMS])
    op.execute(f"INSERT INTO requests_daily ({names}, decision) SELECT {names}, '' FROM requests_daily_old")
    op.drop_table("requests_daily_old")

