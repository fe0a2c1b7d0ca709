"""Graceful stop. SIGTERM/SIGINT: refuse new connections, answer new requests on open ones with
503, let in-flight streams finish (up to `drain_timeout`), flush the store, exit 0. A second
signal exits at once."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading

from mitmproxy import ctx, http

from crossbar import errors
from crossbar.addons.runtime import Runtime, close_socket
from crossbar.app import Router
from crossbar.decisions import Rejection
from crossbar.reclaim import thaw

log = logging.getLogger("crossbar")
CUT_GRACE_S = 2.0  # how long requests cut at drain_timeout get to end through their own hooks


class GracefulStop:
    def __init__(self, rt: Runtime):
        self.rt = rt

    def request(self, flow: http.HTTPFlow) -> None:
        if self.rt.stopping and flow.response is None:
            self.rt.answer(flow, errors.unavailable("crossbar is shutting down", retry_after=5,
                                                    reason=Rejection.SHUTTING_DOWN), None)

    async def done(self) -> None:
        rt = self.rt
        rt.stopping = True
        router = rt.router
        if router is None:
            return
        _exit_on_next_signal()
        ctx.options.update(mode=[])
        if router.live:
            log.info("crossbar: waiting for %d request(s) to finish", len(router.live))
            if not await router.drain(router.cfg.drain_timeout):
                log.warning("crossbar: %d request(s) still running after drain_timeout; cutting them",
                            len(router.live))
                await self._cut(router)
        if rt.session:
            await rt.session.close()
        rt.reclaimer.cancel()
        thaw()
        await router.close()
        log.info("crossbar: stopped")


    async def _cut(self, router: Router) -> None:
        """Cut what outlived `drain_timeout` the way a leaving client would (queued requests leave
        their queue, streams lose their client), so each ends through its own hooks; whatever is
        still live then ends here. Every one writes its row before the store closes."""
        for gone in list(self.rt.gone.values()):
            gone.set()
        for flow in list(self.rt.current.values()):
            close_socket(flow, flow.client_conn)
        await router.drain(CUT_GRACE_S)
        for ex in list(router.live):
            ex.err = ex.err or "cut: crossbar stopped after drain_timeout"
            router.finish(ex)
        router.account_finished()  # their rows now: a hook still running for one changes nothing


def _exit_on_next_signal() -> None:
    def now() -> None:
        log.warning("crossbar: second signal, exiting without waiting")
        os._exit(1)

    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers belong to the main thread (an in-process test master is not)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, now)
