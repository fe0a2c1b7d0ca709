"""host_drains and install_secret: drained hosts and the fingerprint secret, shared by every
instance on one database.

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import DOUBLE_PRECISION

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

EPOCH = sa.REAL().with_variant(DOUBLE_PRECISION(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "host_drains",
        sa.Column("host", sa.String(), primary_key=True, nullable=False),
        sa.Column("since", EPOCH, nullable=False),
    )
    op.create_table(
        "install_secret",
        sa.Column("id", sa.Integer(), primary_key=True, nullable=False),
        sa.Column("key", sa.String(), nullable=False),
    )
