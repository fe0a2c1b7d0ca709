"""Who may use the admin API (`/_crossbar/…`): a pure decision per request.

The operator opens the dashboard in the browser they use for everything else, so any web page
could aim requests at crossbar. Therefore:

- every admin request must name crossbar itself in `Host` (the address the client connected to,
  a configured listen address, `localhost` on a loopback listener, or one of `admin_names`): a
  DNS-rebinding page, whose requests carry its own name, reads nothing;
- a state-changing call (POST) must be `Content-Type: application/json` (a cross-site form cannot
  send that without a CORS preflight, which crossbar never grants) and must not come from another
  site (`Origin`, `Sec-Fetch-Site`);
- with `admin_token`, every call but the dashboard page itself (static, no data) needs
  `Authorization: Bearer <token>`;
- with `admin_peers`, only those callers (by identity) may use it at all.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from crossbar.config import Config
from crossbar.errors import CrossbarError
from crossbar.identity import admitted

STATE_CHANGING = frozenset({"POST"})  # the only method that changes anything (others are 405)
SAME_SITE_FETCH = frozenset({"same-origin", "none"})  # `none`: typed into the address bar
DASHBOARD_PATHS = frozenset({"/_crossbar", "/_crossbar/"})


@dataclass(frozen=True, slots=True)
class AdminPolicy:
    names: frozenset[str]  # host names / canonical addresses accepted in Host besides the local one
    token: str = ""
    peers: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, cfg: Config) -> AdminPolicy:
        listen = [a.host for a in (cfg.listen, cfg.admin_listen) if a is not None]
        names = {canonical_host(h) for h in listen if h and not _is_unspecified(h)}
        return cls(frozenset(names | set(cfg.admin_names)), cfg.admin_token, cfg.admin_peers)


def canonical_host(host: str) -> str:
    """An IP literal in canonical form (an IPv4-mapped IPv6 address as IPv4); a name lower-cased
    without its trailing dot."""
    text = host.strip().strip("[]")
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return text.rstrip(".").lower()
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def host_of(header: str) -> str:
    """The host part of a `Host` header value: `[::1]:7777` → `::1`, `Box.:80` → `box`."""
    value = header.strip()
    if value.startswith("["):
        return canonical_host(value[1:].partition("]")[0])
    host, sep, port = value.rpartition(":")
    if sep and port.isascii() and port.isdigit() and ":" not in host:
        value = host
    return canonical_host(value)


def _is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(canonical_host(host)).is_unspecified
    except ValueError:
        return False


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_allowed(host: str, local_ip: str, policy: AdminPolicy) -> bool:
    local = canonical_host(local_ip)
    if host == local or host in policy.names:
        return True
    return host == "localhost" and _is_loopback(local)


def _forbidden(message: str) -> CrossbarError:
    return CrossbarError(403, "permission_error", message)


def refusal(method: str, path: str, headers: Mapping[str, str], local_ip: str,
            caller: Collection[str] | None, policy: AdminPolicy) -> CrossbarError | None:
    """None when the admin request may proceed, else the error to answer it with.
    `caller` holds the caller's identity names (None when `admin_peers` is not set)."""
    host = headers.get("host")  # a browser always sends one; a request without is no rebinding page
    if host is not None and not host_allowed(host_of(host), local_ip, policy):
        return _forbidden(f"the admin API does not answer to Host {host[:100]!r}; list the name in "
                          "admin_names to use it")
    if method.upper() in STATE_CHANGING:
        problem = _cross_site(headers, host, local_ip, policy)
        if problem:
            return _forbidden(problem)
        media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            return CrossbarError(415, "unsupported_media_type_error",
                                 "admin changes must be sent as Content-Type: application/json")
    if policy.token and path.partition("?")[0] not in DASHBOARD_PATHS and not _token_ok(headers, policy):
        return CrossbarError(401, "authentication_error",
                             "the admin API needs Authorization: Bearer <admin_token>",
                             headers={"WWW-Authenticate": 'Bearer realm="crossbar"'})
    if policy.peers and not admitted(policy.peers, caller or ()):
        return _forbidden("the admin API is not open to this caller (admin_peers)")
    return None


def _cross_site(headers: Mapping[str, str], host: str | None, local_ip: str, policy: AdminPolicy) -> str:
    """Why a change comes from another site, or "". Same-origin means the Origin names this very
    listener: the host and the port the client addressed (its Host header)."""
    site = headers.get("sec-fetch-site", "").strip().lower()
    if site and site not in SAME_SITE_FETCH:
        return f"a {site} request may not change crossbar"
    origin = headers.get("origin")
    if origin is None:
        return ""
    authority = _origin_authority(origin)
    if host is not None:
        same = authority is not None and authority == _authority(host, _default_port(origin))
    else:
        same = authority is not None and host_allowed(authority[0], local_ip, policy)
    return "" if same else f"a request from Origin {origin[:100]!r} may not change crossbar"


def _default_port(origin: str) -> int:
    return 443 if origin.strip().lower().startswith("https:") else 80


def _authority(host_header: str, default_port: int) -> tuple[str, int] | None:
    """(canonical host, port) of a `Host` header value."""
    value = host_header.strip()
    host, port = (value[1:].partition("]")[0], value.partition("]")[2]) if value.startswith("[") \
        else (value.rpartition(":")[0], ":" + value.rpartition(":")[2]) if value.count(":") == 1 \
        else (value, "")
    port = port.removeprefix(":")
    if port and not (port.isascii() and port.isdigit()):  # ("²".isdigit(), but int() refuses it)
        return None
    return canonical_host(host), int(port) if port else default_port


def _origin_authority(origin: str) -> tuple[str, int] | None:
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname or parts.scheme not in ("http", "https"):
        return None
    return canonical_host(parts.hostname), port or _default_port(origin)


def _token_ok(headers: Mapping[str, str], policy: AdminPolicy) -> bool:
    scheme, _, given = headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    # a header value's bytes that are not UTF-8 come as surrogates: compared as those bytes
    return hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), policy.token.encode())
