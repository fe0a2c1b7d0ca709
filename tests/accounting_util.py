"""Client-side helpers for the accounting and metrics tests: send chat turns through crossbar and
work out, independently of crossbar's own tap, what each answer told the client about tokens;
scrape `/_crossbar/metrics` into a flat dict."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from harness import HostSpec
from prometheus_client.parser import text_string_to_metric_families

from llamasim import SimConfig

CHAT = "/v1/chat/completions"


def host(parallel: int = 0, **sim: Any) -> HostSpec:
    """A simulated host serving model "m" (with `parallel` slots when given)."""
    slots = {"n_slots": parallel} if parallel else {}
    models = {"m": {"parallel": parallel} if parallel else {}}
    return HostSpec(models, sim=SimConfig(models=["m"], **sim, **slots))


@dataclass(frozen=True)
class Told:
    """The token figures one answer gave its client (contract: "Token figures in accounting")."""

    prompt: int
    cached: int
    completion: int


def told_by_json(obj: dict[str, Any]) -> Told:
    usage, timings = obj.get("usage") or {}, obj.get("timings") or {}
    details = usage.get("prompt_tokens_details") or {}
    if usage:
        return Told(usage["prompt_tokens"], timings.get("cache_n", details.get("cached_tokens", 0)),
                    usage["completion_tokens"])
    return Told(timings["prompt_n"] + timings["cache_n"], timings["cache_n"], timings["predicted_n"])


def told_by_stream(body: bytes) -> Told:
    """The last event carrying `usage` (include_usage), else the one carrying `timings`."""
    events = [json.loads(line[5:]) for line in body.split(b"\n")
              if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"]
    with_usage = [e for e in events if e.get("usage")]
    with_timings = [e for e in events if e.get("timings")]
    assert with_usage or with_timings, body[-500:]
    return told_by_json((with_usage or with_timings)[-1])


async def send_turn(session: aiohttp.ClientSession, base_url: str, route: str,
                    messages: Sequence[dict[str, str]], *, stream: bool = False,
                    include_usage: bool = False) -> Told:
    body: dict[str, Any] = {"messages": list(messages), "stream": stream}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    async with session.post(f"{base_url}/{route}{CHAT}", json=body) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw[:500]
    return told_by_stream(raw) if stream else told_by_json(json.loads(raw))


def total(answers: Iterable[Told]) -> Told:
    answers = list(answers)
    return Told(sum(a.prompt for a in answers), sum(a.cached for a in answers),
                sum(a.completion for a in answers))


# ---------------------------------------------------------------- metrics

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_exposition(text: str) -> tuple[dict[str, str], Samples]:
    """Family name -> type, and (sample name, labels) -> value."""
    types: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return types, samples


def summed(samples: Samples, name: str, **labels: str) -> float:
    """Sum of every sample `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


async def scrape(base_url: str) -> tuple[dict[str, str], Samples]:
    async with aiohttp.ClientSession() as s, s.get(base_url + "/_crossbar/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return parse_exposition(await resp.text())
