"""Alembic's environment for crossbar: migrations run on the connection `crossbar.backend.migrate`
hands over (there is no alembic.ini; the store upgrades its database when it opens it). Revisions
only go forward: an older crossbar does not open a newer database."""

from alembic import context

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=None,
    version_table=context.config.get_main_option("version_table") or "crossbar_version",
    transaction_per_migration=True,
)
with context.begin_transaction():
    context.run_migrations()
