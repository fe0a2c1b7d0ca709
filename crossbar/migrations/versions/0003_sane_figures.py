"""Figures outside a sane range become unknown: a row an older crossbar stored with a host's absurd
usage (2**62 tokens, 1e308 as a REAL) made every sum overflow and every roll-up fail.

The bounds are those of `crossbar.store` when this revision was written; they are copied here so
that the revision keeps doing what it did.

Revision ID: 0003
Revises: 0002
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

MAX_TOKENS = 100_000_000
MAX_MS = 604_800_000
# a day's sum of sane rows stays far below this; anything above it (or negative) came from absurd rows
MAX_DAILY = 2**53
DAILY_SUMS = ("requests", "errors", "busy_ms", "queued_ms", "prompt_tokens", "cached_tokens",
              "completion_tokens")


def upgrade() -> None:
    for column, top in (("prompt_tokens", MAX_TOKENS), ("cached_tokens", MAX_TOKENS),
                        ("completion_tokens", MAX_TOKENS), ("ttfb_ms", MAX_MS)):
        op.execute(f"UPDATE requests SET {column} = NULL WHERE {column} < 0 OR {column} > {top}")
    op.execute("UPDATE requests SET status = NULL WHERE status < 100 OR status > 599")
    op.execute("UPDATE requests SET cached_tokens = NULL WHERE cached_tokens > prompt_tokens")
    for column in ("queued_ms", "total_ms"):
        op.execute(f"UPDATE requests SET {column} = 0 WHERE {column} < 0 OR {column} > {MAX_MS}")
    for column in DAILY_SUMS:
        op.execute(f"UPDATE requests_daily SET {column} = 0 WHERE {column} < 0 OR {column} > {MAX_DAILY}")

