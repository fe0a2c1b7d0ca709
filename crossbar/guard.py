"""Context guard: will this prompt fit the leased host's per-slot context?

The prompt size is estimated from the body: bytes/4 × 1.2 until the upstream's own counts
(`usage.prompt_tokens` of earlier replies for the same model) teach the model's real tokens per
byte. Tokenizers differ a lot: the lab's tiny models spend one token per byte, so a fixed bytes/4
would under-estimate them fourfold; the learned ratio is measured on the model actually served.
A context that is unknown (0) never blocks.
"""

from __future__ import annotations

import math

from crossbar.errors import CrossbarError

DEFAULT_BYTES_PER_TOKEN = 4.0
MARGIN = 1.2  # on the blind bytes/4 guess only
LEARNED_MARGIN = 1.0  # a ratio measured on the model itself needs none: refusing a prompt the
# server would accept is worse than letting the server refuse one (in the same error shape)
LEARN_MIN_BYTES = 256  # short prompts are dominated by the chat template's fixed overhead
LEARN_WEIGHT = 0.3


class TokenEstimator:
    def __init__(self, bytes_per_token: float = DEFAULT_BYTES_PER_TOKEN, margin: float = MARGIN):
        self.default_ratio = 1.0 / bytes_per_token  # tokens per byte
        self.margin = margin
        self.ratio: dict[str, float] = {}

    def estimate(self, model: str, prompt_bytes: int) -> int:
        if prompt_bytes <= 0:
            return 0
        learned = self.ratio.get(model)
        if learned is None:
            return math.ceil(round(prompt_bytes * self.default_ratio * self.margin, 6))
        return math.ceil(round(prompt_bytes * learned * LEARNED_MARGIN, 6))

    def learn(self, model: str, prompt_bytes: int, prompt_tokens: int | None) -> None:
        """Fold in one reply's real count (whole prompt, cached part included)."""
        if prompt_tokens is None or prompt_tokens <= 0 or prompt_bytes < LEARN_MIN_BYTES:
            return
        seen = prompt_tokens / prompt_bytes
        old = self.ratio.get(model)
        self.ratio[model] = seen if old is None else old + LEARN_WEIGHT * (seen - old)


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
