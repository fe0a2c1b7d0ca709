"""The piecewise JSON reader against `json.loads`, through windows small enough that every path
(a value read whole, an array or object read member by member, a string read a window at a time,
a surrogate pair split between two windows) is taken, and the cost of one C call bounded."""

from __future__ import annotations

import json
import time
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crossbar import jsonpieces

READ_WHOLE = jsonpieces.DECODER.decode  # `json.loads`, NaN and ±Infinity refused
SMALL_WINDOW = 24  # a few values to a window: six characters (one escape) is the least a string needs

_strings = st.text(max_size=40) | st.sampled_from([
    "\ud83d\ude00", "a\ud83d\ude00b" * 9, "\ud800", "\udc00\ud800", "\\" * 13, '"' * 7, "\x01\x1f", "é" * 30])
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.sampled_from([0.5, -2.25, 1e-7]) | _strings,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(_strings, inner, max_size=5),
    max_leaves=40)


def _outcome(read: Any, text: str) -> Any:
    try:
        return "value", read(text)
    except json.JSONDecodeError as e:
        return "error", e.msg, e.pos
    except ValueError as e:
        return "error", type(e).__name__, str(e)


def _texts(value: Any) -> list[str]:
    """The value written compact, indented and (when it is valid UTF-8) without ASCII escapes:
    crossbar reads text decoded from UTF-8, which holds no lone surrogate of its own."""
    texts = [json.dumps(value), json.dumps(value, indent=1)]
    unescaped = json.dumps(value, ensure_ascii=False)
    try:
        unescaped.encode("utf-8")
    except UnicodeEncodeError:
        return texts
    return [*texts, unescaped]


@pytest.fixture(autouse=True)
def small_windows() -> Any:
    with mock.patch.object(jsonpieces, "WINDOW", SMALL_WINDOW):
        yield


@settings(max_examples=500, deadline=None)
@given(value=_json)
def test_a_text_read_through_small_windows_is_what_json_loads_reads(value: Any) -> None:
    for text in _texts(value):
        assert jsonpieces.loads(text) == READ_WHOLE(text), text


_breakers = st.sampled_from(
    [",", "]", "}", "[", "{", '"', "\\", ":", "x", "\x01", "\\u12", "\\ud83d", " ", "-", "tru"])


@settings(max_examples=800, deadline=None)
@given(value=_json, data=st.data())
def test_a_broken_text_read_through_small_windows_is_refused_where_json_loads_refuses_it(value: Any,
                                                                                           data: Any) -> None:
    text = json.dumps({"a": value, "b": [value, "x" * 30]})
    at = data.draw(st.integers(0, len(text)))
    cut = data.draw(st.integers(0, 2))
    broken = text[:at] + data.draw(_breakers) + text[at + cut:]
    assert _outcome(jsonpieces.loads, broken) == _outcome(READ_WHOLE, broken), broken


@pytest.mark.parametrize("text", [
    '"' + "ab\\n" * 40 + '"',  # escapes cut by the window's end
    '"' + "\\ud83d\\ude00" * 20 + '"',  # surrogate pairs split between windows
    '"' + "\\ud83d" * 9 + "x" + '"',  # lone high surrogates, none joined
    '"' + "x" * 100,  # unterminated
    '"' + "x" * 100 + "\\q" + '"',  # an invalid escape past the first window
    '"' + "x" * 100 + "\\u12x4" + '"',
    '"' + "x" * 100 + "\x02" + '"',
    '[' + ", ".join(['{"k": [1, 2, {"z": "' + "y" * 30 + '"}]}'] * 6) + "]",
    '{"a": [' + "[" * 30 + "]" * 30 + "]}",
    '{"a": ' + "1" * 10 + "}",  # a number that fits
    "[" + "1.5, " * 40 + "NaN]",
    "[" + '"s", ' * 40 + "-Infinity]",
    "[1, 2,]", '{"a": 1,}', '{"a" 1}', "[1 2]", "", "   ", "[" * 50,
])
def test_edges_read_through_small_windows_are_read_as_json_loads_reads_them(text: str) -> None:
    assert _outcome(jsonpieces.loads, text) == _outcome(READ_WHOLE, text)


def test_a_number_longer_than_a_window_is_refused_as_too_long() -> None:
    with pytest.raises(ValueError, match="a number longer than"):
        jsonpieces.loads("[" + "1" * (3 * SMALL_WINDOW) + ".5]")


def test_the_elements_of_a_named_top_level_array_go_to_its_sink_a_batch_at_a_time() -> None:
    batches: list[int] = []

    class Count:
        def extend(self, items: Any, large: Any) -> None:
            batches.append(len(items))

    messages = [{"role": "user", "content": ["part"] * 5}] * 600
    body = jsonpieces.loads(json.dumps({"messages": messages, "n": [1]}), {"messages": Count})
    assert isinstance(body["messages"], Count) and body["n"] == [1]
    assert sum(batches) == 600 and max(batches) <= 256


