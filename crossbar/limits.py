"""Connection and message limits, enforced beneath mitmproxy's HTTP layer.

mitmproxy (12.x) reads a message head with no size limit and no time limit, and answers a body
over its `body_size_limit` with an HTML page. So crossbar wraps each connection's reader:

- a request head is held back until it is complete: over `max_head` bytes is a JSON 431, not
  complete within `head_timeout` of its first byte (or of the connection's start) is a JSON 408;
  a kept-alive connection may idle `idle_timeout` between requests; a head with a folded header
  line is a JSON 400 (mitmproxy would read it differently);
- a `Content-Length` over `max_body` is a JSON 413 before any of the body is read; a chunked body
  is counted as it arrives and cut with the same JSON 413 when it passes `max_body`; a body that
  pauses longer than `body_timeout` between two reads is a JSON 408;
- body framing that mitmproxy would refuse (its HTML 400) or read otherwise than crossbar counts
  it (a chunk line past MAX_CHUNK_LINE, trailer fields, on which mitmproxy crashes) is a JSON 400,
  and so is TLS or HTTP/2 on a listener (what they carry would pass beneath these limits);
- a response head from an upstream over `max_head` never reaches mitmproxy: the client gets
  crossbar's JSON 502 and the host is marked down;
- each peer address may hold at most `max_connections_per_peer` connections;
- an upload that ends unfinished gives its memory back (mitmproxy's buffer waits for the cyclic
  garbage collector, and glibc keeps freed heap).

The framing code is pure (`RequestFramer`, `ResponseHeadFramer`); the readers and the addon only
wire it to mitmproxy's connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from mitmproxy import ctx, http
from mitmproxy.connection import Client, Connection
from mitmproxy.net.http import validate
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from crossbar.app import Router
from crossbar.decisions import Rejection
from crossbar.weakid import WeakIdDict

log = logging.getLogger("crossbar")

MAX_CHUNK_LINE = 4096  # a chunk-size line (with extensions) or one trailer line
LENGTH_DIGITS = 18  # a Content-Length this long is already past any body crossbar takes
DEADLINE_CHECK = 1.0  # seconds between looks at a deadline set while a read was waiting
LINGER_SECONDS = 2.0
TRIM_AFTER = 1024 * 1024  # an unfinished upload larger than this returns its memory to the system
HEAD, LENGTH, CHUNKED, BAD = "head", "length", "chunked", "bad"
_H2_PREFACE = b"PRI * HTTP/2"  # an HTTP/2 connection's start: mitmproxy closes on it, at any request
ANSWERED = "crossbar.answered"  # flow.metadata: the flow's answer was counted as written


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int
    type: str
    message: str
    reason: Rejection  # the `crossbar_rejected_total` label

    def response(self, extra_headers: str = "") -> bytes:
        body = json.dumps({"error": {"code": self.status, "type": self.type, "message": self.message}})
        phrase = {400: "Bad Request", 408: "Request Timeout", 413: "Content Too Large",
                  431: "Request Header Fields Too Large", 502: "Bad Gateway",
                  503: "Service Unavailable"}[self.status]
        return (f"HTTP/1.1 {self.status} {phrase}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra_headers}\r\n{body}").encode()


BAD_REQUEST = "invalid_request_error"


def head_too_large(limit: int) -> Refusal:
    return Refusal(431, BAD_REQUEST, f"request head over {limit} bytes (max_head)", Rejection.HEAD_TOO_LARGE)


def body_too_large(limit: int) -> Refusal:
    return Refusal(413, BAD_REQUEST, f"request body over {limit} bytes (max_body)", Rejection.TOO_LARGE)


def head_timeout(limit: float) -> Refusal:
    return Refusal(408, BAD_REQUEST, f"request head not complete within {limit:g}s (head_timeout)",
                   Rejection.HEAD_TIMEOUT)


def folded_header() -> Refusal:
    return Refusal(400, BAD_REQUEST, "request head has a folded (obs-fold) header line",
                   Rejection.BAD_REQUEST)


def has_folded_line(head: bytes) -> bool:
    """Whether a header line starts with a space or tab: an obsolete line folding, which mitmproxy
    joins onto the previous header while a plain reading takes it for a header of its own. Heads
    that carry one are refused, so that crossbar and mitmproxy never disagree on framing."""
    return b"\n " in head or b"\n\t" in head


def bad_framing() -> Refusal:
    return Refusal(400, BAD_REQUEST, "request head has conflicting or invalid Content-Length or "
                   "Transfer-Encoding fields", Rejection.BAD_REQUEST)


def bad_chunk() -> Refusal:
    return Refusal(400, BAD_REQUEST, "malformed chunked request body", Rejection.BAD_REQUEST)


def chunk_trailer() -> Refusal:
    return Refusal(400, BAD_REQUEST, "chunked request body with trailer fields (not accepted)",
                   Rejection.BAD_REQUEST)


def not_plain_http() -> Refusal:
    return Refusal(400, BAD_REQUEST, "crossbar listens for plain HTTP/1.1 (no TLS, no HTTP/2)",
                   Rejection.BAD_REQUEST)


_CHUNK_REFUSALS: dict[str, Callable[[], Refusal]] = {"malformed": bad_chunk, "trailer": chunk_trailer}


def body_timeout(limit: float) -> Refusal:
    return Refusal(408, BAD_REQUEST, f"request body paused longer than {limit:g}s (body_timeout)",
                   Rejection.BODY_TIMEOUT)


def _head_end(buf: bytes | bytearray, start: int = 0, stop: int | None = None) -> int:
    """Index just past the first blank line ending a head (CRLF or bare LF) in buf[start:stop], or
    -1. The bare-LF forms are only looked for before the first CRLF one: a body's bytes after the
    head are never scanned."""
    crlf = buf.find(b"\r\n\r\n", start, stop)
    # the usual head: no bare-LF blank line ends it earlier (the CRLF one holds a "\n\r\n" of its own)
    if crlf >= 0 and buf.find(b"\n\n", start, crlf) < 0 and buf.find(b"\n\r\n", start, crlf + 3) < 0:
        return crlf + 4
    before = stop if crlf < 0 else crlf + 4
    ends = [i + n for i, n in ((crlf, 4), (buf.find(b"\n\n", start, before), 2),
                               (buf.find(b"\n\r\n", start, before), 3)) if i >= 0]
    return min(ends) if ends else -1


# a Content-Length or Transfer-Encoding field of a head (never its first line): the name as
# `bytes.strip()` leaves it, compared without case, then the value up to the end of its line
_FRAMING_FIELD = re.compile(rb"\n[ \t\r\x0b\x0c]*(content-length|transfer-encoding)[ \t\r\x0b\x0c]*:([^\n]*)",
                            re.IGNORECASE)


def body_framing(head: bytes) -> tuple[str, int]:
    """(LENGTH, n), (CHUNKED, 0), (HEAD, 0) for no body, or (BAD, 0) for framing fields mitmproxy
    refuses (it would answer its own HTML 400): a Content-Length that is not a plain decimal,
    several of them, one beside a Transfer-Encoding, several Transfer-Encodings, one outside
    HTTP/1.1 or whose last coding is not chunked. Where mitmproxy takes a head, it frames the body
    the same way (the tests check it against mitmproxy's own reading)."""
    length = _plain_length(head)
    if length is None:
        lengths, encodings = _framing_fields(head)
        if encodings:
            chunked = not lengths and len(encodings) == 1 and _chunked(head, encodings[0])
            return (CHUNKED, 0) if chunked else (BAD, 0)
        if not lengths:
            return HEAD, 0
        if len(lengths) > 1:
            return BAD, 0
        length = lengths[0]
    if not length.isdigit() or (length[:1] == b"0" and length != b"0"):  # mitmproxy's `0|[1-9][0-9]*`
        return BAD, 0
    size = _length(length)
    return (LENGTH, size) if size else (HEAD, 0)


def _chunked(head: bytes, coding: bytes) -> bool:
    """A Transfer-Encoding mitmproxy takes on a request: chunked last, and HTTP/1.1."""
    request_line = head[:head.find(b"\n")].split()
    if len(request_line) != 3 or request_line[2] != b"HTTP/1.1":
        return False
    try:
        return validate.parse_transfer_encoding(coding).endswith("chunked")
    except ValueError:
        return False


def _length(digits: bytes) -> int:
    """A Content-Length's value; one of more digits than any body could need reads as 10**18
    (over every `max_body`), without converting thousands of digits (which Python refuses)."""
    significant = digits.lstrip(b"0")
    return int(significant or b"0") if len(significant) <= LENGTH_DIGITS else 10 ** LENGTH_DIGITS


def _plain_length(head: bytes) -> bytes | None:
    """The value of the usual head's one Content-Length field, written plainly at a line's start
    and named nowhere else, with no Transfer-Encoding named anywhere; None: `_framing_fields`
    decides."""
    lower = head.lower()
    if b"transfer-encoding" in lower or lower.count(b"content-length") != 1:
        return None
    at = lower.find(b"\ncontent-length:")
    if at < 0:
        return None
    line_end = lower.find(b"\n", at + 16)
    return head[at + 16:line_end if line_end >= 0 else len(head)].strip()


def _framing_fields(head: bytes) -> tuple[list[bytes], list[bytes]]:
    """The values of every Content-Length and every Transfer-Encoding field of the head."""
    lengths: list[bytes] = []
    encodings: list[bytes] = []
    for field_ in _FRAMING_FIELD.finditer(head):
        name, value = field_.group(1), field_.group(2).strip()
        (encodings if name.lower() == b"transfer-encoding" else lengths).append(value)
    return lengths, encodings


# a chunk-size line as mitmproxy's reader (h11) takes it, without its CRLF: hex digits, any
# extension, trailing blanks
_CHUNK_SIZE_LINE = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;[^\n]*)?[ \t]*")


