"""Placement of a new conversation: which host should take it (pure, no I/O).

Only new conversations are placed here; an existing lease never moves because a
better host appeared (see `crossbar.lease`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    healthy: bool
    draining: bool
    loaded: bool  # the host reports the model loaded
    listed: bool  # the host's config lists the model
    free_slots: int  # free slots for the model; zero or negative counts as 0
    weight: float
    queued: int  # crossbar's queue depth for (host, model)
    order: int  # position in the route's host list


@dataclass(frozen=True, slots=True)
class Choice:
    host: str
    loads_model: bool  # no eligible host had the model loaded: this one will have to load it


def _eligible(c: Candidate) -> bool:
    return c.healthy and not c.draining


def _rank(c: Candidate) -> tuple[float, int, int]:
    """Sort key: most free slots x weight first, then the shortest queue, then config order."""
    return (-(max(c.free_slots, 0) * c.weight), c.queued, c.order)


def _best(pool: list[Candidate]) -> Candidate | None:
    return min(pool, key=_rank) if pool else None


def choose(candidates: Sequence[Candidate]) -> Choice | None:
    """The host for a new conversation, or None when no eligible host can serve the model.

    Hosts with the model loaded win; only when none has it loaded does a host whose
    config lists it get chosen, and then `loads_model` is True.
    """
    eligible = [c for c in candidates if _eligible(c)]
    loaded = _best([c for c in eligible if c.loaded])
    if loaded is not None:
        return Choice(loaded.name, loads_model=False)
    listed = _best([c for c in eligible if c.listed])
    if listed is not None:
        return Choice(listed.name, loads_model=True)
    return None
