"""crossbar.headers answers exactly as mitmproxy's Headers does."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy import http

from crossbar import headers

_names = st.sampled_from([b"content-type", b"Content-Type", b"CONTENT-TYPE", b"x-session-id", b"Host", b"x"])
_values = st.binary(max_size=12)  # any bytes, not only UTF-8: values decode with surrogate escapes


@settings(max_examples=300, deadline=None)
@given(fields=st.lists(st.tuples(_names, _values), max_size=6),
       wanted=st.sampled_from([b"content-type", b"x-session-id", b"host", b"absent"]))
def test_lookups_answer_as_mitmproxy_headers(fields: list[tuple[bytes, bytes]], wanted: bytes) -> None:
    h = http.Headers(fields)
    name = wanted.decode()
    assert headers.values(h, wanted) == h.get_all(name)
    assert headers.value(h, wanted, None) == h.get(name)
    assert headers.value(h, wanted, "") == h.get(name, "")
    assert headers.has_any(h, frozenset({wanted, b"x-other"})) == (name in h or "x-other" in h)
    assert not headers.has_any(h, frozenset())


_answer_names = st.sampled_from([b"content-type", b"Content-Type", b"content-encoding", b"CONTENT-ENCODING",
                                 b"x"])
_answer_values = st.one_of(st.sampled_from([b"text/event-stream", b" Text/Event-Stream; charset=utf-8",
                                            b"\xc2\xa0text/event-stream", b"gzip", b"identity", b"",
                                            b" , IDENTITY", b"br, identity"]),
                           st.binary(max_size=12))


@settings(max_examples=500, deadline=None)
@given(fields=st.lists(st.tuples(_answer_names, _answer_values), max_size=6))
def test_one_pass_answers_as_event_stream_and_compressed(fields: list[tuple[bytes, bytes]]) -> None:
    h = http.Headers(fields)
    assert headers.event_stream_coding(h) == (headers.event_stream(h), headers.compressed(h))


def test_an_event_stream_is_told_by_its_content_type() -> None:
    assert headers.event_stream(http.Headers(content_type="text/event-stream; charset=utf-8"))
    assert not headers.event_stream(http.Headers(content_type="application/json"))
    assert not headers.event_stream(http.Headers())


def test_a_compressed_body_is_told_by_its_content_encoding() -> None:
    for encoding in ("gzip", " GZIP ", "br", "zstd", "gzip, br"):
        assert headers.compressed(http.Headers(content_encoding=encoding)), encoding
    for encoding in ("identity", " Identity ", "", "IDENTITY, ", " , identity"):
        assert not headers.compressed(http.Headers(content_encoding=encoding)), encoding
    assert not headers.compressed(http.Headers())
    # a field given twice is one list of codings
    twice = [(b"Content-Encoding", b"identity"), (b"content-encoding", b"identity")]
    assert not headers.compressed(http.Headers(twice))
    assert not headers.compressed(http.Headers([(b"Content-Encoding", b""), (b"Content-Encoding", b"")]))
    then_gzip = [(b"Content-Encoding", b"identity"), (b"Content-Encoding", b"gzip")]
    assert headers.compressed(http.Headers(then_gzip))
