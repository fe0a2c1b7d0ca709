from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from crossbar.secret import SECRET_BYTES, SecretError, from_database, load_or_create, secret_path


def test_secret_path_is_beside_the_database(tmp_path: Path) -> None:
    assert secret_path(str(tmp_path / "d" / "crossbar.db")) == tmp_path / "d" / "crossbar.db.secret"


def test_created_0600_then_read_back(tmp_path: Path) -> None:
    path = tmp_path / "new" / "x.db.secret"
    key = load_or_create(path)
    assert len(key) == SECRET_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create(path) == key
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_a_readable_secret_is_tightened(tmp_path: Path) -> None:
    path = tmp_path / "x.secret"
    key = load_or_create(path)
    os.chmod(path, 0o644)
    assert load_or_create(path) == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("content", [b"", b"not hex\n", b"ab" * 8 + b"\n"])
def test_a_file_that_is_not_a_secret_is_an_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.secret"
    path.write_bytes(content)
    with pytest.raises(SecretError, match="not a crossbar secret"):
        load_or_create(path)


def test_a_file_in_the_way_of_the_directory_is_an_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SecretError, match="secret file"):
        load_or_create(blocker / "x.secret")



def test_a_database_url_has_no_secret_file() -> None:
    assert secret_path("postgresql://crossbar@db.example:5432/crossbar") is None


def test_a_secret_from_the_database_is_stored_once_and_read_back() -> None:
    stored: list[str] = []

    def read_or_create(candidate: str) -> str:
        if not stored:
            stored.append(candidate)
        return stored[0]

    first = from_database(read_or_create, "db")
    assert len(first) == SECRET_BYTES and from_database(read_or_create, "db") == first


def test_a_database_row_that_is_not_a_secret_is_an_error() -> None:
    with pytest.raises(SecretError, match="install_secret row of db"):
        from_database(lambda _candidate: "short", "db")
