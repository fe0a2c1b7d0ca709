"""A large JSON text read a bounded piece at a time, for a worker thread that shares the
interpreter lock with the event loop.

The standard library's scanner holds the lock for as long as one value takes to read: a request
whose bulk sat in one message (600k content parts, 23 MiB) held it 0.22 s, and every stream with
it. `loads` reads no more than WINDOW characters in one C call: a value that ends within a window
is read by the scanner in one call; a larger array or object one member at a time (a run of an
array's numbers, or of its objects, that a window holds in one call), a larger string a window at
a time. Between pieces the lock is offered to other threads.

The result, and the kind and position of an error, are those of `json.loads` (NaN and ±Infinity
refused), but for four refusals: a number longer than a window is too long (an integer over 4300
digits already is); values nested some 300 levels deep inside values too large for a window are
nested too deeply (the scanner alone takes about 1000 levels); an object of more than MAX_MEMBERS
members, or with a key of more than MAX_KEY_CHARS characters, is refused.

What was parsed is slow to free at once too: `loads` lists for its caller the arrays and objects
to `dismantle` a step at a time when it is done with them.
"""

from __future__ import annotations

import codecs
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from itertools import compress, count, islice
from json.decoder import scanstring
from typing import Any, Protocol

from crossbar import textjoin

WINDOW = 1 << 16  # characters one C call reads at most
MAX_MEMBERS = 1 << 18  # members of one object (its largest rehash: ~6 ms); more than any vocabulary
MAX_KEY_CHARS = 1 << 16  # an object key's characters (a dict hashes its key in one call)
_PACE_ITEMS = 256  # values read between two offers of the interpreter to other threads...
_PACE_CHARS = 1 << 18  # ...or characters, whichever comes first
# A value read whole of this many characters or more that is a non-empty array or object is added to
# `large` too, so that what `dismantle` frees in a step is small members (under _ADD_CHARS / 2
# objects each) or the members of one value read whole (under a window's text in all)...
_ADD_CHARS = 256
_FREE_ITEMS = 512  # ...some 64k objects at most (~2 ms; usual members: ~0.05 ms)
# Members that were themselves dismantled are freed this many per step: each may be the last object
# left in an arena of the allocator (its members, allocated after it, are gone), which goes back to
# the system as it is freed (~0.1 ms a 1 MiB arena; 300 at once held the lock 28 ms). Others are
# small: values read whole under _ADD_CHARS characters.
_FREE_EMPTIED = 16
_FREE_SLICE_S = 0.0005  # the lock is offered once steps have taken this long
_DECODE_PIECE = 1 << 18  # UTF-8 decoded per call (1 MiB into the 4 MiB of 1M emoji: 2 ms)

_WS = re.compile(r"[ \t\n\r]*")
_COMMA = re.compile(r"[ \t\n\r]*,[ \t\n\r]*")
# a run of what may stand inside a JSON string: never a partial escape, so a run cut short by the end
# of its window is decoded on its own
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*')
_NUMBER_TEXT = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?"
_NUMBER = re.compile(_NUMBER_TEXT)
_NUMBER_START = frozenset("-0123456789")
_OPENERS = frozenset("[{")
_CONTAINERS = (list, dict)  # what a run of objects may add to `large` (a run may hold other values too)
_SHORT_TRY = 4096  # characters an array or object gets after a neighbour failed its try (see _whole)
_NUMBERS = re.compile(rf"(?:{_NUMBER_TEXT}[ \t\n\r]*,[ \t\n\r]*)+")  # each followed by a comma
_OBJECT_TRIES = 3  # closing braces followed by a comma where a run of objects may end (see _objects)


class ConstantRefused(ValueError):
    """NaN / Infinity / -Infinity: accepted by Python's json, but not JSON."""


class TooManyMembers(ValueError):
    """An object of more than MAX_MEMBERS members: growing a dict that large rehashes it in one
    call (2M members: 50 ms)."""


class KeyTooLong(ValueError):
    """An object key longer than MAX_KEY_CHARS: a dict hashes its key in one call (32 MiB: 17 ms,
    32M emoji: 57 ms)."""


def _refuse_constant(name: str) -> Any:
    raise ConstantRefused(f"{name} is not allowed")


DECODER = json.JSONDecoder(parse_constant=_refuse_constant)
_SCAN = DECODER.scan_once


class Sink(Protocol):
    """Takes an array's elements a batch at a time, with the large arrays and objects read in
    them (see `loads`); keeps nothing of them but what it derives (a batch is emptied once the
    sink has it)."""

    def extend(self, items: Sequence[Any], large: Sequence[Any]) -> None: ...


