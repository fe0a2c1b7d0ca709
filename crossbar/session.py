"""The conversation key of a request: the session the client names in a header, else the body
fingerprint (pure, no I/O).

OpenCode sends its session id in `x-session-affinity` and `x-session-id` on every request of a
session: the title request (its own system prompt, so its own fingerprint) and a turn after a
compaction (which rewrites the first user message, so a new fingerprint) included. Keying the
lease on that id keeps all of them on the session's host.

The lease key's `fp` says which kind of key placed a request, without a column of its own:
  "s:" + 64 hex   a session: SHA-256 of the id (the id itself is never stored or logged)
  64 hex          a body fingerprint (`crossbar.request.fingerprint`)
  ""              the route's own lease (`affinity = "route"`, or a body without a user message)
The prefix keeps the two kinds from ever colliding.

A session header that is present but not a valid id (too long, characters outside `SESSION_ID`,
sent twice with different values) is a 400: falling back to the fingerprint would hide a broken
client behind placements that silently stop being sticky, and the message names the route setting
that turns sessions off.
"""

from __future__ import annotations

import hashlib
import re
from enum import StrEnum
from functools import lru_cache

from mitmproxy import http

from crossbar import headers
from crossbar.config import RouteConf
from crossbar.decisions import Rejection
from crossbar.errors import CrossbarError, bad_request

SESSION_PREFIX = "s:"
MAX_SESSION_ID = 128
ID_CHARS = "letters, digits and . _ : @ + = / ~ -"
SESSION_ID = re.compile(r"[A-Za-z0-9._:@+=/~-]+")
_HASH_DOMAIN = b"crossbar-session-1:"


class KeyKind(StrEnum):
    SESSION = "session"
    FINGERPRINT = "fingerprint"
    ROUTE = "route"


def key_kind(fp: str) -> KeyKind:
    """Which kind of conversation key a lease key's `fp` is."""
    if fp.startswith(SESSION_PREFIX):
        return KeyKind.SESSION
    return KeyKind.FINGERPRINT if fp else KeyKind.ROUTE


def session_fp(session_id: str) -> str:
    """The lease key `fp` of a session: a prefixed hash, so the raw id is never stored."""
    return SESSION_PREFIX + hashlib.sha256(_HASH_DOMAIN + session_id.encode("ascii")).hexdigest()


def _invalid(header: str, problem: str) -> CrossbarError:
    return bad_request(
        f"session header {header}: {problem}; fix the client, or set the route's session_headers "
        "to [] to key its conversations by their first messages instead",
        Rejection.SESSION_ID,
    )


@lru_cache(maxsize=64)
def _field_names(names: tuple[str, ...]) -> frozenset[bytes]:
    """Header names as they are matched against a request's raw fields: lower-case bytes."""
    return frozenset(name.lower().encode() for name in names)


def session_id(request_headers: http.Headers, names: tuple[str, ...]) -> str | None:
    """The id in the first of `names` (matched case-insensitively) the request carries with a
    non-empty value, or None.

    Raises a 400 `CrossbarError` when that value is not a valid id. Its text is never echoed.
    """
    if not headers.has_any(request_headers, _field_names(names)):  # the usual request names none
        return None
    for name in names:
        sent = [v.strip() for v in headers.values(request_headers, name.lower().encode())]
        sent = [v for v in sent if v]
        if not sent:
            continue
        if len(set(sent)) > 1:
            raise _invalid(name, f"sent {len(sent)} times with different values")
        value = sent[0]
        if len(value) > MAX_SESSION_ID:
            raise _invalid(name, f"{len(value)} characters, at most {MAX_SESSION_ID} allowed")
        if not SESSION_ID.fullmatch(value):
            raise _invalid(name, f"only {ID_CHARS} are allowed")
        return value
    return None


def conversation_fp(route: RouteConf, request_headers: http.Headers, body_fp: str) -> str:
    """The lease key `fp` of a completion: "" on a route-affinity route, else the named session,
    else the body fingerprint."""
    if route.affinity != "conversation":
        return ""
    sid = session_id(request_headers, route.session_headers)
    return body_fp if sid is None else session_fp(sid)
