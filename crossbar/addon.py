"""The mitmproxy addon: wires mitmproxy's hooks to the router. Short hooks, no policy here.

A request's way through it:
  request          admin short-circuit | resolve route · identity · peek body · lease · context
                   guard · slot · pre-flight of a new upstream connection (refused → fail over,
                   the lease moves) · rewrite upstream
  server_connect   a kept-alive upstream connection closed meanwhile: pre-flight the new one
  responseheaders  first byte; SSE → stream through the usage tap; 5xx → hold for one retry
  response         retry a 5xx elsewhere; read usage; write the row
  error            cut stream, refused connect, client gone: passive health, write the row
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from typing import Any
from weakref import WeakKeyDictionary

import aiohttp
from mitmproxy import ctx, exceptions, http
from mitmproxy.addonmanager import Loader
from mitmproxy.connection import Client
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from crossbar import errors
from crossbar import request as req
from crossbar.admin import Admin, is_admin_path
from crossbar.app import Router
from crossbar.config import Config, ConfigError, RouteConf, load_config
from crossbar.errors import CrossbarError
from crossbar.exchange import Exchange
from crossbar.flowcap import FlowCap
from crossbar.identity import HeaderPeer, IdentityError, Tailscale, admitted
from crossbar.lease import Key
from crossbar.limiter import ClientGone
from crossbar.reclaim import Reclaimer, freeze_startup, thaw
from crossbar.secret import SecretError, load_or_create, secret_path
from crossbar.store import StoreError
from crossbar.tap import SSETap, usage_from_body
from crossbar.upstream import forward_headers, preflight, resend

log = logging.getLogger("crossbar")

META = "crossbar"
MAIN, ADMIN, ROUTE = "main", "admin", "route"  # listener roles
PLACEHOLDER = "http://127.0.0.1:1"  # reverse target never contacted: every request is rewritten
RETRY_STATUSES = frozenset({500, 502, 503, 504})
PASSIVE_DOWN_STATUSES = frozenset({502, 503, 504})
JSON_HEADERS = {"Content-Type": "application/json"}
SWITCH_INTERVAL = 0.001  # seconds a thread holds the interpreter while another waits for it


class Crossbar:
    def __init__(self) -> None:
        self.cfg: Config | None = None
        self.router: Router | None = None
        self.admin: Admin | None = None
        self._session: aiohttp.ClientSession | None = None
        # Per client connection, weakly keyed so nothing outlives the connection: an event set
        # when it leaves, the upstream addresses it holds open (mitmproxy reuses those), and the
        # flow being forwarded on it.
        self._gone: WeakKeyDictionary[Client, asyncio.Event] = WeakKeyDictionary()
        self._upstreams: WeakKeyDictionary[Client, set[tuple[str, int]]] = WeakKeyDictionary()
        self._current: WeakKeyDictionary[Client, http.HTTPFlow] = WeakKeyDictionary()
        self.listen_specs: list[str] = []
        self._roles: dict[str, tuple[str, str]] = {}  # listener spec → (role, route name)
        self.stopping = False
        self.tailscale = Tailscale()
        self.fp_key = b""  # the install's secret that keys fingerprints, read at start
        self.reclaimer = Reclaimer()

    # ------------------------------------------------------------ options and lifecycle

    def load(self, loader: Loader) -> None:
        loader.add_option("crossbar_config", str, "", "Path of crossbar's TOML configuration file.")

    def configure(self, updated: set[str]) -> None:
        if "crossbar_config" not in updated:
            return
        if self.router is not None:
            raise exceptions.OptionsError("crossbar_config cannot change while crossbar runs; restart it")
        path = ctx.options.crossbar_config
        try:
            if not path:
                raise ConfigError("crossbar_config is not set: add --set crossbar_config=PATH")
            self.cfg = load_config(path)
        except ConfigError as exc:
            # one clear line; an error logged during start-up makes mitmproxy exit non-zero
            log.error("crossbar config: %s", exc)
            self.cfg = None
            return
        ctx.options.update(**mitmproxy_options(self.cfg))

    async def running(self) -> None:
        if self.cfg is None:  # the configuration error was logged; mitmproxy exits
            return
        try:
            self.fp_key = load_or_create(secret_path(self.cfg.db))
        except SecretError as exc:
            log.error("crossbar: %s", exc)
            return
        # a worker thread peeking a large body hands the interpreter back to the event loop
        # within 1 ms (the default is 5 ms: every other stream's next event would wait that long)
        sys.setswitchinterval(SWITCH_INTERVAL)
        router = Router(self.cfg)
        try:
            router.open()
        except StoreError as exc:
            log.error("crossbar: %s", exc)
            return
        if not await self._start_identity():
            await router.close()
            return
        self.router, self.admin = router, Admin(router)
        self._session = aiohttp.ClientSession()
        router.start_background()
        await self._listen()
        freeze_startup()

    async def _start_identity(self) -> bool:
        assert self.cfg is not None
        if self.cfg.identity == "tailscale":
            try:
                version = await self.tailscale.check()
            except IdentityError as exc:
                log.error("crossbar: %s", exc)
                return False
            log.info("crossbar: identity from tailscale %s", version)
        elif self.cfg.identity == "header":
            log.warning("crossbar: identity = \"header\" trusts X-Crossbar-Peer from anyone: for tests only")
        return True

    async def _listen(self) -> None:
        """Open every listener the TOML names: the main one, each route's own, the admin one."""
        assert self.cfg is not None
        self._roles = {f"reverse:{PLACEHOLDER}@{self.cfg.listen}": (MAIN, "")}
        if self.cfg.admin_listen is not None:
            self._roles[f"reverse:{PLACEHOLDER}@{self.cfg.admin_listen}"] = (ADMIN, "")
        for name, route in self.cfg.routes.items():
            if route.listen is not None:
                self._roles[f"reverse:{PLACEHOLDER}@{route.listen}"] = (ROUTE, name)
        self.listen_specs = list(self._roles)
        _ensure_certstore()
        ctx.options.update(server=True, mode=self.listen_specs)
        ps = ctx.master.addons.get("proxyserver")
        for _ in range(500):  # the option change starts the servers on a task
            await asyncio.sleep(0.01)
            if not ps.servers.is_updating and len(ps.listen_addrs()) >= len(self.listen_specs):
                break
        if len(ps.listen_addrs()) < len(self.listen_specs):
            log.error("crossbar: could not listen on %s", ", ".join(self.listen_specs))
            return
        log.info("crossbar: serving on %s", ", ".join(f"{h}:{p}" for h, p, *_ in ps.listen_addrs()))

    async def done(self) -> None:
        """SIGTERM/SIGINT: refuse new connections, answer new requests on open ones with 503,
        let in-flight streams finish (up to `drain_timeout`), flush the store, exit 0.
        A second signal exits at once."""
        self.stopping = True
        if self.router is None:
            return
        self._exit_on_next_signal()
        ctx.options.update(mode=[])
        if self.router.live:
            log.info("crossbar: waiting for %d request(s) to finish", len(self.router.live))
            if not await self.router.drain(self.router.cfg.drain_timeout):
                log.warning("crossbar: %d request(s) still running after drain_timeout",
                            len(self.router.live))
        if self._session:
            await self._session.close()
        self.reclaimer.cancel()
        thaw()
        await self.router.close()
        log.info("crossbar: stopped")

    @staticmethod
    def _exit_on_next_signal() -> None:
        def now() -> None:
            log.warning("crossbar: second signal, exiting without waiting")
            os._exit(1)

        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers belong to the main thread (an in-process test master is not)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, now)

    # ------------------------------------------------------------ client tracking

    def client_connected(self, client: Client) -> None:
        self._gone[client] = asyncio.Event()

    def client_disconnected(self, client: Client) -> None:
        self._upstreams.pop(client, None)
        self._current.pop(client, None)
        self._gone_event_of(client).set()  # stays set: a hook still awaiting sees the client left

    def _gone_event_of(self, client: Client) -> asyncio.Event:
        return self._gone.setdefault(client, asyncio.Event())

    def _gone_event(self, flow: http.HTTPFlow) -> asyncio.Event:
        return self._gone_event_of(flow.client_conn)

    # ------------------------------------------------------------ request

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or self.router is None:
            return
        role, route_name = self._roles.get(flow.client_conn.proxy_mode.full_spec, (MAIN, ""))
        if is_admin_path(flow.request.path) or role == ADMIN:
            await self._admin(flow, role)
            return
        if self.stopping:
            self._answer(flow, errors.unavailable("crossbar is shutting down", retry_after=5), None)
            return
        ex: Exchange | None = None
        try:
            ex = await self._exchange(flow, route_name)
            flow.metadata[META] = ex
            self.router.live.add(ex)
            if ex.completion:
                await self.router.lease(ex)
                await self.router.guard(ex)
            else:
                await self.router.host_for_read(ex)
            await self.router.take_slot(ex, self._gone_event(flow))
            await self._reachable(flow, ex)
            if self._gone_event(flow).is_set():
                raise ClientGone
        except CrossbarError as exc:
            self._answer(flow, exc, ex)
            return
        except ClientGone:
            flow.kill()
            return
        except Exception:  # a crossbar bug must not send the flow to the placeholder
            log.exception("crossbar: request failed")
            self._answer(flow, errors.CrossbarError(500, "server_error", "crossbar failed to route the "
                                                    "request; see its log"), ex)
            return
        self._forward(flow, ex)
        self._current[flow.client_conn] = flow
        ex.deadline = asyncio.get_running_loop().call_later(
            self.router.cfg.first_byte_timeout, self._first_byte_overdue, flow
        )

    def _first_byte_overdue(self, flow: http.HTTPFlow) -> None:
        """The upstream accepted the request but sent nothing for `first_byte_timeout`: close its
        connection so the client gets an answer (mitmproxy's 502) instead of waiting forever."""
        ex: Exchange | None = flow.metadata.get(META)
        if ex is None or ex.ttfb_ms is not None or not flow.live or self.router is None:
            return
        limit = self.router.cfg.first_byte_timeout
        ex.err = f"no first byte from {ex.host} within {limit:g}s"
        self.router.passive_mark(ex.host, ex.err)
        if not close_server_connection(flow):
            log.warning("could not close the upstream connection of a hung request to %s", ex.host)

    async def _exchange(self, flow: http.HTTPFlow, listener_route: str) -> Exchange:
        """Route, caller identity and body peek. A route's own listener makes every request that
        route, with its path unchanged; control calls there take no slot and write no row."""
        assert self.cfg is not None
        r = flow.request
        if listener_route:
            resolved = req.resolve_listener(r.method, r.path, self.cfg.routes[listener_route])
            control = req.is_control(r.method, resolved.path)
        else:
            resolved = req.resolve(r.method, r.path, r.headers.get("x-crossbar-route"), self.cfg.routes)
            control = resolved.path not in req.COMPLETION_PATHS
        route = resolved.route
        await self._admit(flow, route)
        if control:
            model = resolved.model or route.default_model
            return Exchange(route=route, key=Key(route.name, "", model), path=resolved.upstream_path,
                            completion=False)
        peek = await req.peek_body_off_loop(r.raw_content, resolved.path, route.default_model,
                                            self.cfg.max_body, self.fp_key)
        fp = peek.fingerprint if route.affinity == "conversation" else ""
        return Exchange(
            route=route, key=Key(route.name, fp, peek.model), path=resolved.upstream_path,
            completion=True, stream=peek.stream, prompt_bytes=peek.prompt_bytes,
        )

    async def _admit(self, flow: http.HTTPFlow, route: RouteConf) -> None:
        """A route that lists `peers` answers 403 to anyone else; an identity that cannot be
        established is a 503, never an open door."""
        assert self.cfg is not None
        if not route.peers or self.cfg.identity == "off":
            return
        try:
            if self.cfg.identity == "header":
                names = await HeaderPeer().names_from(flow.request.headers)
            else:
                names = await self.tailscale.names(flow.client_conn.peername[0])
        except IdentityError as exc:
            log.warning("crossbar: identity check failed: %s", exc)
            raise errors.unavailable(f"cannot establish who is calling: {exc}", retry_after=5) from exc
        if not admitted(route.peers, names):
            raise errors.CrossbarError(403, "permission_error",
                                       f"route {route.name!r} is not open to this caller")

    def _forward(self, flow: http.HTTPFlow, ex: Exchange) -> None:
        assert self.cfg is not None
        conf = self.cfg.hosts[ex.host]
        r = flow.request
        r.scheme = conf.scheme  # before host/port: it decides whether the port shows in Host
        r.host, r.port = conf.host, conf.port
        r.path = conf.base_path + ex.path
        ex.forwarded = True

    def _answer(self, flow: http.HTTPFlow, exc: CrossbarError, ex: Exchange | None) -> None:
        flow.response = http.Response.make(exc.status, exc.body(), {**JSON_HEADERS, **exc.headers})
        flow.metadata["crossbar.local"] = True
        if ex is not None:
            ex.status = exc.status
            ex.err = ex.err or exc.message

    async def _admin(self, flow: http.HTTPFlow, role: str) -> None:
        """The admin API is served on the admin listener when there is one, else on the main
        listener; never on a route's own listener."""
        assert self.admin is not None and self.cfg is not None
        serves_admin = ADMIN if self.cfg.admin_listen is not None else MAIN
        if role != serves_admin or not is_admin_path(flow.request.path):
            self._answer(flow, errors.not_found(f"no such path here: {flow.request.path[:100]!r}"), None)
            return
        try:
            reply = await self.admin.handle(
                flow.request.method, flow.request.path, flow.request.headers, flow.request.raw_content or b""
            )
        except Exception:  # e.g. the database cannot be read: a JSON 500, never a traceback page
            log.exception("crossbar: admin request failed")
            self._answer(flow, errors.CrossbarError(500, "server_error", "the admin API failed; see "
                                                    "crossbar's log"), None)
            return
        flow.response = http.Response.make(reply.status, reply.body, reply.headers)
        flow.metadata["crossbar.local"] = True

    # ------------------------------------------------------------ upstream connection

    async def _reachable(self, flow: http.HTTPFlow, ex: Exchange) -> None:
        """Pre-flight: unless this client connection already holds an open connection to the
        host (mitmproxy reuses it), check the host accepts one. A host that refuses is marked
        down and the request moves on (its lease with it) while crossbar can still answer;
        nowhere left to go is crossbar's JSON error, not mitmproxy's 502 page."""
        assert self.router is not None
        cfg = self.router.cfg
        for _ in range(len(cfg.hosts)):
            conf = cfg.hosts[ex.host]
            if (conf.host, conf.port) in self._upstreams.get(flow.client_conn, ()):
                return
            why = await preflight(conf.host, conf.port, cfg.connect_timeout)
            if why is None:
                ex.checked = (conf.host, conf.port)
                return
            self.router.passive_mark(ex.host, f"connect failed: {why}")
            try:
                await self.router.move(ex, "connect failed", self._gone_event(flow))
            except CrossbarError:
                ex.err = f"{ex.host}: connect failed: {why}; no other host"
                raise

    async def server_connect(self, data: ServerConnectionHookData) -> None:
        """A new upstream connection the request hook did not check: the kept-alive one it
        expected to reuse was closed meanwhile (a host that just died). Check it now and move
        the request if the host refuses; only a 502 is possible when nothing else is left."""
        flow = self._current.get(data.client)
        ex: Exchange | None = flow.metadata.get(META) if flow else None
        if flow is None or ex is None or self.router is None or data.server.address is None:
            return
        if ex.checked == data.server.address:
            return
        why = await preflight(*data.server.address, self.router.cfg.connect_timeout)
        if why is None:
            return
        self.router.passive_mark(ex.host, f"connect failed: {why}")
        try:
            await self.router.move(ex, "connect failed", self._gone_event(flow))
        except (CrossbarError, ClientGone):
            ex.err = f"{ex.host}: connect failed: {why}; no other host"
            return
        self._forward(flow, ex)
        data.server.address = (flow.request.host, flow.request.port)
        if flow.request.scheme == "https":
            data.server.sni = flow.request.host

    def server_connected(self, data: ServerConnectionHookData) -> None:
        if data.server.address is not None:
            self._upstreams.setdefault(data.client, set()).add(data.server.address)

    def server_disconnected(self, data: ServerConnectionHookData) -> None:
        if data.server.address is not None:
            self._upstreams.get(data.client, set()).discard(data.server.address)

    # ------------------------------------------------------------ response

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        ex: Exchange | None = flow.metadata.get(META)
        if ex is None or flow.metadata.get("crossbar.local") or flow.response is None:
            return
        ex.cancel_deadline()
        ex.mark_first_byte()
        ex.status = flow.response.status_code
        if ex.ctx_moved:
            flow.response.headers["X-Crossbar-Ctx"] = ex.ctx_moved
        if ex.completion and ex.status in RETRY_STATUSES and not ex.retried:
            ex.retry_pending = True  # leave the (small) error body buffered: nothing reaches the client yet
            return
        if flow.response.headers.get("content-type", "").startswith("text/event-stream"):
            ex.tap = SSETap()
            flow.response.stream = ex.tap

    def _done_with(self, flow: http.HTTPFlow) -> None:
        # the flow holds its client (the weak key) and its body: drop it as soon as it ends
        if self._current.get(flow.client_conn) is flow:
            del self._current[flow.client_conn]

    async def response(self, flow: http.HTTPFlow) -> None:
        if _holds_large_body(flow):
            self.reclaimer.soon()
        ex: Exchange | None = flow.metadata.get(META)
        if ex is None or self.router is None:
            return
        if ex.retry_pending:
            ex.retry_pending = False
            await self._retry(flow, ex)
        if flow.response is not None:
            ex.status = flow.response.status_code
            if ex.tap is not None:
                ex.usage = ex.tap.usage
            elif ex.completion and not flow.metadata.get("crossbar.local"):
                ex.usage = usage_from_body(_content(flow.response))
            if ex.status >= 400 and not ex.err:
                ex.err = f"upstream answered {ex.status}"
        self._done_with(flow)
        self.router.finish(ex)

    async def _retry(self, flow: http.HTTPFlow, ex: Exchange) -> None:
        """A 5xx before anything reached the client: send the request once to another candidate.
        mitmproxy cannot re-send a request, so crossbar does it and answers with the whole reply.
        A client that leaves meanwhile cancels it (the engine stops, the slot is freed)."""
        assert self.router is not None and self._session is not None and flow.response is not None
        status = flow.response.status_code
        marked = status in PASSIVE_DOWN_STATUSES
        if marked:
            self.router.passive_mark(ex.host, f"answered {status}")
        gone = self._gone_event(flow)
        try:
            # a 500 leaves the host healthy ("Context size has been exceeded."): not "unhealthy"
            reason = "unhealthy" if marked else "retried"
            await self.router.move(ex, f"answered {status}", gone, reason=reason)
        except (CrossbarError, ClientGone):
            ex.err = f"upstream answered {status}; no other host to retry on"
            return
        ex.retried = True
        conf = self.router.cfg.hosts[ex.host]
        retry = asyncio.ensure_future(resend(
            self._session, flow.request.method, conf.base_url + ex.path,
            forward_headers(flow.request.headers.items()), flow.request.raw_content or b"",
            self.router.cfg.connect_timeout, self.router.cfg.first_byte_timeout,
        ))
        left = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({retry, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            left.cancel()
        if not retry.done():
            retry.cancel()
            ex.err = "client left during the retry"
            return
        try:
            new_status, headers, body = retry.result()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.router.passive_mark(ex.host, f"retry failed: {exc}")
            ex.err = f"retry on {ex.host} failed: {exc}"
            return
        if new_status in PASSIVE_DOWN_STATUSES:
            self.router.passive_mark(ex.host, f"answered {new_status}")
        fields = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        flow.response = http.Response.make(new_status, b"", http.Headers(fields))
        flow.response.raw_content = body  # as received: never encoded a second time
        flow.response.headers["Content-Length"] = str(len(body))
        flow.response.headers["X-Crossbar-Retried"] = "1"
        if ex.ctx_moved:
            flow.response.headers["X-Crossbar-Ctx"] = ex.ctx_moved
        if flow.response.headers.get("content-type", "").startswith("text/event-stream"):
            tap = SSETap()
            tap(body)
            tap(b"")
            ex.usage = tap.usage
            ex.tap = tap

    def error(self, flow: http.HTTPFlow) -> None:
        if _holds_large_body(flow):
            self.reclaimer.soon()
        ex: Exchange | None = flow.metadata.get(META)
        if ex is None or self.router is None:
            return
        ex.cancel_deadline()
        msg = flow.error.msg if flow.error else "error"
        ex.err = ex.err or msg
        if flow.response is None and ex.ttfb_ms is None and ex.forwarded and _is_connect_failure(msg):
            self.router.passive_mark(ex.host, msg)
        if ex.tap is not None:
            ex.usage = ex.tap.usage
        if flow.response is not None and ex.status is None:
            ex.status = flow.response.status_code
        self._done_with(flow)
        self.router.finish(ex)


def mitmproxy_options(cfg: Config) -> dict[str, Any]:
    """The mitmproxy options crossbar sets for itself (the benchmark gives bare mitmdump the same).
    `body_size_limit` is a hard memory guard: crossbar itself answers JSON 413 above max_body."""
    return {"connection_strategy": "lazy", "body_size_limit": str(2 * cfg.max_body + (1 << 20)),
            "tcp_timeout": max(600, int(cfg.first_byte_timeout) + 60)}


def _ensure_certstore() -> None:
    """mitmproxy runs a script's `running` hook before its TLS addon's, which loads the cert
    store; a client arriving on a freshly opened listener before that crashes the TLS addon.
    Load it first, as that addon's own `running` would."""
    tls = ctx.master.addons.get("tlsconfig")
    if tls is not None and getattr(tls, "certstore", None) is None:
        tls.configure({"confdir"})


def close_server_connection(flow: http.HTTPFlow) -> bool:
    """Close the flow's upstream socket. mitmproxy has no public call for this (flow.kill() does
    not reach a flow in transit, mitmproxy#4711), so this goes through the proxyserver's handler."""
    ps = ctx.master.addons.get("proxyserver")
    handler = getattr(ps, "connections", {}).get(flow.client_conn.id)
    io = getattr(handler, "transports", {}).get(flow.server_conn) if handler else None
    writer = getattr(io, "writer", None)
    if writer is None:
        return False
    writer.close()
    return True


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


def _is_connect_failure(msg: str) -> bool:
    text = msg.lower()
    return any(s in text for s in ("connect call failed", "connection refused", "connection reset",
                                   "timed out", "no route to host", "network is unreachable",
                                   "name or service not known", "cannot connect"))


def make_addons() -> list[Any]:
    crossbar = Crossbar()
    return [crossbar, FlowCap(lambda: crossbar.cfg.mitmweb_keep_flows if crossbar.cfg else 500)]
