"""The admin API (`/_crossbar/…`): answered on the admin listener when there is one, else on the
main listener; never on a route's own listener. Never contacts an upstream."""

from __future__ import annotations

import logging

from mitmproxy import http

from crossbar import admin_access, errors
from crossbar.addons.runtime import ADMIN, LOCAL, MAIN, Runtime
from crossbar.admin import is_admin_path
from crossbar.errors import CrossbarError

log = logging.getLogger("crossbar")


class AdminApi:
    def __init__(self, rt: Runtime):
        self.rt = rt

    async def request(self, flow: http.HTTPFlow) -> None:
        rt = self.rt
        if flow.response is not None or rt.admin is None or rt.cfg is None:
            return
        role, _ = rt.role(flow)
        if not is_admin_path(flow.request.path) and role != ADMIN:
            return
        serves_admin = ADMIN if rt.cfg.admin_listen is not None else MAIN
        if role != serves_admin or not is_admin_path(flow.request.path):
            rt.answer(flow, errors.not_found(f"no such path here: {flow.request.path[:100]!r}"), None)
            return
        try:
            names = await rt.caller_names(flow) if rt.cfg.admin_peers else None
        except CrossbarError as exc:
            rt.answer(flow, exc, None)
            return
        r = flow.request
        try:
            denied = admin_access.refusal(r.method, r.path, r.headers, flow.client_conn.sockname[0], names,
                                          rt.admin_policy)
            if denied is not None:
                rt.answer(flow, denied, None)
                return
            reply = await rt.admin.handle(r.method, r.path, r.headers, r.raw_content or b"")
        except Exception:  # e.g. the database cannot be read: a JSON 500, never a traceback page, and
            # never the request passed on to the placeholder upstream
            log.exception("crossbar: admin request failed")
            rt.answer(flow, errors.internal("the admin API failed; see crossbar's log"), None)
            return
        flow.response = http.Response.make(reply.status, reply.body, reply.headers)
        flow.metadata[LOCAL] = True
