"""The piecewise JSON reader at its real window size and through `peek_body`: numbers and strings
cut by a window, what the event loop waits for while a large body is read and freed (the collector
off, so that a pause measured is the reader's own), what a refused body leaves behind, and what
nesting costs."""

from __future__ import annotations

import gc
import json
import sys
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
from harness import within_loop_gap

from crossbar import jsonpieces, textjoin
from crossbar.errors import CrossbarError
from crossbar.request import BodyPeek, peek_body, peek_body_off_loop

READ_WHOLE = jsonpieces.DECODER.decode
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
KEY = b"k" * 32
W = jsonpieces.WINDOW  # the real window, 65536


def _outcome(read: Callable[[str], Any], text: str) -> Any:
    try:
        return "value", read(text)
    except json.JSONDecodeError as e:
        return "error", e.msg, e.pos
    except ValueError as e:
        return "error", type(e).__name__


def _peek(raw: bytes, path: str, piecewise: bool) -> Any:
    try:
        return peek_body(raw, path, "m", 32 << 20, KEY, piecewise)
    except CrossbarError as e:
        return e.status, e.message


# ------------------------------------------------------------------ 1. a float cut by a window


@pytest.mark.parametrize("text", [
    '{"a":     11111111111111.5}',    # the window ends just after the point
    '{"a":   1.55555555555555e5}',    # ... just after the exponent mark
    '{"a":   1.55555555555555e-5}',   # ... just after the exponent's sign
    '{"a":    1.5555555555555E+5}',
])
def test_a_float_cut_after_its_point_or_exponent_mark_is_read_as_json_loads_reads_it(text: str) -> None:
    with mock.patch.object(jsonpieces, "WINDOW", 24):
        assert _outcome(jsonpieces.loads, text) == _outcome(READ_WHOLE, text)


@pytest.mark.parametrize("prefix, number_tail", [('{"prompt":"hi","a":1.', "e5}"),   # cut after "e"
                                                  ('{"prompt":"hi","a":', ".5}")])   # cut after "."
def test_a_float_shorter_than_a_window_is_peeked_piecewise_as_whole(prefix: str, number_tail: str) -> None:
    digits = "5" if number_tail == "e5}" else "1"
    raw = (prefix + digits * (W - len(prefix)) + number_tail).encode()  # the number: W - 17 characters
    assert len(raw) - len(prefix) < W
    assert _peek(raw, COMPLETIONS, True) == _peek(raw, COMPLETIONS, False)


# ------------------------------------------------------------------ 2. a large string that ends the text


@pytest.mark.parametrize("tail", ["\\", "\\u1234", "\\ud83d\\ude00"])
def test_a_large_string_ending_the_text_in_an_escape_is_refused_as_json_loads_refuses_it(tail: str) -> None:
    text = '"' + "x" * 100 + tail
    with mock.patch.object(jsonpieces, "WINDOW", 24):
        assert _outcome(jsonpieces.loads, text) == _outcome(READ_WHOLE, text)


def test_a_truncated_body_ending_in_a_backslash_is_refused_alike_piecewise_or_not() -> None:
    raw = b'{"prompt": "' + b"x" * 70_000 + b"\\"  # a client cut short mid-escape
    assert _peek(raw, COMPLETIONS, True) == _peek(raw, COMPLETIONS, False)


# ------------------------------------------------------------------ 3. a sink's refusal and a run of numbers


def test_a_sinks_refusal_comes_before_a_too_long_number_after_it_in_a_run() -> None:
    """`_Reader.array`: 'What the sink refuses in an element is raised before any error in the text
    after that element'. So it is when the long number ends the array, and so it was before."""
    last = b'{"messages": [1, ' + b"9" * 5000 + b"]}"
    in_run = b'{"messages": [1, ' + b"9" * 5000 + b", 2]}"
    assert _peek(last, CHAT, True) == (400, "messages[0] must be an object")
    assert _peek(in_run, CHAT, True) == (400, "messages[0] must be an object")


# ------------------------------------------------------------------ 4. white space read in one call


class _Spy:
    """A compiled pattern whose `match` records how many characters each call read."""

    def __init__(self, pattern: Any, spans: list[int]) -> None:
        self.pattern, self.spans = pattern, spans

    def match(self, string: str, pos: int = 0, endpos: int = sys.maxsize) -> Any:
        found = self.pattern.match(string, pos, endpos)
        self.spans.append(found.end() - pos if found else 0)
        return found


