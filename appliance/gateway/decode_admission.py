"""A generator's side of admission: its decode slots as one gateway sees them (`Decoder`), shared by its
priorities' queues, and its queue (`DecodeQueue`, a `ModelQueue`).

The one idea: a generation is answered (for admission) when it starts and then holds a decode slot until its
answer is made, so its wait is counted in slot frees, each at the pace the last answers were made
(`Decoder.token_s`) for the length they ran, not as weight over an answer rate.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from appliance.gateway.model_queue import ModelQueue

_PACE_SAMPLES = 32  # a generator's pace is taken over its last this many generations made whole
_DECODER_IDLE_S = 10.0  # ... and forgotten after this long with none started, awaited or made


@dataclass(slots=True)
class Decoder:
    """One generator's decode slots as one gateway sees them, shared by its priorities' queues (a batch job's
    generations hold the slots interactive ones wait for): the generations started and not yet made, and how
    long the last ones held their slot for how many tokens."""

    slots: int = 1  # the decode slots this gateway may fill: a box's decode batch times its boxes' worth of them
    box_slots: int | None = None  # one box's decode batch (`options.max_batch_size`), the slots sharing its time;
    # None: `slots` are one box's
    running: dict[str, tuple[float, int, float]] = field(default_factory=dict)  # id -> (started, max_tokens, held)
    # (slots held meanwhile, on average; seconds; tokens made; its max_tokens) of the last generations made whole
    made: deque[tuple[float, float, int, int]] = field(default_factory=lambda: deque(maxlen=_PACE_SAMPLES))
    last_busy: float = -math.inf  # a generation was last started or made
    holders: frozenset[str] = frozenset()  # the boxes holding the model, as the fleet's heartbeats say now
    paced_on: frozenset[str] = frozenset()  # ... as they said when the last answer in `made` was made
    _held: float = 0.0  # slot-seconds held so far (the integral of `len(running)` over time), up to `last_busy`

    def _advance(self, now: float) -> None:
        if now > self.last_busy:
            if self.running:
                self._held += len(self.running) * (now - self.last_busy)
            self.last_busy = now

    def start(self, request_id: str, now: float, max_tokens: int) -> None:
        # Stamps come as chunks reached the gateway, applied as their streams' consumers run: not quite in order.
        now = max(now, self.last_busy)
        self._advance(now)
        self.running[request_id] = (now, max_tokens, self._held)

    def end(self, request_id: str, now: float, *, whole: bool, tokens: int = 0) -> None:
        """A generation let go of its slot: made `whole` (on one box in one go: its `tokens` and time count), or
        cut short."""
        entry = self.running.get(request_id)
        if entry is None:
            return
        now = max(now, self.last_busy)
        self._advance(now)
        del self.running[request_id]
        started, max_tokens, held_before = entry
        held = self._held - held_before
        if whole and tokens > 1 and now > started and held > 0:  # timed from its first chunk: its other tokens
            self.paced_on = self.holders
            self.made.append((held / (now - started), now - started, tokens, max(max_tokens, tokens)))

    def token_s(self) -> float | None:
        """How long a token holds a slot with every slot of its box busy: a box's slots, over the tokens a second
        the last generations were made at (each one's tokens times the slots held meanwhile on its box, over its
        seconds). A slot's pace on a GPU hardly depends on how many share the decode step; on a CPU they share
        its time, and an answer made alone takes a quarter of the time it takes four at once. Reckoned as on a
        CPU, a GPU's is overestimated (more refused) until answers are made with its slots full. The slots held
        meanwhile are taken as on one box (a box pulls as much as it has room for), at most a box's: counted over
        the fleet's, two answers made together on one of two boxes read as half their pace."""
        if not self.made:
            return None
        box = self.box_slots or self.slots
        # After each answer's first token, which started it.
        made = sum(min(held, box) * (tokens - 1) for held, _, tokens, _ in self.made)
        per_box = math.ceil(len(self.running) * box / max(1, self.slots))  # those running now, spread evenly
        return max(box, per_box) * sum(seconds for _, seconds, _, _ in self.made) / made

    def expected_tokens(self, max_tokens: int, made: float = 0.0) -> float:
        """How long an answer of at most `max_tokens` that has `made` tokens so far is expected to be: the mean
        length of the last answers longer than that (all of them, once past, its `max_tokens`), or the share of
        their `max_tokens` they used of its own if that is more, at most its `max_tokens`. `max_tokens` is a cap,
        not a length (a chat client's 8,192 for answers of 200), but a cap unlike the last ones' says something:
        after answers of 16, four of up to 1,000 were taken for answers of 16 (short requests let in behind them
        waited 52 s), and a running answer just past the mean for one that runs to its cap (half of them pass it)."""
        longer = [tokens for _, _, tokens, _ in self.made if tokens > made]
        residual = sum(longer) / len(longer) if longer else max_tokens
        share = sum(tokens / cap for _, _, tokens, cap in self.made) / len(self.made)
        return min(max_tokens, max(residual, share * max_tokens))

    def remaining_s(self, now: float, token_s: float) -> list[float]:
        """When each running generation is expected to let go of its slot (`expected_tokens`)."""
        remaining = []
        for started, max_tokens, _ in self.running.values():
            made = (now - started) / token_s
            remaining.append(max(0.0, (self.expected_tokens(max_tokens, made) - made) * token_s))
        return remaining

    def answer_s(self, max_tokens: int, token_s: float) -> float:
        """How long a generation not started yet is expected to hold its slot (`expected_tokens`)."""
        return self.expected_tokens(max_tokens) * token_s


