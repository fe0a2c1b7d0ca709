"""crossbar.writebehind with a sink in memory, and backend.transient's reading of errors."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time

import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from crossbar.backend import transient
from crossbar.writebehind import Op, WriteBehind

log = logging.getLogger("test.writebehind")


def sqlite_error(message: str) -> OperationalError:
    return OperationalError("INSERT …", {}, sqlite3.OperationalError(message))


class MemorySink:
    """Commits all-or-nothing; ops of kind "refused" raise `refusal`, and the first `outages`
    commits fail as if the database were locked."""

    def __init__(self, refusal: Exception, outages: int = 0) -> None:
        self.refusal = refusal
        self.outages = outages
        self.rows: list[dict[str, object]] = []
        self.recovered = 0
        self.batches: list[int] = []  # the size of every commit attempted

    def commit(self, ops: list[Op]) -> None:
        self.batches.append(len(ops))
        if self.outages:
            self.outages -= 1
            raise sqlite_error("database is locked")
        if any(op.kind == "refused" for op in ops):
            raise self.refusal
        self.rows.extend(op.data for op in ops)

    def transient(self, exc: Exception) -> bool:
        return transient(exc)

    def recover(self, exc: Exception) -> None:
        self.recovered += 1


@pytest.mark.parametrize(
    "refusal",
    [
        sqlite_error("integer overflow"),
        IntegrityError("INSERT …", {}, Exception("NOT NULL constraint failed")),
        OverflowError("Python int too large to convert to SQLite INTEGER"),
    ],
)
def test_a_refused_operation_is_dropped_and_everything_behind_it_lands(refusal: Exception) -> None:
    sink = MemorySink(refusal, outages=1)
    queue = WriteBehind(sink, name="memory", droppable=(), max_pending=100, log=log, linger=0)
    queue.put("row", {"n": 1})
    queue.put("refused", {"n": 2})
    queue.put("row", {"n": 3})
    queue.start("test-writer")
    assert queue.flush(timeout=5)
    assert sink.rows == [{"n": 1}, {"n": 3}]
    assert (queue.dropped, sink.recovered, queue.pending) == (1, 1, 0)
    queue.put("row", {"n": 4})  # the writer is not wedged
    assert queue.flush(timeout=5) and sink.rows[-1] == {"n": 4}
    queue.stop()


@pytest.mark.parametrize(
    ("message", "retry"),
    [
        ("database is locked", True),
        ("attempt to write a readonly database", True),
        ("unable to open database file", True),
        ("database or disk is full", True),
        ("integer overflow", False),
        ("string or blob too big", False),
    ],
)
def test_sqlite_errors_that_are_worth_a_retry(message: str, retry: bool) -> None:
    assert transient(sqlite_error(message)) is retry


@pytest.mark.parametrize("batch", [3, 500])
def test_batches_keep_enqueue_order_across_droppable_and_other_kinds(batch: int) -> None:
    """Droppable and other operations wait in two queues: a batch takes them in enqueue order,
    whether the backlog fits one batch or not."""
    sink = MemorySink(RuntimeError("unused"))
    queue = WriteBehind(sink, name="memory", droppable=("row",), max_pending=100, log=log, batch=batch,
                        linger=0)
    kinds = ["row", "lease", "lease", "row", "row", "row", "lease", "row", "lease", "lease"]
    for n, kind in enumerate(kinds):
        queue.put(kind, {"n": n})
    queue.start("test-writer")
    assert queue.flush(timeout=5)
    assert sink.rows == [{"n": n} for n in range(len(kinds))]
    assert sink.batches == ([3, 3, 3, 1] if batch == 3 else [10])
    queue.stop()


def test_a_lazy_kind_waits_its_own_linger_and_any_other_operation_brings_the_batch_forward() -> None:
    """Lazy operations (a request's row, a lease's last use) may wait `lazy_linger`; an operation
    of any other kind is written within `linger`, with everything enqueued before it."""
    sink = MemorySink(RuntimeError("unused"))
    queue = WriteBehind(sink, name="memory", droppable=("row",), max_pending=100, log=log, linger=0.05,
                        lazy=("row", "touch"), lazy_linger=30)
    queue.start("test-writer")
    try:
        queue.put("row", {"n": 0})
        queue.put("touch", {"n": 1})
        time.sleep(0.5)  # ten times `linger`
        assert sink.rows == []
        queue.put("event", {"n": 2})
        deadline = time.monotonic() + 10  # far below `lazy_linger`
        while len(sink.rows) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sink.rows == [{"n": 0}, {"n": 1}, {"n": 2}]
        queue.put("row", {"n": 3})  # due again only in `lazy_linger`; flush writes it at once
        time.sleep(0.3)
        assert len(sink.rows) == 3
        assert queue.flush(timeout=5) and sink.rows[-1] == {"n": 3}
    finally:
        queue.stop()


def test_an_operation_after_a_shed_backlog_is_still_written_when_due() -> None:
    """Shedding can empty the queue while a due time is set; the next operation must not find the
    writer asleep behind that stale time."""
    gate = threading.Event()

    class SlowSink(MemorySink):
        def commit(self, ops: list[Op]) -> None:
            gate.wait(10)
            super().commit(ops)

    sink = SlowSink(RuntimeError("unused"))
    queue = WriteBehind(sink, name="memory", droppable=("row",), max_pending=2, log=log, linger=0.05,
                        lazy=("row",), lazy_linger=0.2)
    queue.start("test-writer")
    try:
        queue.put("event", {"n": 0})
        queue.put("event", {"n": 1})
        deadline = time.monotonic() + 10
        while queue._inflight < 2 and time.monotonic() < deadline:  # both taken, their commit held
            time.sleep(0.01)
        queue.put("row", {"n": 2})  # over max_pending: shed at once, leaving nothing queued
        assert queue.dropped == 1
        gate.set()
        time.sleep(0.5)  # the shed row's due time passes
        queue.put("event", {"n": 3})
        deadline = time.monotonic() + 10
        while len(sink.rows) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sink.rows == [{"n": 0}, {"n": 1}, {"n": 3}]
    finally:
        gate.set()
        queue.stop()


class DownSink(MemorySink):
    """The database is away until `back` is set; then commits like MemorySink."""

    def __init__(self) -> None:
        super().__init__(RuntimeError("unused"))
        self.back = threading.Event()
        self.attempts = threading.Event()

    def commit(self, ops: list[Op]) -> None:
        self.attempts.set()
        if not self.back.is_set():
            raise sqlite_error("unable to open database file")
        super().commit(ops)


def coalescing_queue(sink: MemorySink, max_pending: int = 100) -> WriteBehind:
    return WriteBehind(sink, name="memory", droppable=("row",), max_pending=max_pending, log=log, linger=0,
                       coalesce={"lease": lambda d: d["k"], "touch": lambda d: d["k"]})


def test_the_writes_of_a_key_waiting_on_an_absent_database_stay_two() -> None:
    sink = DownSink()
    queue = coalescing_queue(sink)
    queue.put("lease", {"k": "a", "n": 0})
    queue.start("test-writer")
    assert sink.attempts.wait(5)  # that first write is held by the writer, retrying
    for n in range(1, 20_001):  # then every turn touches the lease again
        queue.put("touch", {"k": "a", "n": n})
        queue.put("touch", {"k": "b", "n": n})
    assert (queue.pending, queue.dropped) == (3, 0)  # a's write in flight; a's and b's latest waiting
    sink.back.set()
    assert queue.flush(timeout=15)
    assert sink.rows == [{"k": "a", "n": 0}, {"k": "a", "n": 20_000}, {"k": "b", "n": 20_000}]
    queue.stop()


def test_a_later_write_of_a_key_takes_the_waiting_ones_place_and_kind() -> None:
    sink = MemorySink(RuntimeError("unused"))
    queue = coalescing_queue(sink)
    queue.put("touch", {"k": "a", "n": 1})
    queue.put("row", {"n": 2})
    queue.put("lease", {"k": "a", "n": 3})  # replaces the touch, ahead of the row
    queue.put("other", {"n": 4})  # a kind not coalesced: kept as it is
    queue.put("other", {"n": 4})
    assert queue.pending == 4
    queue.start("test-writer")
    assert queue.flush(timeout=5)
    assert sink.rows == [{"k": "a", "n": 3}, {"n": 2}, {"n": 4}, {"n": 4}]
    queue.stop()


def test_put_last_is_written_after_everything_before_it_and_stands_for_earlier_calls() -> None:
    sink = MemorySink(RuntimeError("unused"))
    queue = WriteBehind(sink, name="memory", droppable=(), max_pending=100, log=log, linger=0, batch=3,
                        coalesce={"lease": lambda d: d["k"]})
    queue.put("lease", {"k": "a", "n": 1})
    queue.put_last("last", {"n": "first call"})
    queue.put("row", {"n": 2})
    queue.put("lease", {"k": "a", "n": 3})  # coalesced into the waiting write of a
    for n in (4, 5, 6):
        queue.put("row", {"n": n})
    queue.put_last("last", {"n": "second call"})  # behind the first, and behind everything so far
    queue.put_last("last", {"n": "third call"})  # replaces the second: the first keeps its place
    queue.put("row", {"n": 7})
    assert queue.pending == 8
    queue.start("test-writer")
    assert queue.flush(timeout=5)
    # batches of three: the first call joins the first (only the write of a came before it), the
    # third the last one, once the rows before it are in
    assert sink.rows == [{"k": "a", "n": 3}, {"n": "first call"}, {"n": 2}, {"n": 4}, {"n": 5}, {"n": 6},
                         {"n": "third call"}, {"n": 7}]
    assert sink.batches == [4, 4]
    queue.stop()


def test_a_put_last_gets_written_however_busy_the_queue_stays() -> None:
    sink = MemorySink(RuntimeError("unused"))
    queue = WriteBehind(sink, name="memory", droppable=(), max_pending=10_000, log=log, linger=0, batch=4)
    queue.put("row", {"n": 0})
    queue.put_last("last", {"n": "notice"})
    for n in range(1, 200):  # more keeps coming, each followed by another call
        queue.put("row", {"n": n})
        queue.put_last("last", {"n": f"notice after {n}"})
    queue.start("test-writer")
    assert queue.flush(timeout=5)
    notices = [r["n"] for r in sink.rows if str(r["n"]).startswith("notice")]
    assert notices == ["notice", "notice after 199"]
    assert sink.rows.index({"n": "notice"}) == 1  # right behind the one row before it
    queue.stop()