def test_no_white_space_match_reads_more_than_a_window() -> None:
    spans: list[int] = []
    text = '{"a": [1' + " " * 100 + ", 2" + " " * 100 + "]" + " " * 100 + "}" + " " * 100
    with mock.patch.object(jsonpieces, "WINDOW", 24), \
            mock.patch.object(jsonpieces, "_WS", _Spy(jsonpieces._WS, spans)), \
            mock.patch.object(jsonpieces, "_COMMA", _Spy(jsonpieces._COMMA, spans)):
        assert jsonpieces.loads(text) == json.loads(text)
    assert max(spans) <= 24


async def _peek_off_loop(raw: bytes, path: str) -> Any:
    try:
        return await peek_body_off_loop(raw, path, "m", 32 << 20, KEY)
    except CrossbarError as e:
        return e.status, e.message  # `e` (and what it holds) is let go here, on the loop


async def test_trailing_white_space_does_not_hold_the_event_loop() -> None:
    raw = b'{"model":"m","prompt":"hi"}' + b" " * (30 << 20)
    peek = await within_loop_gap(lambda: _peek_off_loop(raw, COMPLETIONS), 0.03)
    assert peek.model == "m"


# ------------------------------------------------------------------ 5. what is freed at once


@pytest.fixture
def no_collector() -> Any:
    """The cyclic collector off, so that a stall measured is the freeing's own, not a collection's."""
    gc.disable()
    yield
    gc.enable()


def test_the_top_level_object_read_a_member_at_a_time_is_left_for_dismantle() -> None:
    """`loads`: 'The arrays and objects read a member at a time ... are added to `large`': the
    top-level object always is read a member at a time, but is not added."""
    large: list[Any] = []
    value = jsonpieces.loads(json.dumps({f"k{i}": [] for i in range(50_000)}), large=large)
    assert any(container is value for container in large)


async def test_a_body_of_many_members_is_not_freed_at_once_on_the_loops_time(no_collector: Any) -> None:
    members = jsonpieces.MAX_MEMBERS - 3
    raw = b'{"model":"m","prompt":"hi",' + b"".join(b'"k%d":[[]],' % i for i in range(members)) + b'"z":0}'
    peek = await within_loop_gap(lambda: _peek_off_loop(raw, COMPLETIONS), 0.05)
    assert peek.model == "m"
    # the dict's last rehash (~6 ms) and its freeing bounded; 2M members held it 50 ms and more


def test_an_object_of_more_members_than_the_bound_is_refused() -> None:
    """Growing a dict rehashes it in one call: 2M members held the interpreter 50 ms."""
    members = b"".join(b'"k%d":0,' % i for i in range(jsonpieces.MAX_MEMBERS))
    raw = b'{"model":"m","prompt":"hi",' + members + b'"z":0}'
    assert _peek(raw, COMPLETIONS, True) == (
        400, f"request body refused: an object has more than {jsonpieces.MAX_MEMBERS} members")


def _window_of_empty_lists() -> str:
    return "[" + ",".join(["[]"] * 20_000) + "]"  # 60k characters: read whole, 20k lists


# Each of the 300 values fills more than an arena of the allocator, and is the last object left in
# it once emptied: the array that holds them, freed in one step, handed 300 arenas back to the
# system and held the loop 22-35 ms (freed at once, values and all: 135-220 ms); now 4-9 ms, with
# runs of 12-33 ms now and then on an idle machine (the worker inside one 2 ms scan of a window
# when the pause was seen), more often on a busy one.
async def test_dismantling_an_array_of_window_sized_values_does_not_hold_the_loop(no_collector: Any) -> None:
    raw = ('{"model":"m","prompt":"hi","x":[' + ",".join([_window_of_empty_lists()] * 300) + "]}").encode()
    peek = await within_loop_gap(lambda: _peek_off_loop(raw, COMPLETIONS), 0.015)
    assert peek.model == "m"


async def test_a_sink_batch_of_window_sized_values_is_not_freed_at_once(no_collector: Any) -> None:
    raw = ('{"model":"m","prompt":[' + ",".join([_window_of_empty_lists()] * 300) + "]}").encode()
    peek = await within_loop_gap(lambda: _peek_off_loop(raw, COMPLETIONS), 0.015)
    assert peek.model == "m"


