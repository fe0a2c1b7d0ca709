"""The operator's API under `/_crossbar/`, answered without contacting any upstream.

Endpoints (README, "Operating it"): `hosts`, `routes`, `routes/{route}` (pin/release), `reload`,
`hosts/{host}` (drain), `usage`, `metrics`. Every error is JSON.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import parse_qs

from crossbar import dashboard, errors
from crossbar.app import Router
from crossbar.config import ConfigError, parse_duration
from crossbar.errors import CrossbarError
from crossbar.lease import Lease, UnknownHost
from crossbar.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from crossbar.request import match_route
from crossbar.session import key_kind

PREFIX = "/_crossbar"
READ_FLUSH_TIMEOUT = 2.0  # a failing database must not hold the admin API longer than this
T = TypeVar("T")
JSON_TYPE = "application/json"
ROUTE_LEASES = 50  # leases listed per route in GET /_crossbar/routes, most recently used first
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class Reply:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": JSON_TYPE})


def json_reply(obj: Any, status: int = 200) -> Reply:
    return Reply(status, json.dumps(obj).encode())


def rfc3339(ts: float | None) -> str:
    if ts is None:
        return ""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def is_admin_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/") or path.startswith(PREFIX + "?")


class Admin:
    def __init__(self, router: Router, reload: Callable[[], Awaitable[str]] | None = None):
        self.router = router
        self.reload = reload  # re-reads the configuration file: what changed, or ConfigError

    async def handle(self, method: str, target: str, headers: Mapping[str, str], body: bytes) -> Reply:
        path, _, query = target.partition("?")
        self.router.account_finished()  # every finished request is in what this answers
        try:
            args = parse_qs(query, keep_blank_values=True)  # `since=` is a mistake, not the default
            return await self._dispatch(method, path[len(PREFIX):] or "/", args, headers, body)
        except CrossbarError as exc:
            return Reply(exc.status, exc.body(), {"Content-Type": JSON_TYPE, **exc.headers})

    async def _dispatch(
        self, method: str, path: str, query: dict[str, list[str]], headers: Mapping[str, str], body: bytes
    ) -> Reply:
        parts = [p for p in path.split("/") if p]
        match (method, parts):
            case ("GET", []):
                return Reply(200, dashboard.page(), dict(dashboard.HEADERS))
            case ("GET", ["events"]):
                return json_reply(await self.events(query))
            case ("GET", ["hosts"]):
                return json_reply(self.hosts())
            case ("GET", ["routes"]):
                return json_reply(self.routes())
            case ("POST", ["routes", name]):
                return json_reply(self.change_route(name, _json_object(body)))
            case ("POST", ["hosts", name]):
                return json_reply(self.change_host(name, _json_object(body)))
            case ("POST", ["reload"]) if self.reload is not None:
                return await self.reloaded()
            case ("GET", ["usage"]):
                return await self.usage(query, headers.get("accept", ""))
            case ("GET", ["metrics"]):
                return Reply(200, self.router.metrics.exposition(), {"Content-Type": METRICS_CONTENT_TYPE})
            case (_, [] | ["events"] | ["hosts"] | ["routes"] | ["routes", _] | ["hosts", _] | ["usage"]
                  | ["metrics"] | ["reload"]):
                raise CrossbarError(405, "method_not_allowed", f"{method} is not allowed on {PREFIX}{path}")
        raise errors.not_found(f"no admin endpoint {PREFIX}{path}")

    async def reloaded(self) -> Reply:
        """POST /_crossbar/reload: the configuration file read again and applied, or the one-line
        error start-up would give (nothing changed)."""
        assert self.reload is not None
        try:
            summary = await self.reload()
        except ConfigError as exc:
            raise CrossbarError(400, "config_error", str(exc)) from None
        return json_reply({"ok": True, "changed": summary})

    # ------------------------------------------------------------ views

    def hosts(self) -> dict[str, Any]:
        r = self.router
        out: dict[str, Any] = {}
        for name, conf in r.cfg.hosts.items():
            st = r.fleet.state[name]
            in_flight, queued = r.limiter.host_totals(name)
            free = sum(r.fleet.free_slots(name, m, r.in_flight(name, m)) for m in conf.models)
            out[name] = {
                "healthy": st.healthy,
                "loaded": sorted(st.loaded),
                "last_ok": rfc3339(st.last_ok),
                "last_err": st.last_err,
                "free_slots": free,
                "in_flight": in_flight,
                "queued": queued,
                "draining": st.draining,
                "n_ctx": st.n_ctx,
                "slots": st.slots,
                "models": {m: {"n_ctx": c.n_ctx, "slots": c.slots} for m, c in sorted(st.models.items())},
                # the per-slot context the context guard uses for each model it serves
                "ctx": {m: r.fleet.slot_ctx(name, m) for m in sorted(set(conf.models) | set(st.loaded))},
                "router": st.router,
                "weight": conf.weight,
                "base_url": conf.base_url,
            }
        return out

    def routes(self) -> dict[str, Any]:
        """Every route with its lease count per host and its most recently used leases (at most
        ROUTE_LEASES each): the view stays small however many conversations a route holds."""
        r = self.router
        holding = r.leases.routes()
        names = list(r.cfg.routes) + sorted(set(holding) - set(r.cfg.routes))
        out: dict[str, Any] = {}
        for name in names:
            conf = r.cfg.routes.get(name) or match_route(name, r.cfg.routes)
            if conf is None:  # a lease of a route removed from the config
                continue
            out[name] = {
                "hosts": list(conf.hosts),
                "default_model": conf.default_model,
                "pinned": r.leases.pinned(name),
                "lease_count": r.leases.count(name),
                "hosts_leases": r.leases.hosts_count(name),
                "leases": [_lease_json(lease) for lease in r.leases.leases_of(name, ROUTE_LEASES)],
            }
            if conf.is_template:
                out[name]["template"] = True  # concrete routes made from it are listed by name
        return out

    # ------------------------------------------------------------ changes

    def change_route(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.router
        conf = match_route(name, r.cfg.routes) if _NAME.match(name) else None
        if conf is None:
            raise errors.not_found(f"unknown route {name!r}")
        _only_keys(body, {"host", "pin", "release"})
        if body.get("release") is True:
            n = r.release_route(name)
            return {"ok": True, "released": n}
        pin = body.get("pin")
        if pin is False:
            r.unpin_route(name)
            return {"ok": True}
        if pin is not True:
            raise errors.bad_request(
                'send {"host": "<host>", "pin": true}, {"pin": false} or {"release": true}'
            )
        host = body.get("host")
        if not isinstance(host, str) or not host:
            raise errors.bad_request("'host' must name the host to pin the route to")
        if host not in r.cfg.hosts:
            raise errors.not_found(f"unknown host {host!r}")
        try:
            r.pin_route(name, host, conf.hosts)
        except UnknownHost as exc:
            raise errors.bad_request(f"host {host!r} is not a candidate of route {name!r}") from exc
        return {"ok": True}

    def change_host(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.router
        if name not in r.cfg.hosts:
            raise errors.not_found(f"unknown host {name!r}")
        _only_keys(body, {"drain"})
        drain = body.get("drain")
        if not isinstance(drain, bool):
            raise errors.bad_request('send {"drain": true} or {"drain": false}')
        r.set_draining(name, drain)
        return {"ok": True}

    async def events(self, query: dict[str, list[str]]) -> list[dict[str, Any]]:
        """Recent lease moves, newest first."""
        try:
            limit = min(1000, max(1, int(_one(query, "limit", "50"))))
        except ValueError:
            raise errors.bad_request("'limit' must be a number") from None
        rows = await asyncio.to_thread(self._read, self.router.store.lease_events, limit)
        return [
            {"ts": rfc3339(e.ts), "route": e.route, "fp": e.fp, "key": key_kind(e.fp), "model": e.model,
             "from": e.from_host or "", "to": e.to_host or "", "reason": e.reason}
            for e in rows
        ]

    def _read(self, query: Callable[..., T], *args: Any) -> T:
        """In a worker thread: let the writer commit what is queued (it batches for up to a
        second), so the API answers with every request that has finished, then query."""
        self.router.store.flush(READ_FLUSH_TIMEOUT)
        return query(*args)

    # ------------------------------------------------------------ usage

    async def usage(self, query: dict[str, list[str]], accept: str) -> Reply:
        by = _one(query, "by", "route")
        if by not in USAGE_BY:
            raise errors.bad_request(f"'by' must be one of {', '.join(USAGE_BY)}, not {by!r}")
        since = parse_since(_one(query, "since", "24h"), time.time())
        rows = await asyncio.to_thread(self._read, self._usage_rows, since, by)
        if "text/plain" in accept:
            return Reply(200, usage_table(rows).encode(), {"Content-Type": "text/plain; charset=utf-8"})
        return json_reply(rows)

    def _usage_rows(self, since: float, by: str) -> list[dict[str, Any]]:
        store = self.router.store
        rows = store.usage(since, by)
        if by == "host":
            rows = with_uptime(rows, store.host_uptime(since))
        return rows


USAGE_BY = ("route", "model", "host", "decision")
USAGE_COLUMNS = ("requests", "errors", "busy_ms", "queued_ms", "prompt_tokens", "cached_tokens",
                 "completion_tokens")
_SPACED_OFFSET = re.compile(r"(T[0-9:.]+) ([0-9]{2}:?[0-9]{2})$")


def parse_since(value: str, now: float) -> float:
    """RFC 3339 time, or a duration back from now (`24h`, `7d`); never before the epoch."""
    try:
        return max(0.0, now - parse_duration(value, "since"))
    except ConfigError:
        pass
    # an unescaped "+" in a query string arrives as a space: "…T00:00:00 01:00"
    text = _SPACED_OFFSET.sub(r"\1+\2", value.strip())
    try:
        ts = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise errors.bad_request(
            f"'since' must be an RFC 3339 time or a duration such as 24h or 7d, not {value!r}"
        ) from None
    if ts.tzinfo is None:
        raise errors.bad_request("'since' needs a time zone (e.g. 2026-11-30T00:00:00Z)")
    return max(0.0, ts.timestamp())


def with_uptime(rows: list[dict[str, Any]], uptime: dict[str, float]) -> list[dict[str, Any]]:
    """`by=host` rows gain `uptime`: the share of healthy polls since `since` (null when none).
    A host that was polled but served nothing still gets a row, with zero counts."""
    seen = {row["key"] for row in rows}
    zero = dict.fromkeys(USAGE_COLUMNS, 0)
    rows = rows + [{"key": host, **zero} for host in uptime if host not in seen]
    for row in rows:
        share = uptime.get(row["key"])
        row["uptime"] = None if share is None else round(share, 4)
    return sorted(rows, key=lambda row: row["key"])


def usage_table(rows: list[dict[str, Any]]) -> str:
    head = ["key", "requests", "errors", "busy_ms", "queued_ms", "prompt", "cached", "completion",
            "cache_hit"]
    uptime = any("uptime" in row for row in rows)
    if uptime:
        head.append("uptime")
    lines = [head]
    for row in rows:
        prompt, cached = row.get("prompt_tokens") or 0, row.get("cached_tokens") or 0
        hit = f"{cached / prompt:.2f}" if prompt else "-"
        line = [printable(str(row["key"] or "-"))] + [str(row.get(c) or 0) for c in USAGE_COLUMNS] + [hit]
        if uptime:
            line.append("-" if row.get("uptime") is None else f"{row['uptime']:.4f}")
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "".join(
        " ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths,
                 strict=True))).rstrip() + "\n"
        for line in lines
    )


def _lease_json(lease: Lease) -> dict[str, Any]:
    return {
        "fp": lease.key.fp,
        "key": key_kind(lease.key.fp),
        "model": lease.key.model,
        "host": lease.host,
        "state": lease.state,
        "created": rfc3339(lease.created),
        "last_used": rfc3339(lease.last_used),
    }


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """`text` with every control character escaped (`\\x1b`), so a name chosen by a client
    cannot move the cursor or rewrite the operator's terminal."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _ESCAPES.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100
                   else f"\\u{ord(c):04x}") for c in text)


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body or b"{}")
    except (ValueError, RecursionError):
        raise errors.bad_request("body must be a JSON object") from None
    if not isinstance(obj, dict):
        raise errors.bad_request("body must be a JSON object")
    return obj


def _only_keys(body: dict[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise errors.bad_request(f"unknown key {extra[0]!r}; allowed: {', '.join(sorted(allowed))}")


def _one(query: dict[str, list[str]], key: str, default: str) -> str:
    values = query.get(key)
    return values[-1] if values else default
