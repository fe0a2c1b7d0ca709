"""The core answer hooks: tap the answer for usage on its way to the client, and end the request
(row, metrics, slot, lease hold) exactly once, whatever path it took.

  responseheaders  SSE → stream through the usage tap; a body past the buffering bound →
                   stream it, keeping its tail for usage
  response         read usage; end the request (in a `finally`)
  error            cut stream, refused connect, client gone: end the request (in a `finally`)
"""

from __future__ import annotations

import json

from mitmproxy import http

from crossbar import request as req
from crossbar.addons.runtime import LOCAL, Runtime, exchange_of
from crossbar.exchange import Exchange
from crossbar.tap import SSETap, usage_from_body

TAIL = "crossbar.tail"  # flow.metadata key of a streamed answer's BodyTail


class Account:
    def __init__(self, rt: Runtime):
        self.rt = rt

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        ex = exchange_of(flow)
        if ex is None or flow.metadata.get(LOCAL) or flow.response is None or ex.retry_pending:
            return
        if flow.response.headers.get("content-type", "").startswith("text/event-stream"):
            ex.tap = SSETap()
            flow.response.stream = ex.tap
        elif flow.response.stream:  # mitmproxy streams a body past its buffering bound
            flow.metadata[TAIL] = flow.response.stream = BodyTail()

    def response(self, flow: http.HTTPFlow) -> None:
        if _holds_large_body(flow):
            self.rt.reclaimer.soon()
        ex, router = exchange_of(flow), self.rt.router
        if ex is None or router is None:
            return
        try:
            self._read_answer(flow, ex)
        finally:
            self.rt.done_with(flow)
            router.finish(ex)

    def _read_answer(self, flow: http.HTTPFlow, ex: Exchange) -> None:
        if flow.response is None:
            return
        ex.status = flow.response.status_code
        if ex.tap is not None:
            ex.usage = ex.tap.usage
        elif TAIL in flow.metadata:
            ex.usage = usage_from_body(flow.metadata.pop(TAIL).usage_json())
        elif ex.completion and not flow.metadata.get(LOCAL):
            ex.usage = usage_from_body(_content(flow.response))
        if ex.status >= 400 and not ex.err:
            ex.err = f"upstream answered {ex.status}"

    def error(self, flow: http.HTTPFlow) -> None:
        if _holds_large_body(flow):
            self.rt.reclaimer.soon()
        ex, router = exchange_of(flow), self.rt.router
        if ex is None or router is None:
            return
        try:
            ex.cancel_deadline()
            ex.err = ex.err or (flow.error.msg if flow.error else "error")
            if ex.tap is not None:
                ex.usage = ex.tap.usage
            if flow.response is not None and ex.status is None:
                ex.status = flow.response.status_code
        finally:
            self.rt.done_with(flow)
            router.finish(ex)


class BodyTail:
    """Streams a large answer unchanged, keeping only its last bytes: llama-server writes JSON
    with sorted keys, so `usage` comes last and is read from the tail."""

    KEEP = 16 << 10

    def __init__(self) -> None:
        self.tail = b""

    def __call__(self, chunk: bytes) -> bytes:
        self.tail = (self.tail + chunk)[-self.KEEP:]
        return chunk

    def usage_json(self) -> bytes | None:
        at = self.tail.rfind(b'"usage"')
        if at < 0:
            return None
        try:
            usage, _ = json.JSONDecoder().raw_decode(self.tail[at + 7:].lstrip(b": \t\r\n").decode())
        except (ValueError, UnicodeDecodeError):
            return None
        return json.dumps({"usage": usage}).encode()


def _content(response: http.Response) -> bytes | None:
    try:
        return response.content
    except ValueError:  # undecodable Content-Encoding
        return None


def _holds_large_body(flow: http.HTTPFlow) -> bool:
    """A request body left unfinished, or a large request or answer body (not a stream)."""
    if flow.request.timestamp_end is None:
        return True
    large = req.OFF_LOOP_BYTES
    response = flow.response
    return (len(flow.request.raw_content or b"") >= large
            or (response is not None and len(response.raw_content or b"") >= large))
