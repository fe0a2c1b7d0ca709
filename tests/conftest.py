"""Fixtures shared across test modules."""

pytest_plugins = ["pg"]  # pg_server, pg_url: a throwaway PostgreSQL cluster (tests/pg.py)
