"""The addons reach mitmproxy as one `Bundle`: the same handlers, in the same order, with the same
async and exception behaviour as addons registered one by one."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import pytest
from mitmproxy import hooks
from mitmproxy.addonmanager import AddonManager
from mitmproxy.proxy.layers.http import HttpRequestHook, HttpResponseHook
from mitmproxy.test import taddons, tflow

from crossbar.addons import Bundle, make_addon, make_addons

ROOT = Path(__file__).resolve().parent.parent


class Recorder:
    def __init__(self, name: str, calls: list[str], *, sleep: bool = False, fail: bool = False) -> None:
        self.name, self.calls, self.sleep, self.fail = name, calls, sleep, fail

    async def request(self, flow: object) -> None:
        if self.sleep:
            await asyncio.sleep(0.01)  # the next handler must not start before this ends
        self.calls.append(f"{self.name}.request")
        if self.fail:
            raise RuntimeError("boom")

    def response(self, flow: object) -> None:
        self.calls.append(f"{self.name}.response")


class OnlyDone:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def done(self) -> None:
        self.calls.append("done")


async def test_handlers_run_in_order_each_awaited_before_the_next() -> None:
    calls: list[str] = []
    bundle = Bundle([Recorder("a", calls, sleep=True), Recorder("b", calls)])
    with taddons.context(bundle) as tctx:
        f = tflow.tflow()
        await tctx.master.addons.handle_lifecycle(HttpRequestHook(f))
        await tctx.master.addons.trigger_event(HttpResponseHook(f))
    assert calls == ["a.request", "b.request", "a.response", "b.response"]


class ReturnsAwaitable:
    """A plain function that hands back something to await, which mitmproxy awaits too."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def request(self, flow: object) -> object:
        async def later() -> None:
            await asyncio.sleep(0.01)
            self.calls.append("late.request")

        return later()


async def test_an_awaitable_a_plain_handler_returns_is_awaited_before_the_next() -> None:
    calls: list[str] = []
    bundle = Bundle([ReturnsAwaitable(calls), Recorder("b", calls, sleep=True)])
    with taddons.context(bundle) as tctx:
        await tctx.master.addons.handle_lifecycle(HttpRequestHook(tflow.tflow()))
    assert calls == ["late.request", "b.request"]


async def test_an_exception_ends_the_event_for_later_handlers(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []
    bundle = Bundle([Recorder("a", calls, fail=True), Recorder("b", calls)])
    with taddons.context(bundle) as tctx:
        await tctx.master.addons.handle_lifecycle(HttpRequestHook(tflow.tflow()))
    assert calls == ["a.request"]  # as when each was its own addon under one script
    assert "boom" in caplog.text  # mitmproxy logged it


def test_a_hook_only_one_part_handles_is_that_handler_itself() -> None:
    calls: list[str] = []
    part = OnlyDone(calls)
    bundle = Bundle([part, Recorder("a", calls)])
    assert bundle.done == part.done  # no dispatch cost at all
    assert not hasattr(bundle, "client_connected")  # mitmproxy skips hooks no part handles


def test_the_bundle_offers_every_hook_its_parts_handle_with_matching_sync_or_async() -> None:
    parts = make_addons()
    bundle = Bundle(parts)
    for name in hooks.all_hooks:
        handlers = [getattr(p, name) for p in parts if callable(getattr(p, name, None))]
        if not handlers:
            assert not hasattr(bundle, name), name
            continue
        offered = getattr(bundle, name)
        assert inspect.iscoroutinefunction(offered) == any(map(inspect.iscoroutinefunction, handlers)), name
    # mitmproxy calls `load` and `configure` only synchronously: they must stay plain functions
    assert not inspect.iscoroutinefunction(bundle.load)
    assert not inspect.iscoroutinefunction(bundle.configure)


def test_mitmproxy_sees_one_addon_and_no_children() -> None:
    with taddons.context() as tctx:
        manager: AddonManager = tctx.master.addons
        before = len(manager.chain)
        manager.add(make_addon())
        assert len(manager.chain) == before + 1
        assert manager.get("bundle") is not None
        assert not hasattr(manager.get("bundle"), "addons")  # mitmproxy does not walk into the parts


def test_the_script_mitmdump_loads_registers_one_bundle() -> None:
    with taddons.context() as tctx:
        module = tctx.script(str(ROOT / "addons" / "crossbar.py"))
        assert [type(a) for a in module.addons] == [Bundle]
