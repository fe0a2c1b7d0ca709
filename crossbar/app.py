"""The running router: config, host health, leases, slots, store and metrics.

`Router` owns every piece of live state. Where a request goes is decided by the pure
`crossbar.placement` (`stay` for a turn that stays on its lease host, read from that host alone;
`place` for everything else); the router gathers their inputs (a fleet snapshot, the lease
table's view), wakes sleeping hosts when placement asks and places again, takes the slot, and
only then applies the lease change. The mitmproxy addons (`crossbar.addons`) call into it from their hooks.
Nothing here blocks the event loop: the store is written by its own thread, the poller is an
asyncio task.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial

from crossbar import errors
from crossbar.choose import Candidate
from crossbar.config import Config, HostConf, RouteConf
from crossbar.deadlines import Deadlines
from crossbar.decisions import Decision, Reason, Rejection
from crossbar.exchange import Exchange
from crossbar.fleetwide import CLAIMED_MOVES, FLEET_SLOT_WAIT, Fleetwide
from crossbar.guard import TokenEstimator, fits, overflow
from crossbar.hosts import Fleet, Poller, PollResult
from crossbar.learn import BusyMeter, RateLearner
from crossbar.lease import Key, LeaseEvent, LeaseTable
from crossbar.limiter import ClientGone, HostDown, Limiter, QueueFull, Ticket, unless_gone
from crossbar.metrics import CounterCollector, LiveCollector, Metrics, SlotRow
from crossbar.placement import Ask, Change, Home, Placement, Refusal, Snapshot, place, stay
from crossbar.reload import Change as ConfigChange
from crossbar.reload import stranded
from crossbar.request import match_route
from crossbar.store import Store
from crossbar.tap import Usage
from crossbar.wake import Waker
from crossbar.yieldpolicy import HostLoad

log = logging.getLogger("crossbar")

OTHER = "other"  # metrics label of a model no host's config lists
# Finished requests are accounted (row, metrics) together, at most this long after they end and
# at most this many at a time: one pass over many requests costs the event loop less than one
# pass each. What placement reads (learned token and generation rates) is learned at once.
ACCOUNT_EVERY = 0.05
ACCOUNT_BATCH = 1000


class Yielded(Exception):
    """A queued request was taken out of its host's queue to go where it will be served sooner."""

    def __init__(self, placement: Placement) -> None:
        super().__init__(f"yields to {placement.host}")
        self.placement = placement


