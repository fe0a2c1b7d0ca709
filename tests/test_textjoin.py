"""`textjoin.join`: the same string `"".join` makes, with a large ASCII result copied while the
interpreter lock is let go."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from harness import within_loop_gap

from crossbar import jsonpieces, textjoin

BIG = textjoin.FROM_CHARS


class Text(str):
    pass


@pytest.mark.parametrize("pieces", [
    [], [""], ["a"], ["ab", "", "cd"],
    ["x" * BIG], ["x" * (BIG // 2), "y" * (BIG // 2)], ["a" * 7, "b" * BIG, "", "c\n" * 1000],
    ["x" * BIG, "é"], ["€" * BIG, "a"], ["x" * BIG, "\U0001F600"],  # not ASCII: `"".join`
    [Text("x" * BIG), "y"],  # a subclass keeps its characters elsewhere: `"".join`
    ["x" * (BIG - 1)], ["x" * (BIG - 1), "y"],
])
def test_join_makes_what_str_join_makes(pieces: list[str]) -> None:
    joined = textjoin.join(pieces)
    assert joined == "".join(pieces)
    assert type(joined) is str and len(joined) == sum(map(len, pieces))
    assert joined.isascii() == all(p.isascii() for p in pieces)


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
        assert textjoin._HEADER is not None and textjoin._NEW is not None


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
