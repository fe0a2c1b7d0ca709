"""A large text joined from its pieces without holding the interpreter lock for the copy.

`"".join(pieces)` is one C call: it allocates the result and copies every piece into it while it
holds the interpreter lock. For a decoded body of 32 MiB that took 15-25 ms here (most of it the
page faults of the fresh memory the copy writes into), and more when faults are slow; a worker
thread doing it kept the event loop, and every stream on it, waiting that long. One character
outside ASCII makes the result two or four bytes a character: 30 and 55 ms for the same body.
`join` allocates the result as `str.join` does (the C API's `PyUnicode_New`, of the kind the
widest piece has, which keeps the string canonical) and copies the pieces into it with
`ctypes.memmove`, a foreign call, which lets go of the lock while it copies. A piece narrower than
the result is first widened by the codec whose bytes are the result's layout (UTF-16 or UTF-32 in
this machine's byte order), a slice at a time, each a short call that holds the lock.

Freeing such a string holds the lock too, while the system takes its pages back (a 128 MiB one:
13 ms). `discard` hands the pages back first, with the lock let go (`madvise`), when the string
has no other reference than the one it is handed; the freeing that follows is then short.

`join` writes into a string no one else can see yet, which is how the interpreter's own C code
builds one. Where a string's characters start and how it tells its kind are checked at import by
reading known strings of every kind (nothing is written unless every check passes). On another
interpreter, or where a check fails, `join` is `"".join` and `discard` does nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
from collections.abc import Callable, Iterable
from typing import NamedTuple

FROM_CHARS = 1 << 20  # smaller results are joined by `"".join`: its hold of the lock is short
WIDEN_CHARS = 1 << 18  # a narrower piece is widened this many characters per call (~0.3 ms)

_ORDER = "le" if sys.byteorder == "little" else "be"
# per kind (bytes a character): the largest character of a canonical string of that kind, and the
# codec that writes characters as that kind lays them out ("surrogatepass": a lone surrogate, which
# a JSON escape can make, is one code unit like any other)
_MAXCHAR = {1: 0xFF, 2: 0xFFFF, 4: 0x10FFFF}
_CODEC = {1: "latin-1", 2: f"utf-16-{_ORDER}", 4: f"utf-32-{_ORDER}"}
_KIND, _COMPACT, _ASCII = 0b111 << 2, 1 << 5, 1 << 6  # bits of a string's state field


class _Layout(NamedTuple):
    ascii_data: int  # from a compact ASCII string's address to its first character
    data: int  # the same for any other compact string
    state: int  # from a string's address to its state field (kind, compact, ASCII)


def _fresh(text: str) -> str:
    """`text` made at run time: no cached UTF-8 copy, which `sys.getsizeof` would count."""
    return "".join(list(text))


def _layout() -> _Layout | None:
    """Where this interpreter keeps a compact string's characters and its state, when it lays
    strings out as CPython does, checked on a known string of every kind; None otherwise."""
    if sys.implementation.name != "cpython" or not getattr(sys, "_is_gil_enabled", lambda: True)():
        return None  # (without the lock there is nothing to let go, and reference counts are approximate)
    probes = {0: _fresh("crossbar: ASCII"), 1: _fresh("crossbar: \xe9"), 2: _fresh("crossbar: \u20ac"),
              4: _fresh("crossbar: \U0001f600")}
    layout = _Layout(ascii_data=sys.getsizeof(probes[0]) - len(probes[0]) - 1,
                     data=sys.getsizeof(probes[1]) - len(probes[1]) - 1,
                     state=4 * ctypes.sizeof(ctypes.c_ssize_t))  # refcount, type, length, hash
    try:
        for kind, probe in probes.items():
            width, start = (1, layout.ascii_data) if kind == 0 else (kind, layout.data)
            stored = ctypes.string_at(id(probe) + start, (len(probe) + 1) * width)
            if stored != probe.encode(_CODEC[width]) + b"\0" * width:
                return None
            expected_state = width << 2 | _COMPACT | (_ASCII if kind == 0 else 0)
            if _state(probe, layout) & (_KIND | _COMPACT | _ASCII) != expected_state:
                return None
    except (OSError, ValueError):
        return None
    return layout


def _state(text: str, layout: _Layout) -> int:
    return ctypes.c_uint32.from_address(id(text) + layout.state).value


def _allocator() -> Callable[[int, int], str] | None:
    """`PyUnicode_New` through a prototype of its own: `ctypes.pythonapi.PyUnicode_New` is shared
    by the whole process, and whoever set its result type last would decide what `join` gets."""
    prototype = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_ssize_t, ctypes.c_uint32)
    try:
        return prototype(("PyUnicode_New", ctypes.pythonapi))  # type: ignore[no-any-return]
    except AttributeError:
        return None


def _page_release() -> Callable[[int, int, int], int] | None:
    """Linux's `madvise`, called with the interpreter lock let go (None elsewhere)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return madvise  # type: ignore[no-any-return]


