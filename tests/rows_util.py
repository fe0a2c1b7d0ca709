"""Request rows for the store tests: `request()`, a usual row, and a table of rows with unusual
values beside what the store makes of them (the values the dict-based normaliser stored)."""

from __future__ import annotations

import math
from typing import Any

from crossbar.decisions import Decision
from crossbar.schema import REQUEST_COLUMNS
from crossbar.store import MAX_MS, MAX_TOKENS

T0 = 1_780_000_000.0  # some fixed UTC instant, well inside a day


def request(**over: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "route": "r1",
        "fp": "fp1",
        "model": "m1",
        "host": "alpha",
        "started": T0,
        "queued_ms": 2,
        "ttfb_ms": 30,
        "total_ms": 100,
        "status": 200,
        "streamed": True,
        "prompt_tokens": 50,
        "cached_tokens": 40,
        "completion_tokens": 10,
        "err": None,
        "decision": "reused",
    }
    row.update(over)
    return row


NOW = T0 + 7  # the store's clock: a start that is absent or not finite becomes this
STORED = dict(zip(REQUEST_COLUMNS, ("r1", "fp1", "m1", "alpha", T0, 2, 30, 100, 200, 1, 50, 40, 10, None,
                                    "reused"), strict=True))  # `request()` as SQLite has it
UNSET = {"host": None, "started": NOW, "queued_ms": 0, "ttfb_ms": None, "total_ms": 0, "status": None,
         "streamed": 0, "prompt_tokens": None, "cached_tokens": None, "completion_tokens": None, "err": None,
         "decision": None}
REFUSED = None  # the database refuses the row (not UTF-8): it alone is dropped, the rest of its batch lands


class Partial(dict[str, Any]):
    """A row given as a mapping that leaves columns out (they take their defaults)."""


