"""Host health: what each llama-server can do right now.

`Fleet` holds the state of every configured host (health, loaded models, learned context and
slots, drain) and answers the questions placement asks. `Poller` refreshes it on an asyncio task;
the parsing of each endpoint's reply is plain functions so it can be tested against the recorded
samples. Passive marks come from the addon (a refused connection or a 502/503/504 marks a host
down at once); recovery needs two consecutive good polls.

On a llama-server *router* the poller must never make the router load a model: only models whose
`status.value` is "loaded" are asked about (`/props?model=X`, `/slots?model=X`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp

from crossbar.config import HostConf
from crossbar.request import MODEL_MAX

log = logging.getLogger("crossbar.hosts")

GOOD_POLLS_TO_RECOVER = 2
POLL_ANSWER_MAX = 1024 * 1024  # bytes of one poll answer; a larger one fails the poll
PARSE_OFF_LOOP = 64 * 1024  # a poll answer larger than this is parsed on a worker thread
MODELS_MAX = 256  # model names (ids and aliases) believed from one host; the rest are ignored


@dataclass(frozen=True, slots=True)
class ModelCtx:
    """What `/props` taught us about one model: per-slot context and slot count (0 = unknown)."""

    n_ctx: int = 0
    slots: int = 0


_NO_CTX = ModelCtx()  # a model /props said nothing about (only ever read)


@dataclass(slots=True)
class PollResult:
    ok: bool
    error: str = ""
    router: bool = False
    loaded: frozenset[str] = frozenset()
    n_ctx: int = 0  # host level (single server); 0 on a router or unknown
    slots: int = 0
    models: dict[str, ModelCtx] = field(default_factory=dict)
    free_slots: dict[str, int] = field(default_factory=dict)  # model ("" = the single server) → free
    ignored_models: int = 0  # reported model names not believed (too many, too long, unprintable)
    # a router's loaded models whose own questions went unanswered this round: what was learned
    # about them stands
    unanswered: frozenset[str] = frozenset()


@dataclass(slots=True)
class HostState:
    name: str
    healthy: bool = True  # optimistic until the first poll decides
    polled: bool = False
    draining: bool = False
    router: bool = False
    loaded: frozenset[str] = frozenset()
    n_ctx: int = 0
    slots: int = 0
    models: dict[str, ModelCtx] = field(default_factory=dict)
    free_slots: dict[str, int] = field(default_factory=dict)
    last_ok: float | None = None
    last_err: str = ""
    good_polls: int = 0
    marked_at: float = 0.0  # last passive mark: a poll that started before it proves nothing
    # crossbar's own requests that may have been running when `/slots` was read, per slot key:
    # a slot they held then is free again once they end
    ours_seen: dict[str, int] = field(default_factory=dict)
    ignored_models: int = 0


# ---------------------------------------------------------------- parsing (pure)


def parse_models(body: Any) -> dict[str, str]:
    """`/v1/models` → {model id: status}; an entry without a status (single server) is "loaded"."""
    return read_models(body)[0]


def _model_name(name: Any) -> bool:
    return isinstance(name, str) and 0 < len(name) <= MODEL_MAX and name.isprintable()


def read_models(body: Any) -> tuple[dict[str, str], int]:
    """`/v1/models` → ({model id or alias: status}, names ignored). At most MODELS_MAX names are
    believed, each 1 to MODEL_MAX printable characters (the rule for a client's model name)."""
    out: dict[str, str] = {}
    ignored = 0
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return out, ignored
    for entry in data:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        status = entry.get("status")
        value = status.get("value") if isinstance(status, dict) else None
        aliases = entry.get("aliases")
        for name in [entry["id"], *(aliases if isinstance(aliases, list) else ())]:
            if isinstance(name, str) and name in out:  # (an alias may be any JSON value)
                continue
            if not _model_name(name) or len(out) >= MODELS_MAX:
                ignored += 1
                continue
            out[name] = value if isinstance(value, str) else "loaded"
    return out, ignored


def parse_props(body: Any) -> tuple[bool, ModelCtx]:
    """`/props` → (is_router, per-slot context and slots). A router's own props say nothing."""
    if not isinstance(body, dict):
        return False, ModelCtx()
    if body.get("role") == "router":
        return True, ModelCtx()
    settings = body.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    slots = body.get("total_slots")
    return False, ModelCtx(
        n_ctx=n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else 0,
        slots=slots if isinstance(slots, int) and slots > 0 else 0,
    )


def parse_free_slots(body: Any) -> int | None:
    """`/slots` → number of slots not processing; None when the answer is not a slot list."""
    if not isinstance(body, list):
        return None
    return sum(1 for s in body if isinstance(s, dict) and not s.get("is_processing", False))


# ---------------------------------------------------------------- state


class Fleet:
    """Health state of every host; the `HostView` the lease table asks."""

    def __init__(self, hosts: Mapping[str, HostConf], clock: Callable[[], float] = time.time):
        self.conf = hosts
        self.clock = clock
        self.state = {name: HostState(name) for name in hosts}
        # hosts a reload removed while requests still held them: their settings and state stay
        # until those requests end (`sweep`); placement never sees them (no route lists them)
        self.retired: dict[str, HostConf] = {}
        self._settings_changed()

    def conf_of(self, host: str) -> HostConf:
        """The host's settings: configured, or retired but still serving what it was given."""
        return self._settings[host]

    def _settings_changed(self) -> None:
        """What the questions below read of the settings, kept as reloads and sweeps change them:
        every host's (`conf_of`: configured first, though the two never share a name) and the
        `parallel` each sets per slot key (`configured_parallel`)."""
        self._settings = {**self.retired, **self.conf}
        self._parallel = _parallel_by_slot_key(self._settings)

    def reconfigure(self, hosts: Mapping[str, HostConf]) -> list[str]:
        """Take a reloaded host list. A host that stays keeps what was learned about it, unless
        its address changed (another server: learned afresh); a removed host is retired.
        Returns the staying hosts whose learned state was dropped."""
        for name, conf in self.conf.items():
            if name not in hosts:
                self.retired[name] = conf
        fresh = []
        for name, conf in hosts.items():
            was = self.conf.get(name) or self.retired.pop(name, None)
            if was is not None and _address(was) != _address(conf):
                fresh.append(name)
            if name not in self.state or name in fresh:  # a drain is the operator's: it stays
                was_state = self.state.get(name)
                self.state[name] = HostState(name, draining=was_state is not None and was_state.draining)
        self.conf = hosts
        self._settings_changed()
        return fresh

    def sweep(self, busy: Callable[[str], bool]) -> list[str]:
        """Forget retired hosts that no request holds any more; returns their names."""
        done = [name for name in self.retired if not busy(name)]
        for name in done:
            del self.retired[name]
            self.state.pop(name, None)
        if done:
            self._settings_changed()
        return done

    # -- HostView
    def healthy(self, host: str) -> bool:
        st = self.state.get(host)
        return st is not None and st.healthy

    def draining(self, host: str) -> bool:
        st = self.state.get(host)
        return st is not None and st.draining

    def set_draining(self, host: str, draining: bool) -> None:
        self.state[host].draining = draining

    # -- what placement needs
    def loaded(self, host: str, model: str) -> bool:
        """The model is resident: on a router its status is "loaded"; a single server serves
        whatever its config lists (it ignores the body's model)."""
        st = self.state[host]
        if st.router:
            return model in st.loaded
        return self._settings[host].serves(model)

    def knows(self, host: str, model: str) -> bool:
        """The host's config lists the model, or the host reports it (`/v1/models`)."""
        return self._settings[host].serves(model) or model in self.state[host].loaded

    def slot_key(self, host: str, model: str) -> str:
        """The model under which the host's slots are counted. A llama-server router runs a
        process per model; a single server shares its slots across every model name it is sent,
        so its slots are counted under "" whatever the body names."""
        return model if self.state[host].router else ""

    def capacity(self, host: str, model: str) -> int:
        """Slots crossbar lets run at once: `parallel` from config, else learned, else 1.
        `model` "" is a single server's shared slots (its largest configured `parallel`)."""
        parallel = self._parallel.get((host, model))
        if parallel:
            return parallel
        st = self.state[host]
        learned = st.models.get(model, _NO_CTX).slots if model else 0
        return learned or (0 if st.router else st.slots) or 1

    def configured_parallel(self, host: str, model: str) -> int | None:
        """`parallel` from config (model "": the largest of the host's), None when not set (or the
        host is neither configured nor retired)."""
        return self._parallel.get((host, model))

    def free_slots(self, host: str, model: str, in_flight: int, capacity: int | None = None) -> int:
        """Free slots from the host's own `/slots` when known, never more than our own view.
        A slot the reading saw busy with one of crossbar's own requests that has ended since is
        counted free again. `capacity`: the slot key's, when the caller has it already."""
        st, key = self.state[host], self.slot_key(host, model)
        ours = (self.capacity(host, key) if capacity is None else capacity) - in_flight
        reported = st.free_slots.get(key)
        if reported is None:
            return max(0, ours)
        ended_since = max(0, st.ours_seen.get(key, 0) - in_flight)
        return max(0, min(reported + ended_since, ours))

    def slot_ctx(self, host: str, model: str) -> int:
        """Per-slot context for the model on this host (0 = unknown)."""
        mconf = self._settings[host].models.get(model)
        if mconf is not None and mconf.ctx:
            return mconf.ctx
        st = self.state[host]
        if model in st.models:
            return st.models[model].n_ctx
        return 0 if st.router else st.n_ctx

    # -- updates
    def mark_down(self, host: str, reason: str) -> bool:
        """Passive mark; returns True when this changed the host's health."""
        st = self.state.get(host)
        if st is None:
            return False
        was = st.healthy
        st.healthy = False
        st.good_polls = 0
        st.last_err = reason
        st.marked_at = self.clock()
        if was:
            log.warning("host %s marked unhealthy: %s", host, reason)
        return was

    def apply(self, host: str, res: PollResult, started: float | None = None,
              ours_seen: dict[str, int] | None = None) -> bool:
        """Apply one poll (begun at `started`); returns True when the host's health changed.
        A good poll that began before the host's last passive mark is ignored: it may have seen
        the host just before it failed. `ours_seen`: crossbar's requests per slot key that may
        have been running while the poll looked."""
        st = self.state[host]
        if res.ok and started is not None and started < st.marked_at:
            return False
        was = st.healthy
        if not res.ok:
            st.healthy, st.good_polls, st.last_err = False, 0, res.error
        else:
            st.last_ok = self.clock()
            st.router, st.loaded = res.router, res.loaded
            st.n_ctx, st.slots = res.n_ctx, res.slots
            # a router's model left unanswered keeps what the last poll learned, if that poll was good
            kept = {m: st.models[m] for m in res.unanswered if m in st.models} if st.good_polls else {}
            st.models, st.free_slots = {**kept, **res.models}, res.free_slots
            st.ours_seen = dict(ours_seen or {})
            if res.ignored_models and not st.ignored_models:
                log.warning("host %s reports %d model names crossbar ignores (more than %d, or not 1 to %d "
                            "printable characters)", host, res.ignored_models, MODELS_MAX, MODEL_MAX)
            st.ignored_models = res.ignored_models
            st.good_polls += 1
            if not st.polled or st.good_polls >= GOOD_POLLS_TO_RECOVER:
                st.healthy = True
        st.polled = True
        if was != st.healthy:
            log.warning("host %s is now %s", host, "healthy" if st.healthy else f"unhealthy: {st.last_err}")
        return was != st.healthy


def _address(conf: HostConf) -> tuple[str, str, int, str]:
    return conf.scheme, conf.host, conf.port, conf.base_path


def _parallel_by_slot_key(settings: Mapping[str, HostConf]) -> dict[tuple[str, str], int | None]:
    """(host, slot key) → `parallel` from config: each listed model's, and under "" (a single
    server's shared slots) the largest of the host's."""
    table: dict[tuple[str, str], int | None] = {}
    for name, conf in settings.items():
        table.update(((name, model), mconf.parallel) for model, mconf in conf.models.items())
        table[(name, "")] = conf.max_parallel
    return table


# ---------------------------------------------------------------- polling (I/O)


class PollAnswerTooLarge(Exception):
    pass


async def _get_json(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    """(status, parsed JSON or None); an answer over POLL_ANSWER_MAX bytes raises PollAnswerTooLarge."""
    async with session.get(url) as resp:
        raw = bytearray()
        async for chunk in resp.content.iter_any():
            raw += chunk
            if len(raw) > POLL_ANSWER_MAX:
                path = url.split("/", 3)[-1].split("?", 1)[0]
                raise PollAnswerTooLarge(f"/{path} answered more than {POLL_ANSWER_MAX} bytes")
        return resp.status, await _parse_json(bytes(raw))


async def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if len(raw) <= PARSE_OFF_LOOP else await asyncio.to_thread(json.loads, raw)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
        return None


async def poll_host(session: aiohttp.ClientSession, conf: HostConf, timeout: float) -> PollResult:
    """One health round for one host: `/health`, `/v1/models`, `/props` (and `/slots`) within
    `timeout`, else the poll fails; on a router, the questions about each loaded model within as
    long again, a model whose `/props` is not answered by then (or fails) keeping what the last
    good poll learned about it (`PollResult.unanswered`): a busy router answers slowly, which is
    no reason to mark it down. Never asks about a model a router has not loaded.
    Whatever the host answers, the result is a `PollResult`: an answer crossbar cannot make sense
    of is a failed poll, never an exception."""
    try:
        async with asyncio.timeout(timeout):
            res = await _poll(session, conf.base_url)
        if res.router:
            asked: set[str] = set()
            with contextlib.suppress(TimeoutError):  # a busy router is slow to answer: no failure
                async with asyncio.timeout(timeout):
                    await _poll_router_models(session, conf.base_url, res, asked)
            res.unanswered = res.loaded - asked
        return res
    except (aiohttp.ClientError, TimeoutError, OSError, PollAnswerTooLarge) as exc:
        return PollResult(ok=False, error=_describe(exc))
    except Exception as exc:  # an answer the readers above did not expect: the host is not usable
        log.debug("polling %s failed on its answer", conf.base_url, exc_info=True)  # kept in last_err
        return PollResult(ok=False, error=f"unreadable answer ({type(exc).__name__}: {_describe(exc)})")


async def _poll(session: aiohttp.ClientSession, base: str) -> PollResult:
    status, _ = await _get_json(session, f"{base}/health")
    if status != 200:
        return PollResult(ok=False, error=f"/health answered {status}")
    status, body = await _get_json(session, f"{base}/v1/models")
    if status != 200:
        return PollResult(ok=False, error=f"/v1/models answered {status}")
    statuses, ignored = read_models(body)
    status, body = await _get_json(session, f"{base}/props")
    router, host_ctx = parse_props(body) if status == 200 else (False, ModelCtx())
    res = PollResult(ok=True, router=router, n_ctx=host_ctx.n_ctx, slots=host_ctx.slots,
                     ignored_models=ignored)
    if router:
        res.loaded = frozenset(m for m, s in statuses.items() if s == "loaded")
    else:
        res.loaded = frozenset(statuses)
        status, body = await _get_json(session, f"{base}/slots")
        free = parse_free_slots(body) if status == 200 else None
        if free is not None:
            res.free_slots[""] = free
    return res


async def _poll_router_models(session: aiohttp.ClientSession, base: str, res: PollResult,
                              asked: set[str]) -> None:
    """Each loaded model's context and free slots; `asked` gets each model whose `/props`
    answered. A question that fails (refused, reset, an answer over the bound, an error status)
    leaves that model out and goes on with the next."""
    for model in sorted(res.loaded):
        q = quote(model, safe="")
        try:
            status, body = await _get_json(session, f"{base}/props?model={q}&autoload=false")
            if status != 200:
                continue
            res.models[model] = parse_props(body)[1]
            asked.add(model)
            status, body = await _get_json(session, f"{base}/slots?model={q}&autoload=false")
        except (aiohttp.ClientError, OSError, PollAnswerTooLarge):
            continue
        free = parse_free_slots(body) if status == 200 else None
        if free is not None:
            res.free_slots[model] = free


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]


class Poller:
    """Polls every host each `interval` on an asyncio task; `on_round` runs after each round."""

    def __init__(
        self,
        fleet: Fleet,
        interval: float,
        timeout: float,
        on_result: Callable[[str, PollResult, bool], None] | None = None,
        on_round: Callable[[], None] | None = None,
        usage: Callable[[str], dict[str, tuple[int, int]]] | None = None,
    ):
        self.fleet = fleet
        self.usage = usage  # per host: {slot key: (in flight, granted so far)} of crossbar's own
        self.interval = interval
        self.timeout = timeout
        self.on_result = on_result
        self.on_round = on_round
        self.rounds = 0
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._stale: set[aiohttp.ClientSession] = set()  # sessions of an earlier poll_timeout

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="crossbar-poller")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session:
            await self._session.close()
            self._session = None
        while self._stale:
            await self._stale.pop().close()

    def reconfigure(self, interval: float, timeout: float) -> None:
        """New poll settings from a reload: the interval counts from the next round; a new timeout
        takes a new client session, and the old one is closed once what it runs has timed out."""
        self.interval = interval
        if timeout == self.timeout:
            return
        old, self._session, grace = self._session, None, 2 * self.timeout + 1  # a router's poll: 2 x
        self.timeout = timeout
        if old is not None:
            self._stale.add(old)
            asyncio.get_running_loop().call_later(grace, lambda: self._close_stale(old))

    def _close_stale(self, session: aiohttp.ClientSession) -> None:
        if session in self._stale:
            self._stale.discard(session)
            asyncio.get_running_loop().create_task(session.close())

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                connector=aiohttp.TCPConnector(limit_per_host=2, force_close=False),
            )
        return self._session

    async def poll_once(self) -> None:
        """Poll every host at once; each host's result is applied as soon as it is in, so that a
        slow host holds up none of the others (and no host takes longer than `timeout`)."""
        names: Sequence[str] = list(self.fleet.conf)
        await asyncio.gather(*(self.poll_one(name) for name in names))
        self.rounds += 1
        if self.on_round:
            self.on_round()

    async def poll_one(self, name: str) -> None:
        """Poll one host now: in a round, or outside the rounds (a host woken up, or added by a
        reload). Never raises: one host's poll cannot cost the others theirs."""
        try:
            conf, session, state = self.fleet.conf[name], self._client(), self.fleet.state.get(name)
            started = self.fleet.clock()
            before = self._usage(name)
            result = await poll_host(session, conf, self.timeout)
            if self.fleet.state.get(name) is state:  # else a reload gave it another address meanwhile
                self._apply(name, result, started, before)
        except Exception:  # a crossbar bug: logged, and the next round tries again
            log.warning("crossbar: applying the poll of %s failed", name, exc_info=True)

    def _usage(self, name: str) -> dict[str, tuple[int, int]]:
        return self.usage(name) if self.usage else {}

    def _apply(self, name: str, res: PollResult, started: float, before: dict[str, tuple[int, int]]) -> None:
        """`before`: crossbar's usage when the poll began. Every request that was running then or
        was granted a slot since may have been seen busy by the reading."""
        if name not in self.fleet.conf:
            return  # a reload removed the host while it was being polled
        after = self._usage(name)
        seen = {key: busy + after.get(key, (0, granted))[1] - granted
                for key, (busy, granted) in before.items()}
        for key, (_, granted) in after.items():
            seen.setdefault(key, granted)  # a slot key first used during the poll
        changed = self.fleet.apply(name, res, started, seen)
        if self.on_result:
            self.on_result(name, res, changed)

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # a poll bug must not kill health tracking (nor, logged as an error
                # during start-up, make mitmproxy exit)
                log.warning("health poll round failed", exc_info=True)
            await asyncio.sleep(self.interval)
