"""crossbar.toml → frozen, validated settings.

Every problem is reported as one `ConfigError` line that names the key, e.g.
`hosts.alpha.base_url: not an http(s) URL: 'ftp://x'`.

`parse_config` validates everything the file may say; `check_supported` then refuses the
features that are parsed already but not implemented yet (see `NOT_YET_SUPPORTED`);
`load_config` does both for a file.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import math
import os
import re
import socket
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

from crossbar.yieldpolicy import DEFAULT_FACTOR as DEFAULT_YIELD_FACTOR

MIB = 1024 * 1024


class ConfigError(Exception):
    """A bad configuration: one line naming the key and the problem."""


@dataclass(frozen=True, slots=True)
class Address:
    """A listen or send address; `host` has no brackets ("" means every address)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ModelConf:
    """Per-(host, model) tuning from `hosts.<name>.models`."""

    parallel: int | None = None  # slots crossbar lets run at once; None → learned, else 1
    ctx: int | None = None  # per-slot context override; None → learned from /props


@dataclass(frozen=True, slots=True)
class WakeConf:
    """A wake-on-LAN target from `hosts.<name>.wake`."""

    mac: str  # normalised "aa:bb:cc:dd:ee:ff"
    broadcast: Address  # where the magic packet goes (default 255.255.255.255:9)
    wait: float  # seconds to wait for the host to pass health


@dataclass(frozen=True, slots=True)
class HostConf:
    """One upstream llama-server from `[hosts.<name>]`."""

    name: str
    base_url: str  # normalised, no trailing slash
    scheme: str  # "http" | "https"
    host: str
    port: int
    base_path: str  # "" or "/prefix" (no trailing slash), prepended to upstream paths
    weight: float = 1.0
    models: Mapping[str, ModelConf] = field(default_factory=lambda: MappingProxyType({}))
    wake: WakeConf | None = None
    # the largest `parallel` of its models (None: none set): a single server's shared slots
    max_parallel: int | None = field(init=False, default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        largest = max((m.parallel for m in self.models.values() if m.parallel), default=None)
        object.__setattr__(self, "max_parallel", largest)

    def serves(self, model: str) -> bool:
        return model in self.models


# Request headers whose value names the client's session (OpenCode sends both), in priority order.
DEFAULT_SESSION_HEADERS = ("x-session-affinity", "x-session-id")
MAX_SESSION_HEADERS = 8


@dataclass(frozen=True, slots=True)
class RouteConf:
    """One route (or route template, when the name has a `*`) from `[routes.<name>]`."""

    name: str  # a template keeps its "*"; a concrete route made from it carries its own name
    hosts: tuple[str, ...]  # candidates in preference order
    default_model: str = ""
    pin: str = ""
    listen: Address | None = None
    affinity: str = "conversation"  # "conversation" | "route"
    queue: bool = True
    peers: tuple[str, ...] = ()
    yield_factor: float | None = None  # None: the top-level `yield_factor`
    session_headers: tuple[str, ...] = DEFAULT_SESSION_HEADERS  # lower case; () turns sessions off

    @property
    def is_template(self) -> bool:
        return "*" in self.name


@dataclass(frozen=True, slots=True)
class Config:
    """The whole validated configuration; durations in seconds, sizes in bytes."""

    listen: Address
    hosts: Mapping[str, HostConf]  # config order preserved
    routes: Mapping[str, RouteConf]  # config order preserved
    db: str = "crossbar.db"
    poll_interval: float = 60.0
    poll_timeout: float = 5.0
    lease_idle: float = 1800.0
    queue_max: int = 8
    retention: float = 180 * 86400.0
    max_body: int = 32 * MIB
    allow_any_address: bool = False
    identity: str = "off"  # "off" | "tailscale" | "header"
    admin_listen: Address | None = None
    connect_timeout: float = 5.0
    first_byte_timeout: float = 900.0
    drain_timeout: float = 600.0
    mitmweb_keep_flows: int = 500
    yield_factor: float = DEFAULT_YIELD_FACTOR  # 0: a busy host's turns never move
    admin_token: str = ""  # "" → no bearer token required
    admin_peers: tuple[str, ...] = ()  # () → any caller (identity permitting)
    admin_names: tuple[str, ...] = ()  # host names (besides the listen addresses) the admin API answers to
    head_timeout: float = 10.0  # a request head must be complete this long after it began
    idle_timeout: float = 60.0  # a kept-alive client connection may idle this long between requests
    body_timeout: float = 30.0  # a request body may pause this long between two reads
    max_head: int = 64 * 1024  # request and response heads (request line / status line + headers)
    max_connections_per_peer: int = 256

    @property
    def buffered_body_max(self) -> int:
        """The largest body mitmproxy buffers (a larger one is streamed): room for a body at
        `max_body` and some JSON around it. It also bounds what crossbar reads of an answer itself."""
        return 2 * self.max_body + MIB


# Features parsed and validated now but refused by `check_supported` until they work (none now;
# the mechanism stays for the next such feature).
NOT_YET_SUPPORTED: set[str] = set()

IDENTITIES = ("off", "tailscale", "header")
AFFINITIES = ("conversation", "route")
RESERVED_ROUTE_NAMES = frozenset({"v1", "health", "props", "slots", "tokenize", "metrics", "_crossbar"})
DEFAULT_BROADCAST = Address("255.255.255.255", 9)
DEFAULT_WAKE_WAIT = 45.0

_TOP_KEYS = frozenset(
    {
        "listen", "db", "poll_interval", "poll_timeout", "lease_idle", "queue_max", "retention",
        "max_body", "allow_any_address", "identity", "admin_listen", "connect_timeout",
        "first_byte_timeout", "drain_timeout", "mitmweb_keep_flows", "yield_factor", "hosts", "routes",
        "admin_token", "admin_peers", "admin_names", "head_timeout", "idle_timeout", "max_head",
        "max_connections_per_peer", "body_timeout",
    }
)  # fmt: skip
_HOST_KEYS = frozenset({"base_url", "weight", "models", "wake"})
_MODEL_KEYS = frozenset({"parallel", "ctx"})
_WAKE_KEYS = frozenset({"mac", "broadcast", "wait"})
_ROUTE_KEYS = frozenset(
    {"hosts", "default_model", "pin", "listen", "affinity", "queue", "peers", "yield_factor",
     "session_headers"}
)
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}")  # an HTTP field name (token)

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_ROUTE_NAME = re.compile(r"[A-Za-z0-9*][A-Za-z0-9._*-]*")
_NET_HOST = re.compile(r"[A-Za-z0-9_.-]+")
_PORT = re.compile(r"[0-9]{1,5}")
_MAC = re.compile(r"[0-9a-fA-F]{2}([:-])[0-9a-fA-F]{2}(?:\1[0-9a-fA-F]{2}){4}")

