"""Start-up: the `crossbar_config` option, the configuration, the router, and every listener the
TOML names (the main one, each route's own, the admin one)."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import aiohttp
from mitmproxy import ctx, exceptions
from mitmproxy.addonmanager import Loader

from crossbar import admin_access
from crossbar.addons.runtime import ADMIN, MAIN, PLACEHOLDER, ROUTE, Runtime
from crossbar.admin import Admin
from crossbar.app import Router
from crossbar.config import Address, Config, ConfigError, load_config
from crossbar.identity import IdentityError
from crossbar.reclaim import freeze_startup
from crossbar.secret import SecretError, from_database, load_or_create, secret_path
from crossbar.store import Store, StoreError

log = logging.getLogger("crossbar")
SWITCH_INTERVAL = 0.001  # seconds a thread holds the interpreter while another waits for it


class Listeners:
    def __init__(self, rt: Runtime):
        self.rt = rt

    def load(self, loader: Loader) -> None:
        loader.add_option("crossbar_config", str, "", "Path of crossbar's TOML configuration file.")

    def configure(self, updated: set[str]) -> None:
        rt = self.rt
        if "crossbar_config" not in updated:
            return
        if rt.router is not None:
            raise exceptions.OptionsError("crossbar_config cannot change while crossbar runs; restart it")
        path = ctx.options.crossbar_config
        try:
            if not path:
                raise ConfigError("crossbar_config is not set: add --set crossbar_config=PATH")
            rt.cfg = load_config(path)
        except ConfigError as exc:
            # one clear line; an error logged during start-up makes mitmproxy exit non-zero
            log.error("crossbar config: %s", exc)
            rt.cfg = None
            return
        ctx.options.update(**mitmproxy_options(rt.cfg))

    async def running(self) -> None:
        rt = self.rt
        if rt.cfg is None:  # the configuration error was logged; mitmproxy exits
            return
        # a worker thread peeking a large body hands the interpreter back to the event loop
        # within 1 ms (the default is 5 ms: every other stream's next event would wait that long)
        sys.setswitchinterval(SWITCH_INTERVAL)
        router = Router(rt.cfg)
        try:
            router.open()
        except StoreError as exc:
            log.error("crossbar: %s", exc)
            return
        try:
            rt.fp_key = fingerprint_key(rt.cfg.db, router.store)
        except SecretError as exc:
            log.error("crossbar: %s", exc)
            await router.close()
            return
        if not await self._start_identity():
            await router.close()
            return
        rt.router, rt.admin = router, Admin(router, reload=rt.reloader)
        rt.admin_policy = admin_access.AdminPolicy.from_config(rt.cfg)
        rt.session = aiohttp.ClientSession()
        router.start_background()
        await self._listen()
        freeze_startup()

    async def _start_identity(self) -> bool:
        cfg = self.rt.cfg
        assert cfg is not None
        if cfg.identity == "tailscale":
            try:
                version = await self.rt.tailscale.check()
            except IdentityError as exc:
                log.error("crossbar: %s", exc)
                return False
            log.info("crossbar: identity from tailscale %s", version)
        elif cfg.identity == "header":
            log.warning("crossbar: identity = \"header\" trusts X-Crossbar-Peer from anyone: for tests only")
        return True

    async def _listen(self) -> None:
        rt, cfg = self.rt, self.rt.cfg
        assert cfg is not None
        rt.roles = listener_roles(cfg)
        rt.listen_specs = list(rt.roles)
        _ensure_certstore()
        failed = await serve_on(rt.listen_specs)
        if failed:
            log.error("crossbar: could not listen on %s", ", ".join(failed))
            return
        ps = ctx.master.addons.get("proxyserver")
        log.info("crossbar: serving on %s", ", ".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}"
                                                      for h, p, *_ in ps.listen_addrs()))


def listener_roles(cfg: Config) -> dict[str, tuple[str, str]]:
    """Every listener the configuration names: mode spec → (role, route name of a route's own)."""
    roles = {listen_spec(cfg.listen): (MAIN, "")}
    if cfg.admin_listen is not None:
        roles[listen_spec(cfg.admin_listen)] = (ADMIN, "")
    for name, route in cfg.routes.items():
        if route.listen is not None:
            roles[listen_spec(route.listen)] = (ROUTE, name)
    return roles


async def serve_on(specs: list[str]) -> list[str]:
    """Make mitmproxy listen on exactly `specs`; returns those that could not be opened. A server
    whose spec stays keeps running with its connections (mitmproxy only starts and stops the
    specs that changed)."""
    ctx.options.update(server=True, mode=specs)
    ps = ctx.master.addons.get("proxyserver")

    def settled() -> bool:  # every wanted server tried (running or failed), no other one left
        servers = list(ps.servers)
        return (not ps.servers.is_updating and {s.mode.full_spec for s in servers} == set(specs)
                and all(s.is_running or s.last_exception is not None for s in servers))

    for _ in range(500):  # the option change starts and stops the servers on a task
        await asyncio.sleep(0.01)
        if settled():
            break
    running = listening()
    return [spec for spec in specs if spec not in running]


def listening() -> set[str]:
    """The mode specs of the listeners mitmproxy has open."""
    ps = ctx.master.addons.get("proxyserver")
    return {server.mode.full_spec for server in ps.servers if server.is_running}


def mitmproxy_options(cfg: Config) -> dict[str, Any]:
    """The mitmproxy options crossbar sets for itself (the benchmark gives bare mitmdump the same).
    mitmproxy's body_size_limit would cut answers too (a large embeddings reply): instead, bodies
    past `stream_large_bodies` are streamed, not buffered; crossbar answers JSON 413 above max_body."""
    return {"connection_strategy": "lazy",
            "keep_host_header": True,  # the admin API checks the Host the client sent
            "stream_large_bodies": str(cfg.buffered_body_max),
            "tcp_timeout": max(600, int(cfg.first_byte_timeout) + 60)}


def listen_spec(address: Address) -> str:
    """mitmproxy's mode spec for a listener; it takes an IPv6 host without brackets (`@::1:7777`)."""
    return f"reverse:{PLACEHOLDER}@{address.host}:{address.port}"


def _ensure_certstore() -> None:
    """mitmproxy runs a script's `running` hook before its TLS addon's, which loads the cert
    store; a client arriving on a freshly opened listener before that crashes the TLS addon.
    Load it first, as that addon's own `running` would."""
    tls = ctx.master.addons.get("tlsconfig")
    if tls is not None and getattr(tls, "certstore", None) is None:
        tls.configure({"confdir"})


def fingerprint_key(db: str, store: Store) -> bytes:
    """The install's secret: in a file beside a SQLite database, in a PostgreSQL database itself
    (every instance sharing it must key fingerprints alike)."""
    path = secret_path(db)
    if path is None:
        return from_database(store.install_secret, store.label)
    return load_or_create(path)
