"""The running router: config, host health, leases, slots, store and metrics, and placement.

`Router` owns every piece of live state and the decisions made with it; the mitmproxy addon
(`crossbar.addon`) only calls into it from its hooks. Nothing here blocks the event loop: the
store is written by its own thread, the poller is an asyncio task.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Iterable, Sequence

from crossbar import errors
from crossbar.choose import Candidate, choose
from crossbar.config import Config
from crossbar.exchange import Exchange
from crossbar.guard import TokenEstimator, fits, overflow
from crossbar.hosts import Fleet, Poller, PollResult
from crossbar.lease import Grant, LeaseTable, NoHost, PinnedDown
from crossbar.limiter import ClientGone, Limiter, QueueFull
from crossbar.metrics import LiveCollector, Metrics, SlotRow
from crossbar.store import Store
from crossbar.wake import Waker

log = logging.getLogger("crossbar")


class Router:
    def __init__(self, cfg: Config, store: Store | None = None):
        self.cfg = cfg
        self.store = store or Store(cfg.db)
        self.fleet = Fleet(cfg.hosts)
        self.limiter = Limiter(cfg.queue_max, self.fleet.capacity)
        self.leases = LeaseTable(self.store, self.fleet, self._choose, cfg.lease_idle)
        self.metrics = Metrics()
        self.store.on_event(self.metrics.lease_moved)  # one count per lease_events row, every reason
        self.metrics.add_live(
            LiveCollector(self._health_rows, self._slot_rows, lambda: self.store.errors, self.leases.count)
        )
        self.poller = Poller(
            self.fleet, cfg.poll_interval, cfg.poll_timeout, self._on_poll, self._on_poll_round
        )
        self.estimator = TokenEstimator()
        self.waker = Waker(cfg.hosts, self.fleet.healthy, self.poller.poll_one)
        self.live: set[Exchange] = set()  # forwarded and not finished: what a graceful stop waits for
        self._housekeeping: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Synchronous start-up: open the database and load the lease table back."""
        self.store.open()
        self.leases.load(self.store.load_leases())
        for name, route in self.cfg.routes.items():
            if route.pin and self.leases.pinned(name) != route.pin:
                self.leases.pin(name, route.pin, route.hosts, time.time())
        self.store.start()
        log.info("crossbar: %d leases loaded from %s", self.leases.count(), self.cfg.db)

    def start_background(self) -> None:
        self.poller.start()
        self._housekeeping = asyncio.get_running_loop().create_task(self._roll_up(), name="crossbar-rollup")

    async def _roll_up(self) -> None:
        """Rows older than `retention` go into `requests_daily`, on the store's writer thread."""
        every = min(3600.0, max(1.0, self.cfg.retention / 10))
        while True:
            self.store.schedule_rollup(time.time() - self.cfg.retention)
            await asyncio.sleep(every)

    async def drain(self, timeout: float) -> bool:
        """Wait until every forwarded request has finished (or `timeout`); True when none is left."""
        deadline = time.monotonic() + timeout
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.live

    async def close(self) -> None:
        if self._housekeeping:
            self._housekeeping.cancel()
        await self.poller.stop()
        await asyncio.to_thread(self.store.close)

    # ------------------------------------------------------------ placement

    def candidates(self, names: Sequence[str], model: str) -> list[Candidate]:
        fleet, limiter = self.fleet, self.limiter
        return [
            Candidate(
                name=name,
                healthy=fleet.healthy(name),
                draining=fleet.draining(name),
                loaded=fleet.loaded(name, model),
                listed=fleet.conf[name].serves(model),
                free_slots=fleet.free_slots(name, model, limiter.in_flight(name, model)),
                weight=fleet.conf[name].weight,
                queued=limiter.queued(name, model),
                order=i,
            )
            for i, name in enumerate(names)
        ]

    def _choose(self, names: Sequence[str], model: str) -> str | None:
        choice = choose(self.candidates(names, model))
        if choice and choice.loads_model:
            log.warning("no host has %r loaded; placing it on %s, which will load it", model, choice.host)
        return choice.host if choice else None

    async def lease(self, ex: Exchange, exclude: Iterable[str] = (), reason: str = "unhealthy") -> Grant:
        """Pick the host for this request (sticky lease). With no healthy host left, wake a sleeping
        candidate (wake-on-LAN) and try once more. Errors are the client's answer."""
        try:
            grant = self._acquire(ex, exclude, reason)
        except NoHost as exc:
            woke = await self.waker.wake(ex.route.hosts)
            if not woke:
                self.metrics.rejected.labels("no_host").inc()
                raise errors.no_healthy_host([], self._poll_wait()) from exc
            try:
                grant = self._acquire(ex, exclude, reason)
            except NoHost:
                self.metrics.rejected.labels("no_host").inc()
                raise errors.no_healthy_host(woke, self._poll_wait()) from exc
        ex.host, ex.decision = grant.host, str(grant.decision)
        return grant

    def _acquire(self, ex: Exchange, exclude: Iterable[str], reason: str) -> Grant:
        try:
            return self.leases.acquire(ex.key, ex.route.hosts, time.time(), frozenset(exclude), reason)
        except PinnedDown as exc:
            self.metrics.rejected.labels("pinned_down").inc()
            raise errors.unavailable(str(exc), retry_after=self._poll_wait()) from exc

    async def host_for_read(self, ex: Exchange, exclude: Collection[str] = ()) -> None:
        """A GET pass-through (/v1/models, /health, /props) or a control call is answered by the
        host the route's conversations for that model live on, else by the best candidate. It
        creates no lease."""
        usable = [h for h in ex.route.hosts if self.fleet.healthy(h) and h not in exclude]
        pin = self.leases.pinned(ex.key.route)
        if pin:
            if pin not in usable:
                raise errors.unavailable(f"route {ex.key.route!r} is pinned to {pin!r}, which is not healthy",
                                         retry_after=self._poll_wait())
            ex.host, ex.decision = pin, "pinned"
            return
        for lease in self.leases.leases_of(ex.key.route):
            if (not ex.model or lease.key.model == ex.model) and lease.host in usable:
                ex.host, ex.decision = lease.host, "reused"
                return
        if not usable:
            woke = await self.waker.wake(ex.route.hosts)
            usable = [h for h in ex.route.hosts if self.fleet.healthy(h) and h not in exclude]
            if not usable:
                raise errors.no_healthy_host(woke, self._poll_wait())
        ex.host = (self._choose(usable, ex.model) if ex.model else None) or usable[0]
        ex.decision = "new"

    async def guard(self, ex: Exchange) -> None:
        """Context guard, after the lease: a prompt that does not fit the leased host's per-slot
        context moves (with its lease) to a candidate where it fits; fitting nowhere is a 400 in
        llama-server's own shape. A context that is unknown never blocks."""
        est = self.estimator.estimate(ex.host, ex.model, ex.prompt_bytes)
        if fits(est, self.fleet.slot_ctx(ex.host, ex.model)):
            return
        fitting = self._fitting(ex.route.hosts, ex.model, est)
        if not fitting:
            await self.waker.wake([h for h in ex.route.hosts if self._could_fit(h, ex.model, est)])
            fitting = self._fitting(ex.route.hosts, ex.model, est)
        if not fitting:  # a learned ratio alone never refuses what the plain estimate lets fit
            plain = self.estimator.plain(ex.prompt_bytes)
            if fits(plain, self.fleet.slot_ctx(ex.host, ex.model)):
                return
            fitting = self._fitting(ex.route.hosts, ex.model, plain)
        if not fitting:
            self.metrics.rejected.labels("context").inc()
            raise overflow(est, self.largest_slot_ctx(ex.model))
        was = ex.host
        try:
            grant_host = self.leases.acquire(ex.key, fitting, time.time(), frozenset({was}), "context").host
        except (NoHost, PinnedDown) as exc:
            self.metrics.rejected.labels("context").inc()
            raise overflow(est, self.largest_slot_ctx(ex.model)) from exc
        log.warning("prompt of ~%d tokens does not fit %s; moved %s/%s to %s", est, was, ex.key.route,
                    ex.model, grant_host)
        ex.host, ex.decision, ex.ctx_moved = grant_host, "moved:context", f"moved:{was}>{grant_host}"

    def _fitting(self, names: Sequence[str], model: str, tokens: int) -> list[str]:
        return [h for h in names if self.fleet.healthy(h) and not self.fleet.draining(h)
                and fits(tokens, self.fleet.slot_ctx(h, model))]

    def _could_fit(self, host: str, model: str, tokens: int) -> bool:
        """A sleeping host worth waking for this prompt: it serves the model and its per-slot
        context (configured or last learned) is unknown or large enough."""
        return self.fleet.conf[host].serves(model) and fits(tokens, self.fleet.slot_ctx(host, model))

    def largest_slot_ctx(self, model: str) -> int:
        """The largest per-slot context among hosts that have the model loaded."""
        return max((self.fleet.slot_ctx(h, model) for h in self.cfg.hosts
                    if self.fleet.loaded(h, model)), default=0)

    async def take_slot(self, ex: Exchange, gone: asyncio.Event | None) -> None:
        """Wait (bounded FIFO) for a slot on the leased host; 503 + Retry-After when the queue is full."""
        if not ex.completion:
            return
        try:
            ex.ticket = await self.limiter.acquire(ex.host, ex.model, gone, hold=ex.route.queue)
        except QueueFull as exc:
            self.metrics.rejected.labels("queue_full").inc()
            ex.status, ex.err = 503, "queue full"
            raise errors.unavailable(
                f"every slot for {ex.model!r} on {ex.host} is busy and its queue is full",
                retry_after=exc.retry_after,
            ) from exc
        except ClientGone:
            ex.err = "client left while queued"
            raise
        ex.queued_ms += int(ex.ticket.queued_s * 1000)
        self.metrics.queue_wait.labels(ex.host, ex.model).observe(ex.ticket.queued_s)

    def free_slot(self, ex: Exchange) -> None:
        if ex.ticket is not None:
            self.limiter.release(ex.ticket)
            ex.ticket = None

    async def move(self, ex: Exchange, why: str, gone: asyncio.Event | None, reason: str = "unhealthy",
                   ) -> None:
        """The leased host failed before anything reached the client: lease elsewhere (the lease
        moves with it). Raises the client's answer (`CrossbarError`) when there is nowhere to go,
        e.g. a pinned route whose host is down."""
        failed = ex.host
        ex.excluded.add(failed)
        self.free_slot(ex)
        try:
            if ex.completion:
                await self.lease(ex, exclude=ex.excluded, reason=reason)
            else:
                await self.host_for_read(ex, exclude=ex.excluded)
        except errors.CrossbarError:
            ex.host = failed
            raise
        log.warning("%s on %s: moving %s/%s to %s", why, failed, ex.key.route, ex.model, ex.host)
        await self.take_slot(ex, gone)
        ex.decision = "retried"

    def passive_mark(self, host: str, reason: str) -> None:
        if self.fleet.mark_down(host, reason):
            self.store.record_health(time.time(), host, False, [])

    def _poll_wait(self) -> int:
        return max(1, int(self.cfg.poll_interval))

    # ------------------------------------------------------------ accounting

    def finish(self, ex: Exchange) -> None:
        """Release everything the request held and write its row, exactly once."""
        if ex.finished:
            return
        ex.finished = True
        self.live.discard(ex)
        ex.cancel_deadline()
        self.free_slot(ex)
        if not ex.completion:
            return
        if ex.host:
            self.leases.touch(ex.key, time.time())
        self.store.record_request(ex.row())
        host = ex.host or ""
        self.metrics.requests.labels(ex.key.route, host, str(ex.status or 0)).inc()
        if ex.ttfb_ms is not None:
            self.metrics.ttfb.labels(host).observe(ex.ttfb_ms / 1000)
        u = ex.usage
        if u is None:
            return
        self.estimator.learn(host, ex.model, ex.path, ex.prompt_bytes, u.prompt_tokens)
        if u.dropped:
            log.warning("%s reported %d usage figure(s) out of range; stored as unknown", host, u.dropped)
            self.metrics.usage_dropped.labels(host).inc(u.dropped)
        for kind, value in (("prompt", u.prompt_tokens), ("cached", u.cached_tokens),
                            ("completion", u.completion_tokens)):
            if value:
                self.metrics.tokens.labels(ex.key.route, host, kind).inc(value)
        if u.tokens_per_second:
            self.metrics.generation_tps.labels(host, ex.model).observe(u.tokens_per_second)

    # ------------------------------------------------------------ poller callbacks

    def _on_poll(self, host: str, res: PollResult, changed: bool) -> None:
        self.store.record_health(time.time(), host, self.fleet.healthy(host), sorted(res.loaded))

    def _on_poll_round(self) -> None:
        self.limiter.refresh()
        self.leases.expire_idle(time.time())

    # ------------------------------------------------------------ live views

    def _health_rows(self) -> Iterable[tuple[str, bool]]:
        return ((name, self.fleet.healthy(name)) for name in self.cfg.hosts)

    def _slot_rows(self) -> Iterable[SlotRow]:
        for name, conf in self.cfg.hosts.items():
            for model in conf.models:
                busy = self.limiter.in_flight(name, model)
                yield (name, model, self.fleet.free_slots(name, model, busy), busy,
                       self.limiter.queued(name, model), self.fleet.capacity(name, model))
