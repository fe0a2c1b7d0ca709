"""JSON error answers that crossbar makes itself (never forwarded upstream)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CrossbarError(Exception):
    """An error answered to the client as `{"error":{"code","type","message"}}`."""

    status: int
    type: str
    message: str
    headers: dict[str, str] = field(default_factory=dict)
    payload: dict[str, Any] | None = None  # a documented shape that replaces the default body

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> bytes:
        if self.payload is not None:
            return json.dumps(self.payload).encode()
        return json.dumps(
            {"error": {"code": self.status, "type": self.type, "message": self.message}}
        ).encode()


def bad_request(message: str) -> CrossbarError:
    return CrossbarError(400, "invalid_request_error", message)


def not_found(message: str) -> CrossbarError:
    return CrossbarError(404, "not_found_error", message)


def too_large(message: str) -> CrossbarError:
    return CrossbarError(413, "request_too_large", message)


def unavailable(message: str, retry_after: int | None = None) -> CrossbarError:
    headers = {"Retry-After": str(retry_after)} if retry_after else {}
    return CrossbarError(503, "unavailable_error", message, headers)


def no_healthy_host(woke: list[str], retry_after: int) -> CrossbarError:
    """The reference README's shape: `{"error":"no healthy host","woke":[...]}`."""
    return CrossbarError(
        503, "unavailable_error", "no healthy host", {"Retry-After": str(retry_after)},
        payload={"error": "no healthy host", "woke": woke},
    )
