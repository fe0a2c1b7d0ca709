"""`textjoin.join`: the same string `"".join` makes, with a large result copied while the
interpreter lock is let go."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
from harness import LOOP_GAP_TRIES, within_loop_gap

from crossbar import jsonpieces, textjoin

BIG = textjoin.FROM_CHARS


class Text(str):
    pass


@pytest.mark.parametrize("pieces", [
    [], [""], ["a"], ["ab", "", "cd"],
    ["x" * BIG], ["x" * (BIG // 2), "y" * (BIG // 2)], ["a" * 7, "b" * BIG, "", "c\n" * 1000],
    ["x" * BIG, "é"], ["é" * BIG], ["€" * BIG, "a"], ["x" * BIG, "\U0001F600"], ["\U0001F600" * BIG],
    ["é" * 9, "x" * BIG, "€", "", "\U0001F600", "ÿ" * 3],  # every kind, narrower ones widened
    ["é" * 5, "x" * BIG, "€" * 3],
    ["\ud83d" * BIG, "\ude00", "x"],  # lone surrogates (a JSON escape makes them) stay apart
    ["x" * (BIG // 2), "\udfff" * (textjoin.WIDEN_CHARS + 7), "\U0010ffff"],  # widened in slices
    [Text("x" * BIG), "y"],  # a subclass keeps its characters elsewhere: `"".join`
    ["x" * (BIG - 1)], ["x" * (BIG - 1), "y"],
])
def test_join_makes_what_str_join_makes(pieces: list[str]) -> None:
    joined, expected = textjoin.join(pieces), "".join(pieces)
    assert joined == expected and hash(joined) == hash(expected)
    assert type(joined) is str and len(joined) == sum(map(len, pieces))
    assert joined.isascii() == all(p.isascii() for p in pieces)
    assert sys.getsizeof(joined) == sys.getsizeof(expected)  # the same kind: canonical
    assert max(joined, default="") == max(expected, default="")


def test_a_joined_large_string_is_an_ordinary_string() -> None:
    pieces = [f"{i:07d}," * (1 << 14) for i in range(16)]
    joined, expected = textjoin.join(pieces), "".join(pieces)
    assert joined is not expected and joined == expected
    assert hash(joined) == hash(expected)
    assert {joined: 1}[expected] == 1
    assert joined[8:16] == expected[8:16] and joined[-8:] == expected[-8:]
    assert joined.encode() == expected.encode()
    assert joined.count(",") == len(pieces) << 14
    assert sys.getrefcount(joined) == sys.getrefcount(expected)  # no reference leaked


def test_the_layout_check_finds_where_characters_start() -> None:
    if sys.implementation.name == "cpython":
        assert textjoin._LAYOUT is not None and textjoin._NEW is not None


@pytest.mark.parametrize("off_by", [-8, 8])
def test_a_layout_that_reads_otherwise_is_not_used(off_by: int) -> None:
    real = sys.getsizeof
    with mock.patch.object(sys, "getsizeof", lambda o: real(o) + off_by):
        assert textjoin._layout() is None
    with mock.patch.object(textjoin, "_KIND", 0b111 << 3):  # the kind read from other bits
        assert textjoin._layout() is None


@pytest.mark.parametrize("character", ["é", "€", "\U0001F600"])
async def test_decoding_a_large_body_with_a_character_outside_ascii_does_not_hold_the_event_loop(
        character: str) -> None:
    """One such character makes the text one, two or four bytes a character: `"".join` held the
    interpreter lock 14-20, 28-32 and 52-56 ms for these 32 MiB bodies."""
    raw = b'{"model":"m","messages":[' + b'{"role":"user","content":"hello"},' * (1 << 20)
    raw = raw.replace(b"hello", f"hell{character}".encode(), 1)
    text = await within_loop_gap(lambda: asyncio.to_thread(jsonpieces.decode_utf8, raw), 0.01)
    assert text == raw.decode()


async def test_decoding_a_large_body_in_a_worker_does_not_hold_the_event_loop() -> None:
    """Joining the decoded pieces of a 32 MiB body was one call that held the interpreter lock
    15-25 ms (the loop, and every stream on it, waited)."""
    raw = b'{"model":"m","messages":[' + b'{"role":"user","content":"hello"},' * (1 << 20)
    text = await within_loop_gap(lambda: asyncio.to_thread(jsonpieces.decode_utf8, raw), 0.01)
    assert len(text) == len(raw) and text[:10] == raw[:10].decode()


async def test_reading_a_string_value_of_many_windows_does_not_hold_the_event_loop() -> None:
    """A string larger than a window is read a window at a time; joining its parts at the end was
    one call that held the interpreter lock as long as joining a whole body's did."""
    text = '{"model":"m","prompt":"' + "word " * (6 << 20) + '"}'
    value = await within_loop_gap(lambda: asyncio.to_thread(jsonpieces.loads, text), 0.01)
    assert value["model"] == "m" and len(value["prompt"]) == 30 << 20