def test_emptied_values_are_freed_a_few_at_a_time() -> None:
    """A step frees _FREE_EMPTIED members that were dismantled themselves (from the end, in a list
    or a dict), and up to _FREE_ITEMS others."""
    heavy = [[0] * 3 for _ in range(40)]  # dismantled: each may be the last object of an arena
    light = [[0] * 10 for _ in range(300)]  # not: small values read whole
    outer_list = light + heavy[:20]
    outer_dict = {f"k{i}": value for i, value in enumerate(heavy[20:])}
    plain = [[] for _ in range(jsonpieces._FREE_ITEMS + 5)]
    watched = {id(outer_list): "list", id(outer_dict): "dict", id(plain): "plain"}
    left: list[tuple[str, int]] = []
    real_list_step, real_dict_step = jsonpieces._free_list_step, jsonpieces._free_dict_step

    def list_step(container: list[Any], emptied: set[int]) -> None:
        real_list_step(container, emptied)
        if id(container) in watched:
            left.append((watched[id(container)], len(container)))

    def dict_step(container: dict[str, Any], emptied: set[int]) -> None:
        real_dict_step(container, emptied)
        left.append((watched[id(container)], len(container)))

    with mock.patch.object(jsonpieces, "_free_list_step", list_step), \
            mock.patch.object(jsonpieces, "_free_dict_step", dict_step):
        jsonpieces.dismantle([plain, outer_list, outer_dict, *heavy])
    assert left == [("dict", 4), ("dict", 0), ("list", 304), ("list", 0), ("plain", 5), ("plain", 0)]


# ------------------------------------------------------------------ 6. a refused large body


def _held_by(error: BaseException) -> list[Any]:
    """What `error` keeps alive along its chain of errors: each error's `doc` (a JSON error's
    document) and the locals of the frames in its traceback."""
    held: list[Any] = []
    exc: BaseException | None = error
    while exc is not None:
        held.append(getattr(exc, "doc", None))
        tb = exc.__traceback__
        while tb is not None:
            held += tb.tb_frame.f_locals.values()
            tb = tb.tb_next
        exc = exc.__context__
    return held


def _largest_held(error: BaseException) -> int:
    """The longest list or dict a local of a frame in `error`'s chained tracebacks holds."""
    return max((len(value) for value in _held_by(error) if isinstance(value, list | dict)), default=0)


def test_a_refused_body_does_not_keep_its_partial_parse_alive_in_the_error() -> None:
    raw = b'{"model":"m","prompt":"hi","x":{"y":[' + b"[]," * 200_000 + b"]}}"  # a trailing comma
    with pytest.raises(CrossbarError) as refused:
        peek_body(raw, COMPLETIONS, "m", 32 << 20, KEY, piecewise=True)
    assert refused.value.message.startswith("request body is not valid JSON: Expecting value")
    assert _largest_held(refused.value) < 4096


def _chat_of_32_mib_with(character: str) -> bytes:
    one = b'{"role":"user","content":"hello"},'
    last = b'{"role":"user","content":"y"}]}'
    raw = b'{"model":"m","messages":[' + one * ((32 << 20) // len(one) - 2) + last
    return raw.replace(b"hello", f"hell{character}".encode(), 1)


@pytest.mark.parametrize("character", ["é", "€", "\U0001F600"])
async def test_a_large_body_with_a_character_outside_ascii_does_not_hold_the_loop(no_collector: Any,
                                                                                  character: str) -> None:
    """One such character makes the decoded text one, two or four bytes a character: joining its
    pieces and freeing it held the loop 14-20, 28-32 and 52-56 ms (now about 4)."""
    raw = _chat_of_32_mib_with(character)
    assert len(raw) <= 32 << 20
    peek = await within_loop_gap(lambda: _peek_off_loop(raw, CHAT), 0.012)
    assert peek.model == "m" and peek.n_messages > 900_000


def _chat_with(**fields: Any) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body, ensure_ascii=False).encode()


def _tools(description: str, count: int = 1) -> list[Any]:
    return [{"type": "function", "function": {"name": "f", "description": description,
                                              "parameters": {"a": [1, 2, 3]}}}] * count


_MEASURED_BODIES: dict[str, Callable[[], bytes]] = {  # built in the test, not at collection
    "a message's text of 8M emoji": lambda: _chat_with(
        messages=[{"role": "user", "content": "\U0001F600" * ((8 << 20) - 64)}]),
    "a tool's description of 30 MiB": lambda: _chat_with(tools=_tools("x" * (30 << 20))),
    "a tool's description of 10M euro signs": lambda: _chat_with(tools=_tools("\u20ac" * (10 << 20))),
    "300,000 small tools": lambda: _chat_with(tools=_tools("d", 300_000)),
    "a tool's description with a lone surrogate (escaped)": lambda: _chat_with(
        tools=_tools("x" * (30 << 20))).replace(b'"description": "x', b'"description": "\\ud800', 1),
    "a message's role of 8M emoji": lambda: _chat_with(
        messages=[{"role": "\U0001F600" * ((8 << 20) - 64), "content": "hi"}]),
    "a tool call's arguments object": lambda: _chat_with(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {
            "a": "\u20ac" * (10 << 20)}}}]}]),
}


