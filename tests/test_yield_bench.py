"""The yield benchmark's event simulation: deterministic, complete, and yielding only when asked.
(Its figures are reported by the benchmark, never asserted here.)"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import yield_bench as yb


def test_same_sessions_same_result() -> None:
    assert yb.compare(3, [2.0]) == yb.compare(3, [2.0])


def test_every_turn_served_by_every_variant_and_only_yield_moves() -> None:
    report = yb.compare(0, [2.0])
    for load, (count, _) in yb.LOADS.items():
        rows = report[load]
        assert [r["turns"] for r in rows] == [count * yb.TURNS] * len(rows)
        assert [r["moves"] for r in rows[:3]] == [0, 0, 0]  # strict, before, yield off


class RecordingStrict(yb.Strict):
    def __init__(self, hosts: dict[str, yb.TimedHost]) -> None:
        super().__init__(hosts)
        self.placed: dict[str, set[str]] = {}

    def place(self, session: str, prompt_tokens: int, now: float) -> str:
        host = super().place(session, prompt_tokens, now)
        self.placed.setdefault(session, set()).add(host)
        return host


def test_strict_keeps_every_session_on_its_hash_host() -> None:
    policies: list[RecordingStrict] = []

    def make(hosts: dict[str, yb.TimedHost], clock: yb.VirtualClock) -> RecordingStrict:
        policies.append(RecordingStrict(hosts))
        return policies[-1]

    yb.run(yb.make_sessions(random.Random(1), 4, 1), make)
    placed = policies[0].placed
    assert len(placed) == 4 and all(len(hosts) == 1 for hosts in placed.values())
