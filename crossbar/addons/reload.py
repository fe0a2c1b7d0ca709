"""Live reload of the configuration: on SIGHUP (`systemctl reload crossbar`) and on
`POST /_crossbar/reload`, the file named by `crossbar_config` is read and validated whole; a bad
file, or one that changes what only a restart can, changes nothing and gives the same one-line
error start-up gives. Otherwise the router takes the new configuration while it serves (see
`Router.reconfigure`) and the listeners that changed are opened or closed, the others untouched.

mitmproxy's own reload of the entry script when the file changes on disk is turned off at start:
it would build a second router and a second store writer next to the first, whose asynchronous
shutdown cannot run from that path, and requests spanning it would lose their rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading

from mitmproxy import ctx
from mitmproxy.addonmanager import Loader

from crossbar import admin_access, errors
from crossbar.addons.listeners import listener_roles, listening, mitmproxy_options, serve_on
from crossbar.addons.runtime import Runtime
from crossbar.config import Config, ConfigError, load_config
from crossbar.decisions import Rejection
from crossbar.identity import IdentityError
from crossbar.reload import plan_reload

log = logging.getLogger("crossbar")


class Reload:
    def __init__(self, rt: Runtime):
        self.rt = rt
        self._lock = asyncio.Lock()  # one reload at a time
        self._tasks: set[asyncio.Task[None]] = set()
        self._early_sighup = False  # a SIGHUP came before crossbar served
        rt.reloader = self.reload

    def load(self, loader: Loader) -> None:
        """SIGHUP is caught from here on: until crossbar serves, one is noted and applied once it
        does. Left to its default action it would end the process, which systemd counts as a
        clean stop (no restart): `systemctl reload` just after `start` would leave it dead."""
        if threading.current_thread() is threading.main_thread():  # an in-process test master is not
            signal.signal(signal.SIGHUP, self._note_early_sighup)

    def _note_early_sighup(self, _signum: int, _frame: object) -> None:
        self._early_sighup = True  # a signal handler: no logging (its locks may be held)

    def running(self) -> None:
        if self.rt.router is None:
            return
        self._stop_script_reload()
        if threading.current_thread() is threading.main_thread():
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)
            if self._early_sighup:
                self._early_sighup = False
                log.info("crossbar: a SIGHUP came while crossbar started")
                self._on_sighup()

    def done(self) -> None:
        """From the stop on SIGHUP is ignored: a reload would be refused, and the event loop, once
        closed, would give the signal back its default action (the end of the process) while
        crossbar still writes its last rows. Blocked meanwhile, so that none lands in between."""
        if threading.current_thread() is not threading.main_thread():
            return
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            with contextlib.suppress(RuntimeError):  # no running loop: nothing of it to remove
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})

    def _on_sighup(self) -> None:
        log.info("crossbar: SIGHUP: reloading %s", ctx.options.crossbar_config)
        task = asyncio.get_running_loop().create_task(self._reload_quietly(), name="crossbar-reload")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reload_quietly(self) -> None:
        try:
            await self.reload()
        except (ConfigError, errors.CrossbarError):
            pass  # logged by reload()
        except Exception:  # a crossbar bug: in the log, never an unretrieved task exception
            log.exception("crossbar: reload failed")

    async def reload(self) -> str:
        """Read the configuration file again and apply it; returns what changed in one line.
        Raises ConfigError (nothing changed) or CrossbarError (stopping; a listener that could
        not be opened)."""
        async with self._lock:
            try:
                summary = await self._apply()
            except ConfigError as exc:
                log.error("crossbar config: %s", exc)  # the line start-up gives
                log.warning("crossbar: reload refused; the running configuration is unchanged")
                raise
            except errors.CrossbarError as exc:
                log.error("crossbar: reload: %s", exc.message)
                raise
            log.info("crossbar: configuration reloaded: %s", summary)
            return summary

    async def _apply(self) -> str:
        rt = self.rt
        if rt.stopping or rt.router is None or rt.cfg is None:
            raise errors.unavailable("crossbar is shutting down; nothing reloaded", retry_after=5,
                                     reason=Rejection.SHUTTING_DOWN)
        new = await asyncio.to_thread(load_config, ctx.options.crossbar_config)
        change = plan_reload(rt.cfg, new)
        await self._check_identity(rt.cfg, new)
        dropped = rt.router.reconfigure(new, change)
        rt.cfg = new
        rt.limits_reloaded()
        rt.admin_policy = admin_access.AdminPolicy.from_config(new)
        ctx.options.update(**mitmproxy_options(new))
        await rt.router.poll_hosts((*change.hosts_added, *change.hosts_changed))  # not optimistic for long
        summary = change.summary() + (f"; {dropped} lease(s) dropped" if dropped else "")
        failed = await self._relisten(new)
        if failed:
            raise errors.CrossbarError(500, "listen_error", f"reloaded ({summary}), but could not listen "
                                       f"on {', '.join(failed)}; see crossbar's log")
        return summary

    async def _check_identity(self, old: Config, new: Config) -> None:
        """Switching to tailscale identity needs a working tailscale, as at start-up."""
        if new.identity == "tailscale" and old.identity != "tailscale":
            try:
                await self.rt.tailscale.check()
            except IdentityError as exc:
                raise ConfigError(f"identity: {exc}") from None
        if new.identity == "header" and old.identity != "header":
            log.warning("crossbar: identity = \"header\" trusts X-Crossbar-Peer from anyone: for tests only")

    async def _relisten(self, new: Config) -> list[str]:
        """Open the listeners the new configuration adds and close those it drops; the others keep
        running. Connections still open on a dropped listener keep their role (a dropped route's
        own listener answers 404 on them)."""
        rt = self.rt
        roles = listener_roles(new)
        specs = list(roles)
        rt.roles = {**rt.roles, **roles}
        if rt.stopping:  # a stop closes every listener: none reopens
            return []
        failed = [spec for spec in specs if spec not in listening()]
        if specs == rt.listen_specs and not failed:
            return []
        rt.listen_specs = specs
        if failed:  # mitmproxy keeps a listener that failed to open as it is: drop it, then ask again
            await serve_on([spec for spec in specs if spec not in failed])
        return await serve_on(specs)

    def _stop_script_reload(self) -> None:
        """Cancel mitmproxy's watcher of the entry script that loaded these addons."""
        loader = ctx.master.addons.get("scriptloader")
        for script in getattr(loader, "addons", ()):
            namespace = getattr(script, "ns", None)
            if not _loaded_by(self, namespace) or getattr(script, "reloadtask", None) is None:
                continue
            script.reloadtask.cancel()
            script.reloadtask = None
            log.info("crossbar: mitmproxy's reload of %s on change is off; restart crossbar to run new "
                     "code (systemctl reload crossbar or POST /_crossbar/reload re-reads the "
                     "configuration)", script.path)


def _loaded_by(addon: object, namespace: object) -> bool:
    """Whether the script module `namespace` registered `addon`, alone or in a `Bundle`."""
    registered = getattr(namespace, "addons", ())
    return any(a is addon or addon in getattr(a, "parts", ()) for a in registered)