@pytest.mark.parametrize("name", list(_MEASURED_BODIES))
async def test_measuring_a_large_bodys_prompt_does_not_hold_the_loop(no_collector: Any, name: str) -> None:
    """The prompt's bytes were counted in one call per text (`str.encode`) and per tools value
    (orjson, or `json.dumps` when orjson cannot write it): 20-184 ms for these bodies."""
    raw = _MEASURED_BODIES[name]()
    assert len(raw) <= 32 << 20
    peek = await within_loop_gap(lambda: _peek_off_loop(raw, CHAT), 0.012)
    assert isinstance(peek, BodyPeek) and peek.prompt_bytes > 8 << 20, peek


@pytest.mark.parametrize("key", [lambda: "x" * (30 << 20), lambda: "\U0001F600" * ((8 << 20) - 64)])
async def test_an_object_key_longer_than_the_limit_is_refused_without_holding_the_loop(
        no_collector: Any, key: Callable[[], str]) -> None:
    """A dict hashes its key in one call: 17 ms for a key of 32M ASCII characters, 57 for 32M emoji."""
    raw = _chat_with(**{key(): 1})
    refusal = await within_loop_gap(lambda: _peek_off_loop(raw, CHAT), 0.012)
    limit = jsonpieces.MAX_KEY_CHARS
    assert refusal == (400, f"request body refused: an object key is longer than {limit} characters")
    assert _peek(_chat_with(**{"k" * limit: 1}), CHAT, True).model == "m"  # one of the limit's length is read


async def test_emptied_values_of_many_nested_members_are_not_freed_many_at_once(no_collector: Any) -> None:
    """533 values of 1,000 members of 19 lists each: each emptied value was the last object in an
    arena, and a step that freed 512 of them held the loop 51-62 ms."""
    inner = "[" + ",".join(["[" + ",".join(["[]"] * 19) + "]"] * 1000) + "]"
    raw = ('{"model":"m","prompt":"hi","x":[' + ",".join([inner] * 533) + "]}").encode()
    peek = await within_loop_gap(lambda: _peek_off_loop(raw, COMPLETIONS), 0.015)
    assert peek.model == "m"


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, {"model": "m",
                   "prompt": [{"prompt_string": "x" * 2000}, "abc", {"prompt_string": "y"}, 7] * 1500}),
    (CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"d": "x" * 2000}, "abc", {"b": 1}, 7] * 1500}),
])
def test_a_run_of_objects_among_other_values_is_read(path: str, body: dict[str, Any]) -> None:
    """A run read in one call may hold strings and numbers between its objects: they were added to
    the containers to dismantle, and freeing them raised (`'str' object has no attribute
    'popitem'`)."""
    raw = json.dumps(body).encode()
    assert len(raw) >= 2 << 20
    assert _peek(raw, path, True) == _peek(raw, path, False)


def test_a_non_object_message_in_a_run_is_refused_by_its_index() -> None:
    big = {"role": "user", "content": "x" * 2000}
    raw = json.dumps({"model": "m", "messages": [big, 1.5, big, 2] * 10}).encode()
    assert _peek(raw, CHAT, True) == (400, "messages[1] must be an object")


def test_a_large_bodys_text_and_large_strings_are_discarded_in_the_worker() -> None:
    """Their pages go back to the system with the lock let go (`textjoin.discard`), so freeing them
    does not hold it: the decoded text, and a large string value of an object."""
    released: list[int] = []
    real = textjoin._MADVISE

    def madvise(at: int, size: int, advice: int) -> int:
        released.append(size)
        return real(at, size, advice) if real is not None else 0

    with mock.patch.object(textjoin, "_MADVISE", madvise):
        raw = b'{"model":"m","prompt":"' + b"x" * (3 << 20) + b'","n":1}'
        peek = peek_body(raw, COMPLETIONS, "m", 32 << 20, KEY, piecewise=True)
    assert peek.model == "m" and peek.prompt_bytes == 3 << 20
    if real is not None:
        assert len(released) == 2 and min(released) > (3 << 20) - 8192