class ChunkCounter:
    """Follows a chunked body's framing as mitmproxy's reader does; counts its data against
    `limit`. A line mitmproxy would read otherwise, one longer than MAX_CHUNK_LINE (extensions
    included) or a trailer field ends it: mitmproxy crashes on a request trailer."""

    def __init__(self, limit: int):
        self.limit, self.total = limit, 0
        self._line = bytearray()
        self._need = 0
        self._footer = b""  # what is still due of the CRLF that ends a chunk's data
        self._in_trailer = False

    def feed(self, data: bytes, pos: int) -> tuple[int, str]:
        """Consume from data[pos:]: (bytes consumed, "" | "done" | "over" | "malformed" | "trailer")."""
        start = pos
        while pos < len(data):
            if self._need:
                take = min(self._need, len(data) - pos)
                pos += take
                self._need -= take
                self._footer = b"" if self._need else b"\r\n"
                continue
            if self._footer:  # compared byte by byte, as mitmproxy's reader does
                take = min(len(self._footer), len(data) - pos)
                if data[pos:pos + take] != self._footer[:take]:
                    return pos - start, "malformed"
                pos += take
                self._footer = self._footer[take:]
                continue
            newline = data.find(b"\n", pos, pos + MAX_CHUNK_LINE + 1 - len(self._line))
            if newline < 0:
                self._line += data[pos:pos + MAX_CHUNK_LINE + 1]
                if len(self._line) > MAX_CHUNK_LINE:
                    return len(data) - start, "malformed"
                pos = len(data)
                break
            self._line += data[pos:newline]
            pos = newline + 1
            line = bytes(self._line)
            self._line.clear()
            verdict = self._line_done(line)
            if verdict:
                return pos - start, verdict
        return pos - start, ""

    def _line_done(self, raw: bytes) -> str:
        """One line, without its LF."""
        if self._in_trailer:  # mitmproxy ends the body at a blank line, with or without its CR
            return "done" if raw in (b"", b"\r") else "trailer"
        if raw[-1:] != b"\r":  # mitmproxy's lines end with CRLF
            return "malformed"
        matched = _CHUNK_SIZE_LINE.fullmatch(raw, 0, len(raw) - 1)
        if matched is None:
            return "malformed"
        size = int(matched.group(1), 16)
        if size == 0:
            self._in_trailer = True
            return ""
        self.total += size
        if self.total > self.limit:
            return "over"
        self._need = size
        return ""


