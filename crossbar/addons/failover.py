"""Upstream failover: getting the placed request to a host that answers.

  request          pre-flight a new upstream connection (refused → the host is marked down and
                   the request placed again), then rewrite the request to its host (origin-form)
                   and arm the first-byte deadline
  server_connect   a kept-alive upstream connection closed meanwhile: pre-flight the new one
  responseheaders  a 5xx before anything reached the client: hold it for one retry
  response         retry that 5xx on another host (crossbar sends it; mitmproxy cannot re-send)
  error            a refused or reset connection before any byte marks the host down
"""

from __future__ import annotations

import logging

import aiohttp
from mitmproxy import http
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from crossbar import errors, headers
from crossbar.addons.runtime import LOCAL, META, Runtime, answer_failed, close_socket
from crossbar.app import Router
from crossbar.decisions import Reason, Rejection
from crossbar.errors import CrossbarError
from crossbar.exchange import Exchange
from crossbar.limiter import ClientGone, unless_gone
from crossbar.tap import SSETap
from crossbar.upstream import AnswerTooLarge, forward_headers, point_at, preflight, resend

log = logging.getLogger("crossbar")

RETRY_STATUSES = frozenset({500, 502, 503, 504})
PASSIVE_DOWN_STATUSES = frozenset({502, 503, 504})


