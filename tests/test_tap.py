from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from strategies_util import mostly

from crossbar import jsonread, tap
from crossbar.jsonread import UNREAD
from crossbar.tap import SSETap, Usage, merge, usage_from_body, usage_from_object

SAMPLES = Path("/work/shared/llama-lab/samples")
needs_samples = pytest.mark.skipif(not SAMPLES.is_dir(), reason="llama-lab samples absent")


def _body(name: str) -> bytes:
    """A recorded reply's body: what follows the first blank line after the `HTTP` status line."""
    raw = (SAMPLES / name).read_bytes()
    status = raw.index(b"\nHTTP ")
    return raw[raw.index(b"\n\n", status) + 2 :]


STREAMS: dict[str, tuple[Usage, str]] = {
    # no stream_options: timings on the finish chunk only
    "single/chat_stream.txt": (Usage(31, 30, 8, 0.745, 1, 0.175), "length"),
    # include_usage: an extra choices:[] chunk with usage + timings
    "single/chat_stream_usage.txt": (Usage(31, 30, 8, 0.739, 1, 0.124), "length"),
    "router/chat_model0_stream_usage.txt": (Usage(24, 23, 8, 2.145, 1, 0.505), "length"),
}
BODIES: dict[str, Usage] = {
    "single/chat_nonstream.txt": Usage(31, 30, 16, 1.03, 1, 0.25),
    "single/cache_run2.txt": Usage(1219, 1218, 4, 1.336, 1, 0.683),
}


def _replay(chunks: Iterable[bytes], end: bool = True) -> tuple[SSETap, bytes]:
    tap = SSETap(clock=lambda: 12.5)
    out = bytearray()
    for chunk in chunks:
        result = tap(chunk)
        assert result is chunk
        out += result
    if end:
        assert tap(b"") == b""
    return tap, bytes(out)


def _chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def _assert_tap(tap: SSETap, data: bytes, usage: Usage, finish_reason: str) -> None:
    assert tap.usage == usage
    assert tap.done
    assert tap.saw_done_marker
    assert tap.finish_reason == finish_reason
    assert tap.events == data.count(b"\ndata:") + data.startswith(b"data:")
    assert tap.nbytes == len(data)
    assert tap.first_chunk_at == 12.5


# ---------------------------------------------------------------- recorded replies


@needs_samples
@pytest.mark.parametrize(("name", "expected"), STREAMS.items(), ids=list(STREAMS))
def test_recorded_stream_whole(name: str, expected: tuple[Usage, str]) -> None:
    data = _body(name)
    assert data.startswith(b"data: ")
    tap, out = _replay([data])
    assert out == data
    _assert_tap(tap, data, *expected)
    assert tap.events == (12 if "usage" in name else 11)


@needs_samples
@pytest.mark.parametrize(("name", "expected"), STREAMS.items(), ids=list(STREAMS))
def test_recorded_stream_split_everywhere(name: str, expected: tuple[Usage, str]) -> None:
    data = _body(name)
    for cut in range(len(data) + 1):
        # an empty chunk means "end of body", so a cut at either end gives a single chunk
        tap, out = _replay([piece for piece in (data[:cut], data[cut:]) if piece])
        assert out == data, cut
        _assert_tap(tap, data, *expected)


@needs_samples
@pytest.mark.parametrize("size", [1, 2, 7, 64, 1000])
@pytest.mark.parametrize(("name", "expected"), STREAMS.items(), ids=list(STREAMS))
def test_recorded_stream_small_chunks(name: str, expected: tuple[Usage, str], size: int) -> None:
    data = _body(name)
    tap, out = _replay(_chunks(data, size))
    assert out == data
    _assert_tap(tap, data, *expected)


