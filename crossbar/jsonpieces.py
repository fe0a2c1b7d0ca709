"""A large JSON text read a bounded piece at a time, for a worker thread that shares the
interpreter lock with the event loop.

The standard library's scanner holds the lock for as long as one value takes to read: a request
whose bulk sat in one message (600k content parts, 23 MiB) held it 0.22 s, and every stream with
it. `loads` reads no more than WINDOW characters in one C call: a value that ends within a window
is read by the scanner in one call; a larger array or object one member at a time, a larger string
a window at a time. Between pieces the lock is offered to other threads.

The result, and the kind and position of an error, are those of `json.loads` (NaN and ±Infinity
refused), but for two refusals: a number longer than a window is too long (an integer over 4300
digits already is), and values nested some 300 levels deep inside values too large for a window
are nested too deeply (the scanner alone takes about 1000 levels).

A parsed value too large for a window is also slow to free at once: `loads` tells the caller
which of its arrays and objects were read a member at a time, for `dismantle`.
"""

from __future__ import annotations

import codecs
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from json.decoder import scanstring
from typing import Any, Protocol

WINDOW = 1 << 16  # characters one C call reads at most
_PACE_ITEMS = 256  # values read between two offers of the interpreter to other threads...
_PACE_CHARS = 1 << 18  # ...or characters, whichever comes first
_FREE_ITEMS = 4096  # members freed between two offers (freeing 4096 small objects takes ~0.3 ms)
_DECODE_PIECE = 1 << 20  # UTF-8 is decoded a piece at a time: each C call stays short

_WS = re.compile(r"[ \t\n\r]*")
_COMMA = re.compile(r"[ \t\n\r]*,[ \t\n\r]*")
# a run of what may stand inside a JSON string: never a partial escape, so a run cut short by the end
# of its window is decoded on its own
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*')
_NUMBER_TEXT = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"
_NUMBER = re.compile(_NUMBER_TEXT)
_NUMBER_START = frozenset("-0123456789")
_NUMBERS = re.compile(rf"(?:{_NUMBER_TEXT}[ \t\n\r]*,[ \t\n\r]*)+")  # each followed by a comma


class ConstantRefused(ValueError):
    """NaN / Infinity / -Infinity: accepted by Python's json, but not JSON."""


def _refuse_constant(name: str) -> Any:
    raise ConstantRefused(f"{name} is not allowed")


DECODER = json.JSONDecoder(parse_constant=_refuse_constant)
_SCAN = DECODER.scan_once


class Sink(Protocol):
    """Takes an array's elements a batch at a time; keeps nothing of them but what it derives (a
    batch is emptied once the sink has it)."""

    def extend(self, items: Sequence[Any]) -> None: ...


def dismantle(containers: list[list[Any] | dict[str, Any]]) -> None:
    """Empty `containers` (inner ones first) _FREE_ITEMS members at a time, and forget them.
    Freeing a parsed value at once holds the interpreter lock for as long as building it took (a
    message of 600k content parts: 50 ms); a container read in one window is small to free."""
    for container in containers:
        while container:
            if isinstance(container, list):
                del container[-_FREE_ITEMS:]
            else:
                for _ in range(min(_FREE_ITEMS, len(container))):
                    container.popitem()
            let_others_run()
    containers.clear()


def let_others_run() -> None:
    """Release the interpreter lock for a moment: the event loop thread, if it waits for it, runs
    now rather than when the interpreter's switch interval forces a hand-over."""
    time.sleep(0)


def decode_utf8(raw: bytes) -> str:
    """`raw.decode("utf-8")`, a piece at a time for a large body (every piece is one short C call)."""
    if len(raw) <= _DECODE_PIECE:
        return raw.decode("utf-8")
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(raw)
    pieces = []
    for at in range(0, len(raw), _DECODE_PIECE):
        pieces.append(decoder.decode(view[at:at + _DECODE_PIECE]))
        let_others_run()
    pieces.append(decoder.decode(b"", final=True))
    return "".join(pieces)


