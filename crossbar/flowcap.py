"""Keep mitmweb's memory bounded: it stores every flow and has no cap of its own. Under mitmdump
there is no `view` addon and this does nothing."""

from __future__ import annotations

from collections.abc import Callable

from mitmproxy import ctx, http
from mitmproxy.addonmanager import Loader
from mitmproxy.addons.view import View


class FlowCap:
    def __init__(self, keep: Callable[[], int]):
        self.keep = keep  # read at every trim: the limit comes from crossbar's config
        self.view: View | None = None  # mitmweb's flow store, found when crossbar is loaded

    def load(self, loader: Loader) -> None:
        # mitmweb has its store before any script loads; here, unlike in `running`, nothing an
        # earlier part does at start-up can keep this from being found
        self.view = ctx.master.addons.get("view")

    def _trim(self, view: View) -> None:
        excess = view.store_count() - self.keep()
        if excess <= 0:
            return
        oldest = [f for f in list(view._store.values())[: excess + 16] if not f.live][:excess]
        if oldest:
            view.remove(oldest)

    def response(self, flow: http.HTTPFlow) -> None:
        if self.view is not None:
            self._trim(self.view)

    def error(self, flow: http.HTTPFlow) -> None:
        if self.view is not None:
            self._trim(self.view)
