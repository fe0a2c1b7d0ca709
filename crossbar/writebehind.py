"""A write-behind queue: callers enqueue operations without ever blocking on I/O; one background
thread commits them to a database in batches.

Enqueueing is a lock-protected append. The writer thread gathers work (one commit per many
operations keeps its CPU time, and its hold on the GIL shared with the proxy's event loop, small),
then commits up to `batch` operations in one transaction through a `Sink`. An operation waits at
most `linger` seconds, or `lazy_linger` for a kind listed in `lazy`: the batch is written when its
most pressing operation is due, when it is full, or at once for someone waiting in `flush`. A
failing database never raises into callers: the writer logs one warning per failure burst, counts
every failed attempt in `errors`, keeps the batch and retries with backoff (0.1 s doubling to
5 s), asking the sink to reconnect in between. A batch the database refuses (not a transient
failure) is split into single operations so that only the refused ones are dropped (counted in
`dropped`) and everything behind them lands.

Only when more than `max_pending` operations wait are the oldest operations of a droppable kind
shed (counted in `dropped`); other kinds never are. An operation of a kind listed in `coalesce`
replaces the one of the same key (`coalesce[kind](data)`) that still waits, where the sink would
apply only the later one anyway: the operations kept of those kinds are at most two per key (one
waiting, one being written), however long the database is away. `put_last` enqueues an
operation written after everything enqueued before it; while one waits, of the later calls only
the latest waits behind it (the first keeps its place, so it is written however busy the queue
stays).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Protocol

BATCH = 2000
LINGER = 0.25
LAZY_LINGER = 1.0
BACKOFF_FIRST = 0.1
BACKOFF_MAX = 5.0


@dataclass(slots=True)
class Op:
    seq: int
    kind: str
    data: Any  # what the sink needs to apply it: a mapping of columns, or a row's values
    key: Hashable = None  # of a coalesced kind: the key a later operation replaces it by


_SEQ = attrgetter("seq")


class Sink(Protocol):
    """Where the writer thread commits its batches."""

    def commit(self, ops: list[Op]) -> None:
        """Apply `ops` in enqueue order in one transaction; raise on failure."""

    def transient(self, exc: Exception) -> bool:
        """True when `exc` says the database is unavailable (retry the same batch later), False when
        it refuses something in the batch (isolate the operation and drop it)."""

    def recover(self, exc: Exception) -> None:
        """After a transient failure: drop pooled connections, recreate what vanished; never raises."""


def one_line(exc: BaseException) -> str:
    """The first line of a database error, without SQLAlchemy's statement dump."""
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc) or type(exc).__name__
    return text.splitlines()[0]


