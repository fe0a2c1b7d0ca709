"""fleet_slots: requests running on a host for a model, claimed by the instances sharing a database.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import DOUBLE_PRECISION

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

EPOCH = sa.REAL().with_variant(DOUBLE_PRECISION(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "fleet_slots",
        sa.Column("token", sa.String(), primary_key=True, nullable=False),
        sa.Column("host", sa.String(), nullable=False),
        sa.Column("model", sa.String(), nullable=False),
        sa.Column("instance", sa.String(), nullable=False),
        sa.Column("expires", EPOCH, nullable=False),
    )
    op.create_index("ix_fleet_slots_host_model", "fleet_slots", ["host", "model"])