@dataclass(slots=True)
class DecodeQueue(ModelQueue):
    """A generator's queue: a generation is answered (for admission) when it starts, and then holds a decode slot
    until its answer is made, so starts come when slots free, in clumps: taken as an encoder's answers, two slots
    freeing together read as five times the generator's rate (its first half-second let in 11 requests that
    waited up to 29 s); and `max_tokens` is a cap, not a length (a chat client's 8,192 for answers of 200).

    So its wait is counted in generations, not weight: a request that a free slot starts at once (fewer awaited
    than the slots not held) waits for none; one that waits for a slot waits for as many frees as there are
    requests ahead of it for a slot, at the pace answers have been made (`Decoder.token_s`). Until a
    generation has been made whole there is no such rate (or none lately: after `_DECODER_IDLE_S` with nothing
    started or awaited the model may be elsewhere now, unless the boxes holding it are those that made the last
    answers), and one that would wait for a slot is held to rounds of
    the decode batch in tokens, weighing the `max_tokens` of every generation it waits behind, those holding
    slots included, but not its own.
    """

    decoder: Decoder = field(default_factory=Decoder)

    def add(self, request_id: str, now: float, weight: int, deadline: float = math.inf, rows: int = 1) -> None:
        decoder = self.decoder
        idle = not decoder.running and not self.waiting and now - decoder.last_busy > _DECODER_IDLE_S
        # Kept while the boxes that made those answers still hold it (and maybe more: a burst has a second box load
        # it): a pause of over 10 s had a warm model's next burst refused by a third, answered in half a second
        # (black-box findings h41, h43, h44).
        if idle and (not decoder.paced_on or not decoder.paced_on <= decoder.holders):
            decoder.made.clear()
        # Not zero-argument super(): a slots dataclass is a new class, which the compiler's __class__ cell misses.
        super(DecodeQueue, self).add(request_id, now, weight, deadline, rows)

    def remove(self, request_id: str, now: float, *, answered: bool) -> None:
        entry = self.waiting.get(request_id)
        super(DecodeQueue, self).remove(request_id, now, answered=answered)
        if entry is not None and answered:
            self.decoder.start(request_id, now, entry[1])

    def finish(self, request_id: str, now: float, *, whole: bool, tokens: int = 0) -> None:
        self.decoder.end(request_id, now, whole=whole, tokens=tokens)

    def _free(self) -> int:
        return max(0, self.decoder.slots - len(self.decoder.running))

    def wait_s(self, now: float) -> float | None:
        """When a request sent now would start: when a slot frees for it, after those ahead of it for one have
        each had theirs, every generation holding a slot for its expected length (`Decoder.remaining_s`; one
        awaited: `Decoder.answer_s`) at `Decoder.token_s` a token. Slots free in clumps (answers started
        together end together): their spread is read from when each running one started."""
        decoder = self.decoder
        ahead = len(self.waiting) - self._free()
        if ahead < 0:
            return 0.0  # a free slot starts it
        token_s = decoder.token_s()
        if token_s is None:
            return None
        frees = decoder.remaining_s(now, token_s)
        frees += [0.0] * (max(decoder.slots, len(frees)) - len(frees))  # free slots, taken by those awaited
        heapq.heapify(frees)
        for _, max_tokens in self.waiting.values():  # the first take the free slots, the rest the next to free
            heapq.heapreplace(frees, frees[0] + decoder.answer_s(max_tokens, token_s))
        return frees[0]

    def answer_s(self, max_tokens: int) -> float:
        """How long a generation sent now is expected to run once started (0 before any answer is timed)."""
        token_s = self.decoder.token_s()
        return 0.0 if token_s is None else self.decoder.answer_s(max_tokens, token_s)

    def room(self, now: float, seconds: float) -> float:
        return 0.0  # only asked before a generation was made whole: nothing is known to start

    def held(self, weight: int) -> int | None:
        """The `max_tokens` of every generation a new one would wait behind (it starts when one of them is made):
        awaited, or holding a slot. Not its own length."""
        return self.weight + sum(tokens for _, tokens, _ in self.decoder.running.values())