@pytest.mark.parametrize("bulk", ["content parts", "token ids", "escaped text", "top-level array"])
def test_no_single_call_reads_more_than_a_window(bulk: str) -> None:
    """A C call's cost grows with what it reads: one value of a large body held the interpreter
    lock for the whole of it. Each scan (and each string run) reads no more than one window."""
    value: Any = {
        "content parts": {"messages": [{"role": "user", "content": [{"type": "text", "text": "t"}] * 3000}]},
        "token ids": {"prompt": [[7] * 20000]},
        "escaped text": {"messages": [{"role": "user", "content": "a\nb\"" * 8000}]},
        "top-level array": [[1, [2, [3]]]] * 3000,
    }[bulk]
    text = json.dumps(value)
    longest = 0
    real_scan, real_match = jsonpieces._SCAN, jsonpieces._STRING_RUN.match

    def scan(piece: str, at: int) -> Any:
        nonlocal longest
        longest = max(longest, len(piece) - at)
        return real_scan(piece, at)

    def match(string: str, pos: int, endpos: int) -> Any:
        nonlocal longest
        longest = max(longest, endpos - pos)
        return real_match(string, pos, endpos)

    with mock.patch.object(jsonpieces, "WINDOW", 1 << 12), mock.patch.object(jsonpieces, "_SCAN", scan), \
            mock.patch.object(jsonpieces, "_STRING_RUN", mock.Mock(match=match)):
        assert jsonpieces.loads(text) == value
    assert longest <= 1 << 12


def test_the_interpreter_is_offered_to_other_threads_as_a_large_value_is_read() -> None:
    """At least once a window: one C call reads a window at most (a run of small objects, read
    in one call, is offered after as its many values)."""
    offers = 0

    def offer() -> None:
        nonlocal offers
        offers += 1

    text = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "t"}] * 20000}]})
    with mock.patch.object(jsonpieces, "WINDOW", 1 << 16), \
            mock.patch.object(jsonpieces, "let_others_run", offer):
        started = time.perf_counter()
        jsonpieces.loads(text)
    assert offers >= len(text) // (1 << 16), (offers, time.perf_counter() - started)


_object_strings = _strings | st.sampled_from(["},", "}, {", '"},{"', "{", "}", ",", "a}, b", "\\"])
_small_objects = st.dictionaries(
    _object_strings, st.none() | st.integers(-99, 99) | _object_strings
    | st.lists(st.integers(0, 9) | _object_strings, max_size=3)
    | st.dictionaries(_object_strings, st.integers(0, 9) | _object_strings, max_size=2), max_size=3)


@settings(max_examples=400, deadline=None)
@given(objects=st.lists(_small_objects, max_size=40), window=st.sampled_from([32, 64, 256]), data=st.data())
def test_runs_of_small_objects_are_read_as_json_loads_reads_them(objects: list[Any], window: int,
                                                                  data: Any) -> None:
    """A window's run of objects is read in one C call, ending at a brace that a comma follows:
    braces and commas inside strings and nested values, cuts in every place, and errors after,
    inside and before a run are read and refused as `json.loads` reads and refuses them."""
    texts = [json.dumps({"messages": objects, "tools": [{"t": 1}, {"t": 2}], "end": {"e": 0}}),
             json.dumps([objects, {"x": 1}, objects], indent=1), json.dumps(objects, separators=(",", ":"))]
    text = data.draw(st.sampled_from(texts))
    at = data.draw(st.integers(0, len(text)))
    broken = text[:at] + data.draw(_breakers | st.just("NaN")) + text[at + data.draw(st.integers(0, 2)):]
    with mock.patch.object(jsonpieces, "WINDOW", window):
        assert _outcome(jsonpieces.loads, text) == _outcome(READ_WHOLE, text), text
        assert _outcome(jsonpieces.loads, broken) == _outcome(READ_WHOLE, broken), broken


def test_a_run_of_objects_goes_to_the_sink_in_order_and_its_refusal_comes_before_a_later_error() -> None:
    seen: list[Any] = []

    class Refuse:
        def extend(self, items: Any, large: Any) -> None:
            for item in items:
                if item.get("bad"):
                    raise ValueError(f"refused {item['n']}")
                seen.append(item["n"])

    messages = [{"n": i, "role": "user"} for i in range(3000)]
    good = json.dumps({"messages": messages})
    with mock.patch.object(jsonpieces, "WINDOW", 1 << 12):
        assert isinstance(jsonpieces.loads(good, {"messages": Refuse})["messages"], Refuse)
        assert seen == list(range(3000))
        seen.clear()
        messages[1500]["bad"] = True
        broken = json.dumps({"messages": messages})[:-40] + "NaN]}"  # an error after the refused one
        with pytest.raises(ValueError, match="refused 1500"):
            jsonpieces.loads(broken, {"messages": Refuse})
    assert seen == list(range(1500))


def test_refused_tries_at_a_run_of_objects_offer_the_interpreter_too() -> None:
    """Braces that a comma follows, inside strings cut by the window's end: each try at a run
    scans most of a window and is refused; three such scans came one after another with the
    interpreter never offered between them."""
    text = "[" + ", ".join(['{"a": "' + "x}," * 3000 + '"}'] * 300) + "]"
    tries = most = 0
    real_scan = jsonpieces._SCAN

    def scan(piece: str, at: int) -> Any:
        nonlocal tries, most
        if at == 0 and piece.startswith("[{"):  # a try at a run
            tries += 1
            most = max(most, tries)
        return real_scan(piece, at)

    def offer() -> None:
        nonlocal tries
        tries = 0

    with mock.patch.object(jsonpieces, "WINDOW", 1 << 16), mock.patch.object(jsonpieces, "_SCAN", scan), \
            mock.patch.object(jsonpieces, "let_others_run", offer):
        assert jsonpieces.loads(text) == READ_WHOLE(text)
    assert most <= 2  # a run read is paced as values are; after a refused try the lock is offered