def dismantle(containers: list[list[Any] | dict[str, Any]]) -> None:
    """Empty `containers` (the last first: `loads` adds a container before those inside it)
    _FREE_ITEMS members at a time, and forget them. Freeing a parsed value at once holds the
    interpreter lock for as long as building it took (a message of 600k content parts: 50 ms).
    A step frees _FREE_ITEMS members each under _ADD_CHARS characters, or members of one value read
    in one window: some 64k objects (~2 ms) at most; of the members that were in `containers`
    themselves (emptied by then), _FREE_EMPTIED at most."""
    emptied = {id(container) for container in containers}  # an id reused meanwhile only makes a step smaller
    offered = time.perf_counter()
    while containers:
        container = containers.pop()
        while container:
            if isinstance(container, list):
                _free_list_step(container, emptied)
            else:
                _free_dict_step(container, emptied)
            if time.perf_counter() - offered > _FREE_SLICE_S:
                let_others_run()
                offered = time.perf_counter()


def _free_list_step(container: list[Any], emptied: set[int]) -> None:
    """Free the last _FREE_ITEMS members of `container`, or fewer: up to the _FREE_EMPTIED-th
    emptied one from the end. Each test is a pass in C: the last _FREE_EMPTIED (a run of emptied
    values, the usual case where there are any), then how many of the last _FREE_ITEMS are."""
    if not emptied:
        del container[-_FREE_ITEMS:]
        return
    last = list(map(emptied.__contains__, map(id, islice(reversed(container), _FREE_EMPTIED))))
    if len(last) == _FREE_EMPTIED and all(last):
        del container[-_FREE_EMPTIED:]
    elif len(emptied.intersection(map(id, islice(reversed(container), _FREE_ITEMS)))) < _FREE_EMPTIED:
        del container[-_FREE_ITEMS:]
    else:
        flags = map(emptied.__contains__, map(id, islice(reversed(container), _FREE_ITEMS)))
        del container[-next(islice(compress(count(1), flags), _FREE_EMPTIED - 1, None)):]


def _free_dict_step(container: dict[str, Any], emptied: set[int]) -> None:
    """Free the last _FREE_ITEMS members of `container`, or fewer: up to the _FREE_EMPTIED-th
    emptied one, or one large string (its pages handed back first: `textjoin.discard`)."""
    left = _FREE_EMPTIED
    for _ in range(min(_FREE_ITEMS, len(container))):
        value = container.popitem()[1]
        if id(value) in emptied:
            left -= 1
            if not left:
                return
        elif type(value) is str and len(value) >= textjoin.FROM_CHARS:  # a prompt of many MiB
            only = [value]
            del value
            textjoin.discard(only)
            return


def let_others_run() -> None:
    """Release the interpreter lock for a moment: the event loop thread, if it waits for it, runs
    now rather than when the interpreter's switch interval forces a hand-over."""
    time.sleep(0)


def decode_utf8(raw: bytes) -> str:
    """`raw.decode("utf-8")`, a piece at a time for a large body (every piece is one short C call,
    and the pieces are joined with the lock let go while they are copied: `textjoin`)."""
    if len(raw) <= _DECODE_PIECE:
        return raw.decode("utf-8")
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(raw)
    pieces = []
    try:
        for at in range(0, len(raw), _DECODE_PIECE):
            pieces.append(decoder.decode(view[at:at + _DECODE_PIECE]))
            let_others_run()
        pieces.append(decoder.decode(b"", final=True))
        return textjoin.join(pieces)
    finally:  # one at a time, even when a piece is refused: 128 MiB of them at once took 13 ms
        while pieces:
            del pieces[-1]
            let_others_run()


