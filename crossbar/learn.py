"""What hosts have been doing, learned from their replies: rates, reply lengths, busy time.

`RateLearner` keeps, per (host, model), moving averages of llama-server's `timings`
(`prompt_per_second`, `predicted_per_second`, `prompt_n`, `predicted_n`) and, per conversation,
the length of its last reply and how many of its tokens each host that served it processed
(`cache_n + prompt_n + predicted_n`: what that host's prompt cache likely holds). `BusyMeter`
keeps, per host, an exponentially weighted average of how many of its requests were running
over the recent past. Both take the clock as an argument
and hold bounded tables (the least recently touched entry goes first). Timings come from the
upstream, so every figure is checked: non-numbers, negatives, non-finite and absurd values are
ignored, never learned.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from crossbar.tap import Usage
from crossbar.yieldpolicy import HostLoad, Rates, Running

MAX_TOKENS = 10_000_000  # no single reply or prompt is larger; beyond it a figure is nonsense
MAX_TPS = 10_000_000.0
MIN_PREFILL_SAMPLE = 64  # prompt tokens: shorter prefills measure overhead, not the rate
MIN_GEN_SAMPLE = 8  # generated tokens, likewise


def _figure(timings: Mapping[str, Any], key: str, limit: float) -> float | None:
    value = timings.get(key)
    if type(value) is float or type(value) is int:  # the usual case; NaN and infinities fail here
        return float(value) if 0 <= value <= limit else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    if not math.isfinite(value) or value < 0 or value > limit:
        return None
    return value


def _rate(timings: Mapping[str, Any], per_second: str, n: float | None, ms: str) -> float | None:
    """llama-server's own tokens-per-second figure (when it is there, even if it is nonsense),
    else tokens over the reported milliseconds."""
    if per_second in timings or n is None:
        return _figure(timings, per_second, MAX_TPS)
    return _per_second(n, _figure(timings, ms, MAX_TOKENS * 1e3))


def _per_second(n: float, millis: float | None) -> float | None:
    """Tokens per second of `n` tokens over `millis` ms (None without a time), within MAX_TPS."""
    return min(n / millis * 1e3, MAX_TPS) if millis else None


@dataclass(slots=True)
class _Average:
    value: float = 0.0
    samples: int = 0

    def add(self, x: float, alpha: float) -> None:
        self.value = x if self.samples == 0 else self.value + alpha * (x - self.value)
        self.samples += 1


@dataclass(slots=True)
class _PairStats:
    prefill_tps: _Average = field(default_factory=_Average)
    gen_tps: _Average = field(default_factory=_Average)
    reply_tokens: _Average = field(default_factory=_Average)
    prefill_tokens: _Average = field(default_factory=_Average)


@dataclass(slots=True)
class _Conversation:
    reply_tokens: float  # its last reply
    when: float  # of its last reply
    held: dict[str, int] = field(default_factory=dict)  # host -> tokens it processed for it last


_PAIR_FIGURES = ("prefill_tps", "gen_tps", "reply_tokens", "prefill_tokens")  # Rates' field order


def _own_or_mean(own: _PairStats | None, peers: Iterable[_PairStats], name: str) -> float:
    if own is not None and getattr(own, name).samples:
        return getattr(own, name).value
    learned = [getattr(p, name).value for p in peers if getattr(p, name).samples]
    return sum(learned) / len(learned) if learned else 0.0


class RateLearner:
    """Per (host, model) prefill and generation rates and typical lengths; per conversation its
    last reply length (forgotten after `conversation_ttl` seconds)."""

    def __init__(
        self,
        clock: Callable[[], float],
        alpha: float = 0.2,
        conversation_ttl: float = 1800.0,
        max_pairs: int = 1024,
        max_conversations: int = 10_000,
    ) -> None:
        self._clock = clock
        self._alpha = alpha
        self._ttl = conversation_ttl
        self._max_pairs = max_pairs
        self._max_conversations = max_conversations
        self._pairs: OrderedDict[tuple[str, str], _PairStats] = OrderedDict()
        self._by_model: dict[str, dict[str, _PairStats]] = {}  # the same entries, by model then host
        self._conversations: OrderedDict[Hashable, _Conversation] = OrderedDict()

    def forget(self, host: str) -> None:
        """Drop what was learned about `host` (it left the configuration, or its address changed)."""
        for model, hosts in list(self._by_model.items()):
            hosts.pop(host, None)
            if not hosts:
                del self._by_model[model]
        for pair in [p for p in self._pairs if p[0] == host]:
            del self._pairs[pair]

    def observe(self, host: str, model: str, timings: Mapping[str, Any],
                conversation: Hashable | None = None) -> None:
        """Learn from one finished reply's `timings` object; `conversation` is its lease key.
        Without `prompt_per_second` / `predicted_per_second` the rates are the token counts over
        `prompt_ms` / `predicted_ms`, so a caller may pass just those figures."""
        prompt_n = _figure(timings, "prompt_n", MAX_TOKENS)
        predicted_n = _figure(timings, "predicted_n", MAX_TOKENS)
        self._learn(host, model, prompt_n, predicted_n, _figure(timings, "cache_n", MAX_TOKENS),
                    _rate(timings, "prompt_per_second", prompt_n, "prompt_ms"),
                    _rate(timings, "predicted_per_second", predicted_n, "predicted_ms"), conversation)

    def observe_usage(self, host: str, model: str, usage: Usage,
                      conversation: Hashable | None = None) -> None:
        """`observe` of the timings object {prompt_n, prompt_ms, cache_n: cached_tokens,
        predicted_n: completion_tokens, predicted_ms} made of a reply's known figures, without
        making it. `crossbar.tap` has checked them already: whole counts, and finite non-negative
        milliseconds within this module's bound too; only the count bound here, tighter than
        tap's, is left to apply."""
        evaluated, generated, cached = usage.prompt_n, usage.completion_tokens, usage.cached_tokens
        prompt_n = None if evaluated is None or evaluated > MAX_TOKENS else float(evaluated)
        predicted_n = None if generated is None or generated > MAX_TOKENS else float(generated)
        cache_n = None if cached is None or cached > MAX_TOKENS else float(cached)
        prompt_tps = None if prompt_n is None else _per_second(prompt_n, usage.prompt_ms)
        gen_tps = None if predicted_n is None else _per_second(predicted_n, usage.predicted_ms)
        self._learn(host, model, prompt_n, predicted_n, cache_n, prompt_tps, gen_tps, conversation)

    def _learn(self, host: str, model: str, prompt_n: float | None, predicted_n: float | None,
               cache_n: float | None, prompt_tps: float | None, gen_tps: float | None,
               conversation: Hashable | None) -> None:
        """What both ways of observing a reply learn from its checked figures."""
        stats = self._pair(host, model)
        if prompt_n is not None:
            stats.prefill_tokens.add(prompt_n, self._alpha)
            if prompt_n >= MIN_PREFILL_SAMPLE and prompt_tps:
                stats.prefill_tps.add(prompt_tps, self._alpha)
        if predicted_n is not None:
            stats.reply_tokens.add(predicted_n, self._alpha)
            if predicted_n >= MIN_GEN_SAMPLE and gen_tps:
                stats.gen_tps.add(gen_tps, self._alpha)
        if conversation is not None and predicted_n is not None:
            held = None if prompt_n is None or cache_n is None else cache_n + prompt_n + predicted_n
            self._remember(conversation, host, predicted_n, held)

    def rates(self, host: str, model: str) -> Rates:
        """The learned rates. A figure not learned yet on this host is the mean of the hosts that
        have learned it for the same model (a fleet serves one model on alike machines, and a
        fresh host is otherwise invisible to the estimates); zero (not known) when none has."""
        peers = self._by_model.get(model, {})
        own = peers.get(host)
        return Rates(*(_own_or_mean(own, peers.values(), name) for name in _PAIR_FIGURES))

    def reply_tokens(self, host: str, model: str, conversation: Hashable | None = None) -> float:
        """Expected reply length of the conversation's next request: its last reply when known
        and recent, else the host's typical reply for the model."""
        remembered = self._recent(conversation)
        if remembered is not None:
            return remembered.reply_tokens
        return self.rates(host, model).reply_tokens

    def likely_cached(self, conversation: Hashable | None, host: str) -> int:
        """Tokens of the conversation the host's prompt cache likely holds: all it processed and
        generated for the conversation's last request there (0 when it never served it)."""
        remembered = self._recent(conversation)
        return remembered.held.get(host, 0) if remembered is not None else 0

    def host_load(self, host: str, model: str, slots: int, running: Iterable[tuple[float, Hashable | None]],
                  queued: int, conversation: Hashable | None) -> HostLoad:
        """The yield decision's view of a host for one conversation's turn. `running` holds
        (seconds since forwarded, conversation key) of each request in flight there; `queued`
        the requests waiting ahead of the turn."""
        rates = self.rates(host, model)
        jobs = tuple(Running(elapsed, self.reply_tokens(host, model, key), rates.prefill_tokens)
                     for elapsed, key in running)
        return HostLoad(host, slots, rates, jobs, queued, self.likely_cached(conversation, host))

    def _recent(self, conversation: Hashable | None) -> _Conversation | None:
        remembered = self._conversations.get(conversation) if conversation is not None else None
        if remembered is None or self._clock() - remembered.when > self._ttl:
            return None
        return remembered

    def _pair(self, host: str, model: str) -> _PairStats:
        key = (host, model)
        stats = self._pairs.get(key)
        if stats is None:
            stats = self._pairs[key] = self._by_model.setdefault(model, {})[host] = _PairStats()
            while len(self._pairs) > self._max_pairs:
                (old_host, old_model), _ = self._pairs.popitem(last=False)
                del self._by_model[old_model][old_host]
                if not self._by_model[old_model]:
                    del self._by_model[old_model]
        self._pairs.move_to_end(key)
        return stats

    def _remember(self, conversation: Hashable, host: str, reply_tokens: float,
                  held_tokens: float | None) -> None:
        now = self._clock()
        remembered = self._conversations.get(conversation)
        if remembered is None or now - remembered.when > self._ttl:  # unknown, or forgotten by now
            remembered = self._conversations[conversation] = _Conversation(reply_tokens, now)
            self._conversations.move_to_end(conversation)
            while len(self._conversations) > self._max_conversations:
                self._conversations.popitem(last=False)
        else:
            remembered.reply_tokens, remembered.when = reply_tokens, now
            self._conversations.move_to_end(conversation)
        if held_tokens is not None:  # one entry per host that served it: config-bounded
            remembered.held[host] = int(held_tokens)


