"""The install's secret: a random key that keys conversation fingerprints. Created on first start,
read on every later one, so fingerprints (and the leases stored under them) stay the same across
restarts.

With SQLite it is a file beside the database (mode 0600). With PostgreSQL it is a one-row table of
the database (`install_secret`): every instance sharing the database must fingerprint a
conversation the same way, else they would split it."""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path

from crossbar.backend import DatabaseError, parse_db

SECRET_BYTES = 32
SUFFIX = ".secret"


class SecretError(Exception):
    """The secret file cannot be read, created or understood (one line, for the start-up log)."""


def secret_path(db: str) -> Path | None:
    """`crossbar.db` → `crossbar.db.secret`, in the database's directory; None for a database URL
    (the secret then lives in the database)."""
    try:
        parsed = parse_db(db)
    except DatabaseError:
        return None
    if not parsed.path:
        return None
    path = Path(parsed.path)
    return path.with_name(path.name + SUFFIX)


def new_key() -> str:
    return secrets.token_hex(SECRET_BYTES)


def from_database(read_or_create: Callable[[str], str], label: str) -> bytes:
    """The key a database holds: `read_or_create(candidate)` stores the candidate unless a key is
    stored already and returns the stored one."""
    try:
        text = read_or_create(new_key())
    except Exception as exc:  # the driver's errors: the start-up log gets one line
        raise SecretError(f"cannot read the secret from {label}: {' '.join(str(exc).split())}") from exc
    return _parse(text, f"the install_secret row of {label}")


def load_or_create(path: Path) -> bytes:
    """The key in `path`, creating the file (mode 0600) when it does not exist yet. A file whose
    mode lets anyone else read it is tightened to 0600."""
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _create(path)
    except FileExistsError:
        pass  # another process created it first: use theirs
    except OSError as exc:
        raise SecretError(f"cannot create the secret file {path}: {exc.strerror or exc}") from exc
    try:
        return _read(path)
    except FileNotFoundError as exc:
        raise SecretError(f"the secret file {path} vanished while it was created") from exc


def _read(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            if os.fstat(f.fileno()).st_mode & 0o077:
                os.fchmod(f.fileno(), 0o600)
            text = f.read(4 * SECRET_BYTES)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise SecretError(f"cannot read the secret file {path}: {exc.strerror or exc}") from exc
    try:
        return _parse(text.decode("ascii"), str(path))
    except UnicodeDecodeError:
        return _parse("", str(path))


def _parse(text: str, where: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != SECRET_BYTES:
        raise SecretError(f"{where} is not a crossbar secret ({2 * SECRET_BYTES} hex digits); "
                          "move it away to have a new one created (fingerprints then change)")
    return key


def _create(path: Path) -> None:
    """Write a new key to a temporary file, then link it into place: a crash never leaves a
    half-written secret, and two processes starting at once end up with the same one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(new_key().encode("ascii") + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