def loads(text: str, sinks: Mapping[str, Callable[[], Sink]] | None = None,
          large: list[list[Any] | dict[str, Any]] | None = None) -> Any:
    """`json.loads(text)` (see the module's docstring). The elements of a top-level array named
    in `sinks` go to a new sink of that name, a batch at a time (a repeated name starts a new one:
    the last wins, as in `json.loads`), which stands in for the array; each batch is `dismantle`d
    once its sink has it. The arrays and objects read a member at a time (too large for one
    window) or read whole from _ADD_CHARS characters on, the top-level object and, on an error,
    those left half-read are added to `large`, each after those around it, for the caller to
    `dismantle` when it is done with the value or the error."""
    reader = _Reader(text, [] if large is None else large)
    at = reader.ws(0)
    if text.startswith("{", at):
        value, at = reader.members(at, sinks or {})
    else:
        value, at = reader.value(at)
    end = reader.ws(at)
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
        self.untried_before = 0  # arrays and objects that open before this get a short try only
        self.runs_from = 0  # after a failed try at a run of objects, the next is tried from here on

    def pace(self, chars: int, items: int = 1) -> None:
        self.items += items
        self.chars += chars
        if self.items >= _PACE_ITEMS or self.chars >= _PACE_CHARS:
            self.offer()

    def offer(self) -> None:
        self.items = self.chars = 0
        let_others_run()

    def value(self, at: int) -> tuple[Any, int]:
        """The value that starts at text[at] and where it ends."""
        return self._whole(at) or self._large(at)

    def _slice(self, at: int) -> None:
        self.base, self.piece = at, self.text[at:at + WINDOW]
        self.piece_end = at + len(self.piece)
        self.last = self.piece_end == len(self.text)

    def ws(self, at: int) -> int:
        """Where the white space at text[at] ends, read a window at a time."""
        text, size = self.text, len(self.text)
        while True:
            limit = at + WINDOW
            at = _WS.match(text, at, limit).end()
            if at < limit or at >= size:
                return at
            self.pace(WINDOW)

    def _whole(self, at: int) -> tuple[Any, int] | None:
        """The value at text[at] read in one C call, when it ends within a window; None when it
        may not (it is larger, or malformed: reading it a piece at a time tells which).

        An array or object that does not fit makes the arrays and objects that open in the next
        half window be tried in a short piece of their own (_SHORT_TRY characters): each would
        likely fail the same way (a value nested 300 deep around a window would cost 300
        windows), and one that is short still goes to the scanner whole (a nest of 1000 levels in
        a few kilobytes is more than Python's own recursion takes)."""
        if at < self.untried_before and self.text[at:at + 1] in _OPENERS:
            piece = self.text[at:at + _SHORT_TRY]
            return self._scan(piece, at, 0, at + len(piece) == len(self.text))
        offset = at - self.base
        if offset < 0 or (self.piece_end - at < WINDOW // 2 and not self.last):
            self._slice(at)
            offset = 0
        found = self._scan(self.piece, self.base, offset, self.last)
        if found is None and offset:  # perhaps it fits a window of its own
            self._slice(at)
            found = self._scan(self.piece, at, 0, self.last)
        if found is None and self.text[at:at + 1] in _OPENERS:
            self.untried_before = at + WINDOW // 2
        return found

    def _scan(self, piece: str, base: int, offset: int, last: bool) -> tuple[Any, int] | None:
        """The value at piece[offset] (text[base + offset]; `last`: the piece runs to the end of
        the text) read in one C call, and where it ends in the text; None when the piece may have
        cut it short. An error in a piece that runs to the end is the text's own."""
        try:
            value, end = _SCAN(piece, offset)
        except StopIteration as stop:
            if last:
                raise _expecting_value(self.text, base + stop.value) from None
            return None
        except json.JSONDecodeError as e:
            if last:
                raise json.JSONDecodeError(e.msg, self.text, base + e.pos) from None
            return None
        except ValueError:  # ConstantRefused, or an integer's digits cut by the piece
            if last:
                raise
            return None
        # a number cut by the piece ("1." or "1e-" read as 1) ends within its last 3 characters
        if not last and end >= len(piece) - 3:
            return None
        if end - offset >= _ADD_CHARS and value and isinstance(value, list | dict):
            self.large.append(value)
        self.pace(end - offset)
        return value, base + end

    def _large(self, at: int) -> tuple[Any, int]:
        """The value at text[at] that `_whole` could not read, a piece at a time."""
        first = self.text[at:at + 1]
        if first == "{":
            return self.members(at, {})
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
            return textjoin.join(parts), stop + 1
        raise self._string_error(at, start, stop)

    def _string_error(self, at: int, start: int, stop: int) -> json.JSONDecodeError:
        """The standard library's error for the string that opens at text[at], valid up to
        text[stop]: its own reading of the last window from `start` (where an escape begins or
        ends) to a little past `stop` (the longest escape is 12 characters)."""
        text = self.text
        end = min(len(text), stop + 16)
        try:
            scanstring(text[start:end] + ("" if end == len(text) else '"'), 0)
        except json.JSONDecodeError as e:
            if e.msg.startswith("Unterminated string"):
                return json.JSONDecodeError(e.msg, text, at)
            return json.JSONDecodeError(e.msg, text, start + e.pos)
        return json.JSONDecodeError("Unterminated string starting at", text, at)  # not reached

    def array(self, at: int, sink: Sink | None = None) -> tuple[Any, int]:
        """The array that opens at text[at], one element at a time; with a `sink`, the elements go
        to it _PACE_ITEMS at a time, or a run read in one call at a time (and are dropped: nothing
        piles up for the garbage collector)
        and the sink stands in for the array. What the sink refuses in an element is raised
        before any error in the text after that element, as if it had been handed each one as it
        was read."""
        items: list[Any] = []
        if sink is None:
            self.large.append(items)
            return items, self._items(at, items, None)
        start = len(self.large)  # the containers of the batch being read are added from here

        def hand_over() -> None:
            batch = self.large[start:]
            del self.large[start:]
            try:
                sink.extend(items, batch)
            finally:  # handed over, even when refused: an error after it hands over only the rest
                batch.insert(0, items)  # emptied last, as the outermost
                dismantle(batch)

        try:
            at = self._items(at, items, hand_over)
        finally:
            hand_over()
        return sink, at

    def _objects(self, at: int) -> tuple[list[Any], int] | None:
        """The run of objects at text[at], each followed by a comma, that a window holds, read in
        one C call, and where the element after it starts; None when no such run was found.

        The run ends at one of the window's last _OBJECT_TRIES closing braces that a comma
        follows: "[" + the text up to that brace + "]" reads as an array only when the brace
        closes an element of this array (one inside an element, or inside a string, leaves that
        element open), so a cut in the wrong place is refused by the scanner, never misread. What
        it refuses for any other reason (an error, a constant, a number too long, nesting too
        deep) is left to the reading one value at a time, which says where and hands over what
        came before it. When the run's objects average _ADD_CHARS characters or more, they are
        added to `large`, as values read whole that large are. After a failed try, none is made
        again within the next window of text."""
        if at < self.runs_from:
            return None
        self.runs_from = at + WINDOW  # unless this try finds a run
        piece = self.text[at:at + WINDOW]
        end = len(piece)
        for _ in range(_OBJECT_TRIES):
            close = piece.rfind("}", 0, end)
            if close < 0:
                return None
            end = close
            separator = _COMMA.match(piece, close + 1)
            if separator is None or separator.end() == len(piece):
                continue
            try:
                values, stop = _SCAN("[" + piece[:close + 1] + "]", 0)
            except (ValueError, StopIteration, RecursionError):
                self.offer()  # a refused try may have read most of the window
                continue
            if stop != close + 3:
                self.offer()
                continue
            if close + 1 >= _ADD_CHARS * len(values):
                self.large += [value for value in values if value and type(value) in _CONTAINERS]
            self.pace(close + 1, len(values))
            self.runs_from = 0
            return values, at + separator.end()
        return None

    def _items(self, at: int, items: list[Any], batch_full: Callable[[], None] | None) -> int:
        text, comma, whole = self.text, _COMMA.match, self._whole
        at = self.ws(at + 1)
        if text.startswith("]", at):
            return at + 1
        one_by_one_until = 0  # a run that held a number too long for an integer is read one by one
        while True:
            numbers = (_NUMBERS.match(text, at, at + WINDOW)
                       if at >= one_by_one_until and text[at:at + 1] in _NUMBER_START else None)
            run = numbers.group() if numbers is not None else ""
            try:  # a run of numbers (token ids, say): one C call for all of them
                values = _SCAN("[" + run[:run.rindex(",")] + "]", 0)[0] if run else None
            except ValueError:  # read one at a time, so that what comes before it is handed over first
                values, one_by_one_until = None, at + len(run)
            if values is not None:
                items += values
                self.pace(len(run))
                at = self.ws(numbers.end()) if numbers.end() == at + WINDOW else numbers.end()
            elif text.startswith("{", at) and (found := self._objects(at)):
                values, at = found  # a run of objects (chat messages, say): one C call for all of them
                items += values
            else:
                item, at = whole(at) or self._large(at)
                items.append(item)
            if batch_full is not None and len(items) >= _PACE_ITEMS:
                batch_full()
            if values is not None:
                continue
            separator = comma(text, at, at + WINDOW)
            if separator is not None and separator.end() < at + WINDOW:
                at = separator.end()
                continue
            at = self.ws(at)
            if not text.startswith(",", at):
                break
            at = self.ws(at + 1)
        at = self.ws(at)
        if not text.startswith("]", at):
            raise json.JSONDecodeError("Expecting ',' delimiter", text, at)
        return at + 1

    def members(self, at: int, sinks: Mapping[str, Callable[[], Sink]]) -> tuple[dict[str, Any], int]:
        """The object that opens at text[at], one member at a time (see `loads` for `sinks`)."""
        text = self.text
        obj: dict[str, Any] = {}
        self.large.append(obj)
        at = self.ws(at + 1)
        if text.startswith("}", at):
            return obj, at + 1
        while True:
            if not text.startswith('"', at):
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, at)
            key, at = self.value(at)
            if len(key) > MAX_KEY_CHARS:
                raise KeyTooLong(f"an object key is longer than {MAX_KEY_CHARS} characters")
            at = self.ws(at)
            if not text.startswith(":", at):
                raise json.JSONDecodeError("Expecting ':' delimiter", text, at)
            at = self.ws(at + 1)
            if key in sinks and text.startswith("[", at):
                obj[key], at = self.array(at, sinks[key]())
            else:
                obj[key], at = self.value(at)
            if len(obj) > MAX_MEMBERS:
                raise TooManyMembers(f"an object has more than {MAX_MEMBERS} members")
            at = self.ws(at)
            if text.startswith(",", at):
                at = self.ws(at + 1)
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