@needs_samples
@pytest.mark.parametrize(("name", "expected"), STREAMS.items(), ids=list(STREAMS))
def test_recorded_stream_crlf(name: str, expected: tuple[Usage, str]) -> None:
    data = _body(name).replace(b"\n", b"\r\n")
    for size in (1, 7, len(data)):
        tap, out = _replay(_chunks(data, size))
        assert out == data
        _assert_tap(tap, data, *expected)


@needs_samples
@pytest.mark.parametrize(("name", "expected"), BODIES.items(), ids=list(BODIES))
def test_recorded_body(name: str, expected: Usage) -> None:
    body = _body(name)
    assert body.lstrip().startswith(b"{")
    usage = usage_from_body(body)
    assert usage == expected
    assert usage is not None and usage.tokens_per_second == pytest.approx(
        expected.completion_tokens / expected.predicted_ms * 1000
    )


@needs_samples
def test_recorded_stream_cut() -> None:
    data = _body("single/chat_stream_usage.txt")
    cut = data.index(b'data: {"choices":[]')
    tap, out = _replay(_chunks(data[:cut], 7), end=False)
    assert out == data[:cut]
    assert not tap.done
    assert not tap.saw_done_marker
    assert tap.finish_reason == "length"
    assert tap.usage is None  # the finish chunk carries no timings when usage was asked for

    tap, _ = _replay([data[: data.index(b"data: [DONE]")]], end=False)
    assert not tap.done and not tap.saw_done_marker
    assert tap.usage == Usage(31, 30, 8, 0.739, 1, 0.124)


# ---------------------------------------------------------------- synthetic streams


