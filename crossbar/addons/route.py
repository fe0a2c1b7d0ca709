"""The core request hook: route, caller identity, body peek, then placement and a slot (the
router decides; see `crossbar.placement`). Connecting to the chosen host is `Failover`'s."""

from __future__ import annotations

import logging

from mitmproxy import http

from crossbar import errors, headers, session
from crossbar import request as req
from crossbar.addons.runtime import META, Runtime, close_socket
from crossbar.config import RouteConf
from crossbar.decisions import Rejection
from crossbar.errors import CrossbarError
from crossbar.exchange import Exchange
from crossbar.identity import admitted
from crossbar.lease import Key
from crossbar.limiter import ClientGone

log = logging.getLogger("crossbar")


class Route:
    def __init__(self, rt: Runtime):
        self.rt = rt

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        """A body announced beyond mitmproxy's buffering bound would be streamed to the placeholder
        target: close the connection instead (between `max_body` and that bound crossbar answers
        its JSON 413 once the body is read)."""
        if flow.request.stream and self.rt.router is not None:
            self.rt.router.rejected(Rejection.TOO_LARGE)
            flow.kill()
            close_socket(flow, flow.client_conn)  # at once: the client may still be sending it

    async def request(self, flow: http.HTTPFlow) -> None:
        rt = self.rt
        if flow.response is not None or rt.router is None or flow.request.stream:
            return
        ex: Exchange | None = None
        try:
            ex = await self._exchange(flow)
            flow.metadata[META] = ex
            rt.router.admit(ex)
            await rt.router.lease(ex, rt.gone_event(flow))
        except CrossbarError as exc:
            rt.answer(flow, exc, ex)
        except ClientGone:
            flow.kill()
        except Exception:  # a crossbar bug must not send the flow to the placeholder
            log.exception("crossbar: request failed")
            rt.answer(flow, errors.internal("crossbar failed to route the request; see its log"), ex)

    async def _exchange(self, flow: http.HTTPFlow) -> Exchange:
        """Route, caller identity and body peek. A route's own listener makes every request that
        route, with its path unchanged; control calls there take no slot and write no row."""
        cfg = self.rt.cfg
        assert cfg is not None
        r = flow.request
        _, listener_route = self.rt.role(flow)
        if listener_route:
            if listener_route not in cfg.routes:  # a connection opened before a reload removed it
                raise errors.not_found(f"route {listener_route!r} is no longer configured")
            resolved = req.resolve_listener(r.method, r.path, cfg.routes[listener_route])
            control = req.is_control(r.method, resolved.path)
        else:
            named = headers.value(r.headers, b"x-crossbar-route", None)
            resolved = req.resolve(r.method, r.path, named, cfg.routes)
            control = resolved.path not in req.COMPLETION_PATHS
        route = resolved.route
        if route.peers:  # else `_admit` lets every caller in: no coroutine for it
            await self._admit(flow, route)
        if control:
            model = resolved.model or route.default_model
            return Exchange(route=route, key=Key(route.name, "", model), path=resolved.upstream_path,
                            completion=False)
        raw = r.raw_content
        if raw is not None and len(raw) >= req.COUNT_FROM:  # perhaps peeked in a worker thread
            peek = await req.peek_body_off_loop(raw, resolved.path, route.default_model, cfg.max_body,
                                                self.rt.fp_key)
        else:  # peeked here, without a coroutine of its own
            peek = req.peek_body(raw, resolved.path, route.default_model, cfg.max_body, self.rt.fp_key)
        fp = session.conversation_fp(route, r.headers, peek.fingerprint)
        return Exchange(
            route=route, key=Key(route.name, fp, peek.model), path=resolved.upstream_path,
            completion=True, stream=peek.stream, prompt_bytes=peek.prompt_bytes,
        )

    async def _admit(self, flow: http.HTTPFlow, route: RouteConf) -> None:
        """A route that lists `peers` answers 403 to anyone else; an identity that cannot be
        established is a 503, never an open door."""
        cfg = self.rt.cfg
        assert cfg is not None
        if not route.peers or cfg.identity == "off":
            return
        names = await self.rt.caller_names(flow)
        if not admitted(route.peers, names):
            raise errors.forbidden(f"route {route.name!r} is not open to this caller")
