"""The core answer hooks: tap the answer for usage on its way to the client, and end the request
(row, metrics, slot, lease hold) exactly once, whatever path it took.

  responseheaders  SSE → stream through the usage tap (a compressed one untapped: its usage is
                   a dropped figure); a body past the buffering bound → stream it, keeping its
                   edges for usage
  response         read usage (a compressed answer: decoded within a bound, on a worker thread);
                   end the request (in a `finally`)
  error            cut stream, refused connect, client gone: end the request (in a `finally`)
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from functools import partial

from mitmproxy import http

from crossbar import headers
from crossbar import request as req
from crossbar.addons.runtime import LOCAL, Runtime, exchange_of
from crossbar.encoded import usage_of_encoded
from crossbar.exchange import Exchange
from crossbar.tap import EdgeTap, SSETap, Usage, usage_from_body

log = logging.getLogger("crossbar")

EDGES = "crossbar.edges"  # flow.metadata key of a streamed answer's EdgeTap


class _Plain(enum.Enum):
    PLAIN = "plain"  # an answer read as it came: not compressed, or not one whose usage is read


PLAIN = _Plain.PLAIN


class Account:
    def __init__(self, rt: Runtime):
        self.rt = rt

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        ex = exchange_of(flow)
        if ex is None or flow.metadata.get(LOCAL) or flow.response is None or ex.retry_pending:
            return
        stream, compressed = headers.event_stream_coding(flow.response.headers)
        if stream:
            if compressed:  # its events cannot be read as they pass
                flow.response.stream = True
                return
            ex.tap = SSETap()
            flow.response.stream = ex.tap
        elif flow.response.stream and ex.completion:  # a body announced past the buffering bound
            flow.metadata[EDGES] = flow.response.stream = EdgeTap()

    async def response(self, flow: http.HTTPFlow) -> None:
        decoded: Usage | _Plain | None = None  # a compressed answer whose decoding failed: no usage
        try:
            decoded = await self._usage_of_encoded(flow)
        finally:
            self._end(flow, partial(self._read_answer, decoded=decoded))

    def error(self, flow: http.HTTPFlow) -> None:
        self._end(flow, self._read_error)

    def _end(self, flow: http.HTTPFlow, read: Callable[[http.HTTPFlow, Exchange], None]) -> None:
        """What the flow's ending says goes into its exchange, then the exchange ends, whatever
        reading raised."""
        if _holds_large_body(flow):
            self.rt.reclaimer.soon()
        ex, router = exchange_of(flow), self.rt.router
        if ex is None or router is None:
            return
        try:
            if not ex.finished:  # an error after the answer: its row is what it held when it ended
                read(flow, ex)
        finally:
            self.rt.done_with(flow)
            router.finish(ex)

    async def _usage_of_encoded(self, flow: http.HTTPFlow) -> Usage | _Plain | None:
        """Usage of a buffered compressed answer, decoded on a worker thread up to the size
        mitmproxy buffers an answer at; one it cannot read counts as a dropped figure. PLAIN when
        there is no such answer to decode."""
        ex, cfg, response = exchange_of(flow), self.rt.cfg, flow.response
        if (ex is None or response is None or not ex.completion or ex.tap is not None
                or response.stream or flow.metadata.get(LOCAL) or not headers.compressed(response.headers)):
            return PLAIN
        if headers.event_stream(response.headers):  # a retried stream, answered whole
            return _unread(response, ex, "a compressed event stream")
        if cfg is None:
            return None
        encoding, cap = response.headers["content-encoding"], cfg.buffered_body_max
        found = await asyncio.to_thread(usage_of_encoded, response.raw_content or b"", encoding, cap)
        if found.unread:
            log.warning("crossbar: usage from %s %s", ex.host, found.unread)
            return Usage(dropped=1)
        return found.usage

    def _read_answer(self, flow: http.HTTPFlow, ex: Exchange, decoded: Usage | _Plain | None = PLAIN) -> None:
        response = flow.response
        if response is None:
            return
        ex.status = response.status_code
        if ex.tap is not None:
            ex.usage = ex.tap.usage
        elif ex.completion and not flow.metadata.get(LOCAL):
            if decoded is not PLAIN:
                ex.usage = decoded
            elif not response.stream:  # the usual answer, buffered whole
                ex.usage = usage_from_body(response.raw_content)
            else:
                ex.usage = _streamed_usage(response, ex, flow.metadata.pop(EDGES, None))
        if ex.status >= 400 and not ex.err:
            ex.err = f"upstream answered {ex.status}"

    @staticmethod
    def _read_error(flow: http.HTTPFlow, ex: Exchange) -> None:
        flow.metadata.pop(EDGES, None)  # a cut answer's edges tell nothing
        ex.cancel_deadline()
        ex.err = ex.err or (flow.error.msg if flow.error else "error")
        response = flow.response
        if ex.tap is not None:
            ex.usage = ex.tap.usage
        elif ex.completion and response is not None and response.stream \
                and headers.event_stream_coding(response.headers) == (True, True):
            ex.usage = _unread(response, ex, "a compressed event stream, cut")
        if response is not None and ex.status is None:
            ex.status = response.status_code


def _streamed_usage(response: http.Response, ex: Exchange, edges: EdgeTap | None) -> Usage | None:
    """Usage of a completion's answer streamed without a tap: one too large to buffer, read at its
    edges. mitmproxy also streams an answer without a Content-Length once its buffer passes the
    bound, after the hook that would have kept its edges: that one, a compressed one, and a
    compressed event stream count a dropped figure."""
    stream, compressed = headers.event_stream_coding(response.headers)
    if edges is not None and not compressed:
        return edges.usage()
    if edges is not None:
        why = "a compressed answer too large to buffer"
    elif stream:
        why = "a compressed event stream"
    else:
        why = "an answer without a Content-Length that grew past the buffering bound"
    return _unread(response, ex, why)


def _unread(response: http.Response, ex: Exchange, why: str) -> Usage | None:
    """The figures of an answer crossbar does not read: one dropped figure (an error answer
    carries none to drop). A compressed event stream is one: its compressed bytes are never
    scanned as events (a stored gzip block carries them as they are, cut anywhere)."""
    if response.status_code >= 400:
        return None
    log.warning("crossbar: usage from %s not read from %s", ex.host, why)
    return Usage(dropped=1)


def _holds_large_body(flow: http.HTTPFlow) -> bool:
    """A request body left unfinished, or a large request or answer body (not a stream)."""
    request, response = flow.request, flow.response
    if request.timestamp_end is None or len(request.raw_content or b"") >= req.OFF_LOOP_BYTES:
        return True
    return response is not None and len(response.raw_content or b"") >= req.OFF_LOOP_BYTES
