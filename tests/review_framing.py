"""Review: the request framer and mitmproxy must agree on where a request ends.

mitmproxy joins an obs-fold continuation line (" Name: v" after a header) into the previous
header's value, so it sees no Content-Length / Transfer-Encoding and no body; the framer reads the
folded line as a header of its own and treats what follows as a body. Everything after that on the
connection bypasses max_head and head_timeout (with a folded chunked coding: for good, as the next
head is "malformed" chunk data and the framer switches to PASS)."""

from __future__ import annotations

from mitmproxy.net.http.http1 import read_request_head

from crossbar.limits import RequestFramer

BIG_HEAD = b"GET /_crossbar/hosts HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 300_000 + b"\r\n\r\n"


def folded(header: bytes) -> bytes:
    return b"GET /_crossbar/hosts HTTP/1.1\r\nHost: 127.0.0.1\r\nX-A: b\r\n " + header + b"\r\n\r\n"


def test_mitmproxy_reads_a_folded_length_as_no_body() -> None:
    head = read_request_head(folded(b"Content-Length: 1000000").split(b"\r\n")[:-2])
    assert "content-length" not in head.headers  # so mitmproxy reads the next bytes as a new head


def test_an_oversized_head_after_a_folded_chunked_coding_is_refused() -> None:
    framer = RequestFramer(max_head=64 * 1024, max_body=32 << 20)
    out, refusal = framer.feed(folded(b"Transfer-Encoding: chunked"))
    assert refusal is None
    out, refusal = framer.feed(BIG_HEAD)
    assert refusal is not None and refusal.status == 431, (framer.state, len(out))


def test_an_oversized_head_after_a_folded_length_is_refused() -> None:
    framer = RequestFramer(max_head=64 * 1024, max_body=32 << 20)
    framer.feed(folded(b"Content-Length: 1000000"))
    out, refusal = framer.feed(BIG_HEAD)
    assert refusal is not None and refusal.status == 431, (framer.state, len(out))