def _largest_text_held(error: BaseException) -> int:
    """The longest text an error keeps alive: a JSON error's document, a string, a reader's text or
    decoded pieces among its frames' locals, along its chain of errors."""
    texts = []
    for value in _held_by(error):
        texts += [value, getattr(value, "text", None)]
        if isinstance(value, list):  # decoded pieces
            texts.append("".join(piece for piece in value if isinstance(piece, str)))
    return max((len(text) for text in texts if isinstance(text, str)), default=0)


@pytest.mark.parametrize("raw, path", [
    (b'{"model":"m","prompt":"' + b"x" * (3 << 20) + b'",}', COMPLETIONS),  # a trailing comma
    (b'{"model":"m","messages":[' + b'{"role":"user","content":"x"},' * 200_000 + b"3]}", CHAT),  # a sink's
    ('"\U0001F600'.encode() + b"a" * (3 << 20) + b'"', COMPLETIONS),  # a string, not an object
    (b'{"model":"m","prompt":"' + b"a" * (3 << 20) + b'\xff"}', COMPLETIONS),  # not UTF-8 at its end
])
def test_a_refused_large_body_keeps_nothing_of_its_decoded_text_in_the_error(raw: bytes, path: str) -> None:
    """The error goes back to the event loop: the text it kept (the JSON error's document, the
    reader's frames) was freed there, 13 ms for 32 MiB with one emoji."""
    with pytest.raises(CrossbarError) as refused:
        peek_body(raw, path, "m", 32 << 20, KEY, piecewise=True)
    assert refused.value.status == 400
    assert _largest_text_held(refused.value) < 1 << 16


async def test_a_refused_large_body_is_not_freed_at_once_on_the_loops_time(no_collector: Any) -> None:
    raw = b'{"model":"m","prompt":"hi","x":{"y":[' + b"[]," * 3_000_000 + b"]}}"
    refusal = await within_loop_gap(lambda: _peek_off_loop(raw, COMPLETIONS), 0.03)
    assert refusal[0] == 400


# ------------------------------------------------------------------ 7. cost of nesting


def test_a_nested_value_a_little_larger_than_a_window_costs_about_what_json_loads_costs() -> None:
    """A 66 KB body (over 16384 commas: peeked off the loop, piecewise) of one array nested 200
    deep around 33k zeros: every level is scanned twice to a window's end before being read a
    member at a time."""
    text = '{"prompt":"hi","x":' + "[" * 200 + "0," * 33_000 + "0" + "]" * 200 + "}"
    assert jsonpieces.loads(text) == READ_WHOLE(text)
    # the quickest of five runs each, taken in turn: a cost that grows with the nesting grows in
    # every run, a collection or a busy moment does not. Read piecewise it takes about 20 times
    # json.loads (26-49 ms against 1.3-2.6 ms on one machine within minutes); two windows scanned
    # a level took 600 ms (over 200 times)
    runs = [(_seconds(lambda: jsonpieces.loads(text)), _seconds(lambda: READ_WHOLE(text))) for _ in range(5)]
    piecewise, whole = min(p for p, _ in runs), min(w for _, w in runs)
    assert piecewise < 60 * whole + 0.03, f"{piecewise * 1000:.0f} ms against {whole * 1000:.1f} ms"


def _seconds(run: Callable[[], Any]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


@pytest.mark.parametrize("depth", [340, 1000])
def test_a_small_deep_value_beside_a_large_one_is_read_as_json_loads_reads_it(depth: int) -> None:
    """After a large value's failed try, its neighbours were read a member at a time in Python,
    whose recursion gave out near 330 levels where the scanner's takes a thousand."""
    text = '{"x":[' + "[" * depth + "]" * depth + ',"' + "y" * W + '"]}'
    assert jsonpieces.loads(text) == READ_WHOLE(text)
    raw = text.replace('{"x"', '{"prompt":"hi","x"', 1).encode()
    assert _peek(raw, COMPLETIONS, True) == _peek(raw, COMPLETIONS, False)


async def test_a_body_of_many_small_values_does_not_hold_the_loop_with_the_collector_on() -> None:
    """Full collections over the parse's millions of containers, run in the worker, held the loop
    130 ms per 8 MiB; the collector is paused while a large body is peeked."""
    gc.collect()
    gc.freeze()  # as crossbar does once started (reclaim.freeze_startup)
    try:
        raw = b'{"model":"m","prompt":"hi","x":[' + b"[]," * ((8 << 20) // 3) + b"[]]}"
        peek = await within_loop_gap(lambda: _peek_off_loop(raw, COMPLETIONS), 0.03)
        assert gc.isenabled()
    finally:
        gc.unfreeze()
    assert peek.model == "m"
