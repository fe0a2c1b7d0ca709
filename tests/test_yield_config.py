"""The lease-yield settings: `yield_factor` at the top level and per route."""

from __future__ import annotations

import math
from typing import Any

import pytest

from crossbar.config import ConfigError, parse_config
from crossbar.yieldpolicy import DEFAULT_FACTOR


def config(top: object = None, route: object = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "listen": "127.0.0.1:7777",
        "hosts": {"alpha": {"base_url": "http://127.0.0.1:18081", "models": ["m"]}},
        "routes": {"a": {"hosts": ["alpha"]}},
    }
    if top is not None:
        data["yield_factor"] = top
    if route is not None:
        data["routes"]["a"]["yield_factor"] = route
    return data


def test_defaults() -> None:
    cfg = parse_config(config())
    assert cfg.yield_factor == DEFAULT_FACTOR == 2.0
    assert cfg.routes["a"].yield_factor is None  # the top-level factor applies


@pytest.mark.parametrize("value", [0, 1, 1.5, 3])
def test_accepted(value: float) -> None:
    cfg = parse_config(config(top=value, route=value))
    assert cfg.yield_factor == cfg.routes["a"].yield_factor == float(value)


BAD: list[tuple[object, str]] = [
    (0.5, "must be 0 (off) or a number >= 1, got 0.5"),
    (-1, "must be 0 (off) or a number >= 1, got -1"),
    (math.inf, "must be 0 (off) or a number >= 1, got inf"),
    ("2", "expected number, got string"),
    (True, "expected number, got boolean"),
]


@pytest.mark.parametrize(("value", "problem"), BAD, ids=[repr(b[0]) for b in BAD])
def test_refused(value: object, problem: str) -> None:
    with pytest.raises(ConfigError) as top:
        parse_config(config(top=value))
    assert str(top.value).startswith(f"yield_factor: {problem}")
    with pytest.raises(ConfigError) as route:
        parse_config(config(route=value))
    assert str(route.value).startswith(f"routes.a.yield_factor: {problem}")