@dataclass(slots=True)
class _Busy:
    level: float = 0.0  # average number of running requests, decayed up to `since`
    running: int = 0
    since: float = 0.0


class BusyMeter:
    """Recent busy time per host: the running-request count averaged over an exponential window
    of `tau` seconds (so 1.0 on a 1-slot host that has been busy throughout)."""

    def __init__(self, clock: Callable[[], float], tau: float = 60.0, max_hosts: int = 1024) -> None:
        self._clock = clock
        self._tau = tau
        self._max_hosts = max_hosts
        self._hosts: OrderedDict[str, _Busy] = OrderedDict()

    def start(self, host: str) -> None:
        self._advance(host).running += 1

    def end(self, host: str) -> None:
        state = self._advance(host)
        state.running = max(state.running - 1, 0)

    def forget(self, host: str) -> None:
        self._hosts.pop(host, None)

    def busy(self, host: str) -> float:
        state = self._hosts.get(host)
        if state is None:
            return 0.0
        return self._decayed(state, self._clock())

    def _decayed(self, state: _Busy, now: float) -> float:
        keep = math.exp(-max(now - state.since, 0.0) / self._tau)
        return state.level * keep + state.running * (1.0 - keep)

    def _advance(self, host: str) -> _Busy:
        now = self._clock()
        state = self._hosts.get(host)
        if state is None:
            state = self._hosts[host] = _Busy(since=now)
            while len(self._hosts) > self._max_hosts:
                self._hosts.popitem(last=False)
        state.level, state.since = self._decayed(state, now), now
        self._hosts.move_to_end(host)
        return state
