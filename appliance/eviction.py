"""The eviction order: which resident model a load that needs room takes the bytes of first (`EvictionOrder`).

The one idea: a model's bytes cost what they hold up until it is asked for again, so the one whose bytes will wait
longest for their next request goes first: its bytes times the gap between requests its demand says (`Demand`, the
requests it answered, each counting half as much every `DEMAND_HALF_LIFE_S`, kept across its evictions), or the time
since it was last used, if longer. A model loaded for requests serves its turn first (`turn_ends`), and of the models
the order would evict, only the fewest that free the room go (`fewest_first`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from appliance.residency import Resident

DEMAND_HALF_LIFE_S = 60.0  # an answer counts half as much in a model's demand after this long


@dataclass(slots=True)
class Demand:
    """How often a model is asked for: the requests it answered, each counting half as much every
    `DEMAND_HALF_LIFE_S`. Kept across its evictions: a model asked for often and evicted under pressure is judged by
    that when it comes back, not as a newcomer (tester h98: a fresh count made the most asked model go as often as
    with the least recently used first)."""

    count: float = 0.0
    at: float = 0.0

    def add(self, answered: int, now: float) -> None:
        self.count = self.count_at(now) + answered
        self.at = now

    def count_at(self, now: float) -> float:
        return self.count * 0.5 ** ((now - self.at) / DEMAND_HALF_LIFE_S)

    def gap_s(self, now: float) -> float:
        """The mean time between its requests that its count says (a steady rate r leaves r x half-life / ln 2)."""
        count = self.count_at(now)
        return DEMAND_HALF_LIFE_S / (count * math.log(2)) if count > 0 else math.inf


def idle_cost(resident: Resident, demand: Demand | None, now: float) -> float:
    """What keeping a model costs until it is asked for again, in byte-seconds: its bytes times how long it will
    likely wait for its next request. That wait is the gap between requests its demand says (`Demand`), or, when
    longer, how long it has not been used (a model asked for 6,000 times and then not at all must not outstay
    one asked for now: h98); a model never asked for (loaded by `/load`) counts as asked for once, at its load
    (judged by its idle time alone, it stayed where a model asked for once just then went).
    So a model asked for often stays where the least recently used would go (benchmarks/packing.py), and of two
    asked for as often the larger goes, freeing more room in one eviction."""
    demand = demand or Demand(1.0, resident.loaded_at)
    return max(1, resident.nbytes) * max(now - resident.last_used, demand.gap_s(now))


def turn_ends(resident: Resident, min_serve_s: float, first_answer_s: float) -> float:
    """When a model's turn ends: `min_serve_s` after its first answer, or as long as its load took if longer (a
    model serves at least as long as it took to load); before that answer, `first_answer_s` after its load."""
    if resident.first_used is None:
        return resident.loaded_at + first_answer_s
    return resident.first_used + max(min_serve_s, resident.load_s)


def fewest_first(ordered: list[Resident], shortfall: int) -> Resident:
    """The first to evict of `ordered` (non-empty, in eviction order): of the models that order would evict to free
    `shortfall` bytes, only the fewest that free them. A small model first in the order, whose bytes alone would not
    do, stays when the larger one after it frees enough."""
    chosen: list[Resident] = []
    freed = 0
    for resident in ordered:
        chosen.append(resident)
        freed += resident.nbytes
        if freed >= shortfall:
            break
    for resident in reversed(chosen[:-1]):  # the later ones first: they are the ones worth keeping
        if freed - resident.nbytes >= shortfall:
            chosen.remove(resident)
            freed -= resident.nbytes
    return chosen[0]


class EvictionOrder:
    """The order one box's `Residency` evicts its models in, with what it is reckoned from: each model's demand (kept
    across its evictions), whether it has requests in hand now (`in_use`), and how long its turn lasts."""

    def __init__(self, in_use: Callable[[str], bool], min_serve_s: float, first_answer_s: float) -> None:
        self._in_use = in_use  # whether a model has requests in hand now
        # A model loaded for requests keeps its place for its turn (`turn_ends`): it serves at least this long from
        # its first answer, or as long as its load took if longer; before its first answer, this long at most.
        self._min_serve_s = min_serve_s
        self._first_answer_s = first_answer_s
        self._demand: dict[str, Demand] = {}  # model -> how often it is asked for, kept across its evictions

    def answered(self, name: str, answered: int, now: float) -> None:
        """`name` finished `answered` requests now: its demand."""
        self._demand.setdefault(name, Demand()).add(answered, now)

    def demand(self, name: str) -> Demand | None:
        return self._demand.get(name)

    def forget(self, name: str) -> None:
        """`name` was deleted from the catalog: its demand goes with it."""
        self._demand.pop(name, None)

    def first(self, candidates: list[Resident], shortfall: int = 0) -> Resident | None:
        """Of the models that may be evicted, the one that goes first: one in its turn last, then an idle one before
        one with requests in hand (a generator asked once and still generating was "least recently used" beside a
        model asked since, and the load waited out its answer to evict it: a 504), then the one whose bytes will wait
        longest for their next request (`idle_cost`), then the least recently used. Of the models that order would
        evict to free `shortfall` bytes, only the fewest that free them (`fewest_first`)."""
        if not candidates:
            return None
        now = time.monotonic()
        ordered = sorted(
            candidates,
            key=lambda r: (self.in_its_turn(r, now), self._in_use(r.spec.name), -self._idle_cost(r, now), r.last_used),
        )
        return fewest_first(ordered, shortfall)

    def _idle_cost(self, resident: Resident, now: float) -> float:
        """What keeping a model costs until it is asked for again, in byte-seconds (`idle_cost`)."""
        return idle_cost(resident, self._demand.get(resident.spec.name), now)

    def in_its_turn(self, resident: Resident, now: float) -> bool:
        """A model with requests in hand, loaded lately, keeps its place until its turn ends (`turn_ends`). With
        more models asked for than the budget holds, the one just loaded had not answered yet, so it was the least
        recently used: each load evicted it before its worker pulled, and the box answered almost nothing but 504s
        (tester h95: 29 of 155 requests in 120 s, 212 of 234 loads unloaded while they started)."""
        return now < self.turn_ends(resident) and self._in_use(resident.spec.name)

    def turn_ends(self, resident: Resident) -> float:
        return turn_ends(resident, self._min_serve_s, self._first_answer_s)
