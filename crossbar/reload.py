"""Live reconfiguration, the pure part: what a new configuration changes, and what it may not.

`plan_reload(old, new)` compares two validated configurations. Keys that only a restart can
change (the database, the main listen address) refuse the reload with a `ConfigError` that names
the key, in the same one-line form start-up uses; everything else is described by a `Change` that
the router applies while it keeps serving. `stranded(...)` says which leases a new configuration
leaves without their host (the host left the config, or the lease's route no longer lists it, or
the route itself is gone); those are dropped and placed anew at their next turn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from crossbar.config import Config, ConfigError, RouteConf
from crossbar.decisions import Reason

# (key, why) for each setting a running crossbar cannot take over
RESTART_ONLY: tuple[tuple[str, str], ...] = (
    ("db", "the database cannot change while crossbar runs; restart it"),
    ("listen", "the main listen address cannot change while crossbar runs; restart it"),
    ("allow_any_address", "allow_any_address cannot change while crossbar runs; restart it"),
)

# the shape of crossbar.request.match_route: a concrete route name → its settings, or None
RouteLookup = Callable[[str, Mapping[str, RouteConf]], RouteConf | None]

# lease event reasons of a reload
HOST_REMOVED = Reason.HOST_REMOVED  # the lease's host left the configuration
ROUTE_CHANGED = Reason.ROUTE_CHANGED  # the lease's route no longer lists its host, or is gone


@dataclass(frozen=True, slots=True)
class Change:
    hosts_added: tuple[str, ...] = ()
    hosts_removed: tuple[str, ...] = ()
    hosts_changed: tuple[str, ...] = ()
    routes_added: tuple[str, ...] = ()
    routes_removed: tuple[str, ...] = ()
    routes_changed: tuple[str, ...] = ()
    listeners_changed: bool = False
    settings_changed: tuple[str, ...] = ()  # top-level scalar keys with a new value

    @property
    def empty(self) -> bool:
        return not any(getattr(self, f.name) for f in dataclasses.fields(self))

    def summary(self) -> str:
        """One line for the log and the admin answer, e.g. `hosts +gamma ~alpha; routes -old`."""
        parts = []
        for label, added, removed, changed in (
            ("hosts", self.hosts_added, self.hosts_removed, self.hosts_changed),
            ("routes", self.routes_added, self.routes_removed, self.routes_changed),
        ):
            names = [f"+{n}" for n in added] + [f"-{n}" for n in removed] + [f"~{n}" for n in changed]
            if names:
                parts.append(f"{label} {' '.join(names)}")
        if self.settings_changed:
            parts.append(f"settings {' '.join(self.settings_changed)}")
        if self.listeners_changed:
            parts.append("listeners")
        return "; ".join(parts) or "no change"


def _diff(old: Mapping[str, object], new: Mapping[str, object]) -> tuple[tuple[str, ...], ...]:
    added = tuple(n for n in new if n not in old)
    removed = tuple(n for n in old if n not in new)
    changed = tuple(n for n in new if n in old and new[n] != old[n])
    return added, removed, changed


def _listeners(cfg: Config) -> dict[str, object]:
    specs: dict[str, object] = {"admin_listen": cfg.admin_listen}
    specs.update({f"routes.{r.name}.listen": r.listen for r in cfg.routes.values() if r.listen})
    return specs


def _scalar_settings(cfg: Config) -> dict[str, object]:
    skip = {"hosts", "routes", "listen", "admin_listen", "db", "allow_any_address"}
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in skip}


def plan_reload(old: Config, new: Config) -> Change:
    """What `new` changes relative to `old`; ConfigError naming the key for what needs a restart."""
    for key, why in RESTART_ONLY:
        if getattr(old, key) != getattr(new, key):
            raise ConfigError(f"{key}: {why}")
    hosts = _diff(old.hosts, new.hosts)
    routes = _diff(old.routes, new.routes)
    old_settings, new_settings = _scalar_settings(old), _scalar_settings(new)
    return Change(
        hosts_added=hosts[0], hosts_removed=hosts[1], hosts_changed=hosts[2],
        routes_added=routes[0], routes_removed=routes[1], routes_changed=routes[2],
        listeners_changed=_listeners(old) != _listeners(new),
        settings_changed=tuple(k for k in new_settings if new_settings[k] != old_settings[k]),
    )  # fmt: skip


def stranded(
    leases: Iterable[tuple[str, str]], new: Config, route_of: RouteLookup
) -> list[tuple[int, Reason]]:
    """For (route name, host) pairs, the indexes whose host the new config takes away, with why.

    `route_of(name, routes)` resolves a concrete route name (a template match included) in the
    new configuration, as a request would.
    """
    out = []
    for i, (route_name, host) in enumerate(leases):
        if host not in new.hosts:
            out.append((i, HOST_REMOVED))
            continue
        route = route_of(route_name, new.routes)
        if route is None or host not in route.hosts:
            out.append((i, ROUTE_CHANGED))
    return out