def test_pieces_given_by_an_iterator_are_joined() -> None:
    """They were counted, checked and copied in three passes: an iterator gave nothing to the
    copy, and the result was whatever the fresh memory held."""
    pieces = ["a" * BIG, "b" * BIG]
    assert textjoin.join(iter(pieces)) == "".join(pieces)
    assert textjoin.join(p for p in pieces) == "".join(pieces)


def _in_a_process_of_its_own(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)


def test_a_result_type_set_on_the_shared_function_elsewhere_does_not_change_join() -> None:
    """`ctypes.pythonapi.PyUnicode_New` is one object for the whole process: with its result type
    set to an address by other code, `join` copied a MiB into an int (a segmentation fault)."""
    done = _in_a_process_of_its_own(
        "import ctypes\n"
        "from crossbar import textjoin\n"
        "ctypes.pythonapi.PyUnicode_New.restype = ctypes.c_void_p\n"
        "pieces = ['x' * (1 << 20), 'y']\n"
        "assert textjoin.join(pieces) == ''.join(pieces)\n"
        "print('joined')\n")
    assert (done.returncode, done.stdout.strip()) == (0, "joined"), done.stderr[-2000:]


def test_a_list_that_grows_while_its_pieces_are_copied_is_joined_as_it_was_taken() -> None:
    """The copies let go of the lock: a list another thread appended to meanwhile was copied past
    the end of the result (a segmentation fault)."""
    done = _in_a_process_of_its_own(
        "import threading, time\n"
        "from crossbar import textjoin\n"
        "pieces = ['x' * (1 << 20)] * 8\n"
        "stop = False\n"
        "def grow():\n"
        "    while not stop:\n"
        "        pieces.append('x' * (1 << 20)); time.sleep(0)\n"
        "t = threading.Thread(target=grow); t.start()\n"
        "for _ in range(20):\n"
        "    out = textjoin.join(pieces)\n"
        "    assert len(out) % (1 << 20) == 0 and out.count('x') == len(out)\n"
        "    del pieces[8:]\n"
        "stop = True; t.join()\n"
        "print('joined')\n")
    assert (done.returncode, done.stdout.strip()) == (0, "joined"), done.stderr[-2000:]


def _released(make: Callable[[], str], keep: bool) -> list[tuple[int, int]]:
    """The ranges `textjoin.discard` handed back for the string `make` makes (its only reference
    unless `keep`: a list holds it too; made here, since pytest keeps what an assert's calls
    return and what parameters hold), each checked to lie within its characters."""
    text = make()
    released: list[tuple[int, int]] = []
    layout = textjoin._LAYOUT
    assert layout is not None
    width = (textjoin._state(text, layout) & textjoin._KIND) >> 2
    data = id(text) + (layout.ascii_data if text.isascii() else layout.data)
    end = data + len(text) * width
    kept = [text] if keep else []
    only = [text]
    del text

    def record(at: int, size: int, advice: int) -> int:
        released.append((at, size))
        return 0

    with mock.patch.object(textjoin, "_MADVISE", record):
        textjoin.discard(only)
    assert only == [] and all(data <= at and at + size <= end for at, size in released)
    del kept
    return released


@pytest.mark.skipif(textjoin._LAYOUT is None, reason="CPython's string layout")
@pytest.mark.parametrize("character", ["x", "é", "€", "\U0001F600"])
def test_a_large_string_referred_to_once_has_its_pages_handed_back(character: str) -> None:
    assert _released(lambda: "".join([character * (BIG * 2), character * (BIG * 2)]), keep=False)


@pytest.mark.skipif(textjoin._LAYOUT is None, reason="CPython's string layout")
@pytest.mark.parametrize("make, keep", [
    (lambda: "".join(["x" * BIG, "x" * BIG]), True),  # referred to from elsewhere too
    (lambda: "".join(["x" * (BIG // 2), "x" * (BIG // 2 - 1)]), False),  # small: freed quickly anyway
    (lambda: Text("x" * BIG * 4), False),  # not a plain string
])
def test_a_string_referred_to_elsewhere_a_small_one_or_another_type_is_left_as_it_is(
        make: Callable[[], str], keep: bool) -> None:
    assert _released(make, keep) == []


def test_a_string_held_by_a_container_is_left_as_it_is() -> None:
    """`discard` counts references: an expression's value that a dict also holds is not alone."""
    held = {"prompt": "".join(["€" * BIG, "€" * BIG])}
    textjoin.discard([held["prompt"]])
    assert held["prompt"] == "€" * (BIG * 2)


async def test_discarding_a_large_string_does_not_hold_the_event_loop() -> None:
    """Freeing a 128 MiB string (32M characters, some of them emoji) held the interpreter lock
    13 ms while the system took its pages back; they now go back with the lock let go."""
    strings = [["".join(["\U0001F600" * (16 << 20), "x" * (16 << 20)])] for _ in range(LOOP_GAP_TRIES)]
    turns = iter(strings)  # one a try, made before: making one on the loop would hold it
    await within_loop_gap(lambda: asyncio.to_thread(textjoin.discard, next(turns)), 0.006)
    assert strings[0] == []