class RequestFramer:
    """Splits a client's byte stream into request heads (held back until complete) and bodies."""

    def __init__(self, max_head: int, max_body: int):
        self.max_head, self.max_body = max_head, max_body
        self.state = HEAD
        self.head = bytearray()  # the incomplete head held back
        self._remaining = 0
        self._chunks: ChunkCounter | None = None
        self._fresh = True  # nothing received on this connection yet
        self.heads = 0  # complete heads passed on
        self.whole = 0  # requests passed on whole (head and body): each gets an answer

    @property
    def head_started(self) -> bool:
        return self.state == HEAD and bool(self.head)

    @property
    def in_body(self) -> bool:
        return self.state in (LENGTH, CHUNKED)

    def feed(self, data: bytes) -> tuple[bytes, Refusal | None]:
        """What may go on to mitmproxy now, and a refusal when the stream broke a limit (what is
        returned with a refusal is complete data mitmproxy may still have)."""
        if self._fresh and data:
            self._fresh = False
            # TLS: mitmproxy would answer the handshake with a certificate of its own, and what it
            # carries would pass beneath these limits (HTTP/2's preface is refused as a head)
            if data[:1] == b"\x16":
                return b"", not_plain_http()
        if self.state == LENGTH and len(data) < self._remaining:
            self._remaining -= len(data)
            return data, None  # the common case, a body passing through: no copy
        if self.state == HEAD and not self.head and self._one_whole_request(data):
            return data, None
        view = memoryview(data)
        out: list[bytes | memoryview] = []  # joined once: each piece of `data` is copied only there
        pos = 0
        while pos < len(data):
            if self.state == LENGTH:
                take = min(self._remaining, len(data) - pos)
                out.append(view[pos:pos + take])
                pos += take
                self._remaining -= take
                if not self._remaining:
                    self.state = HEAD
                    self.whole += 1
                continue
            if self.state == CHUNKED:
                assert self._chunks is not None
                used, verdict = self._chunks.feed(data, pos)
                if verdict in _CHUNK_REFUSALS:  # the line mitmproxy would misread never reaches it
                    return b"".join(out), _CHUNK_REFUSALS[verdict]()
                out.append(view[pos:pos + used])
                pos += used
                if verdict == "over":
                    return b"".join(out), body_too_large(self._chunks.limit)
                if verdict:
                    self.state = HEAD
                    self.whole += 1
                continue
            pos, refusal = self._feed_head(data, pos, out)
            if refusal:
                return b"".join(out), refusal
        if sum(map(len, out)) == len(data) and all(isinstance(piece, memoryview) for piece in out):
            return data, None  # every byte passed on as it came: no copy
        return b"".join(out), None

    def _one_whole_request(self, data: bytes) -> bool:
        """The usual read: exactly one request, its head within the limits and its body (none, or
        a `Content-Length` one within `max_body`) complete. Counted as `feed` would count it; any
        other read (False) goes through `feed`'s general path."""
        if data[:1] in (b"\r", b"\n") or data.startswith(_H2_PREFACE):
            return False
        end = _head_end(data, 0, self.max_head + 4)
        if end < 0 or end > self.max_head or has_folded_line(head := data[:end]):
            return False
        kind, length = body_framing(head)
        if not ((kind == HEAD and end == len(data)) or (kind == LENGTH and end + length == len(data)
                                                          and length <= self.max_body)):
            return False
        self.heads += 1
        self.whole += 1
        return True

    def _feed_head(self, data: bytes, pos: int, out: list[bytes | memoryview]) -> tuple[int, Refusal | None]:
        """Take a head from data[pos:] (after what is held of it): where the rest of `data` starts,
        and a refusal for a head that breaks the limits."""
        if not self.head:
            while pos < len(data) and data[pos] in b"\r\n":  # blank lines before a request line
                pos += 1
            if pos == len(data):
                return pos, None
        in_place = not self.head
        head, pos = self._take_head(data, pos)
        if head is None:
            if len(self.head) > self.max_head:
                self.head.clear()
                return len(data), head_too_large(self.max_head)
            return len(data), None
        if len(head) > self.max_head:
            return len(data), head_too_large(self.max_head)
        if head.startswith(_H2_PREFACE):  # in pieces, after blank lines, or after a request
            return len(data), not_plain_http()
        if has_folded_line(head):
            return len(data), folded_header()
        self.state, self._remaining = body_framing(head)
        if self.state == BAD:
            self.state = HEAD
            return len(data), bad_framing()
        if self.state == LENGTH and self._remaining > self.max_body:
            return len(data), body_too_large(self.max_body)
        self.heads += 1
        self.whole += self.state == HEAD
        if self.state == CHUNKED:
            self._chunks = ChunkCounter(self.max_body)
        out.append(memoryview(data)[pos - len(head):pos] if in_place else head)
        return pos, None

    def _take_head(self, data: bytes, pos: int) -> tuple[bytes | None, int]:
        """(the complete head, where the bytes after it start), or (None, len(data)) with what
        arrived held. Only the first max_head + 4 bytes are looked at: a head cannot be longer."""
        window = self.max_head + 4 - len(self.head)
        if not self.head:  # the usual case: the whole head in one read, looked for in place
            end = _head_end(data, pos, pos + window)
            if end >= 0:
                return data[pos:end], end
        held = len(self.head)
        self.head += data[pos:pos + window]  # beyond max_head when no end is within the bound
        end = _head_end(self.head)
        if end < 0:
            return None, len(data)
        head = bytes(self.head[:end])
        self.head.clear()
        return head, pos + end - held