_DURATION_UNITS = {
    "ms": Decimal("0.001"),
    "s": Decimal(1),
    "m": Decimal(60),
    "h": Decimal(3600),
    "d": Decimal(86400),
}
_DURATION = re.compile(r"(?:[0-9]+(?:\.[0-9]+)?(?:ms|s|m|h|d))+")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)")
_DURATION_HINT = "(use e.g. '60s', '30m', '180d')"
_UNIT_HINT = "(add a unit, e.g. '60s')"

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
}  # fmt: skip
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)")
_SIZE_HINT = "(use bytes or e.g. '512KiB', '32MiB', '1MB')"


# --- keys, types and scalar helpers ---------------------------------------------------------


def _key(prefix: str, *names: str) -> str:
    """`prefix` (a dotted key, "" at top level) extended by raw names, quoting any name that is
    not a TOML bare key: routes."opencode-*".hosts."""
    quoted = [n if _BARE_KEY.fullmatch(n) else json.dumps(n) for n in names]
    return ".".join([prefix, *quoted] if prefix else quoted)


def _fail(key: str, problem: str) -> ConfigError:
    return ConfigError(f"{key}: {problem}" if key else problem)


def _type_name(value: object) -> str:
    kinds: tuple[tuple[type | tuple[type, ...], str], ...] = (
        (bool, "boolean"), (int, "integer"), (float, "float"), (str, "string"),
        (Mapping, "table"), ((list, tuple), "array"), (dt.datetime, "datetime"),
        (dt.date, "date"), (dt.time, "time"),
    )  # fmt: skip
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


def _expected(key: str, what: str, value: object) -> ConfigError:
    return _fail(key, f"expected {what}, got {_type_name(value)}")


def _check_keys(table: Mapping[str, Any], prefix: str, allowed: frozenset[str]) -> None:
    for name in table:
        if name not in allowed:
            raise _fail(_key(prefix, name), "unknown key")