# (the row: what differs from `request()`, or a partial row; what is stored differently from STORED,
# or None when nothing is stored; figures counted as out of range; rows dropped when enqueued).
# One unusual value per row, so that each check decides alone whether a row is stored as given;
# then a few rows with many.
ROW_CASES: list[tuple[dict[str, Any], dict[str, Any] | None, int, int]] = [
    ({}, {}, 0, 0),
    ({"route": "r\x00"}, {"route": "r\ufffd"}, 0, 0),
    ({"fp": "\x00fp"}, {"fp": "\ufffdfp"}, 0, 0),
    ({"model": "m\x00\x00"}, {"model": "m\ufffd\ufffd"}, 0, 0),
    ({"route": 5}, {"route": "5"}, 0, 0),
    ({"fp": b"x"}, {"fp": "b'x'"}, 0, 0),
    ({"model": 1.5}, {"model": "1.5"}, 0, 0),
    ({"route": "r" * 10_000}, {"route": "r" * 10_000}, 0, 0),
    ({"host": None}, {"host": None}, 0, 0),
    ({"host": ""}, {"host": ""}, 0, 0),
    ({"host": "a\x00"}, {"host": "a\ufffd"}, 0, 0),
    ({"host": 7}, {"host": "7"}, 0, 0),
    ({"host": "h" * 5000}, {"host": "h" * 5000}, 0, 0),
    ({"err": "cut"}, {"err": "cut"}, 0, 0),
    ({"err": "e\x00"}, {"err": "e\ufffd"}, 0, 0),
    ({"err": ValueError("boom")}, {"err": "boom"}, 0, 0),
    ({"err": "x" * 100_000}, {"err": "x" * 100_000}, 0, 0),
    ({"err": "\ud800"}, REFUSED, 0, 0),
    ({"decision": None}, {"decision": None}, 0, 0),
    ({"decision": ""}, {"decision": ""}, 0, 0),
    ({"decision": "d\x00"}, {"decision": "d\ufffd"}, 0, 0),
    ({"decision": Decision.NEW}, {"decision": "new"}, 0, 0),
    ({"decision": "d" * 300}, {"decision": "d" * 300}, 0, 0),
    ({"started": int(T0) + 1}, {"started": T0 + 1}, 0, 0),
    ({"started": math.inf}, {"started": NOW}, 1, 0),
    ({"started": -math.inf}, {"started": NOW}, 1, 0),
    ({"started": math.nan}, {"started": NOW}, 1, 0),
    ({"started": "not a time"}, None, 0, 1),
    ({"started": None}, None, 0, 1),
    ({"streamed": False}, {"streamed": 0}, 0, 0),
    ({"streamed": 0}, {"streamed": 0}, 0, 0),
    ({"streamed": "yes"}, {"streamed": 1}, 0, 0),
    ({"streamed": None}, {"streamed": 0}, 0, 0),
    ({"queued_ms": 0}, {"queued_ms": 0}, 0, 0),
    ({"queued_ms": MAX_MS}, {"queued_ms": MAX_MS}, 0, 0),
    ({"queued_ms": MAX_MS + 1}, {"queued_ms": 0}, 1, 0),
    ({"queued_ms": -1}, {"queued_ms": 0}, 1, 0),
    ({"queued_ms": 1.5}, {"queued_ms": 2}, 0, 0),
    ({"queued_ms": True}, {"queued_ms": 0}, 1, 0),
    ({"queued_ms": None}, {"queued_ms": 0}, 0, 0),
    ({"queued_ms": math.nan}, {"queued_ms": 0}, 1, 0),
    ({"total_ms": MAX_MS}, {"total_ms": MAX_MS}, 0, 0),
    ({"total_ms": MAX_MS + 1}, {"total_ms": 0}, 1, 0),
    ({"total_ms": -1}, {"total_ms": 0}, 1, 0),
    ({"total_ms": 99.5}, {"total_ms": 100}, 0, 0),
    ({"total_ms": False}, {"total_ms": 0}, 0, 0),
    ({"total_ms": math.inf}, {"total_ms": 0}, 1, 0),
    ({"ttfb_ms": None}, {"ttfb_ms": None}, 0, 0),
    ({"ttfb_ms": 0}, {"ttfb_ms": 0}, 0, 0),
    ({"ttfb_ms": MAX_MS}, {"ttfb_ms": MAX_MS}, 0, 0),
    ({"ttfb_ms": MAX_MS + 1}, {"ttfb_ms": None}, 1, 0),
    ({"ttfb_ms": -1}, {"ttfb_ms": None}, 1, 0),
    ({"ttfb_ms": 30.5}, {"ttfb_ms": 30}, 0, 0),
    ({"ttfb_ms": True}, {"ttfb_ms": None}, 1, 0),
    ({"status": None}, {"status": None}, 0, 0),
    ({"status": 100}, {"status": 100}, 0, 0),
    ({"status": 599}, {"status": 599}, 0, 0),
    ({"status": 99}, {"status": None}, 1, 0),
    ({"status": 600}, {"status": None}, 1, 0),
    ({"status": 200.0}, {"status": 200}, 0, 0),
    ({"status": False}, {"status": None}, 1, 0),
    ({"completion_tokens": None}, {"completion_tokens": None}, 0, 0),
    ({"completion_tokens": 0}, {"completion_tokens": 0}, 0, 0),
    ({"completion_tokens": MAX_TOKENS}, {"completion_tokens": MAX_TOKENS}, 0, 0),
    ({"completion_tokens": MAX_TOKENS + 1}, {"completion_tokens": None}, 1, 0),
    ({"completion_tokens": -1}, {"completion_tokens": None}, 1, 0),
    ({"completion_tokens": 2.6}, {"completion_tokens": 3}, 0, 0),
    ({"completion_tokens": 1e308}, {"completion_tokens": None}, 1, 0),
    ({"prompt_tokens": None}, {"prompt_tokens": None}, 0, 0),
    ({"prompt_tokens": MAX_TOKENS}, {"prompt_tokens": MAX_TOKENS}, 0, 0),
    ({"prompt_tokens": MAX_TOKENS + 1}, {"prompt_tokens": None}, 1, 0),
    ({"prompt_tokens": 2**70}, {"prompt_tokens": None}, 1, 0),
    ({"prompt_tokens": -1}, {"prompt_tokens": None}, 1, 0),
    ({"prompt_tokens": 50.6}, {"prompt_tokens": 51}, 0, 0),
    ({"prompt_tokens": True}, {"prompt_tokens": None}, 1, 0),
    ({"prompt_tokens": 39}, {"prompt_tokens": 39, "cached_tokens": None}, 1, 0),  # cached beyond the prompt
    ({"cached_tokens": None}, {"cached_tokens": None}, 0, 0),
    ({"cached_tokens": 0}, {"cached_tokens": 0}, 0, 0),
    ({"cached_tokens": 50}, {"cached_tokens": 50}, 0, 0),
    ({"cached_tokens": 51}, {"cached_tokens": None}, 1, 0),
    ({"cached_tokens": -5}, {"cached_tokens": None}, 1, 0),
    ({"cached_tokens": 2.4}, {"cached_tokens": 2}, 0, 0),
    ({"cached_tokens": False}, {"cached_tokens": None}, 1, 0),
    ({"cached_tokens": math.inf}, {"cached_tokens": None}, 1, 0),
    ({"prompt_tokens": None, "cached_tokens": MAX_TOKENS},
     {"prompt_tokens": None, "cached_tokens": MAX_TOKENS}, 0, 0),
    ({"prompt_tokens": None, "cached_tokens": MAX_TOKENS + 1},
     {"prompt_tokens": None, "cached_tokens": None}, 1, 0),
    ({"prompt_tokens": 2**70, "completion_tokens": 2**63, "ttfb_ms": MAX_MS + 1, "status": 600,
      "queued_ms": 2**64},
     {"prompt_tokens": None, "completion_tokens": None, "ttfb_ms": None, "status": None, "queued_ms": 0},
     5, 0),
    ({"streamed": 1, "prompt_tokens": True, "cached_tokens": False, "status": False, "ttfb_ms": True,
      "queued_ms": True, "total_ms": False},
     {"streamed": 1, "prompt_tokens": None, "cached_tokens": None, "status": None, "ttfb_ms": None,
      "queued_ms": 0, "total_ms": 0}, 5, 0),
    ({"prompt_tokens": math.nan, "cached_tokens": math.inf, "ttfb_ms": -math.inf, "queued_ms": math.nan,
      "total_ms": math.inf},
     {"prompt_tokens": None, "cached_tokens": None, "ttfb_ms": None, "queued_ms": 0, "total_ms": 0}, 5, 0),
    (Partial(route="r2", fp="", model="m1", started=T0, total_ms=5),
     {**UNSET, "route": "r2", "fp": "", "model": "m1", "started": T0, "total_ms": 5}, 0, 0),
    (Partial(), {**UNSET, "route": "", "fp": "", "model": ""}, 0, 0),
]


def as_given(over: dict[str, Any], form: str) -> Any:
    """The case's row as a mapping, or (complete rows) as the proxy gives it: values in column order."""
    if isinstance(over, Partial):
        return dict(over)
    row = request(**over)
    return tuple(row[c] for c in REQUEST_COLUMNS) if form == "tuple" else row