def loads(text: str, sinks: Mapping[str, Callable[[], Sink]] | None = None,
          large: list[list[Any] | dict[str, Any]] | None = None) -> Any:
    """`json.loads(text)` (see the module's docstring). The elements of a top-level array named
    in `sinks` go to a new sink of that name, a batch at a time (a repeated name starts a new one:
    the last wins, as in `json.loads`), which stands in for the array; each batch is `dismantle`d
    once its sink has it. The arrays and objects read a member at a time (too large for one
    window) that are left in the value are added to `large`, inner ones first, for the caller to
    `dismantle` when it is done with the value."""
    reader = _Reader(text, [] if large is None else large)
    at = _WS.match(text, 0).end()
    if text.startswith("{", at):
        value, at = reader.members(at, sinks or {})
    else:
        value, at = reader.value(at)
    end = _WS.match(text, at).end()
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def _expecting_value(text: str, at: int) -> json.JSONDecodeError:
    return json.JSONDecodeError("Expecting value", text, at)


class _Reader:
    """One text's reading. Values that fit are read from `piece`, a copy of text[base:base +
    WINDOW] shared by the values that follow one another in it."""

    def __init__(self, text: str, large: list[list[Any] | dict[str, Any]]):
        self.text, self.large = text, large
        self.base, self.piece = 0, ""
        self.piece_end, self.last = 0, not text  # where the piece ends in the text; whether that is the end
        self.items = self.chars = 0

    def pace(self, chars: int) -> None:
        self.items += 1
        self.chars += chars
        if self.items >= _PACE_ITEMS or self.chars >= _PACE_CHARS:
            self.items = self.chars = 0
            let_others_run()

    def value(self, at: int) -> tuple[Any, int]:
        """The value that starts at text[at] and where it ends."""
        return self._whole(at) or self._large(at)

    def _slice(self, at: int) -> None:
        self.base, self.piece = at, self.text[at:at + WINDOW]
        self.piece_end = at + len(self.piece)
        self.last = self.piece_end == len(self.text)

    def _whole(self, at: int) -> tuple[Any, int] | None:
        """The value at text[at] read in one C call, when it ends within a window; None when it
        may not (it is larger, or malformed: reading it a piece at a time tells which). Kept in
        one function: it runs once per value."""
        offset = at - self.base
        if offset < 0 or (self.piece_end - at < WINDOW // 2 and not self.last):
            self._slice(at)
            offset = 0
        while True:
            try:
                value, end = _SCAN(self.piece, offset)
            except StopIteration as stop:
                if self.last:
                    raise _expecting_value(self.text, self.base + stop.value) from None
            except json.JSONDecodeError as e:
                if self.last:
                    raise json.JSONDecodeError(e.msg, self.text, self.base + e.pos) from None
            else:
                end += self.base
                if end < self.piece_end or self.last:  # else a number may go on past the window
                    self.items += 1
                    self.chars += end - at
                    if self.items >= _PACE_ITEMS or self.chars >= _PACE_CHARS:
                        self.items = self.chars = 0
                        let_others_run()
                    return value, end
            if not offset:
                return None
            self._slice(at)  # perhaps it fits a window of its own
            offset = 0

    def _large(self, at: int) -> tuple[Any, int]:
        """The value at text[at] that `_whole` could not read, a piece at a time."""
        first = self.text[at:at + 1]
        if first == "{":
            obj, end = self.members(at, {})
            self.large.append(obj)
            return obj, end
        if first == "[":
            return self.array(at)
        if first == '"':
            return self.string(at)
        number = _NUMBER.match(self.text, at, at + WINDOW)
        if number is not None and number.end() == at + WINDOW:
            raise ValueError(f"a number longer than {WINDOW} characters")
        try:  # a number shorter than a window, a literal, or no value at all
            return _SCAN(self.text, at)
        except StopIteration as stop:
            raise _expecting_value(self.text, stop.value) from None

    def string(self, at: int) -> tuple[str, int]:
        """The string that opens at text[at], a window at a time."""
        text, parts = self.text, []
        start, size = at + 1, len(text)
        while True:
            window_end = min(size, start + WINDOW)
            stop = _STRING_RUN.match(text, start, window_end).end()
            if stop > start:
                _join(parts, _unescape(text[start:stop]))
            self.pace(stop - start)
            cut = stop == window_end or (text.startswith("\\", stop) and window_end - stop < 6)
            if not cut or window_end == size:
                break
            start = stop
        if text.startswith('"', stop):
            return "".join(parts), stop + 1
        if stop >= size:
            raise json.JSONDecodeError("Unterminated string starting at", text, at)
        if text.startswith("\\u", stop):
            raise json.JSONDecodeError("Invalid \\uXXXX escape", text, stop + 1)
        if text.startswith("\\", stop):
            raise json.JSONDecodeError("Invalid \\escape", text, stop)
        raise json.JSONDecodeError("Invalid control character at", text, stop)

    def array(self, at: int, sink: Sink | None = None) -> tuple[Any, int]:
        """The array that opens at text[at], one element at a time; with a `sink`, the elements go
        to it _PACE_ITEMS at a time (and are dropped: nothing piles up for the garbage collector)
        and the sink stands in for the array. What the sink refuses in an element is raised
        before any error in the text after that element, as if it had been handed each one as it
        was read."""
        items: list[Any] = []
        if sink is None:
            at = self._items(at, items, None)
            self.large.append(items)
            return items, at
        start = len(self.large)  # the large containers of the batch being read begin here

        def hand_over() -> None:
            try:
                sink.extend(items)
            finally:  # handed over, even when refused: an error after it hands over only the rest
                items.clear()
                batch_large = self.large[start:]
                del self.large[start:]
                dismantle(batch_large)

        try:
            at = self._items(at, items, hand_over)
        finally:
            hand_over()
        return sink, at

    def _items(self, at: int, items: list[Any], batch_full: Callable[[], None] | None) -> int:
        text, comma = self.text, _COMMA.match
        at = _WS.match(text, at + 1).end()
        if text.startswith("]", at):
            return at + 1
        whole, size = self._whole, len(text)
        while True:
            numbers = (_NUMBERS.match(text, at, min(size, at + WINDOW)) if text[at:at + 1] in _NUMBER_START
                       else None)
            if numbers is not None:  # a run of numbers (token ids, say): one C call for all of them
                run = numbers.group()
                items += _SCAN("[" + run[:run.rindex(",")] + "]", 0)[0]
                self.pace(len(run))
                at = _WS.match(text, numbers.end()).end()  # the window may end inside the white space
            else:
                item, at = whole(at) or self._large(at)
                items.append(item)
            if batch_full is not None and len(items) >= _PACE_ITEMS:
                batch_full()
            if numbers is not None:
                continue
            separator = comma(text, at)
            if separator is None:
                break
            at = separator.end()
        at = _WS.match(text, at).end()
        if not text.startswith("]", at):
            raise json.JSONDecodeError("Expecting ',' delimiter", text, at)
        return at + 1

    def members(self, at: int, sinks: Mapping[str, Callable[[], Sink]]) -> tuple[dict[str, Any], int]:
        """The object that opens at text[at], one member at a time (see `loads` for `sinks`)."""
        text = self.text
        obj: dict[str, Any] = {}
        at = _WS.match(text, at + 1).end()
        if text.startswith("}", at):
            return obj, at + 1
        while True:
            if not text.startswith('"', at):
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, at)
            key, at = self.value(at)
            at = _WS.match(text, at).end()
            if not text.startswith(":", at):
                raise json.JSONDecodeError("Expecting ':' delimiter", text, at)
            at = _WS.match(text, at + 1).end()
            if key in sinks and text.startswith("[", at):
                obj[key], at = self.array(at, sinks[key]())
            else:
                obj[key], at = self.value(at)
            at = _WS.match(text, at).end()
            if text.startswith(",", at):
                at = _WS.match(text, at + 1).end()
            elif text.startswith("}", at):
                return obj, at + 1
            else:
                raise json.JSONDecodeError("Expecting ',' delimiter", text, at)


def _unescape(run: str) -> str:
    """A run of a string's text (`_STRING_RUN`) decoded."""
    return scanstring(run + '"', 0)[0] if "\\" in run else run


def _join(parts: list[str], part: str) -> None:
    """Append `part`, joining a surrogate pair whose two escapes fell in two windows (text decoded
    from UTF-8 holds no surrogate of its own, so a lone one at either side came from an escape)."""
    if parts and part and "\ud800" <= parts[-1][-1] <= "\udbff" and "\udc00" <= part[0] <= "\udfff":
        pair = chr(0x10000 + ((ord(parts[-1][-1]) - 0xD800) << 10) + (ord(part[0]) - 0xDC00))
        parts[-1] = parts[-1][:-1] + pair
        part = part[1:]
    if part:
        parts.append(part)
