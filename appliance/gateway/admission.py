"""The gateway's admission control: whether a new request may wait for an answer, or gets a 429 now.

The one idea: refuse on the expected wait, not on a full queue. A queue that only refuses when it
is full lets every accepted request wait out its deadline under overload (a 504 after 30 s, not a
429 at once), so the gateway estimates how long a new request would wait, by Little's law over what
it sees of each model's queue: the work it awaits for that model (weighed by cost) ÷ the rate it is
answered. Past `max_queue_s` (or the request's own deadline) it answers 429 with the seconds until
the estimate would be back under the bound. Every gateway sees its own share of a shared queue and
of its answers, so the ratio holds without any gateway knowing the others.

Work that will expire unstarted still counts as work to do: under overload most of it does, and so
would the new request, so the wait is not capped at the deadlines of the work awaited (that let every
request whose deadline is within the bound in, to a 504); only the Retry-After is, since by the latest
of them that work has started or been dropped and a retry gets in. Before a rate is measured (a burst on
an idle model) the work awaited is bounded by the model's batches: what arrives with a busy spell's first
request (a burst) may fill four rounds of them, what keeps coming after (a flood) one, or what the model
has shown it starts within the bound if that is more; never nothing, never unbounded. Batch-priority
work, bounded by its deadline instead of `max_queue_s`, gets those rounds times deadline ÷ `max_queue_s`.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

from appliance.catalog import Batching
from appliance.envelope import BATCH
from appliance.errors import TooManyRequests
from appliance.metrics import Metrics

_RATE_SPAN_S = 0.5  # the answer rate is kept in spans at least this long (shorter busy spells are not load)
_RATE_WINDOW_S = 2.0  # the spans that ended this recently give a model's current rate
_STEADY_WINDOW_S = 10.0  # ... unless those of this long gave a slower one (a fast stretch is not the pace)
_QUEUE_SETTLE_S = 0.5  # the oldest request must have waited this long before the estimate is trusted
# Answers close on each other's heels (under `_BATCH_GAP_S`) just after the one that starts the clock (under
# `_BATCH_S`) came in its batch: computed before the clock started, so the clock starts after them.
_BATCH_GAP_S = 0.005
_BATCH_S = 0.05
# While a model's rate is not measured, what arrives together (within `_BURST_S` of a busy spell's first
# request: clients sent it at once) may fill this many rounds of its batches; what keeps coming after, one.
_BURST_ROUNDS = 4
_BURST_S = 0.1
_PACE_SAMPLES = 32  # a generator's pace is taken over its last this many generations made whole
_DECODER_IDLE_S = 10.0  # ... and forgotten after this long with none started, awaited or made
# A generator's round, while its pace is not measured: tokens a decode slot makes in a quarter of the default
# bound (2.5 s) at 20 a second, a small model on a CPU or a full decode batch of a larger one on a GPU. Counted
# in requests (each the decode batch's `max_batch_size`), 80 long generations sent at once to 8 decode slots
# were all let in, and half of them waited out their deadline (a 504 at 30 s, not a 429 at once).
GENERATION_ROUND_TOKENS = 50


def _retry_s(seconds: float) -> int:
    """A Retry-After: whole seconds, 1 to 60."""
    return max(1, min(60, math.ceil(seconds)))


def unmeasured_budget(
    batching: Batching, decode_batch: int | None = None, *, box_round: int | None = None, boxes: Fraction = Fraction(1)
) -> int:
    """One round of a model's batches: what `Admission` scales its bound by while the model's rate is not measured.

    For an encoder, a batch on each of its `concurrent_batches`, `max_batch_tokens` tokens each (a request
    weighs its tokens), on each of the `boxes`' worth of holders this gateway may fill: as a box holding it runs
    them (`box_round`, its profile's), else the catalog's knobs. The catalog's alone let a burst of 200 requests
    in against a profile's 1,024-token batches: four rounds of 16,384 tokens were 64 of the box's batches, and
    184 of them waited over the 10 s bound (black-box finding). For a generator, its `decode_batch` requests
    (the fleet's share already) each making `GENERATION_ROUND_TOKENS` tokens (a generation weighs its
    `max_tokens`): a round of its decode batch lasts as long as its longest answers.
    """
    if decode_batch is not None:
        return decode_batch * GENERATION_ROUND_TOKENS
    one_box = box_round or batching.max_batch_tokens * batching.concurrent_batches
    return max(1, math.floor(one_box * boxes))


@dataclass(slots=True)
class ModelQueue:
    """What one gateway sees of one model's queue (one priority): work awaited, and how fast it is answered.

    Work is weighed by what it costs the model: an encoder request by its tokens (one request of 250 long inputs
    must not count as one of a word), a generation by the tokens it may make (`max_tokens`: what delays a start
    is a free decode slot, held about as long as the answer runs; `DecodeQueue`). The rate is weight answered
    per second *while work waited*, timed from the first answer of a busy spell (the wait before it, a cold load
    say, says nothing of the model's pace, and nor does the rest of its batch, answered with it): over the spans
    that ended in the last `_RATE_WINDOW_S` (or as long as the last request answered waited, if longer: the answers that
    drained the queue ahead of it; a gateway whose share of a queue that other gateways share comes in runs must not
    read the others' run as a stall), or the last one when answers come seconds apart (large requests),
    and the span still open, or over those of the last `_STEADY_WINDOW_S` when that is slower (a box whose pace
    swings, on shared cores say, must not take in ten seconds of work in a fast second); none before a span has
    closed (one batch answered at once is no rate). Idle time does not dilute it; a stall does, so a queue that
    stops being answered stops admitting. A spell that starts after an idle gap forgets the old spans: the model
    may be elsewhere now, or reloading. What outlasts the gap is the last spell's pace (the weight answered in
    it ÷ its whole length, a floor on how fast the model went then) and how much it answered, used only to admit
    more than the rounds of batches a burst gets.
    """

    waiting: dict[str, tuple[float, int]] = field(default_factory=dict)  # id -> (monotonic send time, weight)
    weight: int = 0  # of the work waiting
    spans: deque[tuple[float, float, int]] = field(default_factory=deque)  # (ended, seconds, weight answered)
    _since: float | None = None  # the open span began (None: nothing answered yet in this busy spell)
    _done: int = 0  # weight answered in the open span
    _first: float = 0.0  # the busy spell's first answer came (it started the clock)
    _deadlines: list[tuple[float, str]] = field(default_factory=list)  # max-heap (-deadline, id), pruned lazily
    _spell_began: float = 0.0  # the first request of this busy spell was sent
    _spell_done: int = 0  # weight answered in this busy spell
    _pace: float = 0.0  # weight per second over the last busy spell, from its first request to its last one gone
    _shown: int = 0  # weight answered in the last busy spell
    _waited: float = 0.0  # how long the last request answered had waited: the span of answers the queue ahead took

    def add(self, request_id: str, now: float, weight: int, deadline: float = math.inf) -> None:
        """A request sent at `now`, dropped unstarted by any box once `deadline` (monotonic) has passed."""
        if not self.waiting:
            self._since, self._done = None, 0
            self._spell_began, self._spell_done = now, 0
            self._deadlines.clear()
            if self.spans and self.spans[-1][0] < now - _RATE_WINDOW_S:
                self.spans.clear()
        self.waiting[request_id] = (now, weight)
        self.weight += weight
        heapq.heappush(self._deadlines, (-deadline, request_id))

    def remove(self, request_id: str, now: float, *, answered: bool) -> None:
        """The request is answered (a generation: started), or no longer awaited."""
        entry = self.waiting.pop(request_id, None)
        if entry is None:
            return
        self.weight -= entry[1]
        if answered:
            self._spell_done += entry[1]
            self._waited = now - entry[0]
            self._count(entry[1], now)
        if not self.waiting and now > self._spell_began:
            self._pace, self._shown = self._spell_done / (now - self._spell_began), self._spell_done

    def _count(self, weight: int, now: float) -> None:
        if self._since is None:  # the spell's first answer starts the clock
            self._since = self._first = now
            return
        if not self._done and now - self._since < _BATCH_GAP_S and now - self._first < _BATCH_S:
            self._since = now  # the rest of the first answer's batch
            return
        self._done += weight
        if now - self._since >= _RATE_SPAN_S:
            self.spans.append((now, now - self._since, self._done))
            self._since, self._done = now, 0

    def restart_rate(self, now: float) -> None:
        """Measure the rate afresh from now: the answers that did not come while the gateway was cut off from NATS
        are not the model's pace (the open span, diluted by the outage, read as a model going ever slower: a 429
        "about 41s to start, retry in 31s" for a backlog cleared in 2 s). What the last spells showed stays."""
        self.spans.clear()
        self._since, self._done = None, 0
        self._spell_began, self._spell_done = now, 0

    def rate(self, now: float) -> float | None:
        """Weight answered per second while work waited, lately; None before a span of answers has closed."""
        while len(self.spans) > 1 and self.spans[0][0] < now - _STEADY_WINDOW_S:
            self.spans.popleft()
        if not self.spans:
            return None
        open_s = now - self._since if self.waiting and self._since is not None else 0.0
        # The answers that drained the queue ahead of a new request: over as long as the last one answered waited
        # (frozen while none is answered, so a stall is seen as soon as before).
        recent_s = min(max(_RATE_WINDOW_S, self._waited), _STEADY_WINDOW_S)
        rates = []
        for window_s in (recent_s, _STEADY_WINDOW_S):
            spans = [span for span in self.spans if span[0] >= now - window_s] or [self.spans[-1]]
            done = self._done + sum(answered for _, _, answered in spans)
            seconds = open_s + sum(span for _, span, _ in spans)
            rates.append(done / seconds if seconds > 0 else 0.0)
        return min(rates) or None

    def room(self, now: float, seconds: float) -> float:
        """The weight the model is known to start within `seconds`, for when the estimate is not trusted yet.

        At the current rate; or at the pace of the last busy spell, or of this one so far (the weight it
        answered ÷ the time since its first request), but no more than twice what that spell answered: a
        lone short request answered in a few milliseconds shows a pace, not that the model would clear a
        thousand times its work at it (a slow start, as TCP's, each answer letting in at most twice its weight).
        """
        shown = min(self._pace * seconds, 2.0 * self._shown)
        if self.waiting and self._spell_done and now > self._spell_began:
            pace = self._spell_done / (now - self._spell_began)
            shown = max(shown, min(pace * seconds, 2.0 * self._spell_done))
        return max(shown, (self.rate(now) or 0.0) * seconds)

    def held(self, weight: int) -> int | None:
        """The weight held to the bound while the model's rate is not measured if a request of `weight` joins: the
        work awaited, its own included. None when it goes at once: a request alone always goes."""
        return self.weight + weight if self.waiting else None

    def finish(self, request_id: str, now: float, *, whole: bool, tokens: int = 0) -> None:
        """A request answered (`remove`) is done with the model: for a generation, its answer of `tokens` was
        made (`whole`: on one box in one go), or cut short. Nothing to do for an encoder's, done when answered."""

    def together(self, now: float) -> bool:
        """Whether a request sent now comes with the busy spell's first (within `_BURST_S`): part of one burst."""
        return not self.waiting or now - self._spell_began < _BURST_S

    def latest_deadline(self) -> float:
        """When every request awaited now has either started or been dropped at its deadline."""
        heap = self._deadlines
        if len(heap) > 2 * len(self.waiting) + 64:  # mostly requests gone: rebuild rather than grow
            heap[:] = [entry for entry in heap if entry[1] in self.waiting]
            heapq.heapify(heap)
        while heap and heap[0][1] not in self.waiting:
            heapq.heappop(heap)
        return -heap[0][0] if heap else -math.inf

    def wait_s(self, now: float) -> float | None:
        """Expected wait of a request sent now (Little's law), or None while there is nothing to go by.

        Not trusted until the oldest awaited request has waited a while: a burst the box clears in a
        blink must not be refused on a rate measured when the work came a little at a time. Work that
        will expire unstarted counts as work to do: under overload most of it does, and so would this
        request (only `Retry-After` is reckoned to the latest deadline, when that work is gone).
        """
        if not self.waiting:
            return None
        oldest = next(iter(self.waiting.values()))[0]
        if now - oldest < _QUEUE_SETTLE_S:
            return None
        rate = self.rate(now)
        if rate is None:
            return None
        return self.weight / rate


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
    started or awaited the model may be elsewhere now), and one that would wait for a slot is held to rounds of
    the decode batch in tokens, weighing the `max_tokens` of every generation it waits behind, those holding
    slots included, but not its own.
    """

    decoder: Decoder = field(default_factory=Decoder)

    def add(self, request_id: str, now: float, weight: int, deadline: float = math.inf) -> None:
        decoder = self.decoder
        if not decoder.running and not self.waiting and now - decoder.last_busy > _DECODER_IDLE_S:
            decoder.made.clear()
        # Not zero-argument super(): a slots dataclass is a new class, which the compiler's __class__ cell misses.
        super(DecodeQueue, self).add(request_id, now, weight, deadline)

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


class Admission:
    """One gateway's admission decision: its per-model queues, its recent answers and the stream's backlog.

    The dispatcher asks it before publishing (`admit`), tells it of each answer (`answered`), and
    asks it for the 429 when the stream itself refuses (`overloaded`).
    """

    def __init__(
        self,
        metrics: Metrics,
        *,
        max_waiting: int,
        max_queue_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metrics = metrics
        self._max_waiting = max_waiting
        self._max_queue_s = max_queue_s
        self._clock = clock
        self._queues: dict[tuple[str, str], ModelQueue] = {}
        self._answered: deque[float] = deque(maxlen=4096)  # reply times, for the Retry-After estimate
        self.backlog = 0  # messages in the request stream, kept fresh by the box's stream monitor

    def admit(
        self,
        model: str,
        priority: str,
        timeout_s: float,
        waiting: int,
        *,
        weight: int,
        budget: int,
        decode_batch: int | None = None,
        box_decode_batch: int | None = None,
    ) -> ModelQueue:
        """The request's model queue, or the 429: it would wait too long to start, or the gateway awaits too many.

        `waiting` is how many requests the gateway awaits now; `weight` is the request's, and `budget` the
        weight its model may have awaited while its rate is not measured (`unmeasured_budget`). A generator's
        queue (one with a `decode_batch`: the decode slots it may fill, `box_decode_batch` of them on each box)
        is a `DecodeQueue`.
        """
        queue = self._queue(model, priority, decode_batch, box_decode_batch)
        self._bound(model, queue, timeout_s, priority, weight, budget)
        if waiting >= self._max_waiting:
            raise self.overloaded(f"this gateway already waits on {waiting} requests", waiting)
        return queue

    def answered(self, now: float) -> None:
        """A request was answered (a stream: its last chunk) at monotonic time `now`."""
        self._answered.append(now)

    def restart_rates(self) -> None:
        """The gateway was cut off from NATS, or is back on it: every model's rate is measured afresh."""
        now = self._clock()
        for queue in self._queues.values():
            queue.restart_rate(now)
        self._answered.clear()  # none came meanwhile: not a backlog draining slowly

    def waiting_for(self, model: str) -> int:
        """The requests for `model` this gateway awaits, every priority (a generation: until its answer starts)."""
        return sum(len(queue.waiting) for (name, _), queue in self._queues.items() if name == model)

    def forget(self, model: str) -> list[ModelQueue]:
        """A deleted model's queues, taken out of the reckoning (their requests are answered by the caller)."""
        keys = [key for key in self._queues if key[0] == model]
        return [self._queues.pop(key) for key in keys]

    def _queue(
        self, model: str, priority: str, decode_batch: int | None, box_decode_batch: int | None = None
    ) -> ModelQueue:
        queue = self._queues.get((model, priority))
        if queue is not None and isinstance(queue, DecodeQueue) != (decode_batch is not None):
            queue = None  # the name is another kind of model's now (deleted and registered again, the delete missed)
        if queue is None:  # not setdefault: that would build a ModelQueue on every request
            if decode_batch is None:
                queue = ModelQueue()
            else:
                others = (other for (name, _), other in self._queues.items() if name == model)
                shared = next((other.decoder for other in others if isinstance(other, DecodeQueue)), Decoder())
                queue = DecodeQueue(decoder=shared)
            self._queues[(model, priority)] = queue
        if isinstance(queue, DecodeQueue) and decode_batch is not None:
            queue.decoder.slots = decode_batch  # as the model's options and the fleet say now
            queue.decoder.box_slots = box_decode_batch
        return queue

    def _bound(self, model: str, queue: ModelQueue, timeout_s: float, priority: str, weight: int, budget: int) -> None:
        """429 when a new request would wait longer than the queue bound (or its own deadline) to start.

        Batch-priority work is meant to wait behind interactive work, so only its deadline bounds it.
        While the estimate is not trusted yet, the work awaited (this request's included) is held to
        `_BURST_ROUNDS` rounds of batches (`budget` is one) for a request sent with the busy spell's first
        (a burst), to one round for one sent later (a flood), or to what the model is known to start
        within the bound (`ModelQueue.room`) if that is more; batch priority gets those rounds times its
        deadline ÷ `max_queue_s` (a bulk job with a long deadline is not a flood), interactive work with a
        deadline short of `max_queue_s` those rounds times deadline ÷ `max_queue_s` (a burst of 200 with 5 s
        deadlines was let in whole and 197 ended 504, black-box finding). A request alone always goes. Its
        Retry-After is 1: the rate is soon measured, or the burst answered.

        A generation's deadline covers its answer too: it must start in time to be made, with an answer's length to
        spare (batch generations with 300 s deadlines were let in to start at 290 s, then at 293 s against an
        estimate of 287 s, and cut), and a batch job's rounds are not scaled by it.
        """
        limit = timeout_s if priority == BATCH else min(self._max_queue_s, timeout_s)
        generation = isinstance(queue, DecodeQueue)
        if generation:  # and an answer's length of slack: the estimate may be off by a slot's free
            limit = max(0.0, min(limit, timeout_s - 2 * queue.answer_s(weight)))
        now = self._clock()
        wait_s = queue.wait_s(now)
        if wait_s is not None:
            if wait_s > limit:
                # Back under the limit as the work drains, or once what is awaited now has started or been
                # dropped at its deadline, whichever is sooner (a generation may wait on slots alone).
                gone_s = queue.latest_deadline() - now if queue.waiting else math.inf
                retry = _retry_s(min(wait_s, gone_s) - limit)
                why = f"what this gateway awaits for it would take about {wait_s:.0f}s to start, over {limit:g}s"
                self._refuse(model, why, retry)
            return
        rounds = _BURST_ROUNDS if queue.together(now) else 1
        if priority == BATCH and not generation:
            rounds *= max(1.0, limit / self._max_queue_s)
        elif priority != BATCH:  # the rounds meant to start within the bound, fewer for a deadline short of it
            rounds *= min(1.0, limit / self._max_queue_s)
        held = queue.held(weight)
        if held is not None and held > max(budget * rounds, queue.room(now, limit)):
            generating = len(queue.decoder.running) if isinstance(queue, DecodeQueue) else 0
            also = f" and {generating} generating" if generating else ""
            # Not "would wait too long": nothing is known of its pace yet (the box may clear them in a blink).
            why = f"this gateway already awaits {len(queue.waiting)} requests for it{also}"
            self._refuse(model, f"{why}, as much as it lets wait before it has timed the model's answers", 1)

    def _refuse(self, model: str, why: str, retry: int) -> None:
        self._metrics.refused.labels(model).inc()
        raise TooManyRequests(f"model {model} is overloaded: {why}; retry in {retry}s", retry_after_s=retry)

    def overloaded(self, why: str, waiting: int) -> TooManyRequests:
        """The 429 for `why`, with the Retry-After of `retry_after_s`."""
        retry = self.retry_after_s(waiting)
        return TooManyRequests(f"{why}; retry in {retry}s", retry_after_s=retry)

    def retry_after_s(self, waiting: int) -> int:
        """Seconds until the backlog would drain at the rate answers have been arriving lately."""
        now = time.monotonic()
        recent = [t for t in self._answered if now - t <= 10.0]
        if not recent:
            return 1
        # Over the time the kept answers span (under 10 s when the gateway just started answering or the
        # deque is full), and the backlog counts the requests this gateway waits for: not both.
        rate = len(recent) / max(1.0, now - recent[0])
        return _retry_s(max(self.backlog, waiting) / rate)
