"""llama-server hosts on a virtual clock: the time model for placement tests and benchmarks.

The HTTP simulator (`llamasim.server`) sleeps for real, which on a shared 2-core machine makes
latency figures noisy and minutes of modelled work take minutes. Placement policy only needs
when each request starts, how much of its prompt was cached and when it ends, so this model
runs on a discrete-event clock instead: a host serves `slots` requests at once, queues the rest
in arrival order (as llama-server does beyond `-np`), prefills the uncached part of a prompt at
`prefill_tps` and generates at `gen_tps`, and keeps a host-memory prompt cache (`--cache-ram`)
of `cache_tokens`, least recently used first out. A run is deterministic and takes
milliseconds whatever the modelled time.

Prompts are modelled per conversation: each turn's prompt extends the previous turn's prompt and
reply, so the cached prefix of a turn is what the host kept of that conversation. A finished
request reports llama-server's `timings` object, consistent with the model.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llamasim.server import timings_json


class VirtualClock:
    """A discrete-event loop: callbacks run in time order (ties in scheduling order)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._events, (max(when, self.now), next(self._seq), callback))

    def run(self, until: float = float("inf")) -> None:
        while self._events and self._events[0][0] <= until:
            when, _, callback = heapq.heappop(self._events)
            self.now = when
            callback()


@dataclass(frozen=True, slots=True)
class TimeModel:
    prefill_tps: float = 20_000.0
    gen_tps: float = 1_000.0
    slots: int = 1
    cache_tokens: int = 1 << 30  # host prompt cache size in tokens; 0 turns it off

    def __post_init__(self) -> None:
        if self.prefill_tps <= 0 or self.gen_tps <= 0 or self.slots < 1 or self.cache_tokens < 0:
            raise ValueError("rates must be > 0, slots >= 1 and cache_tokens >= 0")


@dataclass(slots=True, eq=False)
class TimedRequest:
    conversation: str
    prompt_tokens: int
    reply_tokens: int
    on_start: Callable[[TimedRequest], None] = field(default=lambda r: None, repr=False)
    on_done: Callable[[TimedRequest], None] = field(default=lambda r: None, repr=False)
    host: str = ""  # set when submitted
    submitted: float = 0.0
    started: float = -1.0
    finished: float = -1.0
    cache_n: int = 0

    @property
    def prompt_n(self) -> int:
        return self.prompt_tokens - self.cache_n

    @property
    def running(self) -> bool:
        return self.started >= 0 and self.finished < 0


class ConversationCache:
    """Host prompt cache: per conversation the longest prefix kept, LRU by tokens."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.tokens = 0
        self._kept: OrderedDict[str, int] = OrderedDict()

    def cached(self, conversation: str) -> int:
        n = self._kept.get(conversation, 0)
        if n:
            self._kept.move_to_end(conversation)
        return n

    def peek(self, conversation: str) -> int:
        """Like `cached`, without touching the LRU order."""
        return self._kept.get(conversation, 0)

    def keep(self, conversation: str, n_tokens: int) -> None:
        self.tokens -= self._kept.pop(conversation, 0)
        if n_tokens <= 0 or n_tokens > self.limit:
            return
        self._kept[conversation] = n_tokens
        self.tokens += n_tokens
        while self.tokens > self.limit:
            _, old = self._kept.popitem(last=False)
            self.tokens -= old


class TimedHost:
    """One llama-server (one model) on a virtual clock."""

    def __init__(self, name: str, clock: VirtualClock, model: TimeModel | None = None) -> None:
        self.name = name
        self.clock = clock
        self.model = model or TimeModel()
        self.cache = ConversationCache(self.model.cache_tokens)
        self.running: list[TimedRequest] = []
        self.waiting: deque[TimedRequest] = deque()
        self.busy_s = 0.0  # slot-seconds spent serving, for utilisation figures

    def submit(self, request: TimedRequest) -> None:
        request.host, request.submitted = self.name, self.clock.now
        self.waiting.append(request)
        self._start_waiting()

    def withdraw(self, request: TimedRequest) -> bool:
        """Take back a request that has not started (a router moving a queued turn elsewhere)."""
        if request not in self.waiting:
            return False
        self.waiting.remove(request)
        return True

    def cached_tokens(self, conversation: str) -> int:
        """What the host's cache holds of a conversation now (a peek: the LRU order is kept)."""
        return self.cache.peek(conversation)

    def _start_waiting(self) -> None:
        while self.waiting and len(self.running) < self.model.slots:
            self._start(self.waiting.popleft())

    def _start(self, request: TimedRequest) -> None:
        request.started = self.clock.now
        request.cache_n = min(self.cache.cached(request.conversation), max(request.prompt_tokens - 1, 0))
        self.running.append(request)
        self.clock.at(self.clock.now + self.service_s(request), lambda: self._finish(request))
        request.on_start(request)

    def service_s(self, request: TimedRequest) -> float:
        return request.prompt_n / self.model.prefill_tps + request.reply_tokens / self.model.gen_tps

    def _finish(self, request: TimedRequest) -> None:
        request.finished = self.clock.now
        self.busy_s += request.finished - request.started
        self.running.remove(request)
        self.cache.keep(request.conversation, request.prompt_tokens + request.reply_tokens)
        self._start_waiting()
        request.on_done(request)

    def timings(self, request: TimedRequest) -> dict[str, Any]:
        """The finished request's `timings`, as llama-server reports them."""
        prompt_ms = request.prompt_n / self.model.prefill_tps * 1e3
        predicted_ms = request.reply_tokens / self.model.gen_tps * 1e3
        return timings_json(request.cache_n, request.prompt_n, prompt_ms, request.reply_tokens, predicted_ms)