class ResponseHeadFramer:
    """Holds back an upstream's response head until it is complete; the body passes untouched
    until `expect_head()` says the next response is due."""

    def __init__(self, max_head: int):
        self.max_head = max_head
        self.head = bytearray()
        self.in_head = True

    def expect_head(self) -> None:
        self.in_head = True

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        """(bytes for mitmproxy now, whether the head broke `max_head`)."""
        if not self.in_head:
            return data, False
        if not self.head and data[9:10] != b"1":  # the usual case: a whole final head in one read
            end = _head_end(data, 0, self.max_head + 4)
            if 0 <= end <= self.max_head:
                self.in_head = False
                return data, False
        self.head += data
        end = _head_end(self.head)
        if end < 0 or end > self.max_head:
            too_large = len(self.head) > self.max_head
            if too_large:
                self.head.clear()
            return b"", too_large
        informational = self.head[9:10] == b"1"  # "HTTP/1.1 1xx": the real head follows
        head, rest = bytes(self.head[:end]), bytes(self.head[end:])
        self.head.clear()
        if informational:
            more, too_large = self.feed(rest)
            return head + more, too_large
        self.in_head = False
        return head + rest, False


class Reader(Protocol):
    async def read(self, n: int = -1) -> bytes: ...


class ClientReader:
    """Stands in for a client connection's reader: applies `RequestFramer` and the head timeouts,
    and answers a refusal itself (mitmproxy then sees the connection end).

    The deadline moves on with every chunk of a body, so it is kept by one timer per connection,
    moved only when it fires early (it looks again) or the deadline comes sooner: a timed read per
    chunk cost a timer scheduled and cancelled every 64 KiB. When the deadline has passed, the
    timer cancels the read it finds waiting, which then ends as a timeout."""

    def __init__(self, inner: Reader, writer: Any, framer: RequestFramer, head_timeout_s: float,
                 idle_timeout_s: float, body_timeout_s: float, on_refusal: Callable[[Refusal], None],
                 clock: Callable[[], float] = time.monotonic):
        self.inner, self.writer, self.framer = inner, writer, framer
        self.head_timeout, self.idle_timeout = head_timeout_s, idle_timeout_s
        self.body_timeout = body_timeout_s
        self.on_refusal, self.clock = on_refusal, clock
        self.deadline: float | None = clock() + head_timeout_s
        self.closed = False
        self._pending: Refusal | None = None  # to answer at the next read, after delivering data
        self.body_bytes = 0  # passed on since the last head began (the head included)
        self.answered = 0  # answers mitmproxy has written on this connection
        self._answer = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._reading: asyncio.Task[Any] | None = None  # the task waiting in `_read`, if any
        self._expired = False  # the timer cancelled that read
        self._next_limits: LimitSettings | None = None  # a reload's, for the next request

    def take(self, limits: LimitSettings) -> None:
        """New limits, from the next request on (one under way keeps those it began with)."""
        self._next_limits = limits
        if self.framer.state == HEAD and not self.framer.head_started:
            self._adopt_limits()

    def _adopt_limits(self) -> None:
        limits, self._next_limits = self._next_limits, None
        assert limits is not None
        self.framer.max_head, self.framer.max_body = limits.max_head, limits.max_body
        self.head_timeout, self.idle_timeout = limits.head_timeout, limits.idle_timeout
        self.body_timeout = limits.body_timeout

    def answer_written(self) -> None:
        self.answered += 1
        self._answer.set()

    def response_done(self) -> None:
        """The answer to the last request went out: the next head may take `idle_timeout` to begin."""
        if self.framer.state == HEAD and not self.framer.head_started and self.deadline is None:
            self.deadline = self.clock() + self.idle_timeout

    async def read(self, n: int = -1) -> bytes:
        while not self.closed:
            try:
                data = await self._read(n)
            except TimeoutError:
                if self.deadline is None or self.clock() < self.deadline:
                    continue  # no deadline yet (or a later one): look again
                return await self._refuse(self._timed_out())
            if not data:
                self._disarm()
                return b""
            heads_before, head_was_started = self.framer.heads, self.framer.head_started
            if self._next_limits is not None and self.framer.state == HEAD and not head_was_started:
                self._adopt_limits()  # a reload's: this read begins a request
            out, refusal = self.framer.feed(data)
            self._track_deadline(heads_before, head_was_started)
            if refusal is not None:
                if out:
                    self._pending = refusal
                    return out
                return await self._refuse(refusal)
            if out:
                fresh = self.framer.heads != heads_before
                self.body_bytes = len(out) if fresh else self.body_bytes + len(out)
                return out
        return b""

    def _timed_out(self) -> Refusal | None:
        """What a passed deadline means: nothing to say when no request had begun."""
        if self.framer.in_body:
            return body_timeout(self.body_timeout)
        return head_timeout(self.head_timeout) if self.framer.head_started else None

    async def _read(self, n: int) -> bytes:
        if self._pending is not None:
            await self._refuse(self._pending)
            return b""
        if self.deadline is not None and self.clock() >= self.deadline:
            raise TimeoutError
        task = asyncio.current_task()
        if task is None:
            return await asyncio.wait_for(self.inner.read(n), self._wait())
        self._reading, cancelling = task, task.cancelling()
        self._arm()
        try:
            return await self.inner.read(n)
        except asyncio.CancelledError:
            if self._expired and task.uncancel() <= cancelling:  # the timer's cancellation alone
                raise TimeoutError from None
            self._disarm()  # cancelled from outside: the connection is going away
            raise
        finally:
            self._reading, self._expired = None, False

    def _wait(self) -> float:
        # a read without a deadline still wakes now and then: `response_done` may have set one
        return DEADLINE_CHECK if self.deadline is None else max(0.0, self.deadline - self.clock())

    def _arm(self) -> None:
        """Have the timer fire by the deadline: a later deadline leaves it as it is (it looks again
        when it fires), an earlier one moves it."""
        if self.closed:
            return
        loop = asyncio.get_running_loop()
        when = loop.time() + self._wait()
        if self._timer is not None:
            if self._timer.when() <= when:
                return
            self._timer.cancel()
        self._timer = loop.call_at(when, self._check)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        """The timer fired: time out the read waiting past the deadline, else look again later."""
        self._timer = None
        if self._reading is None or self.closed:
            return  # no read waits: the next one arms the timer again
        if self.deadline is not None and self.clock() >= self.deadline:
            self._expired = True
            self._reading.cancel()
        else:
            self._arm()

    def _track_deadline(self, heads_before: int, head_was_started: bool) -> None:
        completed = self.framer.heads != heads_before
        if self.framer.state != HEAD or completed:
            self.deadline = None  # a request is being served, or the stream is not ours
        if self.framer.in_body:
            self.deadline = self.clock() + self.body_timeout  # the body must keep arriving
        if self.framer.head_started and (completed or not head_was_started):
            limit = self.clock() + self.head_timeout  # a (next) head began
            self.deadline = limit if self.deadline is None else min(self.deadline, limit)

    async def _refuse(self, refusal: Refusal | None) -> bytes:
        """Answer (when there is something to say), let the client finish sending so it sees the
        answer, and end the stream for mitmproxy."""
        self.closed = True
        self._disarm()
        if refusal is not None:
            self.on_refusal(refusal)
            # HTTP/1.1 answers in order: every request passed on whole is answered before this
            while self.answered < self.framer.whole:
                self._answer.clear()
                await self._answer.wait()
            with contextlib.suppress(OSError, RuntimeError):
                self.writer.write(refusal.response())
                await asyncio.wait_for(self.writer.drain(), LINGER_SECONDS)
        with contextlib.suppress(OSError, TimeoutError, RuntimeError):
            deadline = self.clock() + LINGER_SECONDS
            while refusal is not None and self.clock() < deadline:
                if not await asyncio.wait_for(self.inner.read(65536), max(0.0, deadline - self.clock())):
                    break
        return b""


