"""crossbar as mitmproxy addons, split the way mitmproxy splits its own: each addon owns one
concern and only wires hooks to the one `Router` (`crossbar.app`), which holds all live state and
asks the pure `crossbar.placement` where each request goes.

mitmproxy sees them as one addon, a `Bundle` (`make_addon()`), which calls their hooks in this
order:

  Limits        connection-level bounds: request and response heads, bodies, connections per peer
  Listeners     options, configuration, the router, every listener the TOML names
  Reload        SIGHUP and POST /_crossbar/reload: the configuration applied while serving
  Clients       client connections: a queued request notices at once that its client left
  AdminApi      `/_crossbar/…` answered without contacting any upstream
  GracefulStop  503 while stopping; on SIGTERM drain in-flight requests, then close
  Route         route · identity · body peek · placement · slot
  Failover      pre-flight · rewrite to the host · first-byte deadline · server_connect · 5xx retry
  Account       usage tap · the request's one ending (row, metrics, slot, lease hold)
  FlowCap       keeps mitmweb's flow list bounded
"""

from __future__ import annotations

from typing import Any

from crossbar.addons.account import Account
from crossbar.addons.admin_api import AdminApi
from crossbar.addons.bundle import Bundle
from crossbar.addons.failover import Failover
from crossbar.addons.graceful import GracefulStop
from crossbar.addons.listeners import Listeners
from crossbar.addons.reload import Reload
from crossbar.addons.route import Route
from crossbar.addons.runtime import Clients, Runtime
from crossbar.flowcap import FlowCap
from crossbar.limits import Limits

__all__ = ["Bundle", "Runtime", "make_addon", "make_addons"]


def make_addons(rt: Runtime | None = None) -> list[Any]:
    """The addons around one shared `Runtime` (pass one to inspect it, as the tests do)."""
    rt = rt or Runtime()
    limits = Limits(lambda: rt.router, lambda: rt.reclaimer.soon())
    rt.limits_reloaded = limits.reconfigured
    return [limits, Listeners(rt), Reload(rt), Clients(rt), AdminApi(rt), GracefulStop(rt), Route(rt),
            Failover(rt), Account(rt), FlowCap(lambda: rt.cfg.mitmweb_keep_flows if rt.cfg else 500)]


def make_addon(rt: Runtime | None = None) -> Bundle:
    """crossbar as the one addon mitmproxy loads."""
    return Bundle(make_addons(rt))
