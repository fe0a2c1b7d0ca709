"""The fingerprint secret's location for a PostgreSQL `db`: never a file path made of the URL (it
holds the password); the secret lives in the database, shared by every instance."""

from __future__ import annotations

from crossbar.secret import secret_path

URL = "postgresql://crossbar:hunter2@db.tailnet:5432/crossbar"


def test_a_postgresql_url_never_becomes_a_file_path_holding_its_password() -> None:
    path = secret_path(URL)
    assert "hunter2" not in str(path), path


def test_a_postgresql_url_does_not_make_directories_in_the_working_directory() -> None:
    path = secret_path(URL)
    assert not str(path).startswith("postgresql:"), path
