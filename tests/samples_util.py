"""Read the real llama-server's recorded replies and compare JSON shapes against them."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAMPLES = Path(os.environ.get("CROSSBAR_LLAMA_SAMPLES",
                              Path(__file__).resolve().parents[2] / "shared" / "llama-lab" / "samples"))


@dataclass
class Sample:
    status: int
    headers: dict[str, str]
    body: str

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[Any]:
        return sse_events(self.body)


def load(name: str) -> Sample:
    """Parse `# comment`, `HTTP <status>`, header lines, a blank line, then the body."""
    lines = (SAMPLES / name).read_text().split("\n")
    assert lines[0].startswith("#") and lines[1].startswith("HTTP ")
    status = int(lines[1].split()[1])
    headers: dict[str, str] = {}
    i = 2
    while lines[i].strip():
        key, _, value = lines[i].partition(":")
        headers[key.strip().lower()] = value.strip()
        i += 1
    return Sample(status, headers, "\n".join(lines[i + 1:]))


def sse_events(body: str) -> list[Any]:
    """Every `data:` event; `[DONE]` is returned as the string itself."""
    out: list[Any] = []
    for block in body.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return type(value).__name__


def shape_diff(sim: Any, real: Any, path: str = "$", order: bool = True) -> list[str]:
    """Differences in key sets (and key order), value kinds, recursively; ints and floats match."""
    if kind(sim) != kind(real):
        return [f"{path}: sim {kind(sim)} != real {kind(real)}"]
    if isinstance(real, dict):
        return dict_diff(sim, real, path, order)
    if isinstance(real, list) and real and sim:
        pairs = zip(sim, real, strict=True) if len(sim) == len(real) else ((item, real[0]) for item in sim)
        return [d for a, b in pairs for d in shape_diff(a, b, f"{path}[]", order)]
    return []


def dict_diff(sim: dict[str, Any], real: dict[str, Any], path: str, order: bool) -> list[str]:
    out: list[str] = []
    missing = set(real) - set(sim)
    extra = set(sim) - set(real)
    if missing:
        out.append(f"{path}: missing keys {sorted(missing)}")
    if extra:
        out.append(f"{path}: extra keys {sorted(extra)}")
    if order and not missing and not extra and list(sim) != list(real):
        out.append(f"{path}: key order {list(sim)} != {list(real)}")
    for key in set(sim) & set(real):
        out += shape_diff(sim[key], real[key], f"{path}.{key}", order)
    return out


def metric_names(text: str) -> list[str]:
    return [line.split()[0] for line in text.splitlines() if line and not line.startswith("#")]
