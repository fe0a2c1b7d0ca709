"""JSON error answers that crossbar makes itself (never forwarded upstream).

Every one carries the `Rejection` it is counted under in `crossbar_rejected_total{reason}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from crossbar.decisions import Rejection

_BY_STATUS = {400: Rejection.BAD_REQUEST, 403: Rejection.FORBIDDEN, 404: Rejection.NOT_FOUND,
              413: Rejection.TOO_LARGE, 503: Rejection.NO_HOST}


@dataclass
class CrossbarError(Exception):
    """An error answered to the client as `{"error":{"code","type","message"}}`."""

    status: int
    type: str
    message: str
    headers: dict[str, str] = field(default_factory=dict)
    payload: dict[str, Any] | None = None  # a documented shape that replaces the default body
    reason: Rejection | None = None  # the metrics label; by status when not given

    def __post_init__(self) -> None:
        if self.reason is None:
            self.reason = _BY_STATUS.get(self.status, Rejection.INTERNAL)

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> bytes:
        if self.payload is not None:
            return json.dumps(self.payload).encode()
        return json.dumps(
            {"error": {"code": self.status, "type": self.type, "message": self.message}}
        ).encode()


def bad_request(message: str, reason: Rejection = Rejection.BAD_REQUEST) -> CrossbarError:
    """llama-server's own 400 shape (`invalid_request_error`)."""
    return CrossbarError(400, "invalid_request_error", message, reason=reason)


def not_found(message: str) -> CrossbarError:
    return CrossbarError(404, "not_found_error", message)


def forbidden(message: str) -> CrossbarError:
    return CrossbarError(403, "permission_error", message)


def too_large(message: str) -> CrossbarError:
    return CrossbarError(413, "request_too_large", message)


def internal(message: str) -> CrossbarError:
    return CrossbarError(500, "server_error", message, reason=Rejection.INTERNAL)


def unavailable(message: str, retry_after: int | None = None,
                reason: Rejection = Rejection.NO_HOST) -> CrossbarError:
    headers = {"Retry-After": str(retry_after)} if retry_after else {}
    return CrossbarError(503, "unavailable_error", message, headers, reason=reason)


def no_healthy_host(woke: list[str], retry_after: int) -> CrossbarError:
    """`{"error":"no healthy host","woke":[...]}`: the hosts a wake-on-LAN packet was sent to."""
    return CrossbarError(
        503, "unavailable_error", "no healthy host", {"Retry-After": str(retry_after)},
        payload={"error": "no healthy host", "woke": woke}, reason=Rejection.NO_HOST,
    )