def _sse(*objects: Any, done: bool = True) -> bytes:
    lines = [b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n" for obj in objects]
    return b"".join(lines) + (b"data: [DONE]\n\n" if done else b"")


def _delta(text: str) -> dict[str, Any]:
    return {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": text}}]}


def test_stream_without_usage() -> None:
    data = _sse(_delta("a"), _delta("b"), {"choices": [{"finish_reason": "stop", "index": 0, "delta": {}}]})
    tap, out = _replay(_chunks(data, 3))
    assert out == data
    assert tap.usage is None
    assert tap.finish_reason == "stop"
    assert tap.done and tap.saw_done_marker
    assert tap.events == 4


def test_empty_stream() -> None:
    tap, out = _replay([])
    assert out == b""
    assert tap.done and not tap.saw_done_marker
    assert tap.usage is None and tap.events == 0 and tap.nbytes == 0
    assert tap.first_chunk_at is None


def test_usage_null_and_partial_figures() -> None:
    data = _sse(
        {**_delta("a"), "usage": None},
        {"choices": [], "usage": {"completion_tokens": 3}},
        {"choices": [], "timings": {"cache_n": 5}},
    )
    tap, _ = _replay([data])
    assert tap.usage == Usage(prompt_tokens=None, cached_tokens=5, completion_tokens=3, predicted_ms=None)
    assert tap.usage.tokens_per_second is None


def test_later_figures_win() -> None:
    data = _sse(
        {"choices": [{"finish_reason": "length", "delta": {}}], "timings": {"prompt_n": 2, "cache_n": 1}},
        {"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 4}},
    )
    tap, _ = _replay([data])
    assert tap.usage == Usage(prompt_tokens=10, cached_tokens=1, completion_tokens=4, prompt_n=2)


@pytest.mark.parametrize(
    "line",
    [
        b'data: {"timings": {"predicted_n": 1}',  # truncated JSON
        b'data: {"timings": NaNx}',
        b'data: ["timings"]',
        b'data: "usage"',
        b"data: " + b"[" * 100_000 + b'"timings"',
        b'event: {"timings": {"predicted_n": 1}}',  # not a data: line
        b': {"timings": {"predicted_n": 1}}',  # an SSE comment
        b' data: {"timings": {"predicted_n": 1}}',
        b"data: [DONE] trailing",
    ],
)
def test_malformed_lines_are_ignored(line: bytes) -> None:
    data = line + b"\n\n"
    tap, out = _replay(_chunks(data, 5))
    assert out == data
    assert tap.usage is None
    assert not tap.saw_done_marker
    assert tap.done


@pytest.mark.parametrize(
    "line",
    [b"data: [DONE]", b"data:[DONE]", b"data: [DONE] ", b"data: [DONE]\r"],
)
def test_done_marker_forms(line: bytes) -> None:
    tap, _ = _replay([line + b"\n"])
    assert tap.saw_done_marker


def test_last_line_without_newline_is_scanned_at_end() -> None:
    data = _sse({"choices": [], "timings": {"predicted_n": 2}}, done=False) + b"data: [DONE]"
    tap, _ = _replay(_chunks(data, 4), end=False)
    assert not tap.saw_done_marker and tap.usage is not None
    assert tap(b"") == b""
    assert tap.saw_done_marker and tap.done


def test_overlong_line_is_dropped_but_forwarded() -> None:
    big = {"choices": [], "pad": "x" * 300, "timings": {"predicted_n": 99}}
    small = {"choices": [], "timings": {"predicted_n": 7}}
    data = _sse(big, small)
    for size in (1, 7, 50, 1000, len(data)):
        tap = SSETap(max_line=200)
        out = b"".join(tap(chunk) for chunk in _chunks(data, size))
        tap(b"")
        assert out == data
        assert tap.usage == Usage(completion_tokens=7), size
        assert tap.saw_done_marker
        assert len(tap._tail) <= 200


def test_tail_stays_bounded_without_newlines() -> None:
    tap = SSETap(max_line=1000)
    for _ in range(100):
        tap(b"data: " + b"y" * 500)
    assert len(tap._tail) == 0
    tap(b'\ndata: {"timings":{"predicted_n":1}}\n')
    assert tap.usage == Usage(completion_tokens=1)


def test_chunks_after_end_pass_through() -> None:
    tap, _ = _replay([b'data: {"timings":{"predicted_n":1}}\n'])
    chunk = b'data: {"timings":{"predicted_n":2}}\n'
    assert tap(chunk) is chunk
    assert tap.usage == Usage(completion_tokens=1)


def test_first_chunk_clock() -> None:
    ticks = iter([1.0, 2.0, 3.0])
    tap = SSETap(clock=lambda: next(ticks))
    tap(b"")  # the end, with nothing before it
    assert tap.first_chunk_at is None
    tap = SSETap(clock=lambda: next(ticks))
    tap(b"data: x")
    tap(b"\n")
    assert tap.first_chunk_at == 1.0


# ---------------------------------------------------------------- usage objects


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ({}, None),
        ({"choices": []}, None),
        ({"usage": None, "timings": None}, None),
        ({"usage": "x"}, None),
        ({"usage": {}}, Usage()),
        ({"timings": {}}, Usage()),
        (
            {"timings": {"cache_n": 30, "prompt_n": 1, "predicted_n": 8, "predicted_ms": 0.745,
                         "prompt_ms": 0.175}},
            Usage(31, 30, 8, 0.745, 1, 0.175),
        ),
        ({"timings": {"prompt_n": 5}}, Usage(prompt_n=5)),  # prompt_n alone is not the whole prompt
        ({"timings": {"cache_n": 0, "prompt_n": 5}}, Usage(prompt_tokens=5, cached_tokens=0, prompt_n=5)),
        (
            {
                "usage": {
                    "prompt_tokens": 31,
                    "completion_tokens": 8,
                    "prompt_tokens_details": {"cached_tokens": 30},
                }
            },
            Usage(31, 30, 8, None),
        ),
        (
            {
                "usage": {"prompt_tokens": 40, "completion_tokens": 9},
                "timings": {"cache_n": 1, "prompt_n": 2},
            },
            Usage(40, 1, 9, None, 2),
        ),
        ({"usage": {"prompt_tokens": 0, "completion_tokens": 0}}, Usage(0, None, 0, None)),
        (
            {"usage": {"prompt_tokens": True, "completion_tokens": -1, "prompt_tokens_details": None}},
            Usage(),
        ),
        ({"usage": {"prompt_tokens": 7.0, "completion_tokens": 7.5}}, Usage(prompt_tokens=7)),
        ({"usage": {"prompt_tokens": "7"}}, Usage()),
        ({"timings": {"predicted_ms": 2}}, Usage(predicted_ms=2.0)),
        ({"timings": {"predicted_ms": float("nan")}}, Usage()),
        ({"timings": {"predicted_ms": -1.0}}, Usage()),
        ({"timings": {"predicted_ms": False}}, Usage()),
        ({"timings": {"prompt_n": 300, "prompt_ms": 15.0}}, Usage(prompt_n=300, prompt_ms=15.0)),
    ],
)
def test_usage_from_object(obj: dict[str, Any], expected: Usage | None) -> None:
    assert usage_from_object(obj) == expected


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (None, None, None),
        (Usage(1), None, Usage(1)),
        (None, Usage(2), Usage(2)),
        (Usage(1, 2, 3, 4.0), Usage(None, None, 5, None), Usage(1, 2, 5, 4.0)),
        (Usage(1, 2, None, None), Usage(9, 8, 7, 6.0), Usage(9, 8, 7, 6.0)),
        (Usage(1, 0), Usage(None, None), Usage(1, 0)),
    ],
)
def test_merge(a: Usage | None, b: Usage | None, expected: Usage | None) -> None:
    assert merge(a, b) == expected


