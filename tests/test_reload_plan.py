"""crossbar.reload: what a new configuration changes, what needs a restart, which leases it strands."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from crossbar.config import ConfigError, parse_config
from crossbar.reload import HOST_REMOVED, ROUTE_CHANGED, Change, plan_reload, stranded
from crossbar.request import match_route


def base() -> dict[str, Any]:
    return {
        "listen": "127.0.0.1:7777",
        "hosts": {
            "alpha": {"base_url": "http://127.0.0.1:18081", "models": {"m1": {"parallel": 2}}},
            "beta": {"base_url": "http://127.0.0.1:18082", "models": ["m1"]},
        },
        "routes": {
            "a": {"hosts": ["alpha", "beta"], "default_model": "m1"},
            "t-*": {"hosts": ["beta"]},
        },
    }


def edited(**top: Any) -> dict[str, Any]:
    data = copy.deepcopy(base())
    data.update(top)
    return data


def with_(path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(base())
    *parents, last = path.split(".")
    table = data
    for part in parents:
        table = table.setdefault(part, {})
    if value is None:
        del table[last]
    else:
        table[last] = value
    return data


OLD = parse_config(base())


@pytest.mark.parametrize(
    ("new", "expected"),
    [
        (base(), Change()),
        (with_("hosts.gamma", {"base_url": "http://127.0.0.1:18083", "models": ["m1"]}),
         Change(hosts_added=("gamma",))),
        (with_("routes.t-*", None), Change(routes_removed=("t-*",))),
        (with_("hosts.beta.weight", 3.0), Change(hosts_changed=("beta",))),
        (with_("hosts.alpha.models", {"m1": {"parallel": 1}}), Change(hosts_changed=("alpha",))),
        (with_("routes.a.hosts", ["alpha"]), Change(routes_changed=("a",))),
        (with_("routes.b", {"hosts": ["alpha"], "listen": "127.0.0.1:7790"}),
         Change(routes_added=("b",), listeners_changed=True)),
        (edited(poll_interval="5s", queue_max=2), Change(settings_changed=("poll_interval", "queue_max"))),
        (edited(admin_listen="127.0.0.1:7791"), Change(listeners_changed=True)),
    ],
    ids=["same", "host-added", "route-removed", "weight", "parallel", "route-hosts", "route-listener",
         "settings", "admin-listener"],
)
def test_plan(new: dict[str, Any], expected: Change) -> None:
    assert plan_reload(OLD, parse_config(new)) == expected


@pytest.mark.parametrize(
    ("top", "key"),
    [({"db": "/tmp/other.db"}, "db"), ({"listen": "127.0.0.1:7778"}, "listen"),
     ({"allow_any_address": True}, "allow_any_address")],
)
def test_restart_only_keys_refuse_naming_the_key(top: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        plan_reload(OLD, parse_config(edited(**top)))
    assert str(exc.value).startswith(f"{key}: ")
    assert "restart" in str(exc.value)


def test_summary_is_one_line() -> None:
    change = Change(hosts_added=("g",), hosts_removed=("b",), routes_changed=("a",),
                    settings_changed=("poll_interval",), listeners_changed=True)
    assert change.summary() == "hosts +g -b; routes ~a; settings poll_interval; listeners"
    assert Change().summary() == "no change"
    assert Change().empty and not change.empty


def test_stranded_leases() -> None:
    new = parse_config(with_("routes.a.hosts", ["beta"]) | {"hosts": {"beta": base()["hosts"]["beta"]},
                                                            "routes": {"a": {"hosts": ["beta"]},
                                                                       "t-*": {"hosts": ["beta"]}}})
    leases = [("a", "alpha"), ("a", "beta"), ("t-x", "beta"), ("gone", "beta"), ("t-y", "alpha")]
    assert stranded(leases, new, match_route) == [(0, HOST_REMOVED), (3, ROUTE_CHANGED),
                                                  (4, HOST_REMOVED)]


def test_stranded_by_route_host_list_only() -> None:
    new = parse_config(with_("routes.a.hosts", ["beta"]))
    assert stranded([("a", "alpha"), ("a", "beta")], new, match_route) == [(0, ROUTE_CHANGED)]
