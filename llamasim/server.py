"""A simulated llama.cpp ``llama-server`` (build b11312) for tests, benchmarks and the demo.

It answers on the same paths, with the same fields, headers and error shapes as the real server
(recorded in ``../shared/llama-lab/samples``), and models what crossbar cares about: slots that
queue further requests inside the server, per-slot context limits, a per-slot prompt cache plus a
host-memory prompt cache, the unified-KV overflow, and router mode (several models, on-demand
loads, LRU eviction).

Token model (the lab's tiny models): one token per UTF-8 byte. A chat prompt is built as ChatML
with each special token as a single byte, so its length equals the real token count and prompt
caching is a longest common prefix of byte strings.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import random
import signal
import socket
import string
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

BUILD_INFO = "b1-0c1e570"
SERVER_HEADER = "llama.cpp"
JSON_TYPE = "application/json; charset=utf-8"
SSE_TYPE = "text/event-stream"
METRICS_TYPE = "text/plain; version=0.0.4"
IM_START = b"\x01"
IM_END = b"\x02"
GEN_CHARS = "".join(c for c in string.printable if c.isprintable() and c != "~")
ID_CHARS = string.ascii_letters + string.digits
CTX_EXCEEDED = "Context size has been exceeded."
MODEL_MISSING = "model name is missing from the request"
COMPLETION_PATHS = ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
                    "/completion")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)
SAMPLERS = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
SAMPLING_HEAD: dict[str, Any] = {
    "seed": 4294967295, "temperature": 0.800000011920929, "dynatemp_range": 0.0,
    "dynatemp_exponent": 1.0, "top_k": 40, "top_p": 0.949999988079071, "min_p": 0.05000000074505806,
    "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.10000000149011612,
    "typical_p": 1.0, "repeat_last_n": 64, "repeat_penalty": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
    "dry_penalty_last_n": 64,
}
DRY_BREAKERS = ["\n", ":", '"', "*"]
MIROSTAT: dict[str, Any] = {
    "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.10000000149011612,
    "adaptive_target": -1.0, "adaptive_decay": 0.8999999761581421,
}
MODEL_META: dict[str, Any] = {
    "vocab_type": 2, "n_vocab": 260, "n_ctx": 0, "n_ctx_train": 32768, "n_embd": 64,
    "n_params": 107328, "size": 429312, "ftype": "all F32",
}
N_EMBD = 64
METRICS = [
    ("prompt_tokens_total", "counter", "Number of prompt tokens processed, excluding cached tokens"),
    ("prompt_tokens_cached_total", "counter", "Number of prompt tokens reused from the cache"),
    ("prompt_seconds_total", "counter", "Total time spent processing prompts"),
    ("tokens_predicted_total", "counter", "Number of generation tokens processed"),
    ("tokens_predicted_seconds_total", "counter", "Total time spent generating tokens"),
    ("n_decode_total", "counter",
     "Total number of llama_decode() calls, excluding speculative decoding and multimodal decoding"),
    ("n_tokens_max", "counter", "Largest observed sequence length (prompt + generation)"),
    ("spec_decode_num_draft_tokens_total", "counter", "Speculative: Total draft tokens generated"),
    ("spec_decode_num_accepted_tokens_total", "counter",
     "Speculative: Total draft tokens accepted by the target model"),
    ("spec_decode_num_drafts_total", "counter", "Speculative: Total speculative decoding verification steps"),
    ("prompt_tokens_seconds", "gauge", "Average prompt throughput in tokens/s"),
    ("predicted_tokens_seconds", "gauge", "Average generation throughput in tokens/s"),
    ("requests_processing", "gauge", "Number of requests processing"),
    ("requests_deferred", "gauge", "Number of requests deferred"),
    ("n_busy_slots_per_decode", "gauge", "Average number of busy slots per llama_decode() call"),
]
KNOBS = ("refuse", "fail_status", "fail_times", "die_after_events", "hang", "health_status",
         "prompt_ms_per_token", "token_ms", "default_max_tokens", "load_s", "cache_ram_tokens")


# ---------------------------------------------------------------------------------------------
# configuration and statistics
# ---------------------------------------------------------------------------------------------

SLOT_PROMPT_SIMILARITY = 0.1  # llama.cpp common.h default (b11312)

@dataclass
class SimConfig:
    models: list[str]
    router: bool = False
    n_slots: int = 2
    ctx: int = 4096
    kvu: bool = False
    cache_ram_tokens: int = 1 << 30
    prompt_ms_per_token: float = 0.0
    token_ms: float = 0.0
    default_max_tokens: int = 16
    models_max: int = 1
    load_s: float = 0.0
    refuse: bool = False
    fail_status: int = 0
    fail_times: int = -1
    die_after_events: int = 0
    hang: bool = False
    health_status: int = 200

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("SimConfig.models must name at least one model")
        if not self.router and len(self.models) != 1:
            raise ValueError("single mode serves exactly one model")
        if self.n_slots < 1 or self.ctx < 2:
            raise ValueError("n_slots must be >= 1 and ctx >= 2")


@dataclass
class RequestRecord:
    model: str
    path: str
    prompt_tokens: int
    cache_n: int
    completion_tokens: int
    status: int
    stream: bool


@dataclass
class SimStats:
    requests: dict[str, int] = field(default_factory=dict)
    completions_started: int = 0
    completions_finished: int = 0
    failed_injected: int = 0
    aborted: int = 0
    cut: int = 0
    inflight: dict[str, int] = field(default_factory=dict)
    max_concurrent: dict[str, int] = field(default_factory=dict)
    loads: dict[str, int] = field(default_factory=dict)
    records: list[RequestRecord] = field(default_factory=list)

    def reset(self) -> None:
        """Clear the counters; requests still in flight keep counting toward the new peaks."""
        self.requests.clear()
        self.completions_started = self.completions_finished = 0
        self.failed_injected = self.aborted = self.cut = 0
        self.loads.clear()
        self.records.clear()
        self.max_concurrent = {m: n for m, n in self.inflight.items() if n > 0}

    def enter(self, model: str) -> None:
        self.completions_started += 1
        now = self.inflight.get(model, 0) + 1
        self.inflight[model] = now
        self.max_concurrent[model] = max(self.max_concurrent.get(model, 0), now)

    def leave(self, model: str) -> None:
        self.completions_finished += 1
        self.inflight[model] = max(0, self.inflight.get(model, 0) - 1)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class SimError(Exception):
    """An error answered in llama-server's `{"error": {...}}` shape."""

    def __init__(self, status: int, message: str, kind: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.body: dict[str, Any] = {"code": status, "message": message, "type": kind, **extra}


class ClientGone(Exception):
    """The client closed its connection while the answer was being produced."""


def invalid(message: str) -> SimError:
    return SimError(400, message, "invalid_request_error")


def error_kind(status: int) -> str:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error"}
    return kinds.get(status, "server_error")


# ---------------------------------------------------------------------------------------------
# token model
# ---------------------------------------------------------------------------------------------

def content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def chat_prompt(messages: list[dict[str, Any]]) -> bytes:
    """ChatML prompt whose length equals sum(len(role)+len(content)+4) + 11."""
    parts = [IM_START + str(m.get("role", "")).encode() + b"\n" + content_text(m.get("content")).encode()
             + IM_END + b"\n" for m in messages]
    return b"".join(parts) + IM_START + b"assistant\n"


def completion_prompt(prompt: Any) -> bytes:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return bytes(t & 0xFF for t in prompt if isinstance(t, int))
    if not isinstance(prompt, str):
        raise invalid('"prompt" must be a string or an array of tokens')
    return prompt.encode()


def common_prefix(a: bytes, b: bytes) -> int:
    """Length of the longest common prefix; cost grows with the prefix, not with the inputs."""
    n = min(len(a), len(b))
    lo, step = 0, 256
    while lo < n:
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            return lo + _mismatch(a[lo:hi], b[lo:hi])
        lo, step = hi, step * 2
    return n


def _mismatch(a: bytes, b: bytes) -> int:
    lo, hi = 0, len(a)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo if a[lo:lo + 1] != b[lo:lo + 1] else hi


def random_id(rng: random.Random) -> str:
    return "".join(rng.choice(ID_CHARS) for _ in range(32))


def n_predict_of(body: dict[str, Any], default: int) -> int:
    for key in ("max_completion_tokens", "max_tokens", "n_predict"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def sampling_params(n_predict: int, stream: bool, chat: bool, ignore_eos: bool = False) -> dict[str, Any]:
    return {
        **SAMPLING_HEAD, **MIROSTAT, "max_tokens": n_predict, "n_predict": n_predict, "n_keep": 0,
        "n_discard": 0, "ignore_eos": ignore_eos, "stream": stream, "n_probs": 0, "min_keep": 0,
        "chat_format": "peg-native" if chat else "Content-only",
        "reasoning_format": "deepseek" if chat else "none", "reasoning_in_content": False,
        "generation_prompt": "<|im_start|>assistant\n" if chat else "", "samplers": list(SAMPLERS),
        "speculative.types": "none", "timings_per_token": False, "post_sampling_probs": False,
        "backend_sampling": False, "lora": [],
    }


def native_generation_settings(n_predict: int, stream: bool) -> dict[str, Any]:
    """`generation_settings` of a native `/completion` reply, in the real server's key order."""
    return {
        **SAMPLING_HEAD, "dry_sequence_breakers": list(DRY_BREAKERS), **MIROSTAT, "stop": [],
        "max_tokens": n_predict, "n_predict": n_predict, "n_keep": 0, "n_discard": 0, "ignore_eos": False,
        "stream": stream, "logit_bias": [], "n_probs": 0, "min_keep": 0, "grammar": "", "grammar_lazy": False,
        "grammar_triggers": [], "preserved_tokens": [], "chat_format": "Content-only",
        "reasoning_format": "deepseek", "reasoning_in_content": False, "generation_prompt": "",
        "samplers": list(SAMPLERS), "speculative.types": "none", "timings_per_token": False,
        "post_sampling_probs": False, "backend_sampling": False, "lora": [],
    }


# ---------------------------------------------------------------------------------------------
# the engine: slots, prompt caches, generation
# ---------------------------------------------------------------------------------------------

class PromptCache:
    """Host-memory prompt cache (`--cache-ram`), LRU by tokens."""

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, None] = OrderedDict()
        self.tokens = 0

    def put(self, prompt: bytes, limit: int) -> None:
        if not prompt or limit <= 0 or len(prompt) > limit:
            return
        if prompt in self._entries:
            self._entries.move_to_end(prompt)
            return
        for entry in [e for e in self._entries if prompt.startswith(e)]:
            del self._entries[entry]  # a prefix of the new entry can never match longer than it
            self.tokens -= len(entry)
        self._entries[prompt] = None
        self.tokens += len(prompt)
        while self.tokens > limit:
            old, _ = self._entries.popitem(last=False)
            self.tokens -= len(old)

    def best(self, prompt: bytes) -> tuple[int, bytes]:
        best_n, best = 0, b""
        for entry in self._entries:
            n = common_prefix(entry, prompt)
            if n > best_n:
                best_n, best = n, entry
        if best:
            self._entries.move_to_end(best)
        return best_n, best


def timings_json(cache_n: int, prompt_n: int, prompt_ms: float, predicted_n: int,
                 predicted_ms: float) -> dict[str, Any]:
    """llama-server's `timings` object (b11312 keys and arithmetic)."""
    p_ms = max(round(prompt_ms, 3), 1e-3)
    g_ms = max(round(predicted_ms, 3), 1e-3)
    per = max(predicted_n - 1, 1)
    return {
        "cache_n": cache_n, "prompt_n": prompt_n, "prompt_ms": p_ms,
        "prompt_per_token_ms": p_ms / max(prompt_n, 1),
        "prompt_per_second": 1e3 / p_ms * prompt_n,
        "predicted_n": predicted_n, "predicted_ms": g_ms,
        "predicted_per_token_ms": g_ms / per, "predicted_per_second": 1e3 / g_ms * per,
    }


@dataclass
class Job:
    prompt: bytes
    n_predict: int
    stream: bool
    chat: bool
    alive: Callable[[], bool]
    cache_n: int = 0
    prompt_n: int = 0
    text: list[str] = field(default_factory=list)
    t_prompt_ms: float = 0.0
    t_gen_ms: float = 0.0
    kv: int = 0
    error: str = ""
    slot_id: int = -1
    id_task: int = 0

    @property
    def n_prompt(self) -> int:
        return len(self.prompt)

    def check(self) -> None:
        if self.error:
            raise SimError(500, self.error, "server_error")
        if not self.alive():
            raise ClientGone()

    def timings(self) -> dict[str, Any]:
        return timings_json(self.cache_n, self.prompt_n, self.t_prompt_ms, len(self.text), self.t_gen_ms)

    def usage(self) -> dict[str, Any]:
        n_gen = len(self.text)
        return {"completion_tokens": n_gen, "prompt_tokens": self.n_prompt,
                "total_tokens": n_gen + self.n_prompt,
                "prompt_tokens_details": {"cached_tokens": self.cache_n}}


class Sink:
    """Receives the engine's progress; the non-streaming sink ignores it."""

    async def begin(self) -> None:
        return None

    async def token(self, piece: str) -> None:
        return None


@dataclass
class Slot:
    id: int
    tokens: bytes = b""
    used: bool = False
    busy: bool = False
    job: Job | None = None
    last_used: float = 0.0


@dataclass
class EngineMetrics:
    prompt_tokens: int = 0
    prompt_cached: int = 0
    prompt_seconds: float = 0.0
    predicted: int = 0
    predicted_seconds: float = 0.0
    n_decode: int = 0
    n_tokens_max: int = 0
    busy_slot_sum: int = 0


class Engine:
    """One loaded model: slots with FIFO queueing, prompt caches, simulated decoding."""

    def __init__(self, cfg: SimConfig, rng: random.Random) -> None:
        self.cfg = cfg
        self.rng = rng
        self.n_slots = cfg.n_slots
        self.n_ctx_slot = cfg.ctx if cfg.kvu else max(1, cfg.ctx // cfg.n_slots)
        self.slots = [Slot(i) for i in range(self.n_slots)]
        self.cache = PromptCache()
        self.metrics = EngineMetrics()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._reserved = 0
        self._task_ids = 0
        self.active = 0  # requests received and not finished (incl. queued)

    # -- slot scheduling ---------------------------------------------------------------------

    def _free(self) -> list[Slot]:
        return [s for s in self.slots if not s.busy]

    @property
    def deferred(self) -> int:
        return len(self._waiters)

    @property
    def processing(self) -> int:
        return sum(1 for s in self.slots if s.busy)

    async def _acquire(self, job: Job) -> Slot:
        if self._waiters or len(self._free()) - self._reserved <= 0:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await self._wait_turn(fut, job)
            except BaseException:
                self._drop_waiter(fut)
                raise
            self._reserved -= 1
        return self._pick(job.prompt)

    async def _wait_turn(self, fut: asyncio.Future[None], job: Job) -> None:
        while not fut.done():
            await asyncio.wait({fut}, timeout=0.05)
            if not fut.done() and not job.alive():
                raise ClientGone()

    def _drop_waiter(self, fut: asyncio.Future[None]) -> None:
        if fut.done() and not fut.cancelled():
            self._reserved -= 1
            self._wake()
        elif fut in self._waiters:
            self._waiters.remove(fut)
            fut.cancel()

    def _wake(self) -> None:
        while self._waiters and len(self._free()) - self._reserved > 0:
            fut = self._waiters.popleft()
            if not fut.done():
                self._reserved += 1
                fut.set_result(None)

    def _pick(self, prompt: bytes) -> Slot:
        """llama-server's rule: the free slot whose cached prompt shares the largest fraction of
        this prompt, if above --slot-prompt-similarity (0.1); else the least recently used."""
        free = self._free()
        best = max(free, key=lambda s: (common_prefix(s.tokens, prompt), -s.last_used))
        if common_prefix(best.tokens, prompt) <= SLOT_PROMPT_SIMILARITY * len(prompt):
            best = min(free, key=lambda s: s.last_used)
        best.busy = True
        return best

    def _release(self, slot: Slot) -> None:
        slot.busy = False
        slot.last_used = time.monotonic()
        self._wake()

    # -- prompt cache --------------------------------------------------------------------------

    def _load_prompt(self, slot: Slot, prompt: bytes) -> int:
        own = common_prefix(slot.tokens, prompt)
        ram_n, ram = self.cache.best(prompt) if self.cfg.cache_ram_tokens > 0 else (0, b"")
        if own < len(slot.tokens):
            self.cache.put(slot.tokens, self.cfg.cache_ram_tokens)
        if ram_n > own:
            own = ram_n
            slot.tokens = ram
        return min(own, len(prompt) - 1)

    # -- generation ----------------------------------------------------------------------------

    async def run(self, job: Job, sink: Sink) -> None:
        self.active += 1
        try:
            slot = await self._acquire(job)
            try:
                await self._process(job, slot, sink)
            finally:
                self._finish(job, slot)
                self._release(slot)
        finally:
            self.active -= 1

    async def _process(self, job: Job, slot: Slot, sink: Sink) -> None:
        n = job.n_prompt
        if n >= self.n_ctx_slot:
            raise SimError(400, f"request ({n} tokens) exceeds the available context size "
                           f"({self.n_ctx_slot} tokens), try increasing it", "exceed_context_size_error",
                           n_prompt_tokens=n, n_ctx=self.n_ctx_slot)
        job.cache_n = self._load_prompt(slot, job.prompt)
        job.prompt_n = n - job.cache_n
        self._task_ids += 1
        job.id_task, job.slot_id = self._task_ids, slot.id
        slot.job, slot.used = job, True
        slot.tokens = job.prompt[: job.cache_n]
        await sink.begin()
        await self._prefill(job, slot)
        await self._decode(job, slot, sink)

    async def _prefill(self, job: Job, slot: Slot) -> None:
        t0 = time.perf_counter()
        await pause(job.prompt_n * self.cfg.prompt_ms_per_token)
        job.check()
        self._kv_grow(job, job.n_prompt)
        job.check()
        slot.tokens = job.prompt
        job.t_prompt_ms = modelled_ms(job.prompt_n, self.cfg.prompt_ms_per_token, t0)

    async def _decode(self, job: Job, slot: Slot, sink: Sink) -> None:
        room = self.n_ctx_slot - job.n_prompt
        limit = room if job.n_predict < 0 else min(job.n_predict, room)
        t0 = time.perf_counter()
        try:
            for _ in range(limit):
                await pause(self.cfg.token_ms)
                job.check()
                self._kv_grow(job, 1)
                job.check()
                piece = self.rng.choice(GEN_CHARS)
                job.text.append(piece)
                slot.tokens += piece.encode()
                self.metrics.n_decode += 1
                self.metrics.busy_slot_sum += self.processing
                await sink.token(piece)
        finally:
            job.t_gen_ms = modelled_ms(len(job.text), self.cfg.token_ms, t0)

    def _kv_grow(self, job: Job, n: int) -> None:
        job.kv += n
        if not self.cfg.kvu:
            return
        running = [s.job for s in self.slots if s.busy and s.job is not None]
        if sum(j.kv for j in running) <= self.cfg.ctx:
            return
        for other in running:
            other.error = CTX_EXCEEDED
        for s in self.slots:
            if s.busy:
                s.tokens = b""

    def _finish(self, job: Job, slot: Slot) -> None:
        job.kv = 0
        if job.id_task == 0:
            return
        m = self.metrics
        m.prompt_tokens += job.prompt_n
        m.prompt_cached += job.cache_n
        m.prompt_seconds += job.t_prompt_ms / 1e3
        m.predicted += len(job.text)
        m.predicted_seconds += job.t_gen_ms / 1e3
        m.n_tokens_max = max(m.n_tokens_max, job.n_prompt + len(job.text))

    # -- views ---------------------------------------------------------------------------------

    def slots_json(self) -> list[dict[str, Any]]:
        return [self._slot_json(s) for s in self.slots]

    def _slot_json(self, slot: Slot) -> dict[str, Any]:
        out: dict[str, Any] = {"id": slot.id, "n_ctx": self.n_ctx_slot, "speculative": False,
                               "is_processing": slot.busy}
        job = slot.job
        if not slot.used or job is None:
            return out
        n_dec = len(job.text)
        remain = (job.n_predict - n_dec) if job.n_predict >= 0 else -1
        out.update({
            "id_task": job.id_task, "n_prompt_tokens": job.n_prompt,
            "n_prompt_tokens_processed": job.prompt_n if slot.busy else 0,
            "n_prompt_tokens_cache": job.cache_n if slot.busy else 0,
            "params": sampling_params(job.n_predict, job.stream, job.chat),
            "next_token": [{"has_next_token": slot.busy, "has_new_line": False,
                            "n_remain": remain if slot.busy else -1, "n_decoded": n_dec if slot.busy else 0}],
        })
        return out

    def metrics_text(self) -> str:
        m = self.metrics
        values = [
            m.prompt_tokens, m.prompt_cached, m.prompt_seconds, m.predicted, m.predicted_seconds,
            m.n_decode, m.n_tokens_max, 0, 0, 0,
            m.prompt_tokens / m.prompt_seconds if m.prompt_seconds else 0.0,
            m.predicted / m.predicted_seconds if m.predicted_seconds else 0.0,
            self.processing, self.deferred,
            m.busy_slot_sum / m.n_decode if m.n_decode else 0.0,
        ]
        lines = []
        for (name, kind, help_text), value in zip(METRICS, values, strict=True):
            lines += [f"# HELP llamacpp:{name} {help_text}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {float(value):g}"]
        return "\n".join(lines) + "\n"


def modelled_ms(n_tokens: int, ms_per_token: float, t0: float) -> float:
    """Time a phase reports in `timings`: the time model's when it has one (so learned rates are
    exactly the configured ones, whatever the event loop's jitter), else the measured time."""
    if ms_per_token > 0:
        return n_tokens * ms_per_token
    return (time.perf_counter() - t0) * 1e3


async def pause(ms: float) -> None:
    await asyncio.sleep(ms / 1e3 if ms > 0 else 0)


# ---------------------------------------------------------------------------------------------
# models (single and router mode)
# ---------------------------------------------------------------------------------------------

@dataclass
class ModelState:
    name: str
    status: str = "unloaded"
    engine: Engine | None = None
    last_used: float = 0.0
    loaded_port: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def running(self) -> bool:
        return self.status in ("loading", "loaded")

    @property
    def path(self) -> str:
        return f"/models/{self.name}.gguf"


class ModelTable:
    """The router's model instances: on-demand loads, `models_max` resident, LRU eviction."""

    def __init__(self, cfg: SimConfig, stats: SimStats, rng: random.Random) -> None:
        self.cfg = cfg
        self.stats = stats
        self.rng = rng
        self.models = {name: ModelState(name) for name in cfg.models}
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        if not cfg.router:
            self._mark_loaded(self.models[cfg.models[0]])

    def get(self, name: str) -> ModelState | None:
        return self.models.get(name)

    def _mark_loaded(self, state: ModelState) -> None:
        state.engine = Engine(self.cfg, self.rng)
        state.status = "loaded"
        state.loaded_port = self.rng.randint(30000, 60000)
        state.ready.set()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def busy(self, state: ModelState) -> bool:
        return state.status == "loading" or (state.engine is not None and state.engine.active > 0) \
            or self.stats.inflight.get(state.name, 0) > 0

    def _evict_one(self) -> bool:
        idle = [m for m in self.models.values() if m.status == "loaded" and not self.busy(m)]
        if not idle:
            return False
        self.unload(min(idle, key=lambda m: m.last_used))
        return True

    def unload(self, state: ModelState) -> None:
        state.status = "unloaded"
        state.engine = None
        state.ready = asyncio.Event()
        self._notify()

    async def ensure_ready(self, state: ModelState) -> Engine:
        while state.status != "loaded" or state.engine is None:
            if state.status == "unloaded":
                if self._has_room() or self._evict_one():
                    self._start_load(state)
                    continue
                await self._changed.wait()
            else:
                await state.ready.wait()
        return state.engine

    def _has_room(self) -> bool:
        return sum(1 for m in self.models.values() if m.running) < max(1, self.cfg.models_max)

    def _start_load(self, state: ModelState) -> None:
        state.status = "loading"
        self.stats.loads[state.name] = self.stats.loads.get(state.name, 0) + 1
        task = asyncio.get_running_loop().create_task(self._load(state))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._notify()

    async def _load(self, state: ModelState) -> None:
        await asyncio.sleep(self.cfg.load_s)
        if state.status == "loading":
            self._mark_loaded(state)

    def request_load(self, state: ModelState) -> None:
        """`POST /models/load`: returns at once, the load (and any eviction) happens behind."""
        task = asyncio.get_running_loop().create_task(self._background_ready(state))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _background_ready(self, state: ModelState) -> None:
        if self._has_room() or self._evict_one():
            self._start_load(state)
        await self.ensure_ready(state)

    def release_idle(self) -> None:
        self._notify()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task


# ---------------------------------------------------------------------------------------------
# HTTP helpers
# ---------------------------------------------------------------------------------------------

def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=dumps(obj).encode(),
                        headers={"Server": SERVER_HEADER, "Content-Type": JSON_TYPE})


def error_response(err: SimError) -> web.Response:
    return json_response({"error": err.body}, status=err.status)


def client_alive(request: web.Request) -> Callable[[], bool]:
    def alive() -> bool:
        transport = request.transport
        return transport is not None and not transport.is_closing()
    return alive


class StreamSink(Sink):
    """Writes SSE events; honours `die_after_events`; reports a vanished client."""

    def __init__(self, request: web.Request, server: SimServer,
                 render: Callable[[str, bool], list[Any]]) -> None:
        self.request = request
        self.server = server
        self.render = render
        self.response: web.StreamResponse | None = None
        self.events = 0
        self.n = 0
        self.died = False

    async def begin(self) -> None:
        resp = web.StreamResponse(status=200, headers={"Server": SERVER_HEADER, "Content-Type": SSE_TYPE})
        resp.enable_chunked_encoding()
        try:
            await resp.prepare(self.request)
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone() from exc
        self.response = resp

    async def token(self, piece: str) -> None:
        self.n += 1
        for event in self.render(piece, self.n == 1):
            await self.send(event)

    async def send(self, obj: Any) -> None:
        await self.write(b"data: " + (obj if isinstance(obj, bytes) else dumps(obj).encode()) + b"\n\n")

    async def write(self, data: bytes) -> None:
        if self.response is None or self.died:
            raise ClientGone()
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ClientGone()
        try:
            await self.response.write(data)
        except (ConnectionError, RuntimeError) as exc:
            raise ClientGone() from exc
        self.events += 1
        limit = self.server.config.die_after_events
        if limit and self.events >= limit:
            self.died = True
            transport.abort()
            raise ClientGone()


# ---------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SimServer:
    """A simulated llama-server on its own port; several may run in one event loop."""

    def __init__(self, config: SimConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config
        self.host = host
        self.port = port
        self.stats = SimStats()
        self.rng = random.Random()
        self.created = int(time.time())
        self.media_marker = f"<__media_{random_id(self.rng)}__>"
        self._table: ModelTable | None = None
        self._runner: web.ServerRunner | None = None
        self._sock: socket.socket | None = None
        self._server: asyncio.Server | None = None
        self._listen_task: asyncio.Task[None] | None = None
        self._knob_changed = asyncio.Event()
        self._closing = False

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def table(self) -> ModelTable:
        if self._table is None:
            raise RuntimeError("SimServer not started")
        return self._table

    async def start(self) -> None:
        self._table = ModelTable(self.config, self.stats, self.rng)
        self._runner = web.ServerRunner(web.Server(self._dispatch), shutdown_timeout=0.5, access_log=None)
        await self._runner.setup()
        self._listen()
        if self.config.refuse:
            self._unlisten()
        elif self._listen_task is not None:
            await self._listen_task

    async def close(self) -> None:
        self._closing = True
        self._bump()
        self._unlisten()
        if self._runner is not None:
            self._abort_connections()
            await self._runner.cleanup()
            self._runner = None
        if self._table is not None:
            await self._table.close()

    async def __aenter__(self) -> SimServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _listen(self) -> None:
        if self._sock is not None or self._runner is None:
            return
        sock = socket.create_server((self.host, self.port), backlog=128)
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._listen_task = asyncio.get_running_loop().create_task(self._serve(sock))

    async def _serve(self, sock: socket.socket) -> None:
        assert self._runner is not None and self._runner.server is not None
        self._server = await asyncio.get_running_loop().create_server(self._runner.server, sock=sock)

    def _unlisten(self) -> None:
        if self._listen_task is not None and not self._listen_task.done():
            self._listen_task.cancel()
        self._listen_task = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _abort_connections(self) -> None:
        server = self._runner.server if self._runner is not None else None
        for handler in list(server.connections if server is not None else []):
            if handler.transport is not None:
                handler.transport.abort()

    def set(self, **knobs: Any) -> None:
        """Change knobs at runtime; `refuse` closes (and drops connections) or re-opens the port."""
        unknown = set(knobs) - set(KNOBS)
        if unknown:
            raise ValueError(f"unknown sim knob(s): {', '.join(sorted(unknown))}")
        for key, value in knobs.items():
            setattr(self.config, key, value)
        if "refuse" in knobs and self._runner is not None:
            if knobs["refuse"]:
                self._unlisten()
                self._abort_connections()
            else:
                self._listen()
        self._bump()

    def _bump(self) -> None:
        self._knob_changed.set()
        self._knob_changed = asyncio.Event()

    # -- dispatch ------------------------------------------------------------------------------

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path.startswith("/_sim/"):
            return await self._control(request)
        self.stats.requests[path] = self.stats.requests.get(path, 0) + 1
        if self.config.hang:
            await self._hang()
            if self._closing:
                raise ConnectionResetError("sim closing")
        handler = self._routes().get((request.method, path))
        if handler is None:
            return json_response({"error": {"message": "File Not Found", "type": "not_found_error",
                                            "code": 404}}, status=404)
        try:
            return await handler(request)
        except SimError as err:
            return error_response(err)

    async def _hang(self) -> None:
        while self.config.hang and not self._closing:
            await self._knob_changed.wait()

    def _routes(self) -> dict[tuple[str, str], Handler]:
        post_cmpl = self._completion
        routes: dict[tuple[str, str], Handler] = {
            ("GET", "/health"): self._health, ("GET", "/v1/health"): self._health,
            ("GET", "/v1/models"): self._models, ("GET", "/models"): self._models,
            ("GET", "/props"): self._props, ("GET", "/slots"): self._slots,
            ("GET", "/metrics"): self._metrics, ("POST", "/tokenize"): self._tokenize,
            ("POST", "/v1/embeddings"): self._embeddings, ("POST", "/embeddings"): self._embeddings,
            ("POST", "/models/load"): self._models_load, ("POST", "/models/unload"): self._models_unload,
        }
        for path in COMPLETION_PATHS:
            routes[("POST", path)] = post_cmpl
        return routes

    # -- control API ---------------------------------------------------------------------------

    async def _control(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/_sim/stats" and request.method == "GET":
            return json_response(self.stats_json())
        if request.path == "/_sim/config" and request.method == "GET":
            return json_response(dataclasses.asdict(self.config))
        if request.path == "/_sim/config" and request.method == "POST":
            try:
                self.set(**(await request.json()))
            except (ValueError, TypeError) as exc:
                return error_response(invalid(str(exc)))
            return json_response(dataclasses.asdict(self.config))
        if request.path == "/_sim/reset" and request.method == "POST":
            self.stats.reset()
            return json_response({"success": True})
        return json_response({"error": {"message": "File Not Found", "type": "not_found_error",
                                        "code": 404}}, status=404)

    def stats_json(self) -> dict[str, Any]:
        out = self.stats.to_json()
        out["models"] = {name: m.status for name, m in self.table.models.items()}
        return out

    # -- simple endpoints ----------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.StreamResponse:
        status = self.config.health_status
        if status == 200:
            return json_response({"status": "ok"})
        message = "Loading model" if status == 503 else "simulated health failure"
        return error_response(SimError(status, message, error_kind(status)))

    def _model_for_get(self, request: web.Request) -> ModelState:
        if not self.config.router:
            return self.table.models[self.config.models[0]]
        return self._validate(request.query.get("model", ""), self._autoload(request))

    def _autoload(self, request: web.Request) -> bool:
        value = request.query.get("autoload", "")
        return not value or value in ("true", "1")

    def _validate(self, name: str, autoload: bool) -> ModelState:
        if not name:
            raise invalid(MODEL_MISSING)
        state = self.table.get(name)
        if state is None:
            raise invalid(f"model '{name}' not found")
        if not autoload and not state.running:
            raise invalid("model is not loaded")
        return state

    async def _engine_for(self, state: ModelState, autoload: bool) -> Engine:
        if state.engine is not None and state.status == "loaded":
            return state.engine
        if not autoload:
            raise invalid("model is not loaded")
        return await self.table.ensure_ready(state)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        if self.config.router:
            data = [self._router_model_json(m) for m in self.table.models.values()]
            return json_response({"data": data, "object": "list"})
        name = self.config.models[0]
        engine = self.table.models[name].engine
        assert engine is not None
        details = {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                   "parameter_size": "", "quantization_level": ""}
        models = [{"name": name, "model": name, "modified_at": "", "size": "", "digest": "",
                   "type": "model", "description": "", "tags": [""], "capabilities": ["completion"],
                   "parameters": "", "details": details}]
        data = [{"id": name, "aliases": [name], "tags": [], "object": "model", "created": self.created,
                 "owned_by": "llamacpp", "meta": self._meta(engine)}]
        return json_response({"models": models, "object": "list", "data": data})

    def _meta(self, engine: Engine) -> dict[str, Any]:
        return {**MODEL_META, "n_ctx": engine.n_ctx_slot}

    def _router_model_json(self, state: ModelState) -> dict[str, Any]:
        cfg = self.config
        port = str(state.loaded_port)  # 0 until first loaded, then the last child's port (as the real one)
        args = ["llama-server", "--host", "127.0.0.1", "--metrics", "--port", port, "--slots",
                "--no-webui", "--alias", state.name, "--ctx-size", str(cfg.ctx), "--model", state.path,
                "--parallel", str(cfg.n_slots)]
        if cfg.kvu:
            args.append("--kv-unified")
        preset = (f"[{state.name}]\nmetrics = 1\nslots = 1\nwebui = 0\nctx-size = {cfg.ctx}\n"
                  f"model = {state.path}\nparallel = {cfg.n_slots}\n\n")
        out: dict[str, Any] = {
            "id": state.name, "aliases": [], "tags": [], "object": "model", "owned_by": "llamacpp",
            "created": int(time.time()), "status": {"value": state.status, "args": args, "preset": preset},
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
            "source": "models_dir", "can_remove": False,
        }
        if state.status == "loaded" and state.engine is not None:
            out["meta"] = self._meta(state.engine)
        return out

    async def _props(self, request: web.Request) -> web.StreamResponse:
        if self.config.router and not request.query.get("model"):
            return json_response({
                "role": "router", "max_instances": self.config.models_max, "models_autoload": True,
                "model_alias": "llama-server", "model_path": "none",
                "default_generation_settings": {"params": None, "n_ctx": 0}, "ui_settings": {},
                "build_info": BUILD_INFO, "cors_proxy_enabled": False,
            })
        state = self._model_for_get(request)
        engine = await self._engine_for(state, self._autoload(request))
        return json_response(self._props_json(state, engine))

    def _props_json(self, state: ModelState, engine: Engine) -> dict[str, Any]:
        params = sampling_params(-1, False, chat=False)
        return {
            "default_generation_settings": {"params": params, "n_ctx": engine.n_ctx_slot},
            "total_slots": engine.n_slots, "model_alias": state.name, "model_ftype": "all F32",
            "model_path": state.path if self.config.router else state.name,
            "modalities": {"vision": False, "video": False, "audio": False},
            "media_marker": self.media_marker, "endpoint_slots": True, "endpoint_props": False,
            "endpoint_metrics": True, "ui": False, "ui_settings": {}, "chat_template": CHAT_TEMPLATE,
            "chat_template_caps": {
                "supports_object_arguments": False, "supports_parallel_tool_calls": False,
                "supports_preserve_reasoning": False, "supports_reasoning_effort": False,
                "supports_string_content": True, "supports_system_role": True,
                "supports_tool_calls": False, "supports_tools": False, "supports_typed_content": False,
            },
            "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "build_info": BUILD_INFO,
            "is_sleeping": False, "cors_proxy_enabled": False,
        }

    async def _slots(self, request: web.Request) -> web.StreamResponse:
        state = self._model_for_get(request)
        engine = await self._engine_for(state, self._autoload(request))
        return json_response(engine.slots_json())

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        state = self._model_for_get(request)
        engine = await self._engine_for(state, self._autoload(request))
        return web.Response(body=engine.metrics_text().encode(),
                            headers={"Server": SERVER_HEADER, "Content-Type": METRICS_TYPE})

    async def _read_json(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            raise invalid(f"Failed to parse JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise invalid("request body must be a JSON object")
        return body

    async def _post_model(self, request: web.Request, body: dict[str, Any]) -> tuple[ModelState, Engine]:
        if not self.config.router:
            state = self.table.models[self.config.models[0]]
            assert state.engine is not None
            return state, state.engine
        name = body.get("model") if isinstance(body.get("model"), str) else ""
        state = self._validate(name, self._autoload(request))
        state.last_used = time.monotonic()
        engine = await self._engine_for(state, self._autoload(request))
        state.last_used = time.monotonic()
        return state, engine

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        await self._post_model(request, body)
        content = body.get("content", "")
        return json_response({"tokens": list(str(content).encode())})

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        state, _ = await self._post_model(request, body)
        inputs = body.get("input", body.get("content", ""))
        texts = inputs if isinstance(inputs, list) else [inputs]
        data = [{"embedding": embed(str(t)), "index": i, "object": "embedding"} for i, t in enumerate(texts)]
        n_tokens = sum(len(str(t).encode()) for t in texts)
        model = body.get("model", state.name)
        return json_response({"model": model, "object": "list",
                              "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}, "data": data})

    async def _router_model(self, request: web.Request) -> Any:
        """The model a router's load/unload call names; a single server has no such endpoint."""
        if not self.config.router:
            raise SimError(404, "File Not Found", "not_found_error")
        body = await self._read_json(request)
        return self.table.get(str(body.get("model", "")))

    async def _models_load(self, request: web.Request) -> web.StreamResponse:
        state = await self._router_model(request)
        if state is None:
            raise SimError(404, "model is not found", "not_found_error")
        if state.running:
            raise invalid("model is already running")
        self.table.request_load(state)
        await asyncio.sleep(0)
        return json_response({"success": True})

    async def _models_unload(self, request: web.Request) -> web.StreamResponse:
        state = await self._router_model(request)
        if state is None:
            raise invalid("model is not found")
        if not state.running:
            raise invalid("model is not running")
        self.table.unload(state)
        return json_response({"success": True})

    # -- completions -----------------------------------------------------------------------------

    def _injected_failure(self) -> SimError | None:
        cfg = self.config
        if not cfg.fail_status:
            return None
        status = cfg.fail_status
        if cfg.fail_times > 0:
            cfg.fail_times -= 1
            if cfg.fail_times == 0:
                cfg.fail_status, cfg.fail_times = 0, -1
        self.stats.failed_injected += 1
        return SimError(status, f"simulated failure (HTTP {status})", error_kind(status))

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        failure = self._injected_failure()
        if failure is not None:
            return error_response(failure)
        body = await self._read_json(request)
        kind = completion_kind(request.path)
        job = self._make_job(request, body, kind)
        name = body.get("model") if self.config.router else self.config.models[0]
        if self.config.router:
            self._validate(name if isinstance(name, str) else "", self._autoload(request))
        model = str(name)
        self.stats.enter(model)
        try:
            return await self._run_completion(request, body, kind, job, model)
        finally:
            self.stats.leave(model)
            self.table.release_idle()

    def _make_job(self, request: web.Request, body: dict[str, Any], kind: str) -> Job:
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list):
                raise invalid("'messages' is required")
            prompt = chat_prompt([m for m in messages if isinstance(m, dict)])
        else:
            if "prompt" not in body:
                raise invalid('"prompt" is required')
            prompt = completion_prompt(body["prompt"])
        n_predict = n_predict_of(body, self.config.default_max_tokens)
        return Job(prompt=prompt, n_predict=n_predict, stream=bool(body.get("stream")),
                   chat=kind == "chat", alive=client_alive(request))

    async def _run_completion(self, request: web.Request, body: dict[str, Any], kind: str, job: Job,
                              model: str) -> web.StreamResponse:
        state, engine = await self._post_model(request, body)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        meta = ReplyMeta(model=state.name, cmpl_id="chatcmpl-" + random_id(self.rng),
                         created=int(time.time()), include_usage=include_usage)
        sink: Sink = StreamSink(request, self, renderer(kind, job, meta)) if job.stream else Sink()
        status = 200
        try:
            await engine.run(job, sink)
        except SimError as err:
            status = err.status
            return await self._error_reply(err, sink)
        except ClientGone:
            if isinstance(sink, StreamSink) and sink.died:
                self.stats.cut += 1
            else:
                status = 499
                self.stats.aborted += 1
            return self._gone_reply(sink)
        finally:
            self.stats.records.append(RequestRecord(model, request.path, job.n_prompt, job.cache_n,
                                                    len(job.text), status, job.stream))
        if isinstance(sink, StreamSink):
            return await self._finish_stream(sink, kind, job, meta)
        return json_response(final_json(kind, job, meta))

    async def _error_reply(self, err: SimError, sink: Sink) -> web.StreamResponse:
        if isinstance(sink, StreamSink) and sink.response is not None:
            with contextlib.suppress(ClientGone):
                await sink.send({"error": err.body})
            return sink.response
        return error_response(err)

    def _gone_reply(self, sink: Sink) -> web.StreamResponse:
        if isinstance(sink, StreamSink) and sink.response is not None:
            return sink.response
        return json_response({"error": {"code": 499, "message": "client closed", "type": "server_error"}},
                             status=499)

    async def _finish_stream(self, sink: StreamSink, kind: str, job: Job,
                             meta: ReplyMeta) -> web.StreamResponse:
        assert sink.response is not None
        try:
            for event in stream_tail(kind, job, meta):
                await sink.send(event)
            await sink.send(b"[DONE]")
        except ClientGone:
            if sink.died:
                self.stats.cut += 1
            else:
                self.stats.aborted += 1
        return sink.response


# ---------------------------------------------------------------------------------------------
# reply bodies
# ---------------------------------------------------------------------------------------------

@dataclass
class ReplyMeta:
    model: str
    cmpl_id: str
    created: int
    include_usage: bool


def completion_kind(path: str) -> str:
    if path.endswith("chat/completions"):
        return "chat"
    return "native" if path == "/completion" else "text"


def chunk_head(meta: ReplyMeta, choices: list[Any]) -> dict[str, Any]:
    return {"choices": choices, "created": meta.created, "id": meta.cmpl_id, "model": meta.model,
            "system_fingerprint": BUILD_INFO, "object": "chat.completion.chunk"}


def renderer(kind: str, job: Job, meta: ReplyMeta) -> Callable[[str, bool], list[Any]]:
    def chat(piece: str, first: bool) -> list[Any]:
        out = []
        if first:
            out.append(chunk_head(meta, [{"finish_reason": None, "index": 0,
                                          "delta": {"role": "assistant", "content": None}}]))
        out.append(chunk_head(meta, [{"finish_reason": None, "index": 0, "delta": {"content": piece}}]))
        return out

    def text(piece: str, first: bool) -> list[Any]:
        return [{"choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": None}],
                 "created": meta.created, "model": meta.model, "system_fingerprint": BUILD_INFO,
                 "object": "text_completion", "id": meta.cmpl_id}]

    def native(piece: str, first: bool) -> list[Any]:
        return [{"index": 0, "content": piece, "tokens": [], "stop": False, "id_slot": job.slot_id,
                 "tokens_predicted": len(job.text), "tokens_evaluated": job.n_prompt}]

    return {"chat": chat, "text": text, "native": native}[kind]


def stream_tail(kind: str, job: Job, meta: ReplyMeta) -> list[Any]:
    if kind == "chat":
        finish = chunk_head(meta, [{"finish_reason": "length", "index": 0, "delta": {}}])
        if not meta.include_usage:
            return [{**finish, "timings": job.timings()}]
        usage = {**chunk_head(meta, []), "usage": job.usage(), "timings": job.timings()}
        return [finish, usage]
    if kind == "text":
        body = final_json("text", job, meta)
        body["choices"][0]["text"] = ""
        return [body]
    body = final_json("native", job, meta)
    body["content"] = ""
    return [body]


def final_json(kind: str, job: Job, meta: ReplyMeta) -> dict[str, Any]:
    content = "".join(job.text)
    if kind == "chat":
        return {"choices": [{"finish_reason": "length", "index": 0,
                             "message": {"role": "assistant", "content": content}}],
                "created": meta.created, "model": meta.model, "system_fingerprint": BUILD_INFO,
                "object": "chat.completion", "usage": job.usage(), "id": meta.cmpl_id,
                "timings": job.timings()}
    if kind == "text":
        return {"choices": [{"text": content, "index": 0, "logprobs": None, "finish_reason": "length"}],
                "created": meta.created, "model": meta.model, "system_fingerprint": BUILD_INFO,
                "object": "text_completion", "usage": job.usage(), "id": meta.cmpl_id,
                "timings": job.timings()}
    return {"index": 0, "content": content, "tokens": [], "id_slot": job.slot_id, "stop": True,
            "model": meta.model, "tokens_predicted": len(job.text), "tokens_evaluated": job.n_prompt,
            "generation_settings": native_generation_settings(job.n_predict, job.stream),
            "prompt": job.prompt.decode(errors="replace"), "has_new_line": "\n" in content,
            "truncated": False, "stop_type": "limit", "stopping_word": "",
            "tokens_cached": job.n_prompt + len(job.text), "timings": job.timings()}


def embed(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    rng = random.Random(digest)
    vec = [rng.uniform(-1.0, 1.0) for _ in range(N_EMBD)]
    norm = sum(v * v for v in vec) ** 0.5 or 1.0
    return [v / norm for v in vec]


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m llamasim", description="simulated llama-server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18081)
    p.add_argument("--model", action="append", required=True, help="model id (repeat in router mode)")
    p.add_argument("--router", action="store_true")
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--kvu", action="store_true")
    p.add_argument("--token-ms", type=float, default=0.0)
    p.add_argument("--prompt-ms", type=float, default=0.0)
    p.add_argument("--cache-ram-tokens", type=int, default=1 << 30)
    p.add_argument("--models-max", type=int, default=1)
    p.add_argument("--load-s", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=16)
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(models=args.model, router=args.router, n_slots=args.slots, ctx=args.ctx, kvu=args.kvu,
                     cache_ram_tokens=args.cache_ram_tokens, prompt_ms_per_token=args.prompt_ms,
                     token_ms=args.token_ms, default_max_tokens=args.max_tokens, models_max=args.models_max,
                     load_s=args.load_s)


async def serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with SimServer(config_from_args(args), host=args.host, port=args.port) as sim:
        print(f"sim llama-server listening on {sim.url} (models: {', '.join(args.model)})", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
