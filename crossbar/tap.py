"""Token figures from llama-server replies, read without holding up or copying the stream.

llama-server (b11312) puts `timings` on the finish chunk of a stream when the client did not ask
for usage, and sends an extra `choices: []` chunk with `usage` + `timings` when it did. A
non-streamed reply carries both at the top level. Absent figures stay None (never 0).

An upstream is not trusted: a figure outside a sane range (more tokens than any context holds, a
cached part larger than the prompt) is stored as unknown (None) and counted in `Usage.dropped`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from crossbar import jsonread
from crossbar.jsonread import UNREAD

log = logging.getLogger("crossbar")

MAX_LINE = 1024 * 1024  # longer SSE lines are forwarded but not scanned
MAX_TOKENS = 100_000_000  # no context or answer comes near this; larger figures are not believed
MAX_MILLIS = 30 * 86400 * 1000.0
MAX_TOKENS_PER_SECOND = 1e6  # no engine generates this fast: a timing that implies more is not believed
WHOLE_BODY_MAX = 256 * 1024  # a larger non-streamed reply is not parsed whole
EDGE_BYTES = 64 * 1024  # ... but read for usage at its start and its end
MEMBER_MAX = 16 * 1024  # a `usage` or `timings` object is far shorter
HEAD_KEEP = EDGE_BYTES + MEMBER_MAX  # a member found near the start is whole within this
TAIL_KEEP = WHOLE_BODY_MAX  # head + tail is longer than WHOLE_BODY_MAX: read at its edges
_DECODER = json.JSONDecoder()

_DATA = b"data:"
_DONE = b"[DONE]"
_USAGE = b'"usage"'
_USAGE_NULL = b'"usage":null'
_TIMINGS = b'"timings"'
_FINISH = (b'"finish_reason":"', b'"finish_reason": "')


@dataclass(slots=True)
class Usage:
    prompt_tokens: int | None = None  # the whole prompt, cached part included
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    predicted_ms: float | None = None
    prompt_n: int | None = None  # prompt tokens the host evaluated (the uncached part)
    prompt_ms: float | None = None  # time it took to evaluate them
    dropped: int = field(default=0, compare=False)  # out-of-range figures (stored as None)

    @property
    def tokens_per_second(self) -> float | None:
        if self.completion_tokens is None or not self.predicted_ms:
            return None
        tps = self.completion_tokens / self.predicted_ms * 1000.0
        return tps if tps <= MAX_TOKENS_PER_SECOND else None


class _Figures:
    """Reads figures from one reply object and counts the ones that are present but out of range."""

    def __init__(self) -> None:
        self.dropped = 0

    def count(self, value: Any) -> int | None:
        """A token count: an int in 0..MAX_TOKENS (an integral float is accepted), else None."""
        if type(value) is int and 0 <= value <= MAX_TOKENS:  # the usual case, first
            return value
        if value is None:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS:
            return value
        self.dropped += 1
        return None

    def millis(self, value: Any) -> float | None:
        if type(value) is float and 0 <= value <= MAX_MILLIS:  # the usual case; NaN fails here
            return value
        if value is None:
            return None
        if isinstance(value, int | float) and not isinstance(value, bool):
            ms = float(value) if -MAX_MILLIS <= value <= MAX_MILLIS else math.inf  # float(10**400) raises
            if math.isfinite(ms) and 0 <= ms <= MAX_MILLIS:
                return ms
        self.dropped += 1
        return None


def _first(value: int | None, fallback: int | None) -> int | None:
    return fallback if value is None else value


def usage_from_object(obj: Mapping[str, Any]) -> Usage | None:
    """Figures from one reply object or SSE event; None when it has neither `usage` nor `timings`.

    `prompt_tokens` falls back to `timings.prompt_n + timings.cache_n` only when both are given
    (`prompt_n` alone counts just the evaluated part, not the whole prompt).
    """
    usage = obj.get("usage")
    timings = obj.get("timings")
    if not isinstance(timings, dict):  # parsed JSON: objects are dicts
        return _checked_usage(usage, {}) if isinstance(usage, dict) else None
    if not isinstance(usage, dict):  # a stream's finish event without usage, say
        return _checked_usage({}, timings)
    plain = _plain_usage(usage, timings)
    return plain if plain is not None else _checked_usage(usage, timings)


def _plain_usage(usage: dict[str, Any], timings: dict[str, Any]) -> Usage | None:
    """The figures of a reply that carries all those llama-server writes, every count an int and
    every time a float within range, none at odds with another (nearly every reply): what
    `_checked_usage` makes of it, with nothing dropped. None for any other reply."""
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    prompt_n, cache_n, prompt_ms = timings.get("prompt_n"), timings.get("cache_n"), timings.get("prompt_ms")
    predicted_n, predicted_ms = timings.get("predicted_n"), timings.get("predicted_ms")
    details = usage.get("prompt_tokens_details")
    # not used beside cache_n, but counted as dropped when out of range all the same
    cached_detail = details.get("cached_tokens") if isinstance(details, dict) else None
    if not (type(prompt) is type(completion) is type(prompt_n) is type(cache_n) is type(predicted_n) is int):
        return None
    if not (0 <= cache_n <= prompt <= MAX_TOKENS and 0 <= prompt_n <= MAX_TOKENS):
        return None
    if not (0 <= completion <= MAX_TOKENS and 0 <= predicted_n <= MAX_TOKENS):
        return None
    if not (cached_detail is None or (type(cached_detail) is int and 0 <= cached_detail <= MAX_TOKENS)):
        return None
    if not (type(prompt_ms) is type(predicted_ms) is float and 0 <= prompt_ms <= MAX_MILLIS):
        return None
    if not (0 <= predicted_ms <= MAX_MILLIS and completion * 1000.0 <= predicted_ms * MAX_TOKENS_PER_SECOND):
        return None
    return Usage(prompt, cache_n, completion, predicted_ms, prompt_n, prompt_ms)


def _checked_usage(usage: dict[str, Any], timings: dict[str, Any]) -> Usage:
    """Any reply's figures, read one by one: those missing or out of range are None, and the
    ones present but out of range are counted in `dropped`."""
    details = usage.get("prompt_tokens_details")
    details = details if isinstance(details, dict) else {}
    fig = _Figures()
    prompt_n = fig.count(timings.get("prompt_n"))
    cache_n = fig.count(timings.get("cache_n"))
    from_timings = prompt_n + cache_n if prompt_n is not None and cache_n is not None else None
    prompt = _first(fig.count(usage.get("prompt_tokens")), from_timings)
    cached = _first(cache_n, fig.count(details.get("cached_tokens")))
    if prompt is not None and cached is not None and cached > prompt:
        fig.dropped += 1  # a cached part larger than the whole prompt: not believed
        cached = None
    completion = _first(fig.count(usage.get("completion_tokens")), fig.count(timings.get("predicted_n")))
    predicted_ms = fig.millis(timings.get("predicted_ms"))
    if completion and predicted_ms is not None and completion * 1000.0 > predicted_ms * MAX_TOKENS_PER_SECOND:
        fig.dropped += 1  # a generation time too short for its tokens: not believed
        predicted_ms = None
    return Usage(prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
                 predicted_ms=predicted_ms, prompt_n=prompt_n, prompt_ms=fig.millis(timings.get("prompt_ms")),
                 dropped=fig.dropped)


def merge(a: Usage | None, b: Usage | None) -> Usage | None:
    """Field by field, `b`'s known figures win over `a`'s."""
    if a is None:
        return b
    if b is None:
        return a
    merged = Usage()
    for f in fields(Usage):
        if f.name == "dropped":
            continue
        later = getattr(b, f.name)
        setattr(merged, f.name, later if later is not None else getattr(a, f.name))
    merged.dropped = a.dropped + b.dropped
    return merged


def usage_from_body(body: bytes | None) -> Usage | None:
    """Figures from a non-streamed JSON reply; None when there are none or it does not parse.

    A reply over WHOLE_BODY_MAX is not parsed whole (that would hold up every other stream): its
    `usage` and `timings` objects are read from its first and last EDGE_BYTES only.
    """
    if not body:
        return None
    if len(body) > WHOLE_BODY_MAX:
        return _usage_from_edges(body)
    obj = _read(body)
    return usage_from_object(obj) if isinstance(obj, dict) else None


def _read(text: bytes | bytearray) -> Any:
    """The JSON value of an answer or an event, or None when it is not JSON."""
    obj = jsonread.loads(text)
    if obj is not UNREAD:
        return obj
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None


def _usage_from_edges(body: bytes) -> Usage | None:
    """llama-server writes `usage` and `timings` after the choices of a completion and `usage`
    before the vectors of an embeddings reply: each is looked for near the end, then the start."""
    found: dict[str, Any] = {}
    for name in ("usage", "timings"):
        value = _member_near_edges(body, b'"%s"' % name.encode())
        if value is not None:
            found[name] = value
    return usage_from_object(found) if found else None


def _member_near_edges(body: bytes, key: bytes) -> dict[str, Any] | None:
    tail = max(len(body) - EDGE_BYTES, EDGE_BYTES)
    for at in (body.rfind(key, tail), body.find(key, 0, EDGE_BYTES)):
        # a key (not text inside a string: a quote there is escaped); its value must be an object
        if at > 0 and body[at - 1] != 0x5C:
            value = _object_at(body, at + len(key))
            if value is not None:
                return value
    return None


def _object_at(body: bytes, at: int) -> dict[str, Any] | None:
    """The JSON object after the `:` that follows body[at], when it ends within MEMBER_MAX bytes."""
    rest = body[at:at + MEMBER_MAX].decode("utf-8", "replace").lstrip()
    if not rest.startswith(":"):
        return None
    try:
        value, _ = _DECODER.raw_decode(rest[1:].lstrip())
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


class AnswerEdges:
    """The parts of an answer given piece by piece that `usage_from_body` reads: its first
    HEAD_KEEP and last TAIL_KEEP bytes, so `usage_from_body(edges.body())` is
    `usage_from_body(answer)` while at most HEAD_KEEP + TAIL_KEEP bytes are held."""

    __slots__ = ("head", "tail", "total")

    def __init__(self) -> None:
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, piece: bytes) -> None:
        rest = memoryview(piece).cast("B")  # sliced without copying: only what is kept is copied
        self.total += len(rest)
        room = HEAD_KEEP - len(self.head)
        if room > 0:
            self.head += rest[:room]
            rest = rest[room:]
        if len(rest) >= TAIL_KEEP:
            self.tail[:] = rest[-TAIL_KEEP:]
            return
        self.tail += rest
        if len(self.tail) > TAIL_KEEP:
            del self.tail[:-TAIL_KEEP]

    def body(self) -> bytes:
        """The answer itself when it was kept whole, else its edges joined (longer than
        WHOLE_BODY_MAX, so `usage_from_body` reads them at the edges)."""
        return b"".join((self.head, self.tail))

    def usage(self) -> Usage | None:
        return usage_from_body(self.body())


class EdgeTap(AnswerEdges):
    """Streaming callable for an answer too large to buffer: every chunk is returned unchanged
    (the same object) and only its edges are kept, where llama-server writes `usage` and
    `timings` (after a completion's choices, before an embeddings reply's vectors)."""

    __slots__ = ()

    def __call__(self, chunk: bytes) -> bytes:
        self.add(chunk)
        return chunk


class SSETap:
    """Streaming callable for mitmproxy's `flow.response.stream`.

    Every chunk is returned unchanged (the same object). Complete `data:` lines are scanned for
    usage/timings and finish reasons; only the incomplete last line is kept between chunks, and
    a line longer than `max_line` is dropped from scanning (still forwarded). `b""` marks the
    end of the body.
    """

    __slots__ = (
        "_clock",
        "_dropping",
        "_failed",
        "_max_line",
        "_tail",
        "done",
        "events",
        "finish_reason",
        "first_chunk_at",
        "nbytes",
        "saw_done_marker",
        "usage",
    )

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_line: int = MAX_LINE) -> None:
        self._clock = clock
        self._max_line = max_line
        self._tail = bytearray()
        self._dropping = False  # inside an over-long line: skip up to its newline
        self._failed = False  # an event could not be read (logged once)
        self.usage: Usage | None = None
        self.done = False
        self.saw_done_marker = False
        self.finish_reason: str | None = None
        self.events = 0
        self.nbytes = 0
        self.first_chunk_at: float | None = None

    def __call__(self, chunk: bytes) -> bytes:
        if not chunk:
            self._finish()
            return chunk
        if self.done:
            return chunk
        self.nbytes += len(chunk)
        if self.first_chunk_at is None:
            self.first_chunk_at = self._clock()
        first = chunk.find(b"\n")
        if first == -1:
            self._keep(chunk, 0)
            return chunk
        self._close_tail(chunk, first)
        last = chunk.rfind(b"\n")
        start = first + 1
        while start <= last:
            end = chunk.find(b"\n", start)
            self._scan(chunk, start, end)
            start = end + 1
        self._keep(chunk, last + 1)
        return chunk

    def _keep(self, chunk: bytes, start: int) -> None:
        """Append chunk[start:] (an incomplete line) to the tail, unless it grows too long."""
        if self._dropping or start >= len(chunk):
            return
        if len(self._tail) + len(chunk) - start > self._max_line:
            self._tail.clear()
            self._dropping = True
            return
        self._tail += memoryview(chunk)[start:]

    def _close_tail(self, chunk: bytes, newline: int) -> None:
        """The line that ends at chunk[newline]: the kept tail plus chunk[:newline]."""
        if self._dropping:
            self._dropping = False
            return
        if not self._tail:
            self._scan(chunk, 0, newline)
            return
        if len(self._tail) + newline <= self._max_line:
            self._tail += memoryview(chunk)[:newline]
            self._scan(self._tail, 0, len(self._tail))
        self._tail.clear()

    def _finish(self) -> None:
        if not self.done and self._tail and not self._dropping:
            self._scan(self._tail, 0, len(self._tail))  # a last line without its newline
        self._tail.clear()
        self._dropping = False
        self.done = True

    def _scan(self, buf: bytes | bytearray, start: int, end: int) -> None:
        """One complete line buf[start:end] (newline excluded)."""
        if end > start and buf[end - 1] == 0x0D:
            end -= 1
        if not buf.startswith(_DATA, start, end):
            return
        self.events += 1
        if end - start > self._max_line:
            return
        start += len(_DATA)
        if end - start <= len(_DONE) + 2 and buf[start:end].strip() == _DONE:
            self.saw_done_marker = True
            return
        if self._wanted(buf, start, end):
            self._parse(buf[start:end])

    @staticmethod
    def _wanted(buf: bytes | bytearray, start: int, end: int) -> bool:
        if buf.find(_TIMINGS, start, end) != -1:
            return True
        if buf.find(_USAGE, start, end) != -1 and buf.find(_USAGE_NULL, start, end) == -1:
            return True
        return any(buf.find(marker, start, end) != -1 for marker in _FINISH)

    def _parse(self, payload: bytes | bytearray) -> None:
        try:
            self._read_event(payload)
        except Exception:  # figures crossbar cannot read must never stop the stream they ride on
            if not self._failed:
                log.warning("crossbar: an event of a streamed answer could not be read; its figures are "
                            "dropped", exc_info=True)
            self._failed = True
            self.usage = merge(self.usage, Usage(dropped=1))

    def _read_event(self, payload: bytes | bytearray) -> None:
        obj = _read(payload)
        if not isinstance(obj, dict):
            return
        self.usage = merge(self.usage, usage_from_object(obj))
        choices = obj.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                reason = choice.get("finish_reason") if isinstance(choice, dict) else None
                if isinstance(reason, str):
                    self.finish_reason = reason
