"""Health: parsing against the real server's recorded replies, the recovery rule, and a poller
that never makes a llama-server router load a model."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from types import MappingProxyType
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from samples_util import SAMPLES, load

from crossbar import hosts as hosts_module
from crossbar.config import HostConf, ModelConf
from crossbar.hosts import (
    MODELS_MAX,
    POLL_ANSWER_MAX,
    Fleet,
    ModelCtx,
    Poller,
    PollResult,
    parse_free_slots,
    parse_models,
    parse_props,
    read_models,
)
from crossbar.request import MODEL_MAX
from llamasim import SimConfig, SimServer

needs_samples = pytest.mark.skipif(not SAMPLES.is_dir(), reason="llama-lab samples not available")


def host_conf(name: str, url: str = "http://127.0.0.1:9", models: dict[str, ModelConf] | None = None,
              ) -> HostConf:
    scheme, rest = url.split("://")
    host, port = rest.rsplit(":", 1)
    return HostConf(name=name, base_url=url, scheme=scheme, host=host, port=int(port), base_path="",
                    models=MappingProxyType(models or {"m": ModelConf()}))


@needs_samples
@pytest.mark.parametrize(("sample", "expected"), [
    ("single/get_v1_models.txt", {"models/tiny-a.gguf": "loaded"}),
    ("router/get_v1_models_nomodel.txt", {"tiny-a": "unloaded", "tiny-b": "unloaded"}),
    ("router/v1_models_after_model0.txt", {"tiny-a": "loaded", "tiny-b": "unloaded"}),
    ("router/v1_models_after_model1.txt", {"tiny-a": "unloaded", "tiny-b": "loaded"}),
    ("router/v1_models_right_after_load_call.txt", {"tiny-a": "unloaded", "tiny-b": "loading"}),
])
def test_parse_models_against_samples(sample: str, expected: dict[str, str]) -> None:
    assert parse_models(load(sample).json()) == expected


@needs_samples
@pytest.mark.parametrize(("sample", "router", "ctx"), [
    ("single/get_props.txt", False, ModelCtx(n_ctx=2048, slots=2)),
    ("router/get_props_nomodel.txt", True, ModelCtx()),
    ("router/get_props_model0.txt", False, ModelCtx(n_ctx=2048, slots=2)),
])
def test_parse_props_against_samples(sample: str, router: bool, ctx: ModelCtx) -> None:
    assert parse_props(load(sample).json()) == (router, ctx)


@needs_samples
@pytest.mark.parametrize(("sample", "free"), [
    ("single/get_slots.txt", 2),
    ("router/get_slots_model0.txt", 2),
    ("router/get_slots_nomodel.txt", None),  # 400 error object: not a slot list
])
def test_parse_free_slots_against_samples(sample: str, free: int | None) -> None:
    assert parse_free_slots(load(sample).json()) == free


@pytest.mark.parametrize("body", [None, [], "x", {"data": "x"}, {"data": [1, {"id": 5}]}])
def test_parse_models_tolerates_garbage(body: object) -> None:
    assert parse_models(body) == {}


def test_a_host_reporting_100k_models_is_not_believed_whole() -> None:
    body = {"data": [{"id": f"model-{i}-" + "x" * 200, "aliases": [f"alias-{i}"]} for i in range(100_000)]}
    models, ignored = read_models(body)
    assert len(models) == MODELS_MAX and ignored == 200_000 - MODELS_MAX
    assert list(models)[:3] == ["model-0-" + "x" * 200, "alias-0", "model-1-" + "x" * 200]


@pytest.mark.parametrize("name", ["m" * (MODEL_MAX + 1), "m" * 1_000_000, "", "a\nb", "a\x1b[2Jb", "\u2028"])
def test_a_reported_model_name_follows_the_client_model_name_rule(name: str) -> None:
    assert read_models({"data": [{"id": name}, {"id": "ok", "aliases": [name, 7]}]}) == ({"ok": "loaded"}, 3)


def test_ignored_model_names_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    fleet = Fleet({"a": host_conf("a")})
    for _ in range(3):
        fleet.apply("a", PollResult(ok=True, loaded=frozenset({"m"}), ignored_models=5))
    assert sum("ignores" in r.getMessage() for r in caplog.records) == 1


def test_parse_props_ignores_bad_figures() -> None:
    assert parse_props({"default_generation_settings": {"n_ctx": "big"}, "total_slots": -1}) == (
        False, ModelCtx())


def test_busy_slots_are_not_free() -> None:
    body = [{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}, {"id": 2}]
    assert parse_free_slots(body) == 2


# ---------------------------------------------------------------- Fleet rules


def fleet_of(**models: dict[str, ModelConf]) -> Fleet:
    return Fleet({name: host_conf(name, models=m) for name, m in models.items()}, clock=lambda: 100.0)


GOOD = PollResult(ok=True, loaded=frozenset({"m"}))
BAD = PollResult(ok=False, error="refused")


@pytest.mark.parametrize(("polls", "healthy"), [
    ([], True),  # optimistic until the first poll
    ([GOOD], True),
    ([BAD], False),
    ([BAD, GOOD], False),  # one good poll is not enough to recover
    ([BAD, GOOD, GOOD], True),
    ([BAD, GOOD, BAD, GOOD], False),  # consecutive
    ([GOOD, BAD, GOOD, GOOD], True),
])
def test_recovery_needs_two_consecutive_good_polls(polls: list[PollResult], healthy: bool) -> None:
    fleet = fleet_of(a={"m": ModelConf()})
    for res in polls:
        fleet.apply("a", res)
    assert fleet.healthy("a") is healthy


def test_passive_mark_then_recovery() -> None:
    fleet = fleet_of(a={"m": ModelConf()})
    fleet.apply("a", GOOD)
    assert fleet.mark_down("a", "connect refused") is True
    assert fleet.mark_down("a", "again") is False  # already down
    fleet.apply("a", GOOD)
    assert not fleet.healthy("a")
    fleet.apply("a", GOOD)
    assert fleet.healthy("a")
    assert fleet.state["a"].last_ok == 100.0


def test_a_poll_that_began_before_a_passive_mark_does_not_count() -> None:
    now = [100.0]
    fleet = Fleet({"a": host_conf("a")}, clock=lambda: now[0])
    fleet.apply("a", GOOD, started=99.0)
    now[0] = 101.0
    fleet.mark_down("a", "connect refused")  # while the next round is in flight
    fleet.apply("a", GOOD, started=100.5)  # began before the mark: it may have seen the host alive
    fleet.apply("a", GOOD, started=102.0)
    assert not fleet.healthy("a")  # one good poll since the mark is not enough
    fleet.apply("a", GOOD, started=103.0)
    assert fleet.healthy("a")


@pytest.mark.parametrize(("conf", "state", "capacity"), [
    (ModelConf(parallel=4), PollResult(ok=True, slots=2), 4),  # config wins
    (ModelConf(), PollResult(ok=True, slots=3), 3),  # learned from a single server's /props
    (ModelConf(), PollResult(ok=True), 1),  # nothing known
    (ModelConf(), PollResult(ok=True, router=True, slots=3, models={"m": ModelCtx(4096, 6)}), 6),
    (ModelConf(), PollResult(ok=True, router=True), 1),  # router: host-level slots mean nothing
])
def test_capacity(conf: ModelConf, state: PollResult, capacity: int) -> None:
    fleet = fleet_of(a={"m": conf})
    fleet.apply("a", state)
    assert fleet.capacity("a", "m") == capacity


def parallel_as_configured(conf: HostConf, model: str) -> int | None:
    """`parallel` by its definition: the model's (None when the host does not list it), for
    model "" the largest the host sets."""
    if not model:
        return conf.max_parallel
    mconf = conf.models.get(model)
    return mconf.parallel if mconf is not None else None


NAMES = ("a", "b", "c")
Hosts = dict[str, dict[str, ModelConf]]  # host → its models' settings
host_lists = st.dictionaries(
    st.sampled_from(NAMES),
    st.dictionaries(st.sampled_from(("m", "n")), st.builds(ModelConf, parallel=st.sampled_from((None, 1, 3))),
                    min_size=1),
    min_size=1)


@settings(max_examples=200, deadline=None)
@given(host_lists, st.lists(st.tuples(host_lists, st.sets(st.sampled_from(NAMES))), max_size=3))
def test_the_settings_the_fleet_reads_follow_reloads_and_sweeps(
        first: Hosts, reloads: list[tuple[Hosts, set[str]]]) -> None:
    """Every host's settings and `parallel` per slot key, kept as reloads retire hosts and sweeps
    forget them (those a request still holds stay), answer as the configuration they come from."""
    fleet = Fleet({name: host_conf(name, models=m) for name, m in first.items()})
    answers_as_configured(fleet)
    for hosts, held in reloads:
        fleet.reconfigure({name: host_conf(name, models=m) for name, m in hosts.items()})
        answers_as_configured(fleet)
        fleet.sweep(lambda name, held=held: name in held)
        answers_as_configured(fleet)


def answers_as_configured(fleet: Fleet) -> None:
    for name in set(NAMES) - set(fleet.conf) - set(fleet.retired):  # never configured, or forgotten
        with pytest.raises(KeyError):
            fleet.conf_of(name)
    for name, conf in [*fleet.retired.items(), *fleet.conf.items()]:
        assert fleet.conf_of(name) is conf
        for model in ("", "m", "n", "other"):
            parallel = parallel_as_configured(conf, model)
            assert fleet.configured_parallel(name, model) == parallel
            assert fleet.capacity(name, model) == (parallel or 1)  # nothing learned: 1


def test_free_slots_prefer_the_hosts_own_report_but_never_exceed_ours() -> None:
    fleet = fleet_of(a={"m": ModelConf(parallel=4)})
    assert fleet.free_slots("a", "m", in_flight=1) == 3  # nothing reported: capacity - in-flight
    fleet.apply("a", PollResult(ok=True, free_slots={"": 1}))
    assert fleet.free_slots("a", "m", in_flight=1) == 1
    fleet.apply("a", PollResult(ok=True, free_slots={"": 4}))
    assert fleet.free_slots("a", "m", in_flight=3) == 1
    assert fleet.free_slots("a", "m", in_flight=9) == 0


def test_loaded_on_router_means_status_loaded() -> None:
    fleet = fleet_of(a={"m": ModelConf(), "n": ModelConf()})
    fleet.apply("a", PollResult(ok=True, router=True, loaded=frozenset({"n"})))
    assert not fleet.loaded("a", "m")
    assert fleet.loaded("a", "n")


def test_slot_ctx_per_model_on_router_host_level_on_single() -> None:
    fleet = fleet_of(r={"m": ModelConf()}, s={"m": ModelConf()}, o={"m": ModelConf(ctx=999)})
    fleet.apply("r", PollResult(ok=True, router=True, models={"m": ModelCtx(8192, 2)}))
    fleet.apply("s", PollResult(ok=True, n_ctx=2048, slots=2))
    fleet.apply("o", PollResult(ok=True, n_ctx=2048, slots=2))
    assert fleet.slot_ctx("r", "m") == 8192
    assert fleet.slot_ctx("s", "m") == 2048
    assert fleet.slot_ctx("o", "m") == 999


# ---------------------------------------------------------------- polling real HTTP


async def test_poller_reads_a_single_server() -> None:
    async with SimServer(SimConfig(models=["m"], n_slots=3, ctx=6144)) as sim:
        fleet = Fleet({"a": host_conf("a", sim.url)})
        poller = Poller(fleet, interval=60, timeout=2)
        try:
            await poller.poll_once()
        finally:
            await poller.stop()
        st = fleet.state["a"]
        assert st.healthy and not st.router
        assert (st.n_ctx, st.slots) == (2048, 3)
        assert st.free_slots == {"": 3}
        assert fleet.capacity("a", "m") == 3


async def test_poller_never_makes_a_router_load_a_model() -> None:
    cfg = SimConfig(models=["tiny-a", "tiny-b"], router=True, models_max=1, n_slots=2, ctx=4096)
    async with SimServer(cfg) as sim:
        models = {"tiny-a": ModelConf(), "tiny-b": ModelConf()}
        fleet = Fleet({"r": host_conf("r", sim.url, models)})
        poller = Poller(fleet, interval=60, timeout=2)
        try:
            for _ in range(3):
                await poller.poll_once()
            assert sim.stats.loads == {} or sum(sim.stats.loads.values()) == 0
            st = fleet.state["r"]
            assert st.router and st.loaded == frozenset() and st.models == {}
            # a client loads tiny-b; the poller then learns its context, and still loads nothing
            async with asyncio.timeout(5):
                await _chat(sim.url, "tiny-b")
            loads_before = dict(sim.stats.loads)
            for _ in range(3):
                await poller.poll_once()
            assert sim.stats.loads == loads_before
            assert st.loaded == frozenset({"tiny-b"})
            assert st.models["tiny-b"] == ModelCtx(n_ctx=2048, slots=2)
            assert fleet.slot_ctx("r", "tiny-b") == 2048 and fleet.slot_ctx("r", "tiny-a") == 0
        finally:
            await poller.stop()


async def test_poller_marks_a_refusing_host_down_and_recovers_after_two_polls() -> None:
    async with SimServer(SimConfig(models=["m"])) as sim:
        fleet = Fleet({"a": host_conf("a", sim.url)})
        poller = Poller(fleet, interval=60, timeout=1)
        try:
            await poller.poll_once()
            sim.set(refuse=True)
            await poller.poll_once()
            assert not fleet.healthy("a") and fleet.state["a"].last_err
            sim.set(refuse=False)
            await poller.poll_once()
            assert not fleet.healthy("a")
            await poller.poll_once()
            assert fleet.healthy("a")
        finally:
            await poller.stop()


async def test_poll_of_a_hung_host_is_bounded_by_the_timeout() -> None:
    async with SimServer(SimConfig(models=["m"])) as sim:
        fleet = Fleet({"a": host_conf("a", sim.url)})
        poller = Poller(fleet, interval=60, timeout=0.3)
        sim.set(hang=True)
        try:
            async with asyncio.timeout(5):
                await poller.poll_once()
            assert not fleet.healthy("a")
            assert "timed out" in fleet.state["a"].last_err
        finally:
            sim.set(hang=False)
            await poller.stop()


async def test_a_poll_answer_over_the_bound_fails_the_poll() -> None:
    huge = b'{"data": [{"id": "reported", "pad": "' + b"x" * POLL_ANSWER_MAX + b'"}]}'

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with suppress(Exception):
            while True:
                line = (await reader.readuntil(b"\r\n\r\n")).split(b" ", 2)[1]
                body = huge if line == b"/v1/models" else b'{"status": "ok"}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    fleet = Fleet({"a": host_conf("a", f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")})
    poller = Poller(fleet, interval=60, timeout=5)
    try:
        await poller.poll_once()
    finally:
        await poller.stop()
        server.close()
    assert not fleet.healthy("a") and not fleet.knows("a", "reported")
    assert fleet.state["a"].last_err == f"/v1/models answered more than {POLL_ANSWER_MAX} bytes"


async def _chat(url: str, model: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.post(
        f"{url}/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "x"}]}
    ) as resp:
        assert resp.status == 200
        await resp.read()


# ---------------------------------------------------------------- a host that lies or dawdles


@asynccontextmanager
async def answering(answers: dict[str, bytes], delay: float = 0.0,
                    late: Callable[[web.BaseRequest], bool] = lambda request: request.path != "/health",
                    ) -> AsyncIterator[str]:
    """A stand-in host answering GET path → body (`/slots?...` by its path alone, unless
    `path?model=X` is listed), `delay` seconds late where `late(request)`."""

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        if late(request):
            await asyncio.sleep(delay)
        model = request.query.get("model")
        body = answers.get(f"{request.path}?model={model}") if model else None
        return web.Response(body=body or answers.get(request.path, b"{}"), content_type="application/json")

    runner = web.ServerRunner(web.Server(handle), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nobody listens there once it is closed


HEALTHY = {"/health": b'{"status": "ok"}', "/props": b'{"total_slots": 2}', "/slots": b"[]"}


def test_model_aliases_of_any_json_type_are_ignored() -> None:
    body = {"data": [{"id": "m", "aliases": [{"x": 1}, ["y"], 3, None, "alias"]}]}
    assert read_models(body) == ({"m": "loaded", "alias": "loaded"}, 4)


@pytest.mark.parametrize("models", [
    json.dumps({"data": [{"id": "m", "aliases": [{"x": 1}]}]}).encode(),
    b'{"data":' + b"[" * 200_000 + b"]" * 200_000 + b"}",  # deeper than the JSON parser goes
], ids=["unhashable alias", "deep nesting"])
async def test_a_lying_host_costs_no_other_host_its_poll(models: bytes) -> None:
    async with answering({**HEALTHY, "/v1/models": models}) as liar:
        fleet = Fleet({"liar": host_conf("liar", liar), "dead": host_conf("dead", closed_port_url())})
        poller = Poller(fleet, interval=60, timeout=5)
        try:
            await poller.poll_once()
        finally:
            await poller.stop()
    assert not fleet.healthy("dead") and fleet.state["dead"].last_err  # its poll was applied
    assert fleet.healthy("liar") and not fleet.knows("liar", "x")
    assert poller.rounds == 1


async def test_an_answer_the_readers_choke_on_fails_that_hosts_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(body: object) -> tuple[dict[str, str], int]:
        raise KeyError("a reader bug")

    monkeypatch.setattr(hosts_module, "read_models", broken)
    async with answering({**HEALTHY, "/v1/models": b'{"data": []}'}) as url:
        fleet = Fleet({"a": host_conf("a", url)})
        poller = Poller(fleet, interval=60, timeout=5)
        try:
            await poller.poll_once()
        finally:
            await poller.stop()
    assert not fleet.healthy("a") and fleet.state["a"].last_err.startswith("unreadable answer (KeyError")


@pytest.mark.parametrize("slow", ["its questions per model", "its /v1/models"])
async def test_one_slow_host_holds_up_no_other_and_its_poll_is_timed(slow: str) -> None:
    names = [f"m{i}" for i in range(10)]  # a router: two questions per loaded model
    router = {**HEALTHY, "/props": b'{"role": "router"}',
              "/v1/models": json.dumps({"data": [{"id": n, "status": {"value": "loaded"}} for n in names]}
                                       ).encode()}
    late = (lambda request: "model" in request.query) if slow == "its questions per model" else (
        lambda request: request.path == "/v1/models")
    async with answering(router, delay=0.6 if slow == "its questions per model" else 3.0, late=late) as url:
        fleet = Fleet({"slow": host_conf("slow", url), "dead": host_conf("dead", closed_port_url())})
        poller = Poller(fleet, interval=60, timeout=1)
        try:
            started = asyncio.get_running_loop().time()
            round_ = asyncio.ensure_future(poller.poll_once())
            while fleet.healthy("dead"):
                assert not round_.done()
                await asyncio.sleep(0.02)
            assert asyncio.get_running_loop().time() - started < 0.9  # before the slow host's poll ended
            async with asyncio.timeout(5):  # 6 s of questions per model, a 3 s /v1/models: both cut short
                await round_
        finally:
            await poller.stop()
    st = fleet.state["slow"]
    if slow == "its questions per model":  # a busy router answers those slowly: still healthy
        assert st.healthy and st.router and st.loaded == frozenset(names)
        assert 0 < len(st.models) < len(names)  # those answered in time; the others unknown this round
    else:
        assert not st.healthy and st.last_err == "timed out"


async def test_a_poll_of_an_address_a_reload_replaced_meanwhile_is_not_applied() -> None:
    old = {**HEALTHY, "/v1/models": b'{"data": [{"id": "old-model"}]}'}
    async with answering(old, delay=0.3) as old_url:
        fleet = Fleet({"a": host_conf("a", old_url)})
        poller = Poller(fleet, interval=60, timeout=5)
        try:
            polling = asyncio.ensure_future(poller.poll_one("a"))
            await asyncio.sleep(0.1)  # the old address is being polled
            fleet.reconfigure({"a": host_conf("a", closed_port_url())})  # a reload moves the host
            await polling
        finally:
            await poller.stop()
    state = fleet.state["a"]
    assert not state.polled and not fleet.knows("a", "old-model")  # nothing learned from the old server


def test_a_router_model_unanswered_this_round_keeps_what_was_learned() -> None:
    fleet = Fleet({"r": host_conf("r", models={"m0": ModelConf(), "m1": ModelConf()})})
    both, m0 = frozenset({"m0", "m1"}), {"m0": ModelCtx(4096, 2)}
    fleet.apply("r", PollResult(ok=True, router=True, loaded=both, free_slots={"m0": 4, "m1": 4},
                                models={"m0": ModelCtx(8192, 4), "m1": ModelCtx(8192, 4)}))
    fleet.apply("r", PollResult(ok=True, router=True, loaded=both, models=m0, free_slots={"m0": 2},
                                unanswered=frozenset({"m1"})))
    assert (fleet.capacity("r", "m0"), fleet.slot_ctx("r", "m0")) == (2, 4096)  # answered: its new figures
    assert (fleet.capacity("r", "m1"), fleet.slot_ctx("r", "m1")) == (4, 8192)  # unanswered: its last ones
    fleet.apply("r", PollResult(ok=True, router=True, loaded=frozenset({"m0"}), models=m0))
    assert fleet.slot_ctx("r", "m1") == 0  # unloaded since: nothing kept
    fleet.apply("r", PollResult(ok=True, router=True, loaded=both, models={"m1": ModelCtx(8192, 4)}))
    fleet.apply("r", PollResult(ok=False, error="down"))
    fleet.apply("r", PollResult(ok=True, router=True, loaded=both, models=m0, unanswered=frozenset({"m1"})))
    assert fleet.slot_ctx("r", "m1") == 0  # a failed poll came between: it may be another process now


async def test_a_new_poll_timeout_closes_the_old_session_only_after_a_router_poll_could_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A router's poll may take twice the poll timeout (its own questions, then those about each
    model): a reload that changes the timeout closes the old client session only after that."""
    poller = Poller(Fleet({"r": host_conf("r")}), interval=60, timeout=2)
    loop = asyncio.get_running_loop()
    closing_in: list[float] = []
    later = loop.call_later

    def noted(delay: float, *args: Any) -> asyncio.TimerHandle:
        closing_in.append(delay)
        return later(delay, *args)

    monkeypatch.setattr(loop, "call_later", noted)
    try:
        poller._client()
        poller.reconfigure(60, 1)
    finally:
        await poller.stop()
    assert closing_in == [2 * 2 + 1]


async def test_a_router_model_whose_question_fails_leaves_the_others_answered() -> None:
    names = ["m0", "m1", "m2"]
    router = {**HEALTHY, "/props": b'{"role": "router"}',
              "/v1/models": json.dumps({"data": [{"id": n, "status": {"value": "loaded"}} for n in names]}
                                       ).encode(),
              "/props?model=m0": b'{"pad": "' + b"x" * POLL_ANSWER_MAX + b'"}',  # over the bound
              "/props?model=m1": b'{"default_generation_settings": {"n_ctx": 8192}, "total_slots": 4}',
              "/props?model=m2": b'{"default_generation_settings": {"n_ctx": 8192}, "total_slots": 4}'}
    async with answering(router) as url:
        fleet = Fleet({"r": host_conf("r", url, {n: ModelConf() for n in names})})
        poller = Poller(fleet, interval=60, timeout=5)
        try:
            await poller.poll_one("r")
        finally:
            await poller.stop()
    st = fleet.state["r"]
    assert st.healthy and set(st.models) == {"m1", "m2"}  # m0 unknown; the ones after it learned