class Router:
    def __init__(self, cfg: Config, store: Store | None = None):
        self.cfg = cfg
        self.store = store or Store(cfg.db)
        self.fleet = Fleet(cfg.hosts)
        self.limiter = Limiter(cfg.queue_max, self.fleet.capacity)
        self.leases = LeaseTable(self.store, cfg.lease_idle)
        self.metrics = Metrics()
        self.leases.subscribe(self._record_event)
        self.leases.subscribe(self.metrics.lease_event)
        self.metrics.add_live(
            LiveCollector(self._health_rows, self._slot_rows, lambda: self.store.errors, self.leases.count)
        )
        self.poller = Poller(self.fleet, cfg.poll_interval, cfg.poll_timeout, self._on_poll,
                             self._on_poll_round, self.limiter.usage)
        self.estimator = TokenEstimator()
        self.learner = RateLearner(time.monotonic)  # rates and reply lengths, from replies' timings
        self.deadlines = Deadlines()  # the requests' first-byte deadlines
        self.meter = BusyMeter(time.monotonic)  # how busy each host has been lately
        # (host, slot key) → the requests running there upstream, and when each was sent
        self._upstream: dict[tuple[str, str], dict[Exchange, float]] = {}
        # (host, slot key) → the requests waiting in its queue, in queue order, with their tickets
        self._waiting: dict[tuple[str, str], dict[Exchange, Ticket]] = {}
        self._rebalance_due = False
        self.waker = Waker(cfg.hosts, self.fleet.healthy, self.poller.poll_one)
        self.live: set[Exchange] = set()  # admitted and not ended: what a graceful stop waits for
        self._housekeeping: asyncio.Task[None] | None = None
        self._configured_models = frozenset(m for conf in cfg.hosts.values() for m in conf.models)
        self._reloaded = False  # a configuration was reloaded since start
        self.fleetwide: Fleetwide | None = None  # set by open() when the database is PostgreSQL
        self.metrics.add_live(CounterCollector(self._store_figures))
        self._unaccounted: list[Exchange] = []  # finished, row and metrics not yet made
        self._account_timer: asyncio.TimerHandle | None = None
        self._account_loop: asyncio.AbstractEventLoop | None = None  # where that timer runs
        self._closing = False  # set by close(): from then on every request is accounted as it ends

    # ------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Synchronous start-up: open the database and load the lease table back."""
        self.store.open()
        self.leases.load(self.store.load_leases())
        for name, route in self.cfg.routes.items():
            if route.pin and self.leases.pinned(name) != route.pin:
                self.leases.pin(name, route.pin, route.hosts, time.time())
        self.store.start()
        if self.store.postgres:
            self._open_fleetwide()
        log.info("crossbar: %d leases loaded from %s", self.leases.count(), self.store.label)

    def _open_fleetwide(self) -> None:
        """Instances sharing the database share leases, pins, drains and slots."""
        fw = self.fleetwide = Fleetwide(self.store, self.leases, self.fleet, self._placeable)
        fw.load_drains()
        self.leases.subscribe(fw.lease_event)

    def _placeable(self, route: str, host: str) -> bool:
        """The configuration lets `route`'s conversations run on `host`."""
        conf = match_route(route, self.cfg.routes)
        return conf is not None and host in conf.hosts

    def start_background(self) -> None:
        self.poller.start()
        if self.fleetwide is not None:
            self.fleetwide.start()
        self._housekeeping = asyncio.get_running_loop().create_task(self._roll_up(), name="crossbar-rollup")

    async def _roll_up(self) -> None:
        """Rows older than `retention` go into `requests_daily`, on the store's writer thread."""
        while True:
            self.store.schedule_rollup(time.time() - self.cfg.retention)
            await asyncio.sleep(min(3600.0, max(1.0, self.cfg.retention / 10)))

    async def drain(self, timeout: float) -> bool:
        """Wait until every admitted request has ended (or `timeout`); True when none is left."""
        deadline = time.monotonic() + timeout
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.live

    async def close(self) -> None:
        self._closing = True
        self.account_finished()
        if self._housekeeping:
            self._housekeeping.cancel()
        if self.fleetwide is not None:
            self.fleetwide.stop()
        await self.poller.stop()
        await asyncio.to_thread(self.store.close)

    # ------------------------------------------------------------ reload

    def reconfigure(self, new: Config, change: ConfigChange) -> int:
        """Take a reloaded configuration while requests run. Requests in flight or queued keep
        their host (a removed host's settings stay until they end); leases whose host the new
        configuration takes away are dropped (placed anew at their next turn); what was learned
        about the hosts that stay is kept. Returns how many leases were dropped."""
        self.account_finished()  # labels of the old configuration for the requests that ended under it
        now = time.time()
        old, self.cfg, self._reloaded = self.cfg, new, True
        for name in (*change.hosts_removed, *self.fleet.reconfigure(new.hosts)):
            self.estimator.forget(name)
            self.learner.forget(name)
        if self.fleetwide is not None:
            self.fleetwide.apply_drains(set(new.hosts) - set(old.hosts))
        self.waker.hosts = new.hosts
        self.limiter.set_queue_max(new.queue_max)
        self.leases.idle = new.lease_idle
        self.poller.reconfigure(new.poll_interval, new.poll_timeout)
        self._configured_models = frozenset(m for conf in new.hosts.values() for m in conf.models)
        self._repin(old, new, now)
        dropped = self._drop_stranded(new, now)
        for ex in self.live:
            ex.route = _route_now(ex.route, ex.key.route, new)
        self.limiter.refresh()  # a raised `parallel` admits waiters at once
        self._sweep_retired()
        return dropped

    async def poll_hosts(self, names: Iterable[str]) -> None:
        """Poll these hosts now (added or changed by a reload) rather than at the next round."""
        await asyncio.gather(*(self.poller.poll_one(name) for name in names if name in self.fleet.conf))

    def host_conf(self, host: str) -> HostConf:
        """The settings a request's host has: configured, or removed by a reload while the
        request held it."""
        return self.fleet.conf_of(host)

    def _repin(self, old: Config, new: Config, now: float) -> None:
        """A `pin` the reload changed is applied; a pin (from the config or the admin API) on a
        host its route no longer lists, or of a route that is gone, is cleared."""
        for name in dict.fromkeys([*old.routes, *new.routes]):
            route, was = new.routes.get(name), old.routes.get(name)
            want, had = (route.pin if route else ""), (was.pin if was else "")
            if want != had and route is not None and want:
                self.leases.pin(name, want, route.hosts, now)
            elif want != had:
                self.leases.unpin(name, now)
        for name, host in self.leases.pins().items():
            route = match_route(name, new.routes)
            if route is None or host not in route.hosts:
                self.leases.unpin(name, now)

    def _drop_stranded(self, new: Config, now: float) -> int:
        leases = self.leases.snapshot()
        lost = stranded(((lease.key.route, lease.host) for lease in leases), new, match_route)
        for i, reason in lost:
            self.leases.drop(leases[i].key, reason, now)
        if lost:
            log.warning("crossbar: reload dropped %d lease(s) whose host left their route or the "
                        "configuration; their next turns are placed anew", len(lost))
        return len(lost)

    def _sweep_retired(self) -> None:
        """Forget removed hosts once no request holds them any more."""
        if not self.fleet.retired:
            return
        held = {ex.host for ex in self.live}
        for name in self.fleet.sweep(lambda h: h in held or self.limiter.host_totals(h) != (0, 0)):
            self.limiter.forget(name)
            self.estimator.forget(name)  # what its last requests taught
            self.learner.forget(name)
            self.meter.forget(name)

    # ------------------------------------------------------------ a request's life

    def admit(self, ex: Exchange) -> None:
        """The exchange is live until it ends; its conversation is in use meanwhile. A route
        resolved before a reload that came meanwhile is resolved again."""
        if self._reloaded and ex.route is not self.cfg.routes.get(ex.route.name):
            ex.route = _route_now(ex.route, ex.key.route, self.cfg)
        self.live.add(ex)
        ex.on_end(partial(self.live.discard, ex))
        if ex.completion:
            self.leases.hold(ex.key)
            ex.on_end(partial(self._unhold, ex))

    def _unhold(self, ex: Exchange) -> None:
        """The request ended: its conversation's last use is now. That use is written with the
        request's row (`_account`, which `finish` asks for after the ending), in the pass over
        every request that ended meanwhile, rather than on its own."""
        self.leases.unhold(ex.key, time.time(), save=False)

    def estimate(self, ex: Exchange, host: str = "") -> int:
        """Estimated prompt tokens of a completion (0 for reads): on `host`, from what its replies
        taught about the model; without a host, the plain byte estimate."""
        if not ex.completion:
            return 0
        if host:
            return self.estimator.estimate(host, ex.model, ex.prompt_bytes)
        return self.estimator.plain(ex.prompt_bytes)

    def snapshot(self, route: RouteConf, model: str, tokens: Callable[[str], int] | None = None,
                 conversation: Key | None = None, ahead: Mapping[str, int] | None = None) -> Snapshot:
        """The fleet for this model, read lazily: only the hosts placement asks about are read.
        `tokens` gives the prompt estimate per host (else the request's own); with
        `conversation`, each host's load as that conversation's turn sees it (lease yield);
        `ahead`: per host where the turn already waits, the requests queued ahead of it."""
        fleet = self.fleet

        def candidate(name: str) -> Candidate:
            st, conf, key = fleet.state[name], fleet.conf_of(name), fleet.slot_key(name, model)
            running, slots = self.limiter.in_flight(name, key), fleet.capacity(name, key)
            return Candidate(
                name=name,
                healthy=st.healthy,
                draining=st.draining,
                loaded=bool(model) and fleet.loaded(name, model),
                listed=conf.serves(model),
                free_slots=fleet.free_slots(name, model, running, slots),
                weight=conf.weight,
                queued=self.limiter.queued(name, key),
                order=route.hosts.index(name),
                slots=slots,
                in_flight=running,
                active_leases=self.leases.active_on(name),
                recent_busy=self.meter.busy(name),
            )

        def ctx(name: str) -> int:
            return fleet.slot_ctx(name, model) if model else 0

        known = not model or any(fleet.knows(name, model) for name in route.hosts)
        per_host = Lazy(route.hosts, tokens) if tokens is not None else None
        loads = None
        if conversation is not None:
            ahead = ahead or {}
            loads = Lazy(route.hosts, lambda name: self.host_load(name, model, conversation, ahead.get(name)))
        return Snapshot(Lazy(route.hosts, candidate), Lazy(route.hosts, ctx), known, per_host, loads)

    def host_load(self, host: str, model: str, conversation: Key, ahead: int | None = None) -> HostLoad:
        """What `host` holds for `model` (running upstream, queued here: all of it, or the `ahead`
        requests before a turn waiting there) with its learned rates, as a turn of
        `conversation` sees it now."""
        key = self.fleet.slot_key(host, model)
        now = time.monotonic()
        running = [(now - sent, ex.key) for ex, sent in self._upstream.get((host, key), {}).items()]
        queued = self.queued(host, model) if ahead is None else ahead
        return self.learner.host_load(host, model, self.fleet.capacity(host, key), running, queued,
                                      conversation)

    def yield_factor(self, route: RouteConf) -> float:
        """The route's own factor, else the top-level one (0: its turns never yield)."""
        return self.cfg.yield_factor if route.yield_factor is None else route.yield_factor

    def _ask(self, ex: Exchange, why: Reason) -> Ask:
        return Ask(route=ex.key.route, model=ex.model, hosts=ex.route.hosts, fp=ex.key.fp,
                   read=not ex.completion, tokens=self.estimate(ex), excluded=frozenset(ex.excluded),
                   why=why, yield_factor=self.yield_factor(ex.route) if ex.completion else 0.0)

    def _place_once(self, ex: Exchange, why: Reason, ahead: Mapping[str, int] | None = None,
                    ) -> Placement | Refusal:
        """Placement with each host's learned prompt estimate; a learned estimate alone never
        refuses a prompt that the plain byte estimate lets fit, so a context refusal is checked
        once more with the plain estimate."""
        view = self.leases.view(ex.key, read=not ex.completion, own=ex.completion)
        ask, now = self._ask(ex, why), time.time()
        learned = self.snapshot(ex.route, ex.model, lambda host: self.estimate(ex, host),
                                ex.key if ex.completion else None, ahead)
        result = place(ask, learned, view, now, self.cfg.lease_idle)
        if isinstance(result, Refusal) and result.reason == Rejection.CONTEXT:
            plain = place(ask, self.snapshot(ex.route, ex.model), view, now, self.cfg.lease_idle)
            if not isinstance(plain, Refusal) or plain.reason != Rejection.CONTEXT:
                return plain
        return result

    async def place(self, ex: Exchange, why: Reason = Reason.UNHEALTHY,
                    gone: asyncio.Event | None = None, claim_moves: bool = True) -> Placement:
        """Run placement; when it names hosts worth waking, wake them and run it again. A refusal
        is raised as the client's answer; `ClientGone` when the client leaves during a wake. With
        `claim_moves` False a move is claimed by the caller, once it happens (`_take_then_settle`,
        `follow`)."""
        if self.fleetwide is not None and ex.completion:
            await self.fleetwide.adopt_shared(ex.key)
        result = self._place_once(ex, why)
        woke: list[str] = []
        if isinstance(result, Refusal) and result.wake:
            woke = await self._wake(ex, list(result.wake), gone)
            if woke:
                result = self._place_once(ex, why)
        if isinstance(result, Refusal):
            raise self._refused(ex, result, woke)
        result = await self._claimed(ex, result, why, claim_moves)
        if result.loads_model:
            log.warning("no host has %r loaded; placing it on %s, which will load it", ex.model, result.host)
        return result

    async def _wake(self, ex: Exchange, names: list[str], gone: asyncio.Event | None) -> list[str]:
        """`Waker.wake`, left when the client leaves (the wake goes on for the other requests)."""
        try:
            return await unless_gone(self.waker.wake(names), gone)
        except ClientGone:
            ex.err = "client left while a host woke"
            raise

    async def _claimed(self, ex: Exchange, placed: Placement, why: Reason, moves: bool) -> Placement:
        """A conversation placed anew (or, with `moves`, moved off its host) is claimed in the
        shared lease table; when another instance placed or moved it first, placement runs again
        with that instance's lease."""
        if self.fleetwide is None or not ex.completion:
            return placed
        if placed.change.kind in (Change.CREATE, Change.RENEW):
            won = await self.fleetwide.claim(ex.key, placed.host) == placed.host
        elif moves:
            won = await self._move_stands(ex, placed)
        else:
            return placed
        if won:
            return placed
        again = self._place_once(ex, why)
        return placed if isinstance(again, Refusal) else again

    async def _move_stands(self, ex: Exchange, placed: Placement) -> bool:
        """A move other instances hear of (off a failed host, or one the prompt outgrew) is claimed
        in the shared lease table: False when another instance moved the conversation first (its
        host is adopted here)."""
        change = placed.change
        if (self.fleetwide is None or not ex.completion or change.kind != Change.MOVE
                or change.reason not in CLAIMED_MOVES or not change.from_host):
            return True
        return await self.fleetwide.claim_move(ex.key, change.from_host, placed.host) == placed.host

    def _refused(self, ex: Exchange, refusal: Refusal, woke: list[str]) -> errors.CrossbarError:
        match refusal.reason:
            case Rejection.MISSING_MODEL | Rejection.UNKNOWN_MODEL:
                return errors.bad_request(refusal.message, refusal.reason)
            case Rejection.CONTEXT:
                tokens = max(self.estimate(ex, host) for host in ex.route.hosts)  # the best-informed
                err = overflow(tokens, refusal.n_ctx)
                err.reason = Rejection.CONTEXT
                return err
            case Rejection.PINNED_DOWN:
                return errors.unavailable(refusal.message, self._poll_wait(), Rejection.PINNED_DOWN)
        return errors.no_healthy_host(woke, self._poll_wait())

    async def lease(self, ex: Exchange, gone: asyncio.Event | None) -> None:
        """Place the request, apply its lease change and take a slot on its host. A host that goes
        down while the request waits, or is found unusable once the slot is granted, sends the
        request on (the lease moves only once the new host's slot is held)."""
        placed = self._stays(ex)
        self._settle(ex, placed if placed is not None else await self.place(ex, gone=gone))
        await self._slot_until_usable(ex, gone)

    def _stays(self, ex: Exchange) -> Placement | None:
        """A turn that stays on its lease host, read from that host alone (`placement.stay`);
        None: `place` decides. With several instances too: only a conversation without a lease
        in memory looks for one in the shared table, and this needs one in memory."""
        if not ex.completion:
            return None
        view = self.leases.view(ex.key, own=True)
        fleet, host, model = self.fleet, view.host, ex.model
        st = fleet.state.get(host)
        if st is None or not model:
            return None
        key, tokens = fleet.slot_key(host, model), self.estimator.estimate(host, model, ex.prompt_bytes)
        home = Home(known=fleet.knows(host, model), healthy=st.healthy,
                    fits=fits(tokens, fleet.slot_ctx(host, model)),
                    free=fleet.free_slots(host, model, self.limiter.in_flight(host, key)) > 0)
        # the request's `Ask` without its plain prompt estimate, which `stay` never reads (`Home` says
        # whether the prompt fits, by the host's own estimate)
        ask = Ask(route=ex.key.route, model=model, hosts=ex.route.hosts, fp=ex.key.fp,
                  excluded=frozenset(ex.excluded), yield_factor=self.yield_factor(ex.route))
        return stay(ask, view, home, time.time(), self.cfg.lease_idle)

    def _settle(self, ex: Exchange, placed: Placement, lease: bool = True) -> None:
        """The request runs where it was placed; the lease change applies (unless `lease` is False:
        another instance's move of the conversation won)."""
        if lease and (not self._reloaded or self._candidate(ex, placed.host)):
            self.leases.apply(ex.key, placed.change, time.time())
        ex.host, ex.decision = placed.host, placed.decision
        if placed.decision == Decision.CONTEXT:
            self._context_moved(ex, placed)

    def _context_moved(self, ex: Exchange, placed: Placement) -> None:
        was = placed.change.from_host
        log.warning("prompt of ~%d tokens does not fit %s; moved %s/%s to %s", self.estimate(ex), was,
                    ex.key.route, ex.model, placed.host)
        ex.ctx_moved = f"moved:{was}>{placed.host}"

    def usable(self, ex: Exchange) -> bool:
        return self.fleet.healthy(ex.host) and ex.host not in ex.excluded

    async def _slot_until_usable(self, ex: Exchange, gone: asyncio.Event | None) -> None:
        placed: Placement | None = None
        yielding = False  # `placed` is where a queued turn yields to
        for _ in range(len(ex.route.hosts) + 3):  # + 2: a queued turn may yield once, and come back
            try:
                if placed is None:
                    await self.take_slot(ex, gone)
                else:
                    await self._take_then_settle(ex, placed, gone)
            except HostDown as went:
                down = went.host or ex.host
            except Yielded as moved:
                placed, yielding = moved.placement, True
                continue
            except errors.CrossbarError as exc:
                if not yielding or exc.reason != Rejection.QUEUE_FULL:
                    raise
                # the host it yielded to filled its queue before the turn got there: it waits at
                # home again (it yields at most once), where its lease still is
                log.info("%s/%s could not yield to %s (its queue filled); it waits on %s again",
                         ex.key.route, ex.model, placed.host if placed else "", ex.host)
                placed, yielding = None, False
                if ex.err == "queue full":  # what the refusal wrote: it waits instead
                    ex.err = None
                continue
            else:
                if self.usable(ex):
                    return
                ex.drop_slot()
                down = ex.host
            _placing_again(ex, down)
            placed, yielding = await self.place(ex, gone=gone, claim_moves=False), False
        raise errors.no_healthy_host([], self._poll_wait())

    async def take_slot(self, ex: Exchange, gone: asyncio.Event | None) -> None:
        """Wait (bounded FIFO) for a slot on the request's host; 503 + Retry-After when the queue
        is full; `HostDown` when the host is marked down meanwhile."""
        if not ex.completion:
            return
        key = self.fleet.slot_key(ex.host, ex.model)
        ticket = Ticket(ex.host, key, held=ex.route.queue)
        if self.fleetwide is None and (gone is None or not gone.is_set()) and self.limiter.take(ticket):
            # granted without a wait, and nothing ran meanwhile: no rebalance pass can have seen it
            # queued, so it is not entered in `_waiting` (its wait counts 0 ms)
            ex.hold_slot(ticket, self._release)
        else:
            await self._wait_for_slot(ex, key, ticket, gone)
        self.metrics.queue_wait.observe((ex.host, self.model_label(ex.model)), ticket.queued_s)

    async def _wait_for_slot(self, ex: Exchange, key: str, ticket: Ticket,
                             gone: asyncio.Event | None) -> None:
        """`take_slot` where the slot may need a wait: a queue (where a rebalance pass finds the
        request, to yield it elsewhere), or a slot across the instances sharing the database."""
        where = (ex.host, key)
        self._waiting.setdefault(where, {})[ex] = ticket
        waiting_since = time.monotonic()
        try:
            ticket = await self.limiter.acquire(ex.host, key, gone, hold=ex.route.queue, ticket=ticket)
            release = await self._fleet_slot(ex, ticket, key, gone)
        except QueueFull as exc:
            ex.err = "queue full"
            raise errors.unavailable(
                f"every slot for {ex.model!r} on {ex.host} is busy and its queue is full",
                retry_after=exc.retry_after, reason=Rejection.QUEUE_FULL,
            ) from exc
        except ClientGone:
            ex.err = "client left while queued"
            raise
        finally:  # the wait counts however it ended (granted, yielded, client gone, host down)
            self._stop_waiting(where, ex)
            ex.queued_ms += int((time.monotonic() - waiting_since) * 1000)
        ex.hold_slot(ticket, release)

    async def _fleet_slot(self, ex: Exchange, ticket: Ticket, key: str,
                          gone: asyncio.Event | None) -> Callable[[Ticket], None]:
        """With instances sharing the database, the local slot is not enough where the config sets
        `parallel`: one of those slots across every instance is taken too, and given back with the
        local one. (A learned slot count is the server's own queueing: held per instance, at no
        database round trip.) The local ticket is given back at once when none can be had
        (`QueueFull`, `ClientGone`)."""
        fw = self.fleetwide
        if fw is None:
            return self._release
        parallel = self.fleet.configured_parallel(ex.host, key)
        if not parallel:
            return self._release
        wait = FLEET_SLOT_WAIT if ex.route.queue else 0.0
        try:  # its wait counts in `queued_ms` with the local one (see `_wait_for_slot`)
            token = await fw.fleet_slot(ex.host, key, parallel, wait, gone)
        except BaseException:
            self._release(ticket)
            raise
        if token is None:
            self._release(ticket)
            raise QueueFull(self.limiter.retry_after(ex.host, key))

        def release(held: Ticket) -> None:
            self._release(held)
            fw.release(token)

        return release

    def _stop_waiting(self, where: tuple[str, str], ex: Exchange) -> None:
        waiting = self._waiting.get(where)
        if waiting is not None:
            waiting.pop(ex, None)
            if not waiting:
                del self._waiting[where]

    def _release(self, ticket: Ticket) -> None:
        """Give a slot back; with requests queued somewhere, each may now yield (soon, once)."""
        self.limiter.release(ticket)
        if self._waiting and not self._rebalance_due:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._rebalance_due = True
            loop.call_soon(self._rebalance)

    def _rebalance(self) -> None:
        """A slot freed: a queued turn that has not yielded yet leaves its queue when placement
        (with the requests ahead of it) now says it yields; it then takes its slot elsewhere."""
        self._rebalance_due = False
        targets: set[str] = set()  # one move to a host per pass: the snapshot does not see it yet
        for (host, _), waiting in list(self._waiting.items()):
            for ahead, (ex, ticket) in enumerate(list(waiting.items())):
                placed = self._yield_placement(ex, host, ahead)
                if placed is None or placed.host in targets:
                    continue
                if not self.limiter.withdraw(ticket, Yielded(placed)):
                    continue
                ex.yielded = True
                targets.add(placed.host)
                log.info("%s/%s queued on %s yields to %s", ex.key.route, ex.model, host, placed.host)

    def _yield_placement(self, ex: Exchange, host: str, ahead: int) -> Placement | None:
        if ex.yielded or ex.decision == Decision.YIELD or ex.excluded or self.yield_factor(ex.route) <= 0:
            return None
        result = self._place_once(ex, Reason.UNHEALTHY, {host: ahead})
        return result if isinstance(result, Placement) and result.decision == Decision.YIELD else None

    async def _take_then_settle(self, ex: Exchange, placed: Placement, gone: asyncio.Event | None,
                                settle: bool = True, why: Reason = Reason.UNHEALTHY,
                                claim: bool = True) -> Placement:
        """Take the slot on the placed host, then claim a move and apply the lease change (unless
        `settle` is False: the caller does, `follow`); the placement the request runs on. When
        another instance moved the conversation first, the request follows it there if placement
        agrees (else it runs where its slot is held, and the lease is that instance's). When no
        slot can be had (queue full, client gone, `HostDown`: the host was marked down while the
        request waited, or once the slot was granted) nothing changes: the exchange keeps its host
        and the lease stays where it was, in the shared lease table too."""
        failed = ex.host
        ex.host = placed.host
        try:
            await self.take_slot(ex, gone)
            if not self.usable(ex):  # marked down between the grant and this step
                ex.drop_slot()
                raise HostDown(placed.host)
        except (errors.CrossbarError, ClientGone, HostDown):
            ex.host = failed
            raise
        if not settle:
            return placed
        if not claim or await self._move_stands(ex, placed):
            self._settle(ex, placed)
            return placed
        again = self._place_once(ex, why)  # with the other instance's lease, adopted
        if isinstance(again, Refusal) or again.host == placed.host:
            self._settle(ex, placed, lease=False)
            return placed
        ex.drop_slot()
        ex.host = failed  # what the exchange names should the second host fail it too
        return await self._take_then_settle(ex, again, gone, settle, why, claim=False)

    async def move(self, ex: Exchange, why: str, gone: asyncio.Event | None,
                   reason: Reason = Reason.UNHEALTHY, settle: bool = True) -> Placement:
        """The request's host failed it before anything reached the client: place it elsewhere
        and take a slot there; the lease follows only then (with `settle` False, only when the
        caller says so, `follow`). A host that goes down while the request waits for it is left
        out too, and the request placed again. Raises the client's answer (`CrossbarError`) when
        there is nowhere to go, e.g. a pinned route whose host is down; the exchange then still
        names the host that failed."""
        failed = ex.host
        ex.excluded.add(failed)
        ex.drop_slot()
        placed = await self.place(ex, why=reason, gone=gone, claim_moves=False)
        if ex.completion:
            placed = await self._slot_after_move(ex, placed, gone, settle, reason)
        else:
            ex.host = placed.host
        ex.decision = Decision.RETRIED
        log.warning("%s on %s: moved %s/%s to %s", why, failed, ex.key.route, ex.model, ex.host)
        return placed

    async def _slot_after_move(self, ex: Exchange, placed: Placement, gone: asyncio.Event | None,
                               settle: bool, reason: Reason) -> Placement:
        """`_take_then_settle` on the host the move placed the request on; one that goes down
        while the request waits for it is left out as well, and the request placed again."""
        for attempt in range(len(ex.route.hosts)):  # each attempt leaves one more host out
            if attempt:
                placed = await self.place(ex, why=reason, gone=gone, claim_moves=False)
            try:
                return await self._take_then_settle(ex, placed, gone, settle, reason)
            except HostDown as down:
                went = down.host or placed.host
                _placing_again(ex, went)
                ex.excluded.add(went)
        raise errors.no_healthy_host([], self._poll_wait())

    async def follow(self, ex: Exchange, placed: Placement) -> None:
        """The lease follows a move made with `settle` False, now that its host answered: only
        when it is still where the move found it, and no other instance moved it first. Meanwhile
        another turn may have moved it (to the same host, say), or an operator pinned or released
        its route: that stands."""
        if not ex.completion or not self._still_at_start(ex, placed):
            return
        if await self._move_stands(ex, placed) and self._still_at_start(ex, placed):
            self.leases.apply(ex.key, placed.change, time.time())

    def _still_at_start(self, ex: Exchange, placed: Placement) -> bool:
        lease = self.leases.view(ex.key)
        return (lease.host == placed.change.from_host and lease.pin in ("", placed.host)
                and self._candidate(ex, placed.host))

    def _candidate(self, ex: Exchange, host: str) -> bool:
        """The host is still one of the request's route's: a placement made before a reload that
        took it away runs the request there, but leaves the conversation's lease alone."""
        return host in ex.route.hosts and host in self.cfg.hosts

    def sent(self, ex: Exchange) -> None:
        """The request goes upstream to its host now (again, after a move): it counts as running
        there for the load estimates and the busy meter until it ends (or is sent elsewhere)."""
        if not ex.completion:
            return
        if ex.sent_to is None:
            ex.on_end(partial(self._unsent, ex))
        else:
            self._unsent(ex)
        where = (ex.host, self.fleet.slot_key(ex.host, ex.model))
        self._upstream.setdefault(where, {})[ex] = time.monotonic()
        ex.sent_to = where
        self.meter.start(ex.host)

    def _unsent(self, ex: Exchange) -> None:
        where, ex.sent_to = ex.sent_to, None
        if where is None:
            return
        running = self._upstream.get(where)
        if running is not None:
            running.pop(ex, None)
            if not running:
                del self._upstream[where]
        self.meter.end(where[0])

    def passive_mark(self, host: str, reason: str) -> None:
        if self.fleet.mark_down(host, reason):
            self.store.record_health(time.time(), host, False, [])
        self._host_down(host)

    def _host_down(self, host: str) -> None:
        moved = self.limiter.evict(host)
        if moved:
            log.warning("%s is down: %d queued request(s) placed again", host, moved)

    def _poll_wait(self) -> int:
        return max(1, int(self.cfg.poll_interval))

    # ------------------------------------------------------------ operator actions
    # Made through the admin API; instances sharing the database apply them too.

    def pin_route(self, route: str, host: str, candidates: tuple[str, ...]) -> None:
        """Raises `UnknownHost` when `host` is not one of `candidates`."""
        self.leases.pin(route, host, candidates, time.time())
        if self.fleetwide is not None:
            self.fleetwide.pinned(route, host)

    def unpin_route(self, route: str) -> None:
        self.leases.unpin(route, time.time())
        if self.fleetwide is not None:
            self.fleetwide.pinned(route, "")

    def release_route(self, route: str) -> int:
        released = self.leases.release(route, time.time())
        if self.fleetwide is not None:
            self.fleetwide.released(route)
        return released

    def set_draining(self, host: str, draining: bool) -> None:
        if draining and not self.fleet.draining(host):
            self.leases.drain(host, time.time())
        self.fleet.set_draining(host, draining)
        if self.fleetwide is not None:
            self.fleetwide.drained(host, draining)

    # ------------------------------------------------------------ the ending

    def rejected(self, reason: Rejection) -> None:
        self.metrics.rejected.inc((str(reason),))

    def finish(self, ex: Exchange) -> None:
        """The request's one ending: what placement learns from it at once, then everything it
        held is given back, then its row, metrics and lease use are made soon
        (`account_finished`). Runs once; the release and the accounting run even when learning
        raises."""
        if ex.finished:
            return
        try:
            if ex.completion:
                ex.total_ms = ex.elapsed_ms()
                self._learn(ex)
        finally:
            ex.end()
            if ex.completion:
                self._account_soon(ex)

    def _learn(self, ex: Exchange) -> None:
        u = ex.usage
        if u is not None:
            host, model = ex.host or "", ex.key.model
            self.estimator.learn(host, model, ex.path, ex.prompt_bytes, u.prompt_tokens)
            self.learner.observe_usage(host, model, u, conversation=ex.key)

    def _account_soon(self, ex: Exchange) -> None:
        pending = self._unaccounted
        pending.append(ex)
        if len(pending) >= ACCOUNT_BATCH or self._closing:
            self.account_finished()
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to come back on (a synchronous caller): account now
            self.account_finished()
            return
        if self._account_timer is None or self._account_loop is not loop:  # none, or a stopped loop's
            self._account_timer = loop.call_later(ACCOUNT_EVERY, self.account_finished)
            self._account_loop = loop

    def account_finished(self) -> None:
        """Make the rows and metrics of every request finished so far. Readers of rows or metrics
        (the admin API, a reload, closing) call it first, so they never see a request missing."""
        if self._account_timer is not None:
            self._account_timer.cancel()
            self._account_timer = None
        batch, self._unaccounted = self._unaccounted, []
        for done, ex in enumerate(batch, 1):
            try:
                self._account(ex)
            except Exception:  # one bad request must not cost the others their rows
                log.exception("crossbar: accounting a finished request failed")
            except BaseException:  # cancelled or interrupted: the rest wait for the next pass
                log.warning("crossbar: accounting interrupted; one request's row and metrics are lost")
                self._unaccounted[:0] = batch[done:]
                raise

    def _account(self, ex: Exchange) -> None:
        self.store.record_request(ex.row())
        self.leases.save_use(ex.key)  # its last use, set when it ended (`_unhold`)
        host = ex.host or ""
        route = self.route_label(ex.route)
        m = self.metrics
        m.requests.inc((route, host, str(ex.status or 0)))
        if ex.ttfb_ms is not None:
            m.ttfb.observe((host,), ex.ttfb_ms / 1000)
        u: Usage | None = ex.usage
        if u is None:
            return
        if u.dropped:
            log.warning("%s reported %d usage figure(s) out of range or unreadable; stored as unknown",
                        host, u.dropped)
            m.usage_dropped.inc((host,), u.dropped)
        if u.prompt_tokens:
            m.tokens.inc((route, host, "prompt"), u.prompt_tokens)
        if u.cached_tokens:
            m.tokens.inc((route, host, "cached"), u.cached_tokens)
        if u.completion_tokens:
            m.tokens.inc((route, host, "completion"), u.completion_tokens)
        tokens_per_second = u.tokens_per_second
        if tokens_per_second:
            m.generation_tps.observe((host, self.model_label(ex.key.model)), tokens_per_second)

    def route_label(self, route: RouteConf) -> str:
        """A route made from a template is labelled by its template: labels come from the
        config, never from a name a client chose."""
        if route.name in self.cfg.routes:
            return route.name
        return next((name for name, conf in self.cfg.routes.items()
                     if conf.is_template and dataclasses.replace(route, name=name) == conf), OTHER)

    def model_label(self, model: str) -> str:
        return model if model in self._configured_models else OTHER

    # ------------------------------------------------------------ lease events, poller callbacks

    def _record_event(self, event: LeaseEvent) -> None:
        k = event.key
        self.store.record_event(event.ts, k.route, k.fp, k.model, event.from_host, event.to_host,
                                str(event.reason))

    def _on_poll(self, host: str, res: PollResult, changed: bool) -> None:
        healthy = self.fleet.healthy(host)
        self.store.record_health(time.time(), host, healthy, sorted(res.loaded))
        if changed and not healthy:
            self._host_down(host)

    def _on_poll_round(self) -> None:
        self._sweep_retired()
        self.limiter.refresh()
        self.leases.expire_idle(time.time())

    # ------------------------------------------------------------ live views

    def in_flight(self, host: str, model: str) -> int:
        return self.limiter.in_flight(host, self.fleet.slot_key(host, model))

    def queued(self, host: str, model: str) -> int:
        return self.limiter.queued(host, self.fleet.slot_key(host, model))

    def _store_figures(self) -> Iterable[tuple[str, str, float]]:
        store, shared = self.store, self.store.shared
        yield ("crossbar_store_dropped", "Operations the store shed under pressure (never leases)",
               store.dropped)
        yield ("crossbar_store_bad_figures", "Request figures out of range, stored as unknown",
               store.bad_figures)
        if self.fleetwide is None or shared is None:
            return
        yield ("crossbar_shared_errors", "Calls to the shared database that failed or timed out "
               "(decided from memory)", shared.errors)
        yield ("crossbar_shared_refused", "Calls refused at once while the shared database was down "
               "(decided from memory)", shared.refused)
        yield "crossbar_shared_feed_errors", "Lost connections of the change feed", shared.feed_errors

    def _health_rows(self) -> Iterable[tuple[str, bool]]:
        return ((name, self.fleet.healthy(name)) for name in self.cfg.hosts)

    def _slot_rows(self) -> Iterable[SlotRow]:
        for name, conf in self.cfg.hosts.items():
            for model in conf.models:
                busy = self.in_flight(name, model)
                yield (name, model, self.fleet.free_slots(name, model, busy), busy,
                       self.queued(name, model), self.fleet.capacity(name, self.fleet.slot_key(name, model)))


def _route_now(route: RouteConf, name: str, cfg: Config) -> RouteConf:
    """A running request's route in a reloaded configuration: as configured now, or, when the
    route is gone, its old settings with only the hosts that are still configured."""
    return match_route(name, cfg.routes) or dataclasses.replace(
        route, hosts=tuple(h for h in route.hosts if h in cfg.hosts), pin="")


class Lazy[T](Mapping[str, T]):
    """A mapping over `keys` whose values are computed on first read."""

    def __init__(self, keys: tuple[str, ...], make: Callable[[str], T]):
        self._keys, self._make, self._got = keys, make, {}

    def __getitem__(self, key: str) -> T:
        try:
            return self._got[key]
        except KeyError:
            if key not in self._keys:
                raise
        value = self._got[key] = self._make(key)
        return value

    # Mapping's own `get` and `in` go through `__getitem__` and its KeyError: placement asks these
    # for every request
    def get(self, key: str, default: T | None = None) -> T | None:  # type: ignore[override]
        return self[key] if key in self._keys else default

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _placing_again(ex: Exchange, down: str) -> None:
    log.warning("%s went down while %s/%s waited for it; placing it again", down, ex.key.route, ex.model)
