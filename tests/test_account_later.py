"""A finished request's row and metrics are made together with the others that finished within
`ACCOUNT_EVERY` (one pass over many costs the event loop less than one pass each), while what
placement reads from it is learned at once; nothing that reads rows or metrics ever sees a
finished request missing, and one request that cannot be accounted costs no other its row."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crossbar import app
from crossbar.addons import Runtime, graceful
from crossbar.admin import Admin
from crossbar.app import Router
from crossbar.config import parse_config
from crossbar.exchange import Exchange
from crossbar.lease import Key
from crossbar.placement import Change, LeaseChange
from crossbar.reload import plan_reload
from crossbar.tap import SSETap, Usage

CHAT = "/v1/chat/completions"


def raw(db: Path, *routes: str) -> dict[str, Any]:
    return {
        "listen": "127.0.0.1:7777", "db": str(db),
        "hosts": {"a": {"base_url": "http://127.0.0.1:18081", "models": ["m"]}},
        "routes": {name: {"hosts": ["a"], "default_model": "m"} for name in routes or ("r",)},
    }


@contextlib.contextmanager
def router(tmp_path: Path, *routes: str) -> Iterator[Router]:
    r = Router(parse_config(raw(tmp_path / "crossbar.db", *routes)))
    r.open()
    try:
        yield r
    finally:
        r.store.close()


def finished(r: Router, fp: str = "f", usage: Usage | None = None, route: str = "r") -> Exchange:
    ex = Exchange(r.cfg.routes[route], Key(route, fp, "m"), CHAT, completion=True, host="a", status=200,
                  prompt_bytes=4000, usage=usage)
    r.finish(ex)
    return ex


def rows(r: Router) -> list[Any]:
    r.store.flush()
    return r.store.requests_since(0)


def counted(r: Router) -> float:
    return sum(s.value for family in r.metrics.requests.collect() for s in family.samples
               if s.name.endswith("_total"))


async def test_requests_that_end_together_are_accounted_together_soon_after(tmp_path: Path) -> None:
    with router(tmp_path) as r:
        for i in range(3):
            finished(r, f"f{i}")
        assert counted(r) == 0 and r.store.requests_since(0) == []  # none accounted one by one
        await asyncio.sleep(app.ACCOUNT_EVERY * 3)
        assert counted(r) == 3
        assert sorted(row.fp for row in rows(r)) == ["f0", "f1", "f2"]
        r.account_finished()  # nothing is accounted twice
        assert counted(r) == 3 and len(rows(r)) == 3


def test_without_a_running_loop_a_request_is_accounted_at_once(tmp_path: Path) -> None:
    with router(tmp_path) as r:
        finished(r)
        assert counted(r) == 1 and len(rows(r)) == 1


async def test_a_full_batch_is_accounted_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(app, "ACCOUNT_BATCH", 4)
    with router(tmp_path) as r:
        for i in range(3):
            finished(r, f"f{i}")
        assert counted(r) == 0
        finished(r, "f3")
        assert counted(r) == 4  # no timer needed: the batch is bounded


async def test_placement_learns_from_a_reply_at_once(tmp_path: Path) -> None:
    with router(tmp_path) as r:
        assert r.estimator.ratio("a", "m") is None
        finished(r, usage=Usage(prompt_tokens=1000, completion_tokens=10))
        assert r.estimator.ratio("a", "m") is not None  # before its row is made
        assert counted(r) == 0


async def test_the_time_in_the_row_is_the_time_it_finished(tmp_path: Path) -> None:
    with router(tmp_path) as r:
        ex = Exchange(r.cfg.routes["r"], Key("r", "f", "m"), CHAT, completion=True, host="a", status=200,
                      t0=time.monotonic() - 0.2)
        r.finish(ex)
        await asyncio.sleep(0.3)
        r.account_finished()
        (row,) = rows(r)
        assert 200 <= row.total_ms < 400  # not the 500 ms it would be, counted at accounting time


async def test_one_request_that_cannot_be_accounted_costs_no_other_its_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with router(tmp_path) as r:
        exs = [finished(r, f"f{i}") for i in range(3)]
        real_row = Exchange.row

        def row(ex: Exchange) -> Any:
            if ex is exs[1]:
                raise RuntimeError("boom")
            return real_row(ex)

        monkeypatch.setattr(Exchange, "row", row)
        r.account_finished()
        assert sorted(row.fp for row in rows(r)) == ["f0", "f2"]
        assert "accounting a finished request failed" in caplog.text
        assert all(ex.finished for ex in exs)


async def test_the_admin_api_answers_with_every_finished_request(tmp_path: Path) -> None:
    with router(tmp_path) as r:
        finished(r)
        reply = await Admin(r).handle("GET", "/_crossbar/metrics", {}, b"")
        assert b'crossbar_requests_total{host="a",route="r",status="200"} 1.0' in reply.body


async def test_closing_accounts_what_finished_before_it(tmp_path: Path) -> None:
    r = Router(parse_config(raw(tmp_path / "crossbar.db")))
    r.open()
    finished(r)
    await r.close()
    reopened = Router(parse_config(raw(tmp_path / "crossbar.db")))
    reopened.open()
    try:
        assert len(reopened.store.requests_since(0)) == 1
    finally:
        reopened.store.close()


async def test_a_reload_labels_what_ended_before_it_by_the_old_routes(tmp_path: Path) -> None:
    with router(tmp_path, "r", "s") as r:
        finished(r, route="s")
        new = parse_config(raw(tmp_path / "crossbar.db", "r"))
        r.reconfigure(new, plan_reload(r.cfg, new))
        r.account_finished()
        labels = {s.labels["route"] for family in r.metrics.requests.collect() for s in family.samples}
        assert labels == {"s"}  # under the new config, route "s" would be labelled "other"


def test_a_timer_left_by_a_stopped_loop_does_not_hold_rows_back(tmp_path: Path) -> None:
    with router(tmp_path) as r:
        async def finish_one(fp: str) -> None:
            finished(r, fp)

        asyncio.run(finish_one("f0"))  # its loop stops before the timer fires

        async def finish_and_wait() -> None:
            finished(r, "f1")
            await asyncio.sleep(app.ACCOUNT_EVERY * 3)

        asyncio.run(finish_and_wait())
        assert sorted(row.fp for row in rows(r)) == ["f0", "f1"]


async def test_a_request_ending_while_the_router_closes_is_accounted_at_once(tmp_path: Path) -> None:
    r = Router(parse_config(raw(tmp_path / "crossbar.db")))
    r.open()
    closing = asyncio.create_task(r.close())
    await asyncio.sleep(0)  # close has begun
    finished(r, "late")
    assert counted(r) == 1  # not left behind a timer that may never fire
    await closing
    reopened = Router(parse_config(raw(tmp_path / "crossbar.db")))
    reopened.open()
    try:  # stored, or (once the store had closed) counted as dropped: never lost unseen
        assert len(reopened.store.requests_since(0)) + r.store.dropped == 1
    finally:
        reopened.store.close()


async def test_an_interrupted_pass_leaves_the_rest_for_the_next(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with router(tmp_path) as r:
        exs = [finished(r, f"f{i}") for i in range(3)]
        real_account = Router._account

        def account(self: Router, ex: Exchange) -> None:
            if ex is exs[1]:
                raise asyncio.CancelledError
            real_account(self, ex)

        monkeypatch.setattr(Router, "_account", account)
        with pytest.raises(asyncio.CancelledError):
            r.account_finished()
        monkeypatch.setattr(Router, "_account", real_account)
        r.account_finished()
        assert sorted(row.fp for row in rows(r)) == ["f0", "f2"]


async def test_a_finished_request_waiting_for_its_row_holds_no_stream_buffer(tmp_path: Path) -> None:
    with router(tmp_path) as r:
        ex = Exchange(r.cfg.routes["r"], Key("r", "f", "m"), CHAT, completion=True, host="a", status=200,
                      stream=True, tap=SSETap())
        assert ex.tap is not None
        ex.tap(b"data: " + b"x" * 100_000)  # a cut stream: a partial line buffered
        r.finish(ex)
        assert ex.tap is None and counted(r) == 0


async def test_requests_cut_at_shutdown_get_their_rows_before_any_late_hook_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graceful, "CUT_GRACE_S", 0.0)
    with router(tmp_path) as r:
        ex = Exchange(r.cfg.routes["r"], Key("r", "f", "m"), CHAT, completion=True, host="a")
        r.live.add(ex)
        ex.on_end(lambda: r.live.discard(ex))
        rt = Runtime()
        rt.router = r
        await graceful.GracefulStop(rt)._cut(r)
        ex.err = "a hook that outlived the cut"  # e.g. a pre-flight that returned afterwards
        (row,) = rows(r)
        assert row.err == "cut: crossbar stopped after drain_timeout"


def _stored_last_use(r: Router, key: Key) -> float | None:
    r.store.flush()
    return next((row.last_used for row in r.store.leases() if (row.route, row.fp, row.model) == key), None)


async def test_a_turns_last_use_is_written_with_its_row_not_on_its_own(tmp_path: Path) -> None:
    """Each turn's end wrote its conversation's lease on its own, from the hook that ended it;
    it is written in the accounting pass, with the row."""
    with router(tmp_path) as r:
        key = Key("r", "f", "m")
        r.leases.apply(key, LeaseChange(Change.CREATE, "a"), 100.0)
        assert _stored_last_use(r, key) == 100.0
        ex = Exchange(r.cfg.routes["r"], key, CHAT, completion=True, host="a", status=200)
        r.admit(ex)
        r.finish(ex)
        assert _stored_last_use(r, key) == 100.0  # not yet: with the row
        await asyncio.sleep(app.ACCOUNT_EVERY * 3)
        assert len(rows(r)) == 1
        assert _stored_last_use(r, key) == pytest.approx(time.time(), abs=5)


@pytest.mark.parametrize("loop_running", [True, False])
async def test_a_lease_dropped_before_the_pass_is_not_written_back(tmp_path: Path,
                                                                  loop_running: bool) -> None:
    with router(tmp_path) as r:
        key = Key("r", "f", "m")
        r.leases.apply(key, LeaseChange(Change.CREATE, "a"), 100.0)
        ex = Exchange(r.cfg.routes["r"], key, CHAT, completion=True, host="a", status=200)
        r.admit(ex)
        if loop_running:
            r.finish(ex)
            assert r.release_route("r") == 1  # dropped before its use is written
            r.account_finished()
        else:
            await asyncio.to_thread(r.finish, ex)  # accounted at once, after the ending
            assert _stored_last_use(r, key) == pytest.approx(time.time(), abs=5)
            r.release_route("r")
        assert _stored_last_use(r, key) is None
        assert len(rows(r)) == 1


async def test_the_last_use_of_a_turn_ended_while_closing_is_written(tmp_path: Path) -> None:
    with router(tmp_path) as r:
        key = Key("r", "f", "m")
        r.leases.apply(key, LeaseChange(Change.CREATE, "a"), 100.0)
        ex = Exchange(r.cfg.routes["r"], key, CHAT, completion=True, host="a", status=200)
        r.admit(ex)
        r._closing = True  # as `close` sets it: every request is accounted as it ends
        r.finish(ex)
        assert _stored_last_use(r, key) == pytest.approx(time.time(), abs=5)
