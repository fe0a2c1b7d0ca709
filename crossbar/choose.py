"""Placement of a new conversation: which host should take it (pure, no I/O).

Only new conversations are placed here; an existing lease never moves because a
better host appeared (see `crossbar.lease`; a busy host's turn may yield, see
`crossbar.yieldpolicy`). A conversation stays where it is placed, so between hosts with
the same free slots the one holding less work wins (when every slot is busy, all tie at
zero free slots), never simply the first in config order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

MIN_WEIGHT = 1e-6  # a zero or negative weight ranks last, never divides by zero


class Candidate(NamedTuple):
    name: str
    healthy: bool
    draining: bool
    loaded: bool  # the host reports the model loaded
    listed: bool  # the host's config lists the model
    free_slots: int  # free slots for the model; zero or negative counts as 0
    weight: float
    queued: int  # crossbar's queue depth for (host, model)
    order: int  # position in the route's host list
    # The work the host holds for the model; the defaults describe an idle host.
    slots: int = 1  # capacity: parallel slots for the model
    in_flight: int = 0  # requests crossbar has forwarded and not finished
    active_leases: int = 0  # conversations leased to the host and used recently
    recent_busy: float = 0.0  # running requests averaged over the recent past (crossbar.learn)

    def held_per_capacity(self) -> float:
        """Work per slot x weight once the new conversation joins: running and queued requests,
        conversations that will come back, how busy the host has been lately, plus the newcomer
        (so between idle hosts the weight still decides)."""
        held = max(self.in_flight, 0) + max(self.queued, 0) + max(self.active_leases, 0)
        held += max(self.recent_busy, 0.0) + 1
        return held / (max(self.slots, 1) * max(self.weight, MIN_WEIGHT))


@dataclass(frozen=True, slots=True)
class Choice:
    host: str
    loads_model: bool  # no eligible host had the model loaded: this one will have to load it


def _eligible(c: Candidate) -> bool:
    return c.healthy and not c.draining


def _rank(c: Candidate) -> tuple[float, float, int, int]:
    """Sort key: the most free slots x weight first (work starts now), then the least work held
    per slot x weight, then the shortest queue; config order only between hosts that hold the
    same. Without held-work facts (their defaults) this is the plain free-slots ranking."""
    return (-(max(c.free_slots, 0) * c.weight), c.held_per_capacity(), c.queued, c.order)


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
