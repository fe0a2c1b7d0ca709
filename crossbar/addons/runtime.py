"""What crossbar's addons share: the configuration, the one `Router`, and per-connection state.

The addons, called in the order `make_addons()` lists them, meet here. The
per-connection maps are keyed weakly by mitmproxy's client connection, so nothing outlives it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp
from mitmproxy import ctx, http
from mitmproxy.connection import Client, Connection
from mitmproxy.net.http.http1 import assemble_response

from crossbar import admin_access, errors
from crossbar.admin import Admin
from crossbar.app import Router
from crossbar.config import Config
from crossbar.decisions import Rejection
from crossbar.errors import CrossbarError
from crossbar.exchange import Exchange
from crossbar.identity import HeaderPeer, IdentityError, Tailscale
from crossbar.reclaim import Reclaimer
from crossbar.weakid import WeakIdDict

META = "crossbar"  # flow.metadata key of the flow's Exchange
LOCAL = "crossbar.local"  # flow.metadata key: crossbar answered this flow itself
MAIN, ADMIN, ROUTE = "main", "admin", "route"  # listener roles
PLACEHOLDER = "http://127.0.0.1:1"  # reverse target never contacted: every request is rewritten
JSON_HEADERS = {"Content-Type": "application/json"}

log = logging.getLogger("crossbar")


class Runtime:
    def __init__(self) -> None:
        self.cfg: Config | None = None
        self.router: Router | None = None
        self.admin: Admin | None = None
        self.session: aiohttp.ClientSession | None = None  # crossbar's own upstream requests (retries)
        self.tailscale = Tailscale()
        self.admin_policy = admin_access.AdminPolicy(frozenset())
        self.fp_key = b""  # the install's secret that keys fingerprints, read at start
        self.reclaimer = Reclaimer()
        self.listen_specs: list[str] = []
        self.roles: dict[str, tuple[str, str]] = {}  # listener spec → (role, route name)
        self.stopping = False
        self.reloader: Callable[[], Awaitable[str]] | None = None  # re-reads the configuration file
        # after a reload: the connection limits reach connections already open (`Limits.reconfigured`)
        self.limits_reloaded: Callable[[], None] = lambda: None
        # per client connection: set when it leaves; the upstream addresses it holds open
        # (mitmproxy reuses those); the flow being forwarded on it
        self.gone: WeakIdDict[Client, asyncio.Event] = WeakIdDict()
        self.upstreams: WeakIdDict[Client, set[tuple[str, int]]] = WeakIdDict()
        self.current: WeakIdDict[Client, http.HTTPFlow] = WeakIdDict()

    def role(self, flow: http.HTTPFlow) -> tuple[str, str]:
        """(listener role, route name of a route's own listener) for the flow."""
        return self.roles.get(flow.client_conn.proxy_mode.full_spec, (MAIN, ""))

    async def caller_names(self, flow: http.HTTPFlow) -> frozenset[str]:
        """Who is calling, by the configured identity; an identity that cannot be established is
        a 503, never an open door."""
        assert self.cfg is not None
        try:
            if self.cfg.identity == "header":
                return await HeaderPeer().names_from(flow.request.headers)
            return await self.tailscale.names(flow.client_conn.peername[0])
        except IdentityError as exc:
            log.warning("crossbar: identity check failed: %s", exc)
            raise errors.unavailable(f"cannot establish who is calling: {exc}", retry_after=5,
                                     reason=Rejection.IDENTITY) from exc

    def gone_event(self, flow: http.HTTPFlow) -> asyncio.Event:
        try:
            return self.gone[flow.client_conn]  # made when the client connected
        except KeyError:
            event = self.gone[flow.client_conn] = asyncio.Event()
            return event

    def answer(self, flow: http.HTTPFlow, exc: CrossbarError, ex: Exchange | None) -> None:
        """crossbar's own JSON error answer, counted by its reason."""
        flow.response = http.Response.make(exc.status, exc.body(), {**JSON_HEADERS, **exc.headers})
        flow.metadata[LOCAL] = True
        if self.router is not None and exc.reason is not None:
            self.router.rejected(exc.reason)
        if ex is not None:
            ex.status = exc.status
            ex.err = ex.err or exc.message

    def done_with(self, flow: http.HTTPFlow) -> None:
        # the flow holds its client (the weak key) and its body: drop it as soon as it ends
        if self.current.get(flow.client_conn) is flow:
            del self.current[flow.client_conn]


def exchange_of(flow: http.HTTPFlow) -> Exchange | None:
    return flow.metadata.get(META)


def _writer(flow: http.HTTPFlow, conn: Connection) -> asyncio.StreamWriter | None:
    """The socket writer of one of the flow's connections. mitmproxy has no public call for this
    (`flow.kill()` does not reach a flow in transit), so it goes through the proxyserver's
    connection handler."""
    ps = ctx.master.addons.get("proxyserver")
    handler = getattr(ps, "connections", {}).get(flow.client_conn.id)
    io = getattr(handler, "transports", {}).get(conn) if handler else None
    return getattr(io, "writer", None)


def close_socket(flow: http.HTTPFlow, conn: Connection) -> bool:
    """Close one of the flow's sockets (client or upstream) at once."""
    writer = _writer(flow, conn)
    if writer is None:
        return False
    writer.close()
    return True


def answer_failed(flow: http.HTTPFlow, exc: CrossbarError) -> bool:
    """From the `error` hook of a flow whose host failed before sending anything: write crossbar's
    JSON answer to the client and kill the flow, so mitmproxy sends no HTML page of its own after
    it (a killed flow gets none); the connection then closes. False when the client is gone."""
    writer = _writer(flow, flow.client_conn)
    if writer is None or writer.is_closing() or not flow.killable:
        return False
    headers = {**JSON_HEADERS, **exc.headers, "Connection": "close"}
    writer.write(assemble_response(http.Response.make(exc.status, exc.body(), headers)))
    flow.kill()
    return True


class Clients:
    """Tracks client connections: a queued request notices at once that its client left."""

    def __init__(self, rt: Runtime):
        self.rt = rt

    def client_connected(self, client: Client) -> None:
        self.rt.gone[client] = asyncio.Event()

    def client_disconnected(self, client: Client) -> None:
        rt = self.rt
        rt.upstreams.pop(client, None)
        rt.current.pop(client, None)
        rt.gone.setdefault(client, asyncio.Event()).set()  # stays set: an awaiting hook sees it