class UpstreamReader:
    """Stands in for an upstream connection's reader: applies `ResponseHeadFramer`. An oversized
    head becomes crossbar's JSON 502 (so the client gets JSON, and the host is marked)."""

    def __init__(self, inner: Reader, framer: ResponseHeadFramer, on_oversized: Callable[[], None]):
        self.inner, self.framer, self.on_oversized = inner, framer, on_oversized
        self.closed = False

    async def read(self, n: int = -1) -> bytes:
        while not self.closed:
            data = await self.inner.read(n)
            if not data:
                return b""
            out, too_large = self.framer.feed(data)
            if too_large:
                self.closed = True
                self.on_oversized()
                message = f"the upstream sent a response head over {self.framer.max_head} bytes (max_head)"
                return Refusal(502, "bad_gateway", message, Rejection.UPSTREAM_HEAD_TOO_LARGE).response()
            if out:
                return out
        return b""


def _transport(client: Client, conn: Connection) -> Any:
    """mitmproxy's I/O record (reader, writer) of one connection of a client's handler; None once gone."""
    handler = ctx.master.addons.get("proxyserver").connections.get(client.id)
    return handler.transports.get(conn) if handler is not None else None


@dataclass(frozen=True, slots=True)
class LimitSettings:
    max_head: int
    max_body: int
    head_timeout: float
    idle_timeout: float
    body_timeout: float
    max_connections_per_peer: int


