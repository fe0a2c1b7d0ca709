"""One proxied request, from routing to its accounting row. Never holds a body.

The exchange owns what the request holds while it runs (a slot ticket, its place in the live set,
the hold on its conversation's lease, the first-byte deadline) and gives it all back in `end()`,
which runs exactly once whatever happened (answer, error, client gone, a hook that raised).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from crossbar.config import RouteConf
from crossbar.deadlines import Deadlines
from crossbar.decisions import Decision
from crossbar.lease import Key
from crossbar.limiter import Ticket
from crossbar.schema import RequestValues
from crossbar.tap import SSETap, Usage

log = logging.getLogger("crossbar")
_NO_USAGE = Usage()  # the figures of a request whose reply reported none (only ever read)


@dataclass(eq=False, slots=True)
class Exchange:
    route: RouteConf
    key: Key
    path: str  # upstream path without query
    completion: bool  # a POST that takes a slot and writes an accounting row
    # the conversation's model, `key.model`: read by every step of the request, so kept as a field
    model: str = field(init=False, repr=False)
    stream: bool = False
    prompt_bytes: int = 0
    ctx_moved: str = ""  # "moved:<from>><to>" when the context guard moved it (X-Crossbar-Ctx)
    started: float = field(default_factory=time.time)  # wall clock, for the row
    t0: float = field(default_factory=time.monotonic)
    host: str = ""
    decision: Decision | None = None
    ticket: Ticket | None = None
    queued_ms: int = 0
    ttfb_ms: int | None = None  # when the client got (or would get) its first byte
    total_ms: int | None = None  # fixed when it finished (its row may be made a little later)
    tap: SSETap | None = None
    usage: Usage | None = None
    status: int | None = None
    err: str | None = None
    retry_pending: bool = False  # a 5xx arrived before anything reached the client
    retried: bool = False
    excluded: set[str] = field(default_factory=set)  # hosts that failed this request
    checked: tuple[str, int] | None = None  # upstream address the pre-flight just found open
    forwarded: bool = False  # rewritten to a host (else mitmproxy's errors are not the host's)
    sent_to: tuple[str, str] | None = None  # (host, slot key) it runs on upstream, while it runs
    yielded: bool = False  # left a queue to yield elsewhere (a turn yields at most once)
    finished: bool = False
    deadline: tuple[Deadlines, int] | None = None  # first-byte timeout: where it is armed
    _release_ticket: Callable[[Ticket], None] | None = field(default=None, repr=False)
    _cleanups: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.model = self.key.model

    # ---- resources ----------------------------------------------------------------------------

    def on_end(self, cleanup: Callable[[], None]) -> None:
        """Run `cleanup` when the exchange ends (last registered, first run)."""
        self._cleanups.append(cleanup)

    def hold_slot(self, ticket: Ticket, release: Callable[[Ticket], None]) -> None:
        if self.ticket is not None:  # a slot still held is given back first
            self.drop_slot()
        self.ticket, self._release_ticket = ticket, release

    def drop_slot(self) -> None:
        ticket, release = self.ticket, self._release_ticket
        self.ticket = self._release_ticket = None
        if ticket is not None and release is not None:
            release(ticket)

    def arm_deadline(self, deadlines: Deadlines, delay: float, overdue: Callable[[str], None]) -> None:
        """Call `overdue(host)` unless a first byte arrives within `delay`; re-arming replaces it,
        so the timer always names the host the request was last sent to."""
        self.cancel_deadline()
        self.deadline = deadlines, deadlines.arm(self, delay, partial(overdue, self.host))

    def cancel_deadline(self) -> None:
        if self.deadline is not None:
            deadlines, due = self.deadline
            self.deadline = None
            deadlines.cancel(self, due)

    def end(self) -> bool:
        """Give back everything the request holds; True the first time, False after."""
        if self.finished:
            return False
        self.finished = True
        self.tap = None  # its usage was read; the row may be made a little later, without its buffer
        if self.deadline is not None:  # usually cancelled already, by the first byte
            self.cancel_deadline()
        steps = [self.drop_slot, *reversed(self._cleanups)]
        self._cleanups.clear()
        for step in steps:
            try:
                step()
            except Exception:  # one failing step must not keep the others from running
                log.exception("crossbar: releasing a request's resources failed")
        return True

    # ---- timing and the row -------------------------------------------------------------------

    def elapsed_ms(self) -> int:
        return int((time.monotonic() - self.t0) * 1000)

    def mark_first_byte(self) -> None:
        if self.ttfb_ms is None:
            self.ttfb_ms = self.elapsed_ms()

    def row(self) -> RequestValues:
        """The `requests` row, its values in REQUEST_COLUMNS order. Absent token figures stay None
        (NULL), never 0."""
        key, u, decision = self.key, self.usage or _NO_USAGE, self.decision
        total_ms = self.elapsed_ms() if self.total_ms is None else self.total_ms
        return (key.route, key.fp, key.model, self.host or None, self.started, self.queued_ms, self.ttfb_ms,
                total_ms, self.status, self.stream, u.prompt_tokens, u.cached_tokens,
                u.completion_tokens, self.err, str(decision) if decision else None)
