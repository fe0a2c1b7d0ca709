"""A real PostgreSQL server for the tests: a throwaway cluster made by `initdb` in a temporary
directory, listening on a free loopback port, started once per test session.

Debian's `postgresql` package provides the server (`./run.sh test` installs it). Where it is not
installed the PostgreSQL tests are skipped with the reason; CROSSBAR_PG_TESTS=1 (CI) makes that a
failure instead. initdb refuses to run as root, so as root the cluster belongs to the `postgres`
user (Debian's package creates it), else to `nobody`.

tests/conftest.py registers this module as a plugin: any test may ask for `pg_server` or `pg_url`.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

REQUIRED = os.environ.get("CROSSBAR_PG_TESTS") == "1"
SUPERUSER = "crossbar"


def find_bindir() -> Path | None:
    """The directory of initdb/postgres/pg_ctl: PATH first, then Debian's versioned directories."""
    found = shutil.which("initdb")
    if found:
        bindir = Path(found).resolve().parent
        if (bindir / "postgres").exists():
            return bindir
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return versions[-1].parent if versions else None


def _owner() -> pwd.struct_passwd | None:
    """The unprivileged user the cluster runs as when the tests run as root; None otherwise."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise RuntimeError("running as root, and neither a postgres nor a nobody user exists for initdb")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PgServer:
    bindir: Path
    datadir: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def admin(self) -> psycopg.Connection:
        return psycopg.connect(self.url(), autocommit=True, connect_timeout=5)

    def create_database(self) -> str:
        name = f"t_{uuid.uuid4().hex[:12]}"
        with self.admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return name

    def drop_database(self, name: str) -> None:
        with self.admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def start(self) -> None:
        owner = _owner()
        kw: dict[str, object] = {}
        if owner is not None:
            kw = {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []}
        run = subprocess.run(
            [str(self.bindir / "initdb"), "-D", str(self.datadir), "-U", SUPERUSER, "--auth=trust",
             "-E", "UTF8", "--no-locale", "--no-sync"],
            capture_output=True, check=False, **kw,  # type: ignore[call-overload]
        )
        if run.returncode != 0:
            raise RuntimeError(f"initdb failed: {run.stderr.decode(errors='replace').strip()}")
        self.proc = subprocess.Popen(
            [str(self.bindir / "postgres"), "-D", str(self.datadir), "-p", str(self.port),
             "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
             "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
             "-c", "max_connections=200"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw,  # type: ignore[call-overload]
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"postgres exited with {self.proc.returncode}: {err.strip()[-500:]}")
            try:
                with self.admin():
                    return
            except psycopg.OperationalError:
                time.sleep(0.1)
        raise RuntimeError(f"postgres did not accept connections within {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # "smart" shutdown: SIGTERM; fast enough with no clients left
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def cluster_in(top: Path, bindir: Path) -> PgServer:
    """A cluster whose data directory is made in `top` (a private temporary directory), on a free
    loopback port; not started yet."""
    top.chmod(0o755)  # the cluster's owner must reach its data directory inside
    datadir = top / "data"
    datadir.mkdir(mode=0o700)
    owner = _owner()
    if owner is not None:
        os.chown(datadir, owner.pw_uid, owner.pw_gid)
    return PgServer(bindir, datadir, _free_port())


def _unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"PostgreSQL tests required (CROSSBAR_PG_TESTS=1): {reason}")
    pytest.skip(f"PostgreSQL tests skipped: {reason} (install Debian's postgresql, or run ./run.sh test)")


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    bindir = find_bindir()
    if bindir is None:
        _unavailable("no initdb on PATH or in /usr/lib/postgresql/*/bin")
    assert bindir is not None
    top = Path(tempfile.mkdtemp(prefix="crossbar-pg-"))
    server = cluster_in(top, bindir)
    try:
        server.start()
    except (RuntimeError, OSError) as exc:
        server.stop()
        shutil.rmtree(top, ignore_errors=True)
        _unavailable(str(exc))
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def pg_url(pg_server: PgServer) -> Iterator[str]:
    """A fresh, empty database on the session's server, dropped after the test."""
    name = pg_server.create_database()
    try:
        yield pg_server.url(name)
    finally:
        pg_server.drop_database(name)