class Limits:
    """mitmproxy addon: installs the readers above on every connection and caps connections per
    peer, once crossbar runs (`router()` returns its Router, else None)."""

    def __init__(self, router: Callable[[], Router | None], reclaim: Callable[[], None]):
        self.router = router
        self.reclaim = reclaim  # an unfinished upload's memory goes back soon (`crossbar.reclaim`)
        self.per_peer: Counter[str] = Counter()
        self._counted: set[str] = set()  # ids of the client connections counted in per_peer
        self._clients: WeakIdDict[Client, ClientReader] = WeakIdDict()
        self._upstreams: WeakIdDict[Connection, UpstreamReader] = WeakIdDict()

    def settings(self) -> LimitSettings | None:
        router = self.router()
        if router is None:
            return None
        cfg = router.cfg
        return LimitSettings(cfg.max_head, cfg.max_body, cfg.head_timeout, cfg.idle_timeout, cfg.body_timeout,
                             cfg.max_connections_per_peer)

    def reconfigured(self) -> None:
        """After a reload: connections already open take the new limits from their next request
        on (a request under way keeps those it began with); the cap on connections per peer
        counts the open ones and refuses new ones past it."""
        limits = self.settings()
        if limits is None:
            return
        for reader in self._clients.values():
            reader.take(limits)
        for upstream in self._upstreams.values():
            upstream.framer.max_head = limits.max_head

    def count(self, reason: Rejection) -> None:
        router = self.router()
        if router is not None:
            router.rejected(reason)

    def mark_upstream(self, address: tuple[str, int], why: str) -> None:
        router = self.router()
        if router is None:
            return
        for name, conf in router.cfg.hosts.items():
            if (conf.host, conf.port) == tuple(address[:2]):
                log.warning("crossbar: %s %s", name, why)
                router.passive_mark(name, why)

    def client_connected(self, client: Client) -> None:
        limits = self.settings()
        io = _transport(client, client)
        if limits is None or io is None or client.peername is None:
            return
        peer = str(client.peername[0])
        self.per_peer[peer] += 1
        self._counted.add(client.id)
        if self.per_peer[peer] > limits.max_connections_per_peer:
            self._refuse_connection(client, io, limits.max_connections_per_peer)
            return
        reader = ClientReader(io.reader, io.writer, RequestFramer(limits.max_head, limits.max_body),
                              limits.head_timeout, limits.idle_timeout, limits.body_timeout, self._refused)
        io.reader = reader
        self._clients[client] = reader

    def _refuse_connection(self, client: Client, io: Any, cap: int) -> None:
        self.count(Rejection.PEER_CONNECTIONS)
        log.warning("crossbar: %s holds more than %d connections; refusing one", client.peername[0], cap)
        refusal = Refusal(503, "unavailable_error", f"more than {cap} connections from this address "
                          "(max_connections_per_peer)", Rejection.PEER_CONNECTIONS)
        with contextlib.suppress(OSError, RuntimeError):
            io.writer.write(refusal.response("Retry-After: 5\r\n"))
        client.error = "too many connections from this peer"

    def client_disconnected(self, client: Client) -> None:
        if client.id not in self._counted:
            return
        self._counted.discard(client.id)
        peer = str(client.peername[0])
        self.per_peer[peer] -= 1
        if self.per_peer[peer] <= 0:
            del self.per_peer[peer]
        reader = self._clients.pop(client, None)
        if reader is not None and reader.framer.state in (LENGTH, CHUNKED) and reader.body_bytes > TRIM_AFTER:
            self.reclaim()

    def _refused(self, refusal: Refusal) -> None:
        self.count(refusal.reason)

    def server_connected(self, data: ServerConnectionHookData) -> None:
        limits = self.settings()
        io = _transport(data.client, data.server)
        if limits is None or io is None:
            return
        address = data.server.address
        reader = UpstreamReader(io.reader, ResponseHeadFramer(limits.max_head),
                                lambda: self._oversized(address, limits.max_head))
        io.reader = reader
        self._upstreams[data.server] = reader

    def _oversized(self, address: tuple[str, int] | None, limit: int) -> None:
        self.count(Rejection.UPSTREAM_HEAD_TOO_LARGE)
        if address is not None:
            self.mark_upstream(address, f"sent a response head over {limit} bytes")

    def response(self, flow: http.HTTPFlow) -> None:
        self._message_done(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._message_done(flow)

    def _message_done(self, flow: http.HTTPFlow) -> None:
        upstream = self._upstreams.get(flow.server_conn)
        if upstream is not None:
            upstream.framer.expect_head()
        client = self._clients.get(flow.client_conn)
        if client is not None:
            client.response_done()
            if not flow.metadata.get(ANSWERED):
                flow.metadata[ANSWERED] = True
                _when_hook_returns(client.answer_written)


def _when_hook_returns(callback: Callable[[], None]) -> None:
    """Run `callback` once the task running this hook ends: mitmproxy runs each hook on a task of
    its own that writes what the hook decided (the answer) before it ends; later addons' hooks
    may still await before that."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop: called outside mitmproxy
        task = None
    if task is None:
        callback()
    else:
        task.add_done_callback(lambda _: callback())

