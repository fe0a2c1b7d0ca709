"""A large text joined from its pieces without holding the interpreter lock for the copy.

`"".join(pieces)` is one C call: it allocates the result and copies every piece into it while it
holds the interpreter lock. For a decoded body of 32 MiB that took 15-25 ms here (most of it the
page faults of the fresh memory the copy writes into), and more when faults are slow; a worker
thread doing it kept the event loop, and every stream on it, waiting that long. `join` allocates
the result as `str.join` does (the C API's `PyUnicode_New`) and copies the pieces into it with
`ctypes.memmove`, a foreign call, which lets go of the lock while it copies.

It writes into a string no one else can see yet, which is how the interpreter's own C code builds
one. Only ASCII pieces qualify: their characters sit right after a header of fixed size, which is
checked at import by reading a known string (nothing is written unless the check passes). On
another interpreter, or where the check fails, `join` is `"".join`.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterable

FROM_CHARS = 1 << 20  # smaller results are joined by `"".join`: its hold of the lock is short

_PROBE = "crossbar: where an ASCII string's characters start"


def _ascii_header() -> int | None:
    """Bytes from a compact ASCII string's address to its first character, when this interpreter
    lays strings out that way (CPython); None otherwise."""
    if sys.implementation.name != "cpython":
        return None
    header = sys.getsizeof("") - 1  # the header and the terminating NUL of the empty string
    try:
        found = ctypes.string_at(id(_PROBE) + header, len(_PROBE) + 1)
    except (OSError, ValueError):
        return None
    return header if found == _PROBE.encode() + b"\0" else None


def _allocator() -> Callable[[int, int], str] | None:
    """`PyUnicode_New` through a prototype of its own: `ctypes.pythonapi.PyUnicode_New` is shared
    by the whole process, and whoever set its result type last would decide what `join` gets."""
    prototype = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_ssize_t, ctypes.c_uint32)
    try:
        return prototype(("PyUnicode_New", ctypes.pythonapi))  # type: ignore[no-any-return]
    except AttributeError:
        return None


_HEADER = _ascii_header()
_NEW = _allocator() if _HEADER is not None else None


def join(pieces: Iterable[str]) -> str:
    """`"".join(pieces)`; a large result of ASCII pieces is copied with the interpreter lock let go.
    The pieces are taken once, into a tuple that holds them: what is copied is what was counted,
    whatever happens to a list they came in while the lock is let go."""
    taken = tuple(pieces)
    size = sum(map(len, taken))
    if (_NEW is None or _HEADER is None or size < FROM_CHARS
            or not all(type(p) is str and p.isascii() for p in taken)):
        return "".join(taken)
    out = _NEW(size, 127)  # compact ASCII, its characters not yet written
    at = id(out) + _HEADER
    for piece in taken:
        ctypes.memmove(at, id(piece) + _HEADER, len(piece))
        at += len(piece)
    return out
