"""Review: the fingerprint secret's location for a PostgreSQL `db`.

`Listeners` calls `load_or_create(secret_path(cfg.db))` whatever `db` is. For the README's
`db = "postgresql://crossbar:secret@db.tailnet:5432/crossbar"` that is the relative path
`postgresql:/crossbar:secret@db.tailnet:5432/crossbar.secret`: directories named after the URL,
password included, created in the working directory (and printed in the start-up error when that
fails). Several instances sharing the database also each get their own random secret, so the
fingerprint leases they share never match across instances."""

from __future__ import annotations

from crossbar.secret import secret_path

URL = "postgresql://crossbar:hunter2@db.tailnet:5432/crossbar"


def test_a_postgresql_url_never_becomes_a_file_path_holding_its_password() -> None:
    path = secret_path(URL)
    assert "hunter2" not in str(path), path


def test_a_postgresql_url_does_not_make_directories_in_the_working_directory() -> None:
    path = secret_path(URL)
    assert not str(path).startswith("postgresql:"), path
