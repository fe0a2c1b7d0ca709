"""The words crossbar uses for what it decided and why, shared by lease events, accounting rows,
metrics labels and the README. One vocabulary, so a row, an event and a counter always agree."""

from __future__ import annotations

from enum import StrEnum


class Decision(StrEnum):
    """How a request got its host (the `decision` column of a `requests` row)."""

    REUSED = "reused"  # the conversation's lease, still usable
    NEW = "new"  # a new conversation, placed by `choose`
    INHERITED = "inherited"  # a new fingerprint took its route's fingerprint-less lease host
    PINNED = "pinned"  # the route is pinned
    MOVED = "moved:unhealthy"  # the lease's host was unhealthy, excluded or left the route
    IDLE = "moved:idle"  # the lease had been idle longer than `lease_idle`: placed anew
    CONTEXT = "moved:context"  # the prompt does not fit the lease's host: moved where it fits
    RETRIED = "retried"  # re-placed after its host failed it (refused, 5xx) before any byte
    YIELD = "moved:yield"  # its host was busy: waiting cost more than re-prefilling elsewhere


class Reason(StrEnum):
    """Why a lease changed (the `reason` of a `lease_events` row and of `crossbar_lease_moves`)."""

    NEW = "new"
    UNHEALTHY = "unhealthy"
    RETRIED = "retried"  # a 500 (the host stays healthy) moved the conversation
    IDLE = "idle"
    CONTEXT = "context"
    PIN = "pin"
    RELEASE = "release"
    DRAIN = "drain"  # recorded for each lease on a host being drained; nothing moves
    EVICTED = "evicted"  # the lease table was full: the oldest idle lease made room
    HOST_REMOVED = "host_removed"  # a reload took the lease's host out of the configuration
    ROUTE_CHANGED = "route_changed"  # a reload took the host out of the lease's route, or the route
    YIELD = "yield"  # a turn left its busy host where the wait outweighed re-prefilling elsewhere


# reasons that change where a conversation lives (a drain only records; nothing moves)
MOVES = frozenset(set(Reason) - {Reason.DRAIN})


class Rejection(StrEnum):
    """Why crossbar answered a request itself with an error (`crossbar_rejected_total{reason}`)."""

    BAD_REQUEST = "bad_request"  # 400: the body or a parameter is wrong
    SESSION_ID = "session_id"  # 400: a session header carries an invalid id
    MISSING_MODEL = "missing_model"  # 400: no model in the body and none by default
    UNKNOWN_MODEL = "unknown_model"  # 400: no host of the route lists or reports the model
    CONTEXT = "context"  # 400: the prompt fits no host of the route
    FORBIDDEN = "forbidden"  # 403: the caller is not admitted to the route
    NOT_FOUND = "not_found"  # 404: unknown route or path
    TOO_LARGE = "too_large"  # 413: body over max_body
    HEAD_TOO_LARGE = "head_too_large"  # 431: request head over max_head
    HEAD_TIMEOUT = "head_timeout"  # 408: request head not complete within head_timeout
    BODY_TIMEOUT = "body_timeout"  # 408: request body paused longer than body_timeout
    PEER_CONNECTIONS = "peer_connections"  # 503: more connections from one address than allowed
    UPSTREAM_HEAD_TOO_LARGE = "upstream_head_too_large"  # 502: a host's response head over max_head
    UPSTREAM_FAILED = "upstream_failed"  # 502: the host failed the request before its first byte
    UPSTREAM_TOO_LARGE = "upstream_too_large"  # 502: a retried answer over 2 x max_body + 1 MiB
    NO_HOST = "no_host"  # 503: no healthy host
    PINNED_DOWN = "pinned_down"  # 503: the route's pinned host is down
    QUEUE_FULL = "queue_full"  # 503: every slot busy and the queue full
    SHUTTING_DOWN = "shutting_down"  # 503: crossbar is stopping
    IDENTITY = "identity"  # 503: the caller's identity could not be established
    INTERNAL = "internal"  # 500: a crossbar bug