def _required(table: Mapping[str, Any], prefix: str, name: str) -> Any:
    if name not in table:
        raise _fail(_key(prefix, name), "missing (required)")
    return table[name]


def _table(value: object, key: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _expected(key, "table", value)
    return value


def _str(value: object, key: str) -> str:
    if not isinstance(value, str):
        raise _expected(key, "string", value)
    return value


def _nonempty_str(value: object, key: str) -> str:
    text = _str(value, key)
    if not text:
        raise _fail(key, "must not be empty")
    return text


def _bool(value: object, key: str) -> bool:
    if not isinstance(value, bool):
        raise _expected(key, "boolean", value)
    return value


def _int(value: object, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _expected(key, "integer", value)
    if value < minimum:
        raise _fail(key, f"must be >= {minimum}, got {value}")
    return value


def _positive_number(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _expected(key, "number", value)
    if not (math.isfinite(value) and value > 0):
        raise _fail(key, f"must be a number > 0, got {value}")
    return float(value)


def _yield_factor(value: object, key: str) -> float:
    """0 turns yielding off; below 1 a turn would move to wait longer, so it is refused."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _expected(key, "number", value)
    if not (math.isfinite(value) and (value == 0 or value >= 1)):
        raise _fail(key, f"must be 0 (off) or a number >= 1, got {value}")
    return float(value)


def _choice(value: object, key: str, options: tuple[str, ...]) -> str:
    text = _str(value, key)
    if text not in options:
        raise _fail(key, f"must be one of {', '.join(repr(o) for o in options)}, got {text!r}")
    return text


def _str_list(value: object, key: str) -> tuple[str, ...]:
    """A non-empty array of non-empty, distinct strings."""
    if not isinstance(value, list | tuple):
        raise _expected(key, "array of strings", value)
    if not value:
        raise _fail(key, "must not be empty")
    items: list[str] = []
    for item in value:
        if not isinstance(item, str):
            raise _fail(key, f"expected array of strings, got an item of type {_type_name(item)}")
        if not item:
            raise _fail(key, "items must not be empty strings")
        if item in items:
            raise _fail(key, f"{item!r} listed twice")
        items.append(item)
    return tuple(items)


# --- durations, sizes, addresses ------------------------------------------------------------


def parse_duration(value: object, key: str) -> float:
    """A duration string such as "500ms", "30m", "180d" or "1h30m" → seconds (>= 0).

    Bare numbers and booleans are refused: a unit is always required.
    """
    if isinstance(value, bool):
        raise _fail(key, f"expected a duration with a unit, got boolean {_UNIT_HINT}")
    if isinstance(value, int | float):
        raise _fail(key, f"not a duration: {value!r} {_UNIT_HINT}")
    text = _str(value, key).strip()
    if re.fullmatch(r"[0-9]+(?:\.[0-9]+)?", text):
        raise _fail(key, f"not a duration: {value!r} {_UNIT_HINT}")
    if not _DURATION.fullmatch(text):
        raise _fail(key, f"not a duration: {value!r} {_DURATION_HINT}")
    total = sum(Decimal(num) * _DURATION_UNITS[unit] for num, unit in _DURATION_PART.findall(text))
    return float(total)


def _positive_duration(value: object, key: str) -> float:
    seconds = parse_duration(value, key)
    if seconds <= 0:
        raise _fail(key, f"must be longer than zero, got {value!r}")
    return seconds


def parse_size(value: object, key: str) -> int:
    """An integer of bytes, or a string such as "32MiB", "512KiB", "1MB", "1k" → bytes.

    k/KB/MB/GB are powers of 1000, KiB/MiB/GiB powers of 1024; units are case-insensitive.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _expected(key, f"integer or size string {_SIZE_HINT}", value)
    if isinstance(value, int):
        if value < 0:
            raise _fail(key, f"must be >= 0, got {value}")
        return value
    match = _SIZE.fullmatch(value.strip().lower())
    if match is None or match.group(2) not in _SIZE_UNITS:
        raise _fail(key, f"not a size: {value!r} {_SIZE_HINT}")
    size = Decimal(match.group(1)) * _SIZE_UNITS[match.group(2)]
    if size != size.to_integral_value():
        raise _fail(key, f"not a whole number of bytes: {value!r}")
    return int(size)


def _positive_size(value: object, key: str) -> int:
    size = parse_size(value, key)
    if size <= 0:
        raise _fail(key, f"must be larger than zero, got {value!r}")
    return size


def _split_host_port(text: str, key: str) -> tuple[str, str]:
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise _fail(key, f"not a host:port address: {text!r} (IPv6 looks like '[::1]:7777')")
        if ":" not in host:
            raise _fail(key, f"brackets are only for IPv6 addresses, got {text!r}")
        return host, rest[1:]
    host, sep, port = text.rpartition(":")
    if not sep:
        raise _fail(key, f"not a host:port address: {text!r}")
    if ":" in host:
        raise _fail(key, f"IPv6 addresses need brackets, e.g. '[::1]:7777', got {text!r}")
    return host, port


def _canonical_host(host: str, text: str, key: str) -> str:
    """Canonical text of an IP literal (as the resolver would read it); hostnames lower-cased."""
    if host == "":
        return host
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not _NET_HOST.fullmatch(host):
        raise _fail(key, f"bad host in address {text!r}")
    try:  # "127.1" or "0" are IPv4 to the resolver, so compare and check them as such
        return socket.inet_ntoa(socket.inet_aton(host))
    except OSError:
        return host.lower()


def _is_unspecified_ip(text: str) -> bool:
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:0.0.0.0 binds every IPv4 address too
    return ip.is_unspecified or bool(mapped and mapped.is_unspecified)


def _is_any(host: str, resolve: Callable[[str], list[str]]) -> bool:
    """Every address: the empty host, 0.0.0.0, ::, ::ffff:0.0.0.0, or a name resolving to one."""
    if host == "" or _is_unspecified_ip(host):
        return True
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
        return False
    except ValueError:
        pass
    return any(_is_unspecified_ip(ip) for ip in resolve(host))


def resolve_host(host: str) -> list[str]:
    """The addresses a listen host name resolves to ([] when it does not resolve: binding will
    report that)."""
    try:
        return [str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)]
    except (OSError, UnicodeError):
        return []


def parse_address(value: object, key: str, allow_any: bool,
                  resolve: Callable[[str], list[str]] | None = None) -> Address:
    """ "host:port" or "[v6]:port" (port 0-65535) → Address.

    An address on every interface (0.0.0.0, ::, ::ffff:0.0.0.0, an empty host, or a name that
    resolves to one of those) is refused unless `allow_any` is true.
    """
    text = _str(value, key)
    host_text, port_text = _split_host_port(text.strip(), key)
    if not _PORT.fullmatch(port_text) or int(port_text) > 65535:
        raise _fail(key, f"bad port in address {text!r} (0-65535)")
    host = _canonical_host(host_text, text, key)
    if not allow_any and _is_any(host, resolve or resolve_host):
        raise _fail(
            key,
            f"{text!r} listens on every address; bind a specific (e.g. tailnet) address, "
            "or set allow_any_address = true to allow it",
        )
    return Address(host, int(port_text))


# --- hosts ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Url:
    scheme: str
    host: str
    port: int
    path: str

    def render(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        port = "" if self.port == default else f":{self.port}"
        return f"{self.scheme}://{host}{port}{self.path}"


def _parse_base_url(value: object, key: str) -> _Url:
    text = _nonempty_str(value, key)
    if any(c.isspace() for c in text):
        raise _fail(key, f"not an http(s) URL: {text!r} (contains whitespace)")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise _fail(key, f"not an http(s) URL: {text!r} ({exc})") from None
    if parts.scheme.lower() not in ("http", "https") or not text.lower().startswith(f"{parts.scheme}://"):
        raise _fail(key, f"not an http(s) URL: {text!r}")
    if "?" in text or "#" in text:
        raise _fail(key, f"must not have a query or fragment: {text!r}")
    if "@" in parts.netloc:
        raise _fail(key, f"must not carry user info: {text!r}")
    if not parts.hostname:
        raise _fail(key, f"URL has no host: {text!r}")
    if not (":" in parts.hostname or _NET_HOST.fullmatch(parts.hostname)):
        raise _fail(key, f"bad host in URL: {text!r}")
    if port == 0:
        raise _fail(key, f"bad port in URL: {text!r}")
    scheme = parts.scheme.lower()
    default = 443 if scheme == "https" else 80
    return _Url(scheme, parts.hostname, port or default, parts.path.rstrip("/"))


def _parse_model(name: str, value: object, key: str) -> ModelConf:
    if not name:
        raise _fail(key, "model id must not be empty")
    table = _table(value, key)
    _check_keys(table, key, _MODEL_KEYS)
    kwargs = {k: _int(v, _key(key, k), 1) for k, v in table.items()}
    return ModelConf(**kwargs)


def _parse_models(value: object, key: str) -> Mapping[str, ModelConf]:
    """Either a table of model id → { parallel, ctx } or an array of model ids."""
    if isinstance(value, list | tuple):
        return MappingProxyType({name: ModelConf() for name in _str_list(value, key)})
    if not isinstance(value, Mapping):
        raise _expected(key, "table or array of model ids", value)
    if not value:
        raise _fail(key, "must list at least one model")
    models = {name: _parse_model(name, conf, _key(key, name)) for name, conf in value.items()}
    return MappingProxyType(models)


def _parse_mac(value: object, key: str) -> str:
    text = _str(value, key)
    match = _MAC.fullmatch(text)
    if match is None:
        raise _fail(key, f"not a MAC address: {text!r} (use e.g. 'aa:bb:cc:dd:ee:ff')")
    return text.replace(match.group(1), ":").lower()


def _parse_wake(value: object, key: str) -> WakeConf:
    table = _table(value, key)
    _check_keys(table, key, _WAKE_KEYS)
    mac = _parse_mac(_required(table, key, "mac"), _key(key, "mac"))
    broadcast = DEFAULT_BROADCAST
    if "broadcast" in table:
        broadcast = parse_address(table["broadcast"], _key(key, "broadcast"), allow_any=True)
    wait = DEFAULT_WAKE_WAIT
    if "wait" in table:
        wait = _positive_duration(table["wait"], _key(key, "wait"))
    return WakeConf(mac=mac, broadcast=broadcast, wait=wait)


def _parse_host(name: str, value: object) -> HostConf:
    key = _key("hosts", name)
    if not _HOST_NAME.fullmatch(name):
        raise _fail(key, "bad host name (letters, digits, '.', '_', '-'; starts with a letter or digit)")
    table = _table(value, key)
    _check_keys(table, key, _HOST_KEYS)
    url = _parse_base_url(_required(table, key, "base_url"), _key(key, "base_url"))
    models = _parse_models(_required(table, key, "models"), _key(key, "models"))
    weight = _positive_number(table["weight"], _key(key, "weight")) if "weight" in table else 1.0
    wake = _parse_wake(table["wake"], _key(key, "wake")) if "wake" in table else None
    return HostConf(
        name=name, base_url=url.render(), scheme=url.scheme, host=url.host, port=url.port,
        base_path=url.path, weight=weight, models=models, wake=wake,
    )  # fmt: skip


def _parse_hosts(value: object) -> Mapping[str, HostConf]:
    table = _table(value, "hosts")
    if not table:
        raise _fail("hosts", "must define at least one host")
    return MappingProxyType({name: _parse_host(name, conf) for name, conf in table.items()})


# --- routes ---------------------------------------------------------------------------------


@dataclass(slots=True)
class _RouteContext:
    """What route checks need from the rest of the config."""

    hosts: Mapping[str, HostConf]
    identity: str
    allow_any: bool
    listeners: dict[Address, str]  # address → key that claimed it


def _claim(address: Address, key: str, ctx: _RouteContext) -> None:
    """Refuse an address another listener holds already (port 0 is always a fresh port)."""
    owner = ctx.listeners.get(address)
    if owner is not None:
        raise _fail(key, f"{str(address)!r} is already used by {owner}")
    if address.port != 0:
        ctx.listeners[address] = key


def _route_hosts(table: Mapping[str, Any], key: str, ctx: _RouteContext) -> tuple[str, ...]:
    if "hosts" not in table:
        return tuple(ctx.hosts)
    names = _str_list(table["hosts"], _key(key, "hosts"))
    for name in names:
        if name not in ctx.hosts:
            raise _fail(_key(key, "hosts"), f"unknown host {name!r}")
    return names


def _route_default_model(value: object, key: str, hosts: tuple[str, ...], ctx: _RouteContext) -> str:
    model = _str(value, key)
    if model and not any(ctx.hosts[h].serves(model) for h in hosts):
        raise _fail(key, f"{model!r} is not served by any of the route's hosts ({', '.join(hosts)})")
    return model


def _route_pin(value: object, key: str, hosts: tuple[str, ...], is_template: bool) -> str:
    if is_template:  # each concrete route of a template is its own route: pin those (admin API)
        raise _fail(key, "not allowed on a template route; pin its concrete routes with the admin API")
    pin = _str(value, key)
    if pin and pin not in hosts:
        raise _fail(key, f"{pin!r} is not one of the route's hosts ({', '.join(hosts)})")
    return pin


def _route_listen(value: object, key: str, is_template: bool, ctx: _RouteContext) -> Address:
    if is_template:
        raise _fail(key, "not allowed on a template route")
    address = parse_address(value, key, ctx.allow_any)
    _claim(address, key, ctx)
    return address


def _route_peers(value: object, key: str, ctx: _RouteContext) -> tuple[str, ...]:
    if ctx.identity == "off":
        raise _fail(key, 'needs identity = "tailscale" or "header"')
    return _str_list(value, key)


def _session_headers(value: object, key: str) -> tuple[str, ...]:
    """Header names, matched case-insensitively; an empty array turns session keys off."""
    if isinstance(value, list | tuple) and not value:
        return ()
    names = tuple(name.lower() for name in _str_list(value, key))
    if len(names) > MAX_SESSION_HEADERS:
        raise _fail(key, f"at most {MAX_SESSION_HEADERS} header names")
    for name in names:
        if not _HEADER_NAME.fullmatch(name):
            raise _fail(key, f"{name[:70]!r} is not an HTTP header name")
    if len(set(names)) < len(names):
        raise _fail(key, "a header is listed twice")
    return names


def _check_route_name(name: str, key: str) -> None:
    if name in RESERVED_ROUTE_NAMES:
        raise _fail(key, f"{name!r} is reserved (it is one of crossbar's own paths)")
    if not _ROUTE_NAME.fullmatch(name):
        raise _fail(
            key, "bad route name (letters, digits, '.', '_', '-', '*'; starts with a letter, digit or '*')"
        )


def _parse_route(name: str, value: object, ctx: _RouteContext) -> RouteConf:
    key = _key("routes", name)
    _check_route_name(name, key)
    table = _table(value, key)
    _check_keys(table, key, _ROUTE_KEYS)
    hosts = _route_hosts(table, key, ctx)
    parsers: dict[str, Callable[[object, str], Any]] = {
        "default_model": lambda v, k: _route_default_model(v, k, hosts, ctx),
        "pin": lambda v, k: _route_pin(v, k, hosts, "*" in name),
        "listen": lambda v, k: _route_listen(v, k, "*" in name, ctx),
        "affinity": lambda v, k: _choice(v, k, AFFINITIES),
        "queue": _bool,
        "peers": lambda v, k: _route_peers(v, k, ctx),
        "yield_factor": _yield_factor,
        "session_headers": _session_headers,
    }
    kwargs = {k: parse(table[k], _key(key, k)) for k, parse in parsers.items() if k in table}
    if kwargs.get("affinity") == "route" and kwargs.get("session_headers"):
        raise _fail(_key(key, "session_headers"), 'has no effect with affinity = "route"')
    return RouteConf(name=name, hosts=hosts, **kwargs)


def _parse_routes(value: object, ctx: _RouteContext) -> Mapping[str, RouteConf]:
    table = _table(value, "routes")
    if not table:
        raise _fail("routes", "must define at least one route")
    return MappingProxyType({name: _parse_route(name, conf, ctx) for name, conf in table.items()})


# --- the whole file -------------------------------------------------------------------------

_TOP_SCALARS: dict[str, Callable[[object, str], Any]] = {
    "db": _nonempty_str,
    "poll_interval": _positive_duration,
    "poll_timeout": _positive_duration,
    "lease_idle": _positive_duration,
    "queue_max": lambda v, k: _int(v, k, 0),
    "retention": _positive_duration,
    "max_body": _positive_size,
    "connect_timeout": _positive_duration,
    "first_byte_timeout": _positive_duration,
    "drain_timeout": _positive_duration,
    "mitmweb_keep_flows": lambda v, k: _int(v, k, 0),
    "yield_factor": _yield_factor,
    "admin_names": lambda v, k: tuple(_host_name(n, k) for n in _str_list(v, k)),
    "head_timeout": _positive_duration,
    "idle_timeout": _positive_duration,
    "body_timeout": _positive_duration,
    "max_head": lambda v, k: _size_at_least(v, k, 4096),
    "max_connections_per_peer": lambda v, k: _int(v, k, 1),
}

ADMIN_TOKEN_MIN = 16
_TOKEN = re.compile(r"[\x21-\x7e]+")  # what a bearer token may hold: visible ASCII


def _admin_token(value: object, key: str) -> str:
    token = _str(value, key)
    if not _TOKEN.fullmatch(token) or len(token) < ADMIN_TOKEN_MIN:
        raise _fail(key, f"must be at least {ADMIN_TOKEN_MIN} visible ASCII characters (e.g. the output "
                         "of `openssl rand -hex 24`)")
    return token


def _host_name(value: str, key: str) -> str:
    name = value.strip().rstrip(".").lower()
    if not _NET_HOST.fullmatch(name):
        raise _fail(key, f"not a host name: {value!r}")
    return name


def _size_at_least(value: object, key: str, minimum: int) -> int:
    size = parse_size(value, key)
    if size < minimum:
        raise _fail(key, f"must be at least {minimum} bytes, got {value!r}")
    return size


def parse_config(data: Mapping[str, Any]) -> Config:
    """Validate a decoded TOML document into a Config; the first problem raises ConfigError."""
    if not isinstance(data, Mapping):
        raise _expected("config", "table", data)
    _check_keys(data, "", _TOP_KEYS)
    allow_any = _bool(data.get("allow_any_address", False), "allow_any_address")
    identity = _choice(data.get("identity", "off"), "identity", IDENTITIES)
    listen = parse_address(_required(data, "", "listen"), "listen", allow_any)
    ctx = _RouteContext(hosts={}, identity=identity, allow_any=allow_any, listeners={})
    _claim(listen, "listen", ctx)
    admin_listen = None
    if "admin_listen" in data:
        admin_listen = parse_address(data["admin_listen"], "admin_listen", allow_any)
        _claim(admin_listen, "admin_listen", ctx)
    scalars = {k: parse(data[k], k) for k, parse in _TOP_SCALARS.items() if k in data}
    if "admin_token" in data:
        scalars["admin_token"] = _admin_token(data["admin_token"], "admin_token")
    if "admin_peers" in data:
        if identity == "off":
            raise _fail("admin_peers", 'needs identity = "tailscale" or "header"')
        scalars["admin_peers"] = _str_list(data["admin_peers"], "admin_peers")
    ctx.hosts = _parse_hosts(_required(data, "", "hosts"))
    routes = _parse_routes(_required(data, "", "routes"), ctx)
    return Config(
        listen=listen, hosts=ctx.hosts, routes=routes, allow_any_address=allow_any,
        identity=identity, admin_listen=admin_listen, **scalars,
    )  # fmt: skip


def _features_in_use(cfg: Config) -> Iterator[tuple[str, str]]:
    """(feature name, key) for each optional feature the config uses, in file order."""
    if cfg.identity != "off":
        yield "identity", "identity"
    if cfg.admin_listen is not None:
        yield "admin_listen", "admin_listen"
    if cfg.yield_factor != DEFAULT_YIELD_FACTOR:
        yield "yield_factor", "yield_factor"
    for host in cfg.hosts.values():
        if host.wake is not None:
            yield "wake", _key("hosts", host.name, "wake")
    for route in cfg.routes.values():
        key = _key("routes", route.name)
        if route.listen is not None:
            yield "route_listen", _key(key, "listen")
        if route.affinity != "conversation":
            yield "affinity", _key(key, "affinity")
        if not route.queue:
            yield "queue", _key(key, "queue")
        if route.peers:
            yield "peers", _key(key, "peers")
        if route.yield_factor is not None:
            yield "yield_factor", _key(key, "yield_factor")


def check_supported(cfg: Config) -> None:
    """Refuse the first feature in use that is still in NOT_YET_SUPPORTED."""
    for feature, key in _features_in_use(cfg):
        if feature in NOT_YET_SUPPORTED:
            raise _fail(key, "not supported yet")


def _read_toml(name: str) -> dict[str, Any]:
    try:
        with open(name, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise _fail(name, "config file not found") from None
    except OSError as exc:
        raise _fail(name, f"cannot read config file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise _fail(name, "config file is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise _fail(name, f"bad TOML: {' '.join(str(exc).split())}") from None


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read a TOML file, validate it and refuse features not supported yet."""
    cfg = parse_config(_read_toml(os.fspath(path)))
    check_supported(cfg)
    return cfg