class WriteBehind:
    """The queue and its writer thread; see the module docstring."""

    def __init__(
        self,
        sink: Sink,
        *,
        name: str,
        droppable: Collection[str],
        max_pending: int,
        log: logging.Logger,
        batch: int = BATCH,
        linger: float = LINGER,
        lazy: Collection[str] = (),
        lazy_linger: float = LAZY_LINGER,
        coalesce: Mapping[str, Callable[[Any], Hashable]] | None = None,
    ) -> None:
        self.sink = sink
        self.name = name  # where the rows go, for log lines
        self.droppable = frozenset(droppable)
        self.max_pending = max_pending
        self.log = log
        self.batch = batch
        self.linger = linger
        self.lazy = frozenset(lazy)
        self.lazy_linger = max(linger, lazy_linger)
        self.coalesce = dict(coalesce or {})
        self.errors = 0
        self.dropped = 0
        self.written = 0
        self.last_error = ""
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)  # the writer waits on this
        self._committed = threading.Condition(self._lock)  # flush() waits on this
        self._wake = threading.Event()
        self._urgent = 0  # callers blocked in flush(): write now
        self._ordered: deque[Op] = deque()  # never dropped
        self._rows: deque[Op] = deque()  # droppable: oldest shed beyond max_pending
        self._waiting: dict[Hashable, Op] = {}  # the waiting operation of each coalesced key
        # `put_last`'s operations, each written behind every one enqueued before it: the first
        # waiting one keeps its place; later calls replace the one behind it
        self._lasts: list[Op] = []
        self._seq = 0
        self._due = math.inf  # time.monotonic() by which what waits must be written
        self._inflight = 0
        self._inflight_first: int | None = None
        self._failing = False
        self._dropping = False
        self._stop = False
        self._closed = False
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, thread_name: str) -> None:
        """Start the writer thread (a daemon); idempotent."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until everything enqueued before the call is committed; False on timeout."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return self.pending == 0
        with self._lock:
            target = self._seq
            self._urgent += 1
            self._has_work.notify()
            self._wake.set()  # cut a backoff sleep short: try now
            try:
                return self._committed.wait_for(lambda: self._done_upto() >= target, timeout)
            finally:
                self._urgent -= 1

    def stop(self, timeout: float = 5.0) -> None:
        """Flush, then stop the writer thread; later operations are refused (counted as dropped)."""
        self.flush(timeout)
        with self._lock:
            self._closed = True
            self._stop = True
            self._has_work.notify_all()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending(self) -> int:
        return len(self._ordered) + len(self._rows) + self._inflight + len(self._lasts)

    def count_dropped(self, n: int = 1) -> None:
        with self._lock:
            self.dropped += n

    # -- enqueue (never blocks on I/O, never raises) ----------------------------------------------

    def put(self, kind: str, data: Any) -> None:
        key_of = self.coalesce.get(kind)
        key = key_of(data) if key_of is not None else None
        with self._lock:
            if self._closed:
                self.dropped += 1
                return
            self._seq += 1
            if key is not None and (waiting := self._waiting.get(key)) is not None:
                waiting.kind, waiting.data = kind, data  # the later state of the key, in its place
                if self._sooner(kind):
                    self._has_work.notify()
                return
            queued = len(self._ordered) + len(self._rows) + len(self._lasts)
            if queued == 0:  # nothing waits (a shed backlog may have left a due time behind)
                self._due = math.inf
            op = Op(self._seq, kind, data, key)
            (self._rows if kind in self.droppable else self._ordered).append(op)
            if key is not None:
                self._waiting[key] = op
            if queued + 1 + self._inflight > self.max_pending:  # self.pending, without the call
                self._drop_oldest()
            if self._sooner(kind) or queued + 1 >= self.batch:  # the writer only needs waking for these
                self._has_work.notify()

    def put_last(self, kind: str, data: Any) -> None:
        """Enqueue an operation that is written after every one enqueued before it (in that
        batch or a later one). While one waits, a later call's operation waits behind it, and
        replaces any that already waited there: the first keeps its place, so it gets written
        however busy the queue stays."""
        with self._lock:
            if self._closed:
                self.dropped += 1
                return
            self._seq += 1
            if not (self._ordered or self._rows or self._lasts):
                self._due = math.inf
            self._lasts[1:] = [Op(self._seq, kind, data)]
            if self._sooner(kind):
                self._has_work.notify()

    def _sooner(self, kind: str) -> bool:
        """Under the lock: an operation of `kind` was just enqueued; True when it makes the batch
        due sooner. (A lazy one never does while something waits: that was enqueued earlier.)"""
        lazy = kind in self.lazy
        if lazy and self._due != math.inf:
            return False
        due = time.monotonic() + (self.lazy_linger if lazy else self.linger)
        if due >= self._due:
            return False
        self._due = due
        return True

    def _drop_oldest(self) -> None:
        """Under the lock: shed the oldest droppable operations down to max_pending."""
        shed = 0
        while self._rows and self.pending > self.max_pending:
            op = self._rows.popleft()
            if op.key is not None and self._waiting.get(op.key) is op:
                del self._waiting[op.key]
            shed += 1
        self.dropped += shed
        if shed and not self._dropping:
            self._dropping = True
            self.log.warning("store: more than %d operations pending, dropping the oldest rows",
                             self.max_pending)

    def _done_upto(self) -> int:
        """Under the lock: every operation with seq <= this is committed (or dropped)."""
        heads = [q[0].seq for q in (self._ordered, self._rows) if q]
        if self._lasts:
            heads.append(self._lasts[0].seq)
        if self._inflight_first is not None:
            heads.append(self._inflight_first)
        return min(heads) - 1 if heads else self._seq

    # -- the writer thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            self.write(batch)
            with self._lock:
                self._inflight = 0
                self._inflight_first = None
                self._committed.notify_all()

    def _take(self) -> list[Op] | None:
        """Block for work; pop up to `batch` operations in enqueue order (None when stopping)."""
        with self._lock:
            self._has_work.wait_for(lambda: self._stop or self._ordered or self._rows or self._lasts)
            self._linger()
            if self._stop:
                return None
            batch = self._pop_batch()
            self._take_last(batch)
            if not (self._ordered or self._rows or self._lasts):  # else the rest stays due when it was
                self._due = math.inf
            self._forget_keys(batch)
            self._inflight = len(batch)
            self._inflight_first = batch[0].seq
            if not self._rows:
                self._dropping = False
            return batch

    def _linger(self) -> None:
        """Under the lock: let a batch gather until it is due or full, unless someone waits for it."""
        while not (self._stop or self._urgent or len(self._ordered) + len(self._rows) >= self.batch):
            remaining = self._due - time.monotonic()
            if remaining <= 0:
                return
            self._has_work.wait(remaining)

    def _pop_batch(self) -> list[Op]:
        """Under the lock: up to `batch` operations in enqueue order."""
        if len(self._ordered) + len(self._rows) > self.batch:
            return [self._pop_next() for _ in range(self.batch)]
        batch = [*self._ordered, *self._rows]  # the usual case: everything waiting
        self._ordered.clear()
        self._rows.clear()
        batch.sort(key=_SEQ)  # two runs in order: the sort merges them
        return batch

    def _take_last(self, batch: list[Op]) -> None:
        """Under the lock: `put_last`'s operation joins the batch once nothing enqueued before it
        still waits."""
        heads = [q[0].seq for q in (self._ordered, self._rows) if q]
        joined = [op for op in self._lasts if not heads or op.seq < min(heads)]
        if not joined:
            return
        del self._lasts[:len(joined)]
        batch.extend(joined)
        batch.sort(key=_SEQ)

    def _forget_keys(self, batch: list[Op]) -> None:
        """Under the lock: the batch's operations no longer wait; later ones of their keys queue anew."""
        if not self._waiting:
            return
        if not (self._ordered or self._rows):
            self._waiting.clear()
            return
        for op in batch:
            if op.key is not None and self._waiting.get(op.key) is op:
                del self._waiting[op.key]

    def _pop_next(self) -> Op:
        if not self._rows:
            return self._ordered.popleft()
        if not self._ordered or self._rows[0].seq < self._ordered[0].seq:
            return self._rows.popleft()
        return self._ordered.popleft()

    def write(self, batch: list[Op]) -> None:
        """Commit the batch, retrying with backoff until it lands or the queue is stopped."""
        delay = BACKOFF_FIRST
        while batch and not self._stop:
            try:
                self.sink.commit(batch)
            except Exception as exc:
                self._failed(exc)
                if self.sink.transient(exc):
                    self.sink.recover(exc)
                else:
                    batch = self._write_each(batch)
            else:
                self._succeeded(len(batch))
                return
            if batch:
                self._backoff(delay)
                delay = min(delay * 2, BACKOFF_MAX)

    def _write_each(self, batch: list[Op]) -> list[Op]:
        """Write ops one per transaction, dropping those refused; return the rest on a transient error."""
        for i, op in enumerate(batch):
            try:
                self.sink.commit([op])
            except Exception as exc:
                if self.sink.transient(exc):
                    return batch[i:]
                self.log.error("store: dropping a %s operation the database refuses: %s",
                               op.kind, one_line(exc))
                self.count_dropped()
            else:
                self._succeeded(1)
        return []

    def _failed(self, exc: BaseException) -> None:
        message = one_line(exc)
        with self._lock:
            self.errors += 1
            self.last_error = message
            first = not self._failing
            self._failing = True
        if first:
            self.log.warning("store: cannot write to %s (%s); keeping rows and retrying", self.name, message)

    def _succeeded(self, count: int) -> None:
        with self._lock:
            self.written += count
            recovered = self._failing
            self._failing = False
        if recovered:
            self.log.info("store: writing to %s again (%d errors so far)", self.name, self.errors)

    def _backoff(self, delay: float) -> None:
        self._wake.wait(delay)
        self._wake.clear()