class Failover:
    def __init__(self, rt: Runtime):
        self.rt = rt

    # ------------------------------------------------------------ before the request is sent

    async def request(self, flow: http.HTTPFlow) -> None:
        rt, router, ex = self.rt, self.rt.router, flow.metadata.get(META)
        if ex is None or router is None or flow.response is not None or flow.error is not None:
            return
        try:
            await self._reachable(flow, ex, router)
            if rt.gone_event(flow).is_set():
                raise ClientGone
        except CrossbarError as exc:
            rt.answer(flow, exc, ex)
            return
        except ClientGone:
            flow.kill()
            return
        except Exception:  # a crossbar bug must not send the flow to the placeholder
            log.exception("crossbar: request failed")
            rt.answer(flow, errors.internal("crossbar failed to route the request; see its log"), ex)
            return
        self._forward(flow, ex, router)
        rt.current[flow.client_conn] = flow

    async def _reachable(self, flow: http.HTTPFlow, ex: Exchange, router: Router) -> None:
        """Pre-flight: unless this client connection already holds an open connection to the
        host (mitmproxy reuses it), check the host accepts one. A host that refuses is marked
        down and the request moves on (its lease with it) while crossbar can still answer;
        nowhere left to go is crossbar's JSON error, not mitmproxy's 502 page."""
        for _ in range(len(router.cfg.hosts)):
            conf = router.host_conf(ex.host)
            if (conf.host, conf.port) in self.rt.upstreams.get(flow.client_conn, ()):
                return
            why = await preflight(conf.host, conf.port, router.cfg.connect_timeout)
            if why is None:
                ex.checked = (conf.host, conf.port)
                return
            router.passive_mark(ex.host, f"connect failed: {why}")
            try:
                await router.move(ex, "connect failed", self.rt.gone_event(flow))
            except CrossbarError:
                ex.err = f"{ex.host}: connect failed: {why}; no other host"
                raise

    def _forward(self, flow: http.HTTPFlow, ex: Exchange, router: Router) -> None:
        """Send the request to its host, in origin-form whatever form the client used; the
        first-byte deadline is armed for that host. Its settings are read now: a reload during the
        pre-flight's wait may have moved it (the connection to the new address is then checked
        in `server_connect`)."""
        conf = router.host_conf(ex.host)
        point_at(flow.request, conf.scheme, conf.host, conf.port, conf.base_path + ex.path)
        ex.forwarded = True
        router.sent(ex)
        ex.arm_deadline(router.deadlines, router.cfg.first_byte_timeout,
                        lambda host: self._first_byte_overdue(flow, host))

    def _first_byte_overdue(self, flow: http.HTTPFlow, host: str) -> None:
        """The host accepted the request but the client has no first byte after
        `first_byte_timeout`: the host sent nothing, or (an answer crossbar buffers) has not sent
        all of it. Close its connection so the client gets crossbar's 502 (`error`) instead of
        waiting forever. `host` is the one the timer was armed for; a request moved since is not
        its fault."""
        ex, router = flow.metadata.get(META), self.rt.router
        if ex is None or ex.ttfb_ms is not None or not flow.live or router is None or ex.host != host:
            return
        if flow.response is not None and flow.response.stream:
            # an answer without a Content-Length that outgrew the buffering bound: mitmproxy
            # streams it to the client from then on (it calls no hook there), so bytes are flowing
            return
        missing = "first byte" if flow.response is None else "complete answer"
        ex.err = f"no {missing} from {host} within {router.cfg.first_byte_timeout:g}s"
        router.passive_mark(host, ex.err)
        if not close_socket(flow, flow.server_conn):
            log.warning("could not close the upstream connection of a hung request to %s", host)

    # ------------------------------------------------------------ upstream connections

    async def server_connect(self, data: ServerConnectionHookData) -> None:
        """A new upstream connection the request hook did not check: the kept-alive one it
        expected to reuse was closed meanwhile (a host that just died). Check it now and move
        the request if the host refuses; only a 502 is possible when nothing else is left."""
        rt = self.rt
        flow = rt.current.get(data.client)
        ex = flow.metadata.get(META) if flow else None
        if flow is None or ex is None or rt.router is None or data.server.address is None:
            return
        if ex.checked == data.server.address:
            return
        why = await preflight(*data.server.address, rt.router.cfg.connect_timeout)
        if why is None:
            return
        rt.router.passive_mark(ex.host, f"connect failed: {why}")
        try:
            await rt.router.move(ex, "connect failed", rt.gone_event(flow))
        except (CrossbarError, ClientGone):
            ex.err = f"{ex.host}: connect failed: {why}; no other host"
            return
        self._forward(flow, ex, rt.router)
        data.server.address = (flow.request.host, flow.request.port)
        if flow.request.scheme == "https":
            data.server.sni = flow.request.host

    def server_connected(self, data: ServerConnectionHookData) -> None:
        if data.server.address is not None:
            self.rt.upstreams.setdefault(data.client, set()).add(data.server.address)

    def server_disconnected(self, data: ServerConnectionHookData) -> None:
        if data.server.address is not None:
            self.rt.upstreams.get(data.client, set()).discard(data.server.address)

    # ------------------------------------------------------------ the answer

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        """A streamed answer's first byte goes to the client now. A buffered one's goes with the
        whole answer (`response`): until then nothing has reached the client, and the first-byte
        deadline keeps running, so a host that sends a head and then stalls is bounded too."""
        ex = flow.metadata.get(META)
        if ex is None or flow.metadata.get(LOCAL) or flow.response is None:
            return
        ex.status = flow.response.status_code
        if ex.ctx_moved:
            flow.response.headers["X-Crossbar-Ctx"] = ex.ctx_moved
        # a streamed answer (a body beyond mitmproxy's buffering bound) cannot be held back
        if ex.completion and ex.status in RETRY_STATUSES and not ex.retried and not flow.response.stream:
            ex.retry_pending = True  # leave the (small) error body buffered: nothing reaches the client yet
        elif flow.response.stream or headers.event_stream(flow.response.headers):
            ex.cancel_deadline()  # streamed: its first byte goes to the client now
            ex.mark_first_byte()

    async def response(self, flow: http.HTTPFlow) -> None:
        ex = flow.metadata.get(META)
        if ex is None or ex.finished or flow.metadata.get(LOCAL):
            return
        ex.cancel_deadline()  # a buffered answer is whole: its first byte goes to the client now
        ex.mark_first_byte()
        if not ex.retry_pending or self.rt.router is None:
            return
        ex.retry_pending = False
        if flow.response is not None and flow.response.stream:
            # an answer without a Content-Length that grew past the buffering bound: mitmproxy
            # streamed it to the client after all, so it stands
            return
        try:
            await self._retry(flow, ex)
        except Exception:  # the client gets the first answer; the request still ends normally
            log.exception("crossbar: the retry of %s/%s failed", ex.key.route, ex.model)
            ex.err = ex.err or "the retry failed; see crossbar's log"

    async def _retry(self, flow: http.HTTPFlow, ex: Exchange) -> None:
        """A 5xx before anything reached the client: send the request once to another host and
        answer with the whole reply. A retry that cannot run (no other host, no slot), that fails,
        or whose client leaves meanwhile (the engine stops, the slot is freed) changes nothing:
        the client gets the first answer (if still there), the row names the host that gave it,
        and the lease stays. The lease follows the retry only once its host answered."""
        rt, router = self.rt, self.rt.router
        assert router is not None and rt.session is not None and flow.response is not None
        status, first = flow.response.status_code, ex.host
        marked = status in PASSIVE_DOWN_STATUSES
        if marked:
            router.passive_mark(ex.host, f"answered {status}")
        try:
            # a 500 leaves the host healthy ("Context size has been exceeded."): not "unhealthy"
            reason = Reason.UNHEALTHY if marked else Reason.RETRIED
            placed = await router.move(ex, f"answered {status}", rt.gone_event(flow), reason=reason,
                                       settle=False)
        except CrossbarError as exc:  # (a wait for a slot or a wake may have come first)
            ex.err = f"upstream answered {status}; not retried: {exc.message}"
            ex.ttfb_ms = ex.elapsed_ms()  # the first answer goes to the client only now
            return
        except ClientGone:
            ex.err = f"upstream answered {status}; the client left before a retry"
            return
        answered = False
        try:
            answered = await self._resend(flow, ex, router)
        finally:
            if answered:
                await router.follow(ex, placed)
            else:
                ex.host = first
                if not self.rt.gone_event(flow).is_set():
                    ex.ttfb_ms = ex.elapsed_ms()  # the first answer goes to the client only now

    async def _resend(self, flow: http.HTTPFlow, ex: Exchange, router: Router) -> bool:
        """Send the request to the host it moved to; True when that host's answer replaces the
        first one (or crossbar's 502 for an answer too large to hold does)."""
        rt = self.rt
        assert rt.session is not None
        ex.retried = True
        router.sent(ex)
        conf = router.host_conf(ex.host)
        retry = resend(
            rt.session, flow.request.method, conf.base_url + ex.path,
            forward_headers(flow.request.headers.items()), flow.request.raw_content or b"",
            router.cfg.connect_timeout, router.cfg.first_byte_timeout, router.cfg.buffered_body_max,
        )
        try:
            new_status, answer_headers, body = await unless_gone(retry, rt.gone_event(flow))
        except ClientGone:
            ex.err = "client left during the retry"
            return False
        except AnswerTooLarge as exc:
            rt.answer(flow, CrossbarError(502, "bad_gateway", f"{exc} (2 x max_body + 1 MiB)",
                                          reason=Rejection.UPSTREAM_TOO_LARGE), ex)
            ex.ttfb_ms = ex.elapsed_ms()
            return True
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            limit = router.cfg.first_byte_timeout
            why = str(exc) or f"no complete answer within {limit:g}s (first_byte_timeout)"
            router.passive_mark(ex.host, f"retry failed: {why}")
            ex.err = f"retry on {ex.host} failed: {why}"
            return False
        if new_status in PASSIVE_DOWN_STATUSES:
            router.passive_mark(ex.host, f"answered {new_status}")
        ex.ttfb_ms = ex.elapsed_ms()  # the client gets its first byte now, with the whole answer
        fields = [(_header_bytes(k), _header_bytes(v)) for k, v in answer_headers]
        flow.response = http.Response.make(new_status, b"", http.Headers(fields))
        flow.response.raw_content = body  # as received: never encoded a second time
        flow.response.headers["Content-Length"] = str(len(body))
        flow.response.headers["X-Crossbar-Retried"] = "1"
        if ex.ctx_moved:
            flow.response.headers["X-Crossbar-Ctx"] = ex.ctx_moved
        stream, compressed = headers.event_stream_coding(flow.response.headers)
        if stream and not compressed:  # a compressed one's figures are not read (Account)
            tap = SSETap()
            tap(body)
            tap(b"")
            ex.tap = tap
        return True

    def error(self, flow: http.HTTPFlow) -> None:
        ex, router = flow.metadata.get(META), self.rt.router
        if ex is None or router is None or ex.finished:
            return
        ex.cancel_deadline()
        msg = flow.error.msg if flow.error else "error"
        # nothing reached the client yet: no answer, or a buffered one cut before it was whole
        if (flow.response is not None and flow.response.stream) or ex.ttfb_ms is not None or not ex.forwarded:
            return
        if _is_connect_failure(msg):
            router.passive_mark(ex.host, msg)
        if not self.rt.gone_event(flow).is_set():
            exc = errors.bad_gateway(ex.err or f"{ex.host}: {msg}")
            if answer_failed(flow, exc):
                router.rejected(Rejection.UPSTREAM_FAILED)
                ex.status = exc.status


def _header_bytes(text: str) -> bytes:
    """A header as received: aiohttp decodes header bytes as UTF-8 (with surrogate escapes)."""
    return text.encode("utf-8", "surrogateescape")


def _is_connect_failure(msg: str) -> bool:
    text = msg.lower()
    return any(s in text for s in ("connect call failed", "connection refused", "connection reset",
                                   "timed out", "no route to host", "network is unreachable",
                                   "name or service not known", "cannot connect"))
