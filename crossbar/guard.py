"""Context guard: will this prompt fit the leased host's per-slot context?

The prompt size is estimated from the body: bytes/4 × 1.2 until the upstream's own counts
(`usage.prompt_tokens` of earlier chat/completion replies of the same host and model) teach the
real tokens per byte. Tokenizers differ a lot: the lab's tiny models spend one token per byte, so a
fixed bytes/4 would under-estimate them fourfold; the learned ratio is measured on what is served.

An upstream is not trusted, so learning is bounded: only chat and completion replies teach (an
embeddings call with token arrays says nothing about text), a ratio outside a sane band is never
believed, a sample far from what was learned is ignored (unless several in a row agree), and a
ratio not confirmed for `forget_after` is forgotten. The learned estimate may move a prompt to a
host with a larger context, but it alone never refuses one: the caller refuses only when the plain
byte estimate does not fit either (otherwise the host decides, answering in the same shape).
A context that is unknown (0) never blocks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from crossbar.errors import CrossbarError

DEFAULT_BYTES_PER_TOKEN = 4.0
MARGIN = 1.2  # on the blind bytes/4 guess only
LEARNED_MARGIN = 1.0  # a ratio measured on the model itself needs none: refusing a prompt the
# server would accept is worse than letting the server refuse one (in the same error shape)
ROUNDING_SLACK = 5e-7  # far above the error of a product of a few floats, far below one token
LEARN_MIN_BYTES = 256  # short prompts are dominated by the chat template's fixed overhead
LEARN_WEIGHT = 0.3
RATIO_BAND = (0.02, 1.5)  # tokens per byte any real tokenizer stays within (1.0: byte-level models)
OUTLIER_FACTOR = 3.0  # a sample this many times off the learned ratio is an outlier
OUTLIERS_TO_RESEED = 3  # ... unless this many in a row agree: then the model really changed
FORGET_AFTER = 3600.0  # seconds without a believed sample before a learned ratio is dropped
LEARN_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


@dataclass(slots=True)
class _Learned:
    ratio: float  # tokens per byte
    at: float  # when a sample last confirmed it
    outliers: list[float]  # consecutive outlying samples


class TokenEstimator:
    """Tokens per byte, learned per (host, model)."""

    def __init__(self, bytes_per_token: float = DEFAULT_BYTES_PER_TOKEN, margin: float = MARGIN,
                 clock: Callable[[], float] = time.monotonic, forget_after: float = FORGET_AFTER):
        self.default_ratio = 1.0 / bytes_per_token
        self.margin = margin
        self.clock = clock
        self.forget_after = forget_after
        self._learned: dict[tuple[str, str], _Learned] = {}

    def plain(self, prompt_bytes: int) -> int:
        """The blind estimate: bytes/4 with a margin."""
        if prompt_bytes <= 0:
            return 0
        return _whole_tokens(prompt_bytes * self.default_ratio * self.margin)

    def ratio(self, host: str, model: str) -> float | None:
        """The learned tokens per byte of (host, model), or None (never learned, or forgotten)."""
        entry = self._learned.get((host, model))
        if entry is None:
            return None
        if self.clock() - entry.at > self.forget_after:
            del self._learned[(host, model)]
            return None
        return entry.ratio

    def forget(self, host: str) -> None:
        """Drop what was learned on a host (it left the configuration, or is another server now)."""
        for key in [k for k in self._learned if k[0] == host]:
            del self._learned[key]

    def estimate(self, host: str, model: str, prompt_bytes: int) -> int:
        if prompt_bytes <= 0:
            return 0
        learned = self.ratio(host, model)
        if learned is None:
            return self.plain(prompt_bytes)
        return _whole_tokens(prompt_bytes * learned * LEARNED_MARGIN)

    def learn(self, host: str, model: str, path: str, prompt_bytes: int, prompt_tokens: int | None) -> None:
        """Fold in one reply's real count (whole prompt, cached part included)."""
        if path not in LEARN_PATHS or prompt_tokens is None or prompt_bytes < LEARN_MIN_BYTES:
            return
        seen = prompt_tokens / prompt_bytes
        if not RATIO_BAND[0] <= seen <= RATIO_BAND[1]:
            return
        now = self.clock()
        old = self.ratio(host, model)
        if old is None:
            self._learned[(host, model)] = _Learned(seen, now, [])
            return
        entry = self._learned[(host, model)]
        if max(seen / old, old / seen) > OUTLIER_FACTOR:
            entry.outliers.append(seen)
            if len(entry.outliers) >= OUTLIERS_TO_RESEED and _agree(entry.outliers):
                self._learned[(host, model)] = _Learned(sum(entry.outliers) / len(entry.outliers), now, [])
            return
        entry.ratio, entry.at, entry.outliers = old + LEARN_WEIGHT * (seen - old), now, []


def _whole_tokens(estimate: float) -> int:
    """`estimate` rounded up, where a product that lands a hair above a whole number (300.00000000000006
    for 1000 bytes x 0.25 x 1.2) is that number. As `ceil(round(estimate, 6))` but without the
    decimal conversion `round` makes, which cost a request more than the rest of the estimate."""
    return math.ceil(estimate - ROUNDING_SLACK)


def _agree(samples: list[float]) -> bool:
    return max(samples) / min(samples) <= OUTLIER_FACTOR


def fits(tokens: int, n_ctx: int) -> bool:
    """llama-server refuses a prompt of n_ctx tokens or more (it needs room to generate)."""
    return n_ctx <= 0 or tokens < n_ctx


def overflow(n_prompt_tokens: int, n_ctx: int) -> CrossbarError:
    """llama-server's own overflow shape, so a client that handles the server's error handles ours."""
    message = (f"prompt too large: request (~{n_prompt_tokens} tokens) exceeds the available context "
               f"size ({n_ctx} tokens) of every host that serves this model")
    return CrossbarError(
        400, "exceed_context_size_error", message,
        payload={"error": {"code": 400, "type": "exceed_context_size_error", "message": message,
                           "n_prompt_tokens": n_prompt_tokens, "n_ctx": n_ctx}},
    )
