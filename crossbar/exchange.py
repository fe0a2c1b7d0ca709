"""One proxied request's bookkeeping, from routing to its accounting row. Never holds a body."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from crossbar.config import RouteConf
from crossbar.lease import Key
from crossbar.limiter import Ticket
from crossbar.tap import SSETap, Usage


@dataclass(eq=False)
class Exchange:
    route: RouteConf
    key: Key
    path: str  # upstream path without query
    completion: bool  # a POST that takes a slot and writes an accounting row
    stream: bool = False
    prompt_bytes: int = 0
    ctx_moved: str = ""  # "moved:<from>><to>" when the context guard moved it (X-Crossbar-Ctx)
    started: float = field(default_factory=time.time)  # wall clock, for the row
    t0: float = field(default_factory=time.monotonic)
    host: str = ""
    decision: str = ""
    ticket: Ticket | None = None
    queued_ms: int = 0
    ttfb_ms: int | None = None
    tap: SSETap | None = None
    usage: Usage | None = None
    status: int | None = None
    err: str | None = None
    retry_pending: bool = False  # a 5xx arrived before anything reached the client
    retried: bool = False
    excluded: set[str] = field(default_factory=set)  # hosts that failed this request
    checked: tuple[str, int] | None = None  # upstream address the pre-flight just found open
    forwarded: bool = False  # rewritten to a host (else mitmproxy's errors are not the host's)
    finished: bool = False
    deadline: asyncio.TimerHandle | None = None  # first-byte timeout

    def cancel_deadline(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    @property
    def model(self) -> str:
        return self.key.model

    def elapsed_ms(self) -> int:
        return int((time.monotonic() - self.t0) * 1000)

    def mark_first_byte(self) -> None:
        if self.ttfb_ms is None:
            self.ttfb_ms = self.elapsed_ms()

    def row(self) -> dict[str, Any]:
        """The `requests` row (PLAN §7a). Absent token figures stay None (NULL), never 0."""
        u = self.usage or Usage()
        return {
            "route": self.key.route,
            "fp": self.key.fp,
            "model": self.key.model,
            "host": self.host or None,
            "started": self.started,
            "queued_ms": self.queued_ms,
            "ttfb_ms": self.ttfb_ms,
            "total_ms": self.elapsed_ms(),
            "status": self.status,
            "streamed": self.stream,
            "prompt_tokens": u.prompt_tokens,
            "cached_tokens": u.cached_tokens,
            "completion_tokens": u.completion_tokens,
            "err": self.err,
            "decision": self.decision or None,
        }
