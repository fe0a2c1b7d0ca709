"""JSON from clients and hosts, read by orjson where it can and by the standard library where it
cannot.

Every completion's body is parsed on the event loop before it can be placed (and every small
answer for its usage): that parse is most of what crossbar adds to a large request's time to
first byte. orjson reads the bytes as they arrived (no decoded copy of the whole body first)
about twice as fast as `json`. Where it refuses a text that `json` reads (a lone surrogate
escape, an integer too large for a double, nesting deeper than 1024 levels), the text goes to
the standard library, so what crossbar accepts and refuses, and every error message, stay as
they were. What differs is only in the prompt size estimate, by a few bytes: an integer beyond
64 bits reads as a float (so such a token id counts no bytes), and a tool definition's numbers
are counted as orjson writes them (`2.5e-05` as `0.000025`).
"""

from __future__ import annotations

from typing import Any, Final

import orjson


class _Unread:
    def __repr__(self) -> str:
        return "UNREAD"


UNREAD: Final = _Unread()  # `loads` could not read the text: let the standard library decide


def loads(text: bytes | bytearray | memoryview | str) -> Any:
    """The value of a JSON text, or UNREAD when orjson refuses it."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return UNREAD


def compact_len(value: Any) -> int | None:
    """UTF-8 bytes of `value` as compact JSON without ASCII escaping, or None when orjson cannot
    write it (deeper than 254 levels, an integer beyond 64 bits, a lone surrogate)."""
    try:
        return len(orjson.dumps(value))
    except orjson.JSONEncodeError:
        return None
