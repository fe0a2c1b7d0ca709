"""crossbar.config: parsing, validation and the not-yet-supported gate."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossbar import config as config_mod
from crossbar.config import (
    MIB,
    Address,
    Config,
    ConfigError,
    ModelConf,
    RouteConf,
    check_supported,
    load_config,
    parse_address,
    parse_config,
    parse_duration,
    parse_size,
)

ROOT = Path(__file__).resolve().parent.parent
DELETE = object()

Path_ = tuple[str, ...]
Edit = tuple[Path_, object]


def base() -> dict[str, Any]:
    """A small valid config: two hosts (table- and list-form models), a route and a template."""
    return {
        "listen": "127.0.0.1:7777",
        "hosts": {
            "alpha": {
                "base_url": "http://127.0.0.1:18081",
                "models": {"m1": {"parallel": 2}, "m2": {}},
            },
            "beta": {"base_url": "http://127.0.0.1:18082", "weight": 2.0, "models": ["m1"]},
        },
        "routes": {
            "a": {"hosts": ["alpha", "beta"], "default_model": "m1"},
            "t-*": {"hosts": ["beta"]},
        },
    }


def make(*edits: Edit) -> dict[str, Any]:
    """base() with each (path, value) set, or removed when value is DELETE."""
    data = copy.deepcopy(base())
    for path, value in edits:
        table = data
        for part in path[:-1]:
            table = table.setdefault(part, {})
        if value is DELETE:
            del table[path[-1]]
        else:
            table[path[-1]] = value
    return data


def p(dotted: str) -> Path_:
    return tuple(dotted.split("."))


def assert_error(exc: pytest.ExceptionInfo[ConfigError], key: str, problem: str = "") -> None:
    message = str(exc.value)
    assert "\n" not in message
    assert re.match(rf"{re.escape(key)}: {problem}", message), message


# --- good configs -------------------------------------------------------------------------------


def test_example_toml_loads() -> None:
    cfg = load_config(ROOT / "example.toml")
    assert cfg.listen == Address("127.0.0.1", 7777)
    assert list(cfg.hosts) == ["alpha", "beta", "gamma"]
    assert [h.port for h in cfg.hosts.values()] == [18081, 18082, 18083]
    assert cfg.hosts["alpha"].models["small-9b"] == ModelConf(parallel=4)
    assert cfg.hosts["beta"].weight == 2.0
    assert list(cfg.routes) == ["opencode-a", "opencode-*", "hermes-x"]
    assert cfg.routes["opencode-*"].is_template
    assert cfg.routes["opencode-*"].hosts == ("beta", "alpha")
    assert cfg.routes["opencode-a"].default_model == "ornith-1.5-35b-a3b"
    assert cfg.queue_max == 4
    assert cfg.lease_idle == 1800.0
    assert cfg.retention == 180 * 86400.0


def test_defaults() -> None:
    cfg = parse_config(make((p("routes"), {"r": {}})))
    assert cfg.db == "crossbar.db"
    assert cfg.poll_interval == 60.0
    assert cfg.poll_timeout == 5.0
    assert cfg.lease_idle == 1800.0
    assert cfg.queue_max == 8
    assert cfg.retention == 180 * 86400.0
    assert cfg.max_body == 32 * MIB
    assert cfg.allow_any_address is False
    assert cfg.identity == "off"
    assert cfg.admin_listen is None
    assert cfg.connect_timeout == 5.0
    assert cfg.first_byte_timeout == 900.0
    assert cfg.drain_timeout == 600.0
    assert cfg.mitmweb_keep_flows == 500
    assert cfg.hosts["alpha"].weight == 1.0
    assert cfg.hosts["alpha"].wake is None
    assert cfg.routes["r"] == RouteConf(name="r", hosts=("alpha", "beta"))


def test_all_top_level_keys() -> None:
    cfg = parse_config(
        make(
            (p("db"), "/var/lib/crossbar/crossbar.db"),
            (p("poll_interval"), "1m"),
            (p("poll_timeout"), "2s"),
            (p("lease_idle"), "1h"),
            (p("queue_max"), 0),
            (p("retention"), "30d"),
            (p("max_body"), "1MiB"),
            (p("connect_timeout"), "500ms"),
            (p("first_byte_timeout"), "20m"),
            (p("drain_timeout"), "1m30s"),
            (p("mitmweb_keep_flows"), 0),
        )
    )
    assert (cfg.db, cfg.poll_interval, cfg.poll_timeout, cfg.lease_idle) == (
        "/var/lib/crossbar/crossbar.db",
        60.0,
        2.0,
        3600.0,
    )
    assert (cfg.queue_max, cfg.retention, cfg.max_body) == (0, 30 * 86400.0, MIB)
    assert (cfg.connect_timeout, cfg.first_byte_timeout, cfg.drain_timeout) == (0.5, 1200.0, 90.0)
    assert cfg.mitmweb_keep_flows == 0


def test_models_list_and_table_forms() -> None:
    cfg = parse_config(base())
    assert dict(cfg.hosts["alpha"].models) == {"m1": ModelConf(parallel=2), "m2": ModelConf()}
    assert dict(cfg.hosts["beta"].models) == {"m1": ModelConf()}
    cfg = parse_config(make((p("hosts.alpha.models"), {"m1": {"parallel": 4, "ctx": 8192}})))
    assert cfg.hosts["alpha"].models["m1"] == ModelConf(parallel=4, ctx=8192)
    assert cfg.hosts["beta"].serves("m1") and not cfg.hosts["beta"].serves("m2")


def test_mappings_are_read_only_and_ordered() -> None:
    hosts = {name: {"base_url": f"http://h{name}:1", "models": ["m"]} for name in "zyxw"}
    cfg = parse_config({"listen": "127.0.0.1:1", "hosts": hosts, "routes": {"b": {}, "a": {}}})
    assert list(cfg.hosts) == ["z", "y", "x", "w"]
    assert list(cfg.routes) == ["b", "a"]
    assert cfg.routes["a"].hosts == ("z", "y", "x", "w")
    for mapping in (cfg.hosts, cfg.routes, cfg.hosts["z"].models):
        with pytest.raises(TypeError):
            mapping["new"] = None  # type: ignore[index]


def test_config_is_frozen() -> None:
    cfg = parse_config(base())
    with pytest.raises(AttributeError):
        cfg.queue_max = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("url", "scheme", "host", "port", "base_path", "normalised"),
    [
        ("http://127.0.0.1:18081", "http", "127.0.0.1", 18081, "", "http://127.0.0.1:18081"),
        ("http://h:8080/", "http", "h", 8080, "", "http://h:8080"),
        ("http://titan.tail.ts.net", "http", "titan.tail.ts.net", 80, "", "http://titan.tail.ts.net"),
        ("http://h:80/", "http", "h", 80, "", "http://h"),
        ("HTTPS://H.Example/prefix/", "https", "h.example", 443, "/prefix", "https://h.example/prefix"),
        ("https://h:8443/a/b", "https", "h", 8443, "/a/b", "https://h:8443/a/b"),
        ("http://[::1]:8081/v/", "http", "::1", 8081, "/v", "http://[::1]:8081/v"),
    ],
)
def test_base_url_normalised(
    url: str, scheme: str, host: str, port: int, base_path: str, normalised: str
) -> None:
    h = parse_config(make((p("hosts.alpha.base_url"), url))).hosts["alpha"]
    assert (h.scheme, h.host, h.port, h.base_path, h.base_url) == (scheme, host, port, base_path, normalised)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("1s", 1.0),
        ("30m", 1800.0),
        ("2h", 7200.0),
        ("180d", 180 * 86400.0),
        ("1h30m", 5400.0),
        ("1d12h", 129600.0),
        ("2m30s500ms", 150.5),
        ("1.5h", 5400.0),
        ("0s", 0.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text, "k") == seconds


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("5 minutes", re.escape("not a duration: '5 minutes' (use e.g. '60s', '30m', '180d')")),
        (60, "not a duration: 60 .*add a unit"),
        (1.5, "not a duration: 1.5 .*add a unit"),
        ("60", "not a duration: '60' .*add a unit"),
        (True, "expected a duration with a unit, got boolean .*add a unit"),
        ("-5s", "not a duration"),
        ("5S", "not a duration"),
        ("1h 30m", "not a duration"),
        ("", "not a duration"),
        (["5s"], "expected string, got array"),
    ],
)
def test_parse_duration_refuses(value: object, problem: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_duration(value, "poll_interval")
    assert_error(exc, "poll_interval", problem)


@pytest.mark.parametrize(
    ("value", "size"),
    [
        (1024, 1024),
        ("32MiB", 32 * MIB),
        ("512KiB", 512 * 1024),
        ("1MB", 1_000_000),
        ("1k", 1000),
        ("1KB", 1000),
        ("1kib", 1024),
        ("2GiB", 2 * 1024**3),
        ("1gb", 10**9),
        ("10B", 10),
        ("1.5KiB", 1536),
        ("1 MiB", MIB),
        ("77", 77),
    ],
)
def test_parse_size(value: object, size: int) -> None:
    assert parse_size(value, "max_body") == size


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("32 furlongs", "not a size"),
        ("MiB", "not a size"),
        ("1.5B", "not a whole number of bytes"),
        (1.5, "expected integer or size string"),
        (True, "expected integer or size string.*got boolean"),
        (-1, "must be >= 0"),
    ],
)
def test_parse_size_refuses(value: object, problem: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_size(value, "max_body")
    assert_error(exc, "max_body", problem)


@pytest.mark.parametrize(
    ("text", "allow_any", "address"),
    [
        ("127.0.0.1:7777", False, Address("127.0.0.1", 7777)),
        ("[::1]:7777", False, Address("::1", 7777)),
        ("[0:0:0:0:0:0:0:1]:80", False, Address("::1", 80)),
        ("LocalHost:0", False, Address("localhost", 0)),
        ("100.64.0.1:65535", False, Address("100.64.0.1", 65535)),
        ("127.1:80", False, Address("127.0.0.1", 80)),
        ("crossbar.tail.ts.net:7777", False, Address("crossbar.tail.ts.net", 7777)),
        ("0.0.0.0:7777", True, Address("0.0.0.0", 7777)),
        ("[::]:7777", True, Address("::", 7777)),
        (":7777", True, Address("", 7777)),
    ],
)
def test_parse_address(text: str, allow_any: bool, address: Address) -> None:
    assert parse_address(text, "listen", allow_any) == address


def test_address_str() -> None:
    assert str(Address("::1", 7777)) == "[::1]:7777"
    assert str(Address("127.0.0.1", 1)) == "127.0.0.1:1"


def test_ipv6_listen() -> None:
    assert parse_config(make((p("listen"), "[::1]:7777"))).listen == Address("::1", 7777)


@pytest.mark.parametrize(
    ("key", "address"),
    [
        ("listen", "0.0.0.0:7777"),
        ("listen", "[::]:7777"),
        ("listen", ":7777"),
        ("admin_listen", "0.0.0.0:7778"),
        ("routes.a.listen", "[::]:7801"),
    ],
)
def test_any_address_needs_allow_any_address(key: str, address: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(make((p(key), address)))
    assert_error(exc, key, ".*every address.*allow_any_address = true")
    cfg = parse_config(make((p(key), address), (p("allow_any_address"), True)))
    assert cfg.allow_any_address is True


def test_port_zero_listeners_never_collide() -> None:
    """Port 0 asks the OS for a fresh port, so tests may give it to several listeners."""
    cfg = parse_config(
        make(
            (p("listen"), "127.0.0.1:0"),
            (p("admin_listen"), "127.0.0.1:0"),
            (p("routes.a.listen"), "127.0.0.1:0"),
            (p("routes.b"), {"listen": "127.0.0.1:0"}),
        )
    )
    assert cfg.routes["a"].listen == cfg.routes["b"].listen == Address("127.0.0.1", 0)


def test_wake_parsed_and_normalised() -> None:
    cfg = parse_config(make((p("hosts.alpha.wake"), {"mac": "AA-BB-CC-DD-EE-0F"})))
    wake = cfg.hosts["alpha"].wake
    assert wake is not None
    assert (wake.mac, wake.broadcast, wake.wait) == ("aa:bb:cc:dd:ee:0f", Address("255.255.255.255", 9), 45.0)
    full = {"mac": "aa:bb:cc:dd:ee:ff", "broadcast": "192.168.1.255:7", "wait": "2m"}
    wake = parse_config(make((p("hosts.alpha.wake"), full))).hosts["alpha"].wake
    assert wake is not None
    assert (wake.broadcast, wake.wait) == (Address("192.168.1.255", 7), 120.0)


def test_route_options_parsed() -> None:
    route = {
        "hosts": ["beta", "alpha"],
        "default_model": "m2",
        "pin": "alpha",
        "listen": "127.0.0.1:17801",
        "affinity": "route",
        "queue": False,
        "peers": ["talos", "hermes"],
    }
    cfg = parse_config(make((p("routes.box"), route), (p("identity"), "tailscale")))
    assert cfg.routes["box"] == RouteConf(
        name="box",
        hosts=("beta", "alpha"),
        default_model="m2",
        pin="alpha",
        listen=Address("127.0.0.1", 17801),
        affinity="route",
        queue=False,
        peers=("talos", "hermes"),
    )
    assert not cfg.routes["box"].is_template


# --- bad configs: one case per rule, checking the key the message names ------------------------


def bad(path: str | Path_, value: object, problem: str, key: str = "", also: tuple[Edit, ...] = ()) -> Any:
    """One refused config: base() with `path` set to `value` (after `also`); the message must
    name `key` (default: the dotted path) and match `problem`."""
    parts = p(path) if isinstance(path, str) else path
    shown = "DELETE" if value is DELETE else repr(value)
    edits = (*also, (parts, value))
    return pytest.param(edits, key or ".".join(parts), problem, id=f"{'.'.join(parts)}={shown}")


MAC = "aa:bb:cc:dd:ee:ff"
HOST = {"base_url": "http://h", "models": ["m"]}
URL_KEY = "hosts.alpha.base_url"
NOT_URL = r"not an http\(s\) URL"
HEADER = ((p("identity"), "header"),)

BAD = [
    # top level
    bad("frobnicate", 1, "unknown key$"),
    bad("listen", DELETE, "missing"),
    bad("listen", 7777, "expected string, got integer"),
    bad("listen", "localhost", "not a host:port"),
    bad("listen", "127.0.0.1:65536", "bad port"),
    bad("listen", "127.0.0.1:http", "bad port"),
    bad("listen", "127.0.0.1:-1", "bad port"),
    bad("listen", "::1:7777", "IPv6 addresses need brackets"),
    bad("listen", "[::1]", "not a host:port"),
    bad("listen", "a b:1", "bad host"),
    bad("listen", "1.2.3.4 x:1", "bad host"),
    bad("listen", "[127.0.0.1]:1", "brackets are only for IPv6"),
    bad("listen", "0:7777", ".*every address"),
    bad("admin_listen", "127.0.0.1:7777", "'127.0.0.1:7777' is already used by listen$"),
    bad("db", 5, "expected string, got integer"),
    bad("db", "", "must not be empty"),
    bad(
        "poll_interval", "5 minutes", re.escape("not a duration: '5 minutes' (use e.g. '60s', '30m', '180d')")
    ),
    bad("poll_interval", 60, "not a duration: 60 .*add a unit"),
    bad("poll_interval", True, ".*boolean.*add a unit"),
    bad("poll_interval", "0s", "must be longer than zero"),
    bad("poll_timeout", "5S", "not a duration"),
    bad("lease_idle", "30", "not a duration.*add a unit"),
    bad("retention", "half a year", "not a duration"),
    bad("connect_timeout", 5, "not a duration"),
    bad("first_byte_timeout", "15x", "not a duration"),
    bad("drain_timeout", "0ms", "must be longer than zero"),
    bad("queue_max", -1, "must be >= 0, got -1"),
    bad("queue_max", "8", "expected integer, got string"),
    bad("queue_max", 1.5, "expected integer, got float"),
    bad("queue_max", True, "expected integer, got boolean"),
    bad("mitmweb_keep_flows", -5, "must be >= 0"),
    bad("max_body", 0, "must be larger than zero"),
    bad("max_body", "32MiBs", "not a size"),
    bad("allow_any_address", "yes", "expected boolean, got string"),
    bad("identity", "oauth", "must be one of 'off', 'tailscale', 'header'"),
    bad("hosts", DELETE, "missing"),
    bad("hosts", {}, "must define at least one host"),
    bad("hosts", ["alpha"], "expected table, got array"),
    bad("routes", DELETE, "missing"),
    bad("routes", {}, "must define at least one route"),
    # hosts
    bad("hosts.alpha.frob", 1, "unknown key$"),
    bad("hosts.alpha", "http://x", "expected table, got string"),
    bad(("hosts", "-bad"), HOST, "bad host name"),
    bad(("hosts", "a b"), HOST, "bad host name", key='hosts."a b"'),
    bad(URL_KEY, DELETE, "missing"),
    bad(URL_KEY, "ftp://x", re.escape("not an http(s) URL: 'ftp://x'") + "$"),
    bad(URL_KEY, "127.0.0.1:18081", NOT_URL),
    bad(URL_KEY, "http://", "URL has no host"),
    bad(URL_KEY, "http://:8080", "URL has no host"),
    bad(URL_KEY, "http://h/x?y=1", "must not have a query or fragment"),
    bad(URL_KEY, "http://h?", "must not have a query or fragment"),
    bad(URL_KEY, "http://h/#f", "must not have a query or fragment"),
    bad(URL_KEY, "http://u:pw@h", "must not carry user info"),
    bad(URL_KEY, "http://h:99999", NOT_URL),
    bad(URL_KEY, "http://h:abc", NOT_URL),
    bad(URL_KEY, "http://h:0", "bad port"),
    bad(URL_KEY, "http://[::1:8080", NOT_URL),
    bad(URL_KEY, "http://h /x", NOT_URL),
    bad(URL_KEY, 1, "expected string, got integer"),
    bad("hosts.alpha.weight", 0, "must be a number > 0"),
    bad("hosts.alpha.weight", -1.0, "must be a number > 0"),
    bad("hosts.alpha.weight", float("nan"), "must be a number > 0"),
    bad("hosts.alpha.weight", "1", "expected number, got string"),
    bad("hosts.alpha.weight", True, "expected number, got boolean"),
    bad("hosts.alpha.models", DELETE, "missing"),
    bad("hosts.alpha.models", {}, "must list at least one model"),
    bad("hosts.beta.models", [], "must not be empty"),
    bad("hosts.beta.models", "m1", "expected table or array"),
    bad("hosts.beta.models", ["m1", "m1"], "'m1' listed twice"),
    bad("hosts.beta.models", [1], "expected array of strings"),
    bad("hosts.alpha.models.m1.frob", 1, "unknown key$"),
    bad("hosts.alpha.models.m1", 4, "expected table, got integer"),
    bad(("hosts", "alpha", "models", ""), {}, "model id must not be empty", key='hosts.alpha.models.""'),
    bad("hosts.alpha.models.m1.parallel", 0, "must be >= 1"),
    bad("hosts.alpha.models.m1.parallel", True, "expected integer"),
    bad("hosts.alpha.models.m2.ctx", "8k", "expected integer, got string"),
    bad(
        ("hosts", "alpha", "models", "org/m:q4", "ctx"),
        0,
        "must be >= 1",
        key='hosts.alpha.models."org/m:q4".ctx',
    ),
    # wake
    bad("hosts.alpha.wake", MAC, "expected table"),
    bad("hosts.alpha.wake", {"mac": MAC, "port": 9}, "unknown key$", key="hosts.alpha.wake.port"),
    bad("hosts.alpha.wake", {"wait": "10s"}, "missing", key="hosts.alpha.wake.mac"),
    bad("hosts.alpha.wake.mac", "aa:bb:cc:dd:ee", "not a MAC address"),
    bad("hosts.alpha.wake.mac", "aa:bb-cc:dd:ee:ff", "not a MAC address"),
    bad("hosts.alpha.wake.mac", "gg:bb:cc:dd:ee:ff", "not a MAC address"),
    bad("hosts.alpha.wake.mac", "aabbccddeeff", "not a MAC address"),
    bad("hosts.alpha.wake.broadcast", "x", "not a host:port", also=((p("hosts.alpha.wake.mac"), MAC),)),
    bad("hosts.alpha.wake.wait", 45, "not a duration.*add a unit", also=((p("hosts.alpha.wake.mac"), MAC),)),
    # routes
    bad("routes.a", ["alpha"], "expected table, got array"),
    bad("routes.a.frob", 1, "unknown key$"),
    bad("routes.t-*.frob", 1, "unknown key$", key='routes."t-*".frob'),
    bad("routes.a.hosts", ["alpha", "gamma"], "unknown host 'gamma'$"),
    bad("routes.a.hosts", [], "must not be empty"),
    bad("routes.a.hosts", ["alpha", "alpha"], "'alpha' listed twice"),
    bad("routes.a.hosts", "alpha", "expected array of strings, got string"),
    bad(
        "routes.a.default_model",
        "m2",
        r"'m2' is not served by any of the route's hosts \(beta\)",
        also=((p("routes.a.hosts"), ["beta"]),),
    ),
    bad("routes.a.default_model", "nope", "'nope' is not served"),
    bad("routes.a.default_model", 1, "expected string"),
    bad(
        "routes.a.pin",
        "beta",
        r"'beta' is not one of the route's hosts \(alpha\)",
        also=((p("routes.a.hosts"), ["alpha"]),),
    ),
    bad("routes.a.pin", "zeta", "'zeta' is not one of the route's hosts"),
    bad("routes.a.listen", "127.0.0.1:7777", "'127.0.0.1:7777' is already used by listen$"),
    bad(
        "routes.a.listen",
        "127.0.0.1:7778",
        "'127.0.0.1:7778' is already used by admin_listen$",
        also=((p("admin_listen"), "127.0.0.1:7778"),),
    ),
    bad(
        "routes.b.listen",
        "127.0.0.1:17801",
        "'127.0.0.1:17801' is already used by routes.a.listen$",
        also=((p("routes.a.listen"), "127.0.0.1:17801"),),
    ),
    bad(
        "routes.b.listen",
        "[0::1]:17801",
        r"'\[::1\]:17801' is already used by routes.a.listen$",
        also=((p("routes.a.listen"), "[::1]:17801"),),
    ),
    bad("routes.t-*.listen", "127.0.0.1:17801", "not allowed on a template route", key='routes."t-*".listen'),
    bad("routes.t-*.pin", "alpha", "not allowed on a template route", key='routes."t-*".pin'),
    bad("routes.a.listen", "17801", "not a host:port"),
    bad("routes.a.affinity", "sticky", "must be one of 'conversation', 'route'"),
    bad("routes.a.queue", "no", "expected boolean, got string"),
    bad("routes.a.peers", ["talos"], 'needs identity = "tailscale" or "header"'),
    bad("routes.a.peers", [], "must not be empty", also=HEADER),
    bad("routes.a.peers", [1], "expected array of strings", also=HEADER),
    bad(("routes", "-a"), {}, "bad route name"),
    bad(("routes", "a/b"), {}, "bad route name", key='routes."a/b"'),
    bad(("routes", ""), {}, "bad route name", key='routes.""'),
    bad("admin_token", "short", "must be at least 16 visible ASCII"),
    bad("admin_token", "sixteen chars with spaces", "must be at least 16 visible ASCII"),
    bad("admin_peers", ["talos"], 'needs identity = "tailscale" or "header"'),
    bad("admin_peers", [], "must not be empty", also=HEADER),
    bad("admin_names", ["a b"], "not a host name"),
    bad("admin_names", [], "must not be empty"),
    bad("head_timeout", "0s", "must be longer than zero"),
    bad("idle_timeout", 5, "not a duration"),
    bad("body_timeout", "0s", "must be longer than zero"),
    bad("max_head", "1KiB", "must be at least 4096 bytes"),
    bad("max_connections_per_peer", 0, "must be >= 1"),
    bad("listen", "[::ffff:0.0.0.0]:7777", ".*every address"),
]


def test_admin_and_limit_settings() -> None:
    cfg = parse_config(make((p("identity"), "tailscale"), (p("admin_peers"), ["kyle@github"]),
                            (p("admin_token"), "0123456789abcdef"), (p("admin_names"), ["Crossbar.TS.net."]),
                            (p("head_timeout"), "2s"), (p("idle_timeout"), "30s"), (p("max_head"), "16KiB"),
                            (p("max_connections_per_peer"), 4), (p("body_timeout"), "5s")))
    assert (cfg.admin_peers, cfg.admin_token, cfg.admin_names) == (("kyle@github",), "0123456789abcdef",
                                                                   ("crossbar.ts.net",))
    limits = (cfg.head_timeout, cfg.idle_timeout, cfg.max_head, cfg.max_connections_per_peer,
              cfg.body_timeout)
    assert limits == (2, 30, 16384, 4, 5)


@pytest.mark.parametrize(("edits", "key", "problem"), BAD)
def test_bad_config(edits: tuple[Edit, ...], key: str, problem: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(make(*edits))
    assert_error(exc, key, problem)


@pytest.mark.parametrize("name", ["v1", "health", "props", "slots", "tokenize", "metrics", "_crossbar"])
def test_reserved_route_names(name: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(make((("routes", name), {})))
    assert_error(exc, f"routes.{name}", f"'{name}' is reserved")


def test_not_a_table_at_all() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(["listen"])  # type: ignore[arg-type]
    assert_error(exc, "config", "expected table, got array")


# --- features parsed now, refused by check_supported until they work ---------------------------

FEATURES: list[tuple[str, tuple[Edit, ...], str]] = [
    ("identity", ((p("identity"), "tailscale"),), "identity"),
    ("admin_listen", ((p("admin_listen"), "127.0.0.1:7778"),), "admin_listen"),
    ("wake", ((p("hosts.beta.wake"), {"mac": "aa:bb:cc:dd:ee:ff"}),), "hosts.beta.wake"),
    ("route_listen", ((p("routes.a.listen"), "127.0.0.1:17801"),), "routes.a.listen"),
    ("affinity", ((p("routes.t-*.affinity"), "route"),), 'routes."t-*".affinity'),
    ("queue", ((p("routes.a.queue"), False),), "routes.a.queue"),
    ("peers", ((p("identity"), "header"), (p("routes.a.peers"), ["talos"])), "routes.a.peers"),
    ("yield_factor", ((p("routes.a.yield_factor"), 3),), "routes.a.yield_factor"),
]


@pytest.mark.parametrize(("feature", "edits", "key"), FEATURES, ids=[f[0] for f in FEATURES])
def test_not_yet_supported_refused(
    monkeypatch: pytest.MonkeyPatch, feature: str, edits: tuple[Edit, ...], key: str
) -> None:
    cfg = parse_config(make(*edits))
    monkeypatch.setattr(config_mod, "NOT_YET_SUPPORTED", {feature})
    with pytest.raises(ConfigError) as exc:
        check_supported(cfg)
    assert str(exc.value) == f"{key}: not supported yet"
    monkeypatch.setattr(config_mod, "NOT_YET_SUPPORTED", set())
    check_supported(cfg)


def test_not_yet_supported_names_are_known_features() -> None:
    assert {f[0] for f in FEATURES} >= config_mod.NOT_YET_SUPPORTED


def test_check_supported_names_first_offending_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_mod, "NOT_YET_SUPPORTED", {"wake", "queue"})
    cfg = parse_config(
        make((p("routes.a.queue"), False), (p("hosts.beta.wake"), {"mac": "aa:bb:cc:dd:ee:ff"}))
    )
    with pytest.raises(ConfigError, match=r"^hosts\.beta\.wake: not supported yet$"):
        check_supported(cfg)


def test_check_supported_accepts_plain_config() -> None:
    check_supported(parse_config(base()))
    check_supported(parse_config(make((p("routes.a.affinity"), "conversation"), (p("routes.a.queue"), True))))


# --- load_config ---------------------------------------------------------------------------------

GOOD_TOML = """
listen = "127.0.0.1:7777"
[hosts.alpha]
base_url = "http://127.0.0.1:18081"
models = ["m"]
[routes.a]
"""


def test_load_config_from_str_and_path(tmp_path: Path) -> None:
    path = tmp_path / "crossbar.toml"
    path.write_text(GOOD_TOML)
    assert load_config(path) == load_config(str(path))
    assert isinstance(load_config(path), Config)


def test_load_config_runs_check_supported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_mod, "NOT_YET_SUPPORTED", {"queue"})
    path = tmp_path / "crossbar.toml"
    path.write_text(GOOD_TOML + "queue = false\n")
    with pytest.raises(ConfigError, match=r"^routes\.a\.queue: not supported yet$"):
        load_config(path)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ('listen = "127.0.0.1:1"\nlisten = "127.0.0.1:2"\n', "bad TOML: .*line 2"),
        ("listen = \n", "bad TOML: .*line 1"),
        ("[hosts\n", "bad TOML"),
        (b"listen = '\xff'\n", "config file is not UTF-8 text"),
    ],
)
def test_load_config_bad_file(tmp_path: Path, content: str | bytes, problem: str) -> None:
    path = tmp_path / "crossbar.toml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert_error(exc, str(path), problem)


def test_load_config_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as exc:
        load_config(path)
    assert_error(exc, str(path), "config file not found$")


def test_load_config_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(tmp_path)
    assert_error(exc, str(tmp_path), "cannot read config file")


def test_load_config_reports_key_not_file(tmp_path: Path) -> None:
    path = tmp_path / "crossbar.toml"
    path.write_text("frobnicate = 1\n" + GOOD_TOML)
    with pytest.raises(ConfigError, match=r"^frobnicate: unknown key$"):
        load_config(path)


# --- properties ----------------------------------------------------------------------------------

UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


@given(st.integers(min_value=0, max_value=10**12))
def test_duration_seconds_round_trip(n: int) -> None:
    assert parse_duration(f"{n}s", "k") == n


@given(st.integers(min_value=0, max_value=10**9), st.sampled_from(["s", "m", "h", "d"]))
def test_duration_units_round_trip(n: int, unit: str) -> None:
    assert parse_duration(f"{n}{unit}", "k") == n * UNITS[unit]


@given(st.integers(min_value=0, max_value=10**12))
def test_duration_millis_round_trip(n: int) -> None:
    assert parse_duration(f"{n}ms", "k") == n / 1000


@given(st.integers(0, 1000), st.integers(0, 1000), st.integers(0, 1000), st.integers(0, 1000))
def test_duration_compound_round_trip(d: int, h: int, m: int, s: int) -> None:
    assert parse_duration(f"{d}d{h}h{m}m{s}s", "k") == d * 86400 + h * 3600 + m * 60 + s


@given(st.integers(min_value=0, max_value=10**6), st.sampled_from(["KiB", "MiB", "GiB", "kb", "MB", "b"]))
def test_size_round_trip(n: int, unit: str) -> None:
    factors = {"kib": 1024, "mib": 1024**2, "gib": 1024**3, "kb": 1000, "mb": 1000**2, "b": 1}
    assert parse_size(f"{n}{unit}", "k") == n * factors[unit.lower()]


@given(st.one_of(st.text(max_size=20), st.integers(), st.floats(), st.booleans()))
def test_duration_errors_are_one_line(value: object) -> None:
    try:
        seconds = parse_duration(value, "poll_interval")
    except ConfigError as exc:
        assert str(exc).startswith("poll_interval: ")
        assert "\n" not in str(exc)
    else:
        assert seconds >= 0


@given(st.text(max_size=30))
def test_address_errors_are_one_line(text: str) -> None:
    try:
        address = parse_address(text, "listen", allow_any=False)
    except ConfigError as exc:
        assert str(exc).startswith("listen: ")
        assert "\n" not in str(exc)
    else:
        assert 0 <= address.port <= 65535