_LAYOUT = _layout()
_NEW = _allocator() if _LAYOUT is not None else None
_MADVISE = _page_release() if _LAYOUT is not None else None
_DONTNEED = 4  # MADV_DONTNEED: the pages go back to the system; read again, they are zeros


def join(pieces: Iterable[str]) -> str:
    """`"".join(pieces)`; a large result is copied with the interpreter lock let go. The pieces
    are taken once, into a tuple that holds them: what is copied is what was counted, whatever
    happens to a list they came in while the lock is let go."""
    taken = tuple(pieces)
    if _NEW is None or _LAYOUT is None or not all(type(p) is str for p in taken):
        return "".join(taken)
    size = sum(map(len, taken))
    if size < FROM_CHARS:
        return "".join(taken)
    states = [_state(piece, _LAYOUT) for piece in taken]
    if not all(state & _COMPACT for state in states):
        return "".join(taken)
    kinds = [(state & _KIND) >> 2 for state in states]
    kind = max(kinds)
    ascii_only = all(state & _ASCII for state in states)
    out = _NEW(size, 127 if ascii_only else _MAXCHAR[kind])  # its characters not yet written
    at = id(out) + (_LAYOUT.ascii_data if ascii_only else _LAYOUT.data)
    for piece, state, piece_kind in zip(taken, states, kinds, strict=True):
        if piece_kind == kind:
            start = _LAYOUT.ascii_data if state & _ASCII else _LAYOUT.data
            ctypes.memmove(at, id(piece) + start, len(piece) * kind)
            at += len(piece) * kind
        else:
            at = _widened(piece, kind, at)
    return out


def _widened(piece: str, kind: int, at: int) -> int:
    """Copy `piece`, narrower than `kind`, to address `at` as characters of `kind`; where the
    copy ends."""
    for start in range(0, len(piece), WIDEN_CHARS):
        wide = piece[start:start + WIDEN_CHARS].encode(_CODEC[kind], "surrogatepass")
        ctypes.memmove(at, wide, len(wide))
        at += len(wide)
    return at


def discard(only: list[str]) -> None:
    """Free the large string `only` holds (a list of one, and the string's only reference: the
    caller has let go of its own), its pages handed back to the system first with the interpreter
    lock let go, so that the freeing holds the lock only briefly. `only` is emptied. A string
    referred to from anywhere else, or smaller than FROM_CHARS, is freed or kept as it would be."""
    (text,) = only
    only.clear()
    alone = object()  # counted as `text` is: a local of this frame, referred to from nowhere else
    if (_MADVISE is None or _LAYOUT is None or type(text) is not str or len(text) < FROM_CHARS
            or sys.getrefcount(text) != sys.getrefcount(alone)):
        return
    state = _state(text, _LAYOUT)
    if not state & _COMPACT:
        return
    start = id(text) + (_LAYOUT.ascii_data if state & _ASCII else _LAYOUT.data)
    end = start + len(text) * ((state & _KIND) >> 2)
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        _MADVISE(first, last - first, _DONTNEED)