def test_merge_does_not_mutate() -> None:
    a, b = Usage(1), Usage(None, 2)
    merge(a, b)
    assert a == Usage(1) and b == Usage(None, 2)


@pytest.mark.parametrize(
    "body",
    [
        None,
        b"",
        b"not json",
        b"\xff\xfe",
        b"[1, 2]",
        b'"usage"',
        b"[" * 100_000,
        b'{"choices": []}',
        b'{"error": {"code": 400, "message": "x"}}',
    ],
)
def test_usage_from_body_tolerant(body: bytes | None) -> None:
    assert usage_from_body(body) is None


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        (Usage(completion_tokens=8, predicted_ms=0.5), 16000.0),
        (Usage(completion_tokens=8, predicted_ms=0.0), None),
        (Usage(completion_tokens=None, predicted_ms=1.0), None),
        (Usage(completion_tokens=8), None),
        (Usage(completion_tokens=0, predicted_ms=10.0), 0.0),
    ],
)
def test_tokens_per_second(usage: Usage, expected: float | None) -> None:
    assert usage.tokens_per_second == expected


@pytest.mark.parametrize(
    ("obj", "expected", "dropped"),
    [
        ({"usage": {"prompt_tokens": 2**70, "completion_tokens": 3}}, Usage(None, None, 3, None), 1),
        ({"usage": {"prompt_tokens": 5, "completion_tokens": 1e308}}, Usage(5, None, None, None), 1),
        ({"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 6}}}, Usage(5), 1),
        ({"timings": {"prompt_n": 1, "cache_n": -3, "predicted_ms": 1e300}}, Usage(prompt_n=1), 2),
        ({"timings": {"prompt_n": 2**40, "prompt_ms": -1.0}}, Usage(), 2),
        ({"usage": {"prompt_tokens": 10**8, "completion_tokens": 0}}, Usage(10**8, None, 0), 0),
    ],
)
def test_figures_out_of_range_are_unknown_and_counted(obj: dict[str, Any], expected: Usage,
                                                      dropped: int) -> None:
    usage = usage_from_object(obj)
    assert usage == expected
    assert usage is not None and usage.dropped == dropped


# ---------------------------------------------------------------- large non-streamed replies


def _large_chat_reply(content: str) -> bytes:
    return json.dumps({
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
        "created": 1, "model": "m", "object": "chat.completion",
        "usage": {"completion_tokens": 5, "prompt_tokens": 7, "total_tokens": 12}, "id": "c",
        "timings": {"prompt_n": 3, "cache_n": 4, "predicted_n": 5, "predicted_ms": 10.0},
    }).encode()


def test_large_reply_usage_from_its_tail() -> None:
    # the content quotes a usage object: escaped inside a string, it is never taken for the key
    fake = '"usage": {"prompt_tokens": 99, "completion_tokens": 99}, "timings": {"cache_n": 99}'
    body = _large_chat_reply(fake * 30_000)
    assert len(body) > 2 * 1024 * 1024
    assert usage_from_body(body) == Usage(prompt_tokens=7, cached_tokens=4, completion_tokens=5,
                                          predicted_ms=10.0, prompt_n=3)


def test_large_reply_is_not_parsed_whole() -> None:
    body = bytearray(_large_chat_reply("x" * 1_000_000))
    body[500_000:500_001] = b"\x00"  # not JSON any more, yet the tail still tells the usage
    assert usage_from_body(bytes(body)) == Usage(7, 4, 5, 10.0, 3)


def test_large_embeddings_reply_usage_from_its_head() -> None:
    body = json.dumps({"model": "m", "object": "list", "usage": {"prompt_tokens": 9, "total_tokens": 9},
                       "data": [{"embedding": [0.25] * 1000, "index": i} for i in range(200)]}).encode()
    assert len(body) > 1024 * 1024
    assert usage_from_body(body) == Usage(prompt_tokens=9)


def test_large_reply_without_usage() -> None:
    assert usage_from_body(b'{"data": [' + b"1, " * 500_000 + b"1]}") is None


_FIGURES = {"usage": {"prompt_tokens": 9, "completion_tokens": 2, "note": "n" * 5000},  # a long member
            "timings": {"cache_n": 5, "prompt_n": 4, "predicted_n": 2, "predicted_ms": 3.0}}
_FIGURES_JSON = json.dumps(_FIGURES)[1:-1]
_SHAPES = ["figures first", "figures last", "figures in the middle", "figures across the head's end",
           "figures at the tail's start", "no figures"]


def _answer(shape: str, filler: int, size: int) -> bytes:
    """An answer with its figures where `shape` says, `filler` bytes of text elsewhere, padded
    with spaces to `size` bytes when it is shorter (before it when its figures are near its end)."""
    text, head_filler = '"' + "y" * filler + '"', '"' + "y" * (tap.EDGE_BYTES - 20) + '"'
    tail_filler = '"' + "y" * (tap.EDGE_BYTES - 200) + '"'
    pieces = {
        "figures first": f'{{"object": "list", {_FIGURES_JSON}, "data": [{{"embedding": {text}}}]}}',
        "figures last": f'{{"choices": [{{"message": {{"content": {text}}}}}], {_FIGURES_JSON}}}',
        "figures in the middle": f'{{"a": {text}, {_FIGURES_JSON}, "b": {text}}}',
        "no figures": f'{{"data": {text}}}',
        # `"usage"` begins within the first EDGE_BYTES, its object ends beyond them
        "figures across the head's end": f'{{"a": {head_filler}, {_FIGURES_JSON}, "b": {text}}}',
        # `"timings"` begins just within the last EDGE_BYTES
        "figures at the tail's start": f'{{"a": {text}, {_FIGURES_JSON}, "b": {tail_filler}}}',
    }
    body = pieces[shape].encode()
    padding = b" " * max(0, size - len(body))
    return padding + body if shape in ("figures last", "figures at the tail's start") else body + padding


@settings(max_examples=150, deadline=None)
@given(shape=st.sampled_from(_SHAPES),
       filler=st.sampled_from([0, 1000, tap.HEAD_KEEP, tap.WHOLE_BODY_MAX, 3 * tap.TAIL_KEEP]),
       size=st.sampled_from([0, tap.WHOLE_BODY_MAX, tap.WHOLE_BODY_MAX + 1,
                             tap.HEAD_KEEP + tap.TAIL_KEEP - 1, tap.HEAD_KEEP + tap.TAIL_KEEP,
                             tap.HEAD_KEEP + tap.TAIL_KEEP + 1]),
       cuts=st.lists(st.integers(min_value=1, max_value=200_000), max_size=12))
def test_a_streamed_answer_is_read_at_its_edges_as_if_whole(shape: str, filler: int, size: int,
                                                            cuts: list[int]) -> None:
    body = _answer(shape, filler, size)
    edge_tap, at, forwarded = tap.EdgeTap(), 0, []
    for cut in [*cuts, len(body)]:
        chunk = body[at:at + cut]
        assert edge_tap(chunk) is chunk  # forwarded as it came
        forwarded.append(chunk)
        at += cut
        assert len(edge_tap.head) + len(edge_tap.tail) <= tap.HEAD_KEEP + tap.TAIL_KEEP
    assert edge_tap(b"") == b""  # mitmproxy's end of the body
    event(shape)
    assert b"".join(forwarded) == body
    assert edge_tap.usage() == usage_from_body(body)
    found = edge_tap.usage()
    if shape == "no figures":
        assert found is None
    elif shape != "figures in the middle":  # what the shape puts near an edge is found there
        assert found is not None and found.prompt_tokens == 9
        assert found == Usage(9, 5, 2, 3.0, 4) or len(body) > tap.WHOLE_BODY_MAX


def test_the_edges_kept_cover_what_a_large_answer_is_read_from() -> None:
    # a member found in the first EDGE_BYTES is whole in the head; the last EDGE_BYTES are in the
    # tail; and edges joined with a gap between them are read at their edges, as the answer is
    assert tap.HEAD_KEEP >= tap.EDGE_BYTES + tap.MEMBER_MAX
    assert tap.TAIL_KEEP >= tap.EDGE_BYTES
    assert tap.HEAD_KEEP + tap.TAIL_KEEP > tap.WHOLE_BODY_MAX


_usage_answers = [
    b'{"usage": {"prompt_tokens": 10, "completion_tokens": 2, '
    b'"prompt_tokens_details": {"cached_tokens": 4}}}',
    b'{"usage": {"prompt_tokens": 18446744073709551616}, "timings": {"prompt_n": 3, "prompt_ms": 1e-7}}',
    b'{"usage": {"prompt_tokens": 5}, "x": "\\ud800"}',  # orjson refuses the lone surrogate
    b'{"usage": {"prompt_tokens": 5}, "x": ' + b"[" * 1100 + b"]" * 1100 + b"}",
    b'{"usage": {"prompt_tokens": NaN}}', b'{"usage": {"prompt_tokens": 7}} trailing', b"\xff", b"[]", b"",
]


@pytest.mark.parametrize("body", _usage_answers)
def test_answers_read_by_orjson_give_the_standard_librarys_usage(body: bytes) -> None:
    with mock.patch.object(jsonread, "loads", lambda text: UNREAD):
        standard = usage_from_body(body)
    assert usage_from_body(body) == standard


@pytest.mark.parametrize("body", _usage_answers)
def test_events_read_by_orjson_give_the_standard_librarys_usage(body: bytes) -> None:
    def scan() -> Usage | None:
        tap = SSETap()
        tap(b"data: " + body + b"\n\n")
        tap(b"")
        return tap.usage

    with mock.patch.object(jsonread, "loads", lambda text: UNREAD):
        standard = scan()
    assert scan() == standard


# ---------------------------------------------------------------- the plain reply's shortcut

_ODD_COUNTS = (None, -1, tap.MAX_TOKENS, tap.MAX_TOKENS + 1, 2**70, 7.0, 7.5, -0.0, math.nan, True, "7", [7])
_ODD_MILLIS = (None, 0.0, -0.0, -1.0, 2, tap.MAX_MILLIS, tap.MAX_MILLIS * 1.01, math.inf, math.nan, False,
               "1")
_NOT_OBJECTS = (None, "x", [1], 7)


def _mostly(plain: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`plain` nine times in ten, else `odd`."""
    return st.tuples(mostly(True, False), plain, odd).map(lambda t: t[1] if t[0] else t[2])


def _object(**members: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """An object with these members, one whose member is None leaving it out (as a reply does)."""
    return st.fixed_dictionaries(members).map(lambda d: {k: v for k, v in d.items() if v is not None})


def _member(**members: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly an object with these members, now and then no object at all."""
    return _mostly(_object(**members), st.sampled_from(_NOT_OBJECTS))


def _count(high: int) -> st.SearchStrategy[Any]:
    return _mostly(st.integers(0, high), st.sampled_from(_ODD_COUNTS))


_millis = _mostly(st.floats(0.0, 50.0), st.sampled_from(_ODD_MILLIS))
_replies = _object(  # a cached part is drawn smaller than the prompt, mostly (as it is)
    usage=_member(prompt_tokens=_count(3_000), completion_tokens=_count(3_000),
                  prompt_tokens_details=_member(cached_tokens=_count(1_000))),
    timings=_member(prompt_n=_count(3_000), cache_n=_count(1_000), predicted_n=_count(3_000),
                    prompt_ms=_millis, predicted_ms=_millis),
)


def _read_figure_by_figure(obj: dict[str, Any]) -> Usage | None:
    """`usage_from_object` without its shortcut for plain replies."""
    usage, timings = obj.get("usage"), obj.get("timings")
    if not isinstance(usage, dict) and not isinstance(timings, dict):
        return None
    return tap._checked_usage(usage if isinstance(usage, dict) else {},
                              timings if isinstance(timings, dict) else {})


@settings(max_examples=2_000, deadline=None)
@given(_replies)
def test_the_plain_reply_shortcut_agrees_with_the_figure_by_figure_reading(reply: dict[str, Any]) -> None:
    expected, usage = _read_figure_by_figure(reply), usage_from_object(reply)
    with mock.patch.object(tap, "_checked_usage", lambda *_: None):
        shortcut = usage_from_object(reply) is not None
    event(f"shortcut answered: {shortcut}; figures dropped: {expected.dropped if expected else None}")
    assert usage == expected
    if usage is not None and expected is not None:
        assert usage.dropped == expected.dropped
        assert [type(getattr(usage, f)) for f in Usage.__slots__] == [
            type(getattr(expected, f)) for f in Usage.__slots__]


@needs_samples
@pytest.mark.parametrize("name", list(BODIES))
def test_a_recorded_llama_server_reply_takes_the_shortcut(name: str) -> None:
    """(else the property above would hold vacuously for the replies that matter)"""
    reply = json.loads(_body(name))
    assert tap._plain_usage(reply["usage"], reply["timings"]) == BODIES[name]


def test_a_time_too_large_for_a_float_is_dropped_not_raised() -> None:
    u = usage_from_object({"timings": {"predicted_n": 1, "predicted_ms": 10**400, "prompt_ms": -(10**400)}})
    assert u is not None and (u.predicted_ms, u.prompt_ms, u.dropped) == (None, None, 2)


def test_a_tap_whose_reading_fails_passes_every_chunk_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(obj: object) -> Usage:
        raise ValueError("a reader bug")

    monkeypatch.setattr(tap, "usage_from_object", broken)
    t = SSETap()
    chunks = [b'data: {"timings": {"predicted_n": 1}}\n\n', b'data: {"usage": {"prompt_tokens": 1}}\n\n', b""]
    assert [t(c) for c in chunks] == chunks
    assert t.usage is not None and t.usage.dropped == 2
