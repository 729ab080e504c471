"""What one gateway sees of one model's queue (`ModelQueue`): the work it awaits, weighed by cost, and how fast
that work is answered; from them the wait a new request can expect, for `admission.Admission` to bound.

The one idea: the rate is the weight answered per second *while work waited*, timed in spans from a busy spell's
first answer, so idle time (and time no box held the model) does not dilute it and a stall does (Little's law:
the weight awaited ÷ that rate is the wait). A generator's queue (`decode_admission.DecodeQueue`) is one of these
whose wait is counted in decode slots instead.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

_RATE_SPAN_S = 0.5  # the answer rate is kept in spans at least this long (shorter busy spells are not load)
_RATE_WINDOW_S = 2.0  # the spans that ended this recently give a model's current rate
_STEADY_WINDOW_S = 10.0  # ... unless those of this long gave a slower one (a fast stretch is not the pace)
_QUEUE_SETTLE_S = 0.5  # the oldest request must have waited this long before the estimate is trusted
# Answers close on each other's heels (under `_BATCH_GAP_S`) just after the one that starts the clock (under
# `_BATCH_S`) came in its batch: computed before the clock started, so the clock starts after them.
_BATCH_GAP_S = 0.005
_BATCH_S = 0.05
# What arrives within this long of a busy spell's first request came with it (clients sent it at once): a burst.
_BURST_S = 0.1
# How long the most weight a busy spell answered is remembered, as what the model has shown it can take in: the
# last spell's alone (one small request) held a request sent while a large one ran to a round of rows (tester h70).
_SHOWN_MEMORY_S = 60.0
_NOT_TIMED = (0.0, 1.0, -math.inf, 0.0)  # `ModelQueue._timed` before any spell was timed: no pace


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
    closed (one batch answered at once is no rate). Idle time does not dilute it, nor time away (`away`); a stall
    does, so a queue that stops being answered stops admitting. A spell that starts after an idle gap forgets the
    old spans: the model may be elsewhere now, or reloading. What outlasts the gap is the last spell's pace (the
    weight answered in it ÷ its whole length, a floor on how fast the model went then), how much it answered, and
    the most a spell answered in the last minute, used only to admit more than the rounds of batches a burst gets, and
    the pace of the last spell long enough to be timed (`timed_pace`), as far as the holders' pace since allows.
    """

    waiting: dict[str, tuple[float, int]] = field(default_factory=dict)  # id -> (monotonic send time, weight)
    weight: int = 0  # of the work waiting
    rows: int = 0  # of the work waiting: its inputs (an encoder's)
    _rows_of: dict[str, int] = field(default_factory=dict)  # id -> inputs, where more than one
    spans: deque[tuple[float, float, int]] = field(default_factory=deque)  # (ended, seconds, weight answered)
    _since: float | None = None  # the open span began (None: nothing answered yet in this busy spell)
    _done: int = 0  # weight answered in the open span
    _first: float = 0.0  # the busy spell's first answer came (it started the clock)
    _deadlines: list[tuple[float, str]] = field(default_factory=list)  # max-heap (-deadline, id), pruned lazily
    _spell_began: float = 0.0  # the first request of this busy spell was sent
    _spell_done: int = 0  # weight answered in this busy spell
    _pace: float = 0.0  # weight per second over the last busy spell, from its first request to its last one gone
    _shown: int = 0  # weight answered in the last busy spell
    _most_shown: int = 0  # the most weight a busy spell answered in the `_SHOWN_MEMORY_S` before `_most_shown_at`
    _most_shown_at: float = -math.inf  # when that spell ended
    _waited: float = 0.0  # how long the last request answered had waited: the span of answers the queue ahead took
    _spell_rows: int = 0  # inputs answered in this busy spell
    holders_pace: float = 0.0  # the weight a second its holders' heartbeats said lately (`Admission`), 0 unknown
    # The last busy spell that ran at least `_RATE_SPAN_S`, as a rate's span must: its weight a second and a row,
    # when it ended, and the holders' pace then (`timed_pace`).
    _timed: tuple[float, float, float, float] = _NOT_TIMED

    def add(self, request_id: str, now: float, weight: int, deadline: float = math.inf, rows: int = 1) -> None:
        """A request of `rows` inputs sent at `now`, dropped unstarted by any box once `deadline` (monotonic) has
        passed."""
        if not self.waiting:
            self._since, self._done = None, 0
            self._spell_began, self._spell_done, self._spell_rows = now, 0, 0
            self._deadlines.clear()
            if self.spans and self.spans[-1][0] < now - _RATE_WINDOW_S:
                self.spans.clear()
        self.waiting[request_id] = (now, weight)
        self.weight += weight
        self.rows += rows
        if rows != 1:
            self._rows_of[request_id] = rows
        heapq.heappush(self._deadlines, (-deadline, request_id))

    def remove(self, request_id: str, now: float, *, answered: bool) -> None:
        """The request is answered (a generation: started), or no longer awaited."""
        entry = self.waiting.pop(request_id, None)
        if entry is None:
            return
        self.weight -= entry[1]
        rows = self._rows_of.pop(request_id, 1)
        self.rows -= rows
        if answered:
            self._spell_done += entry[1]
            self._spell_rows += rows
            self._waited = now - entry[0]
            self._count(entry[1], now)
        if not self.waiting and now > self._spell_began:
            self._pace, self._shown = self._spell_done / (now - self._spell_began), self._spell_done
            if self._spell_done >= self._most_shown or now - self._most_shown_at > _SHOWN_MEMORY_S:
                self._most_shown, self._most_shown_at = self._spell_done, now
            if self._spell_done and now - self._spell_began >= _RATE_SPAN_S:
                self._timed = (self._pace, self._spell_done / max(1, self._spell_rows), now, self.holders_pace)

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
        self._spell_began, self._spell_done, self._spell_rows = now, 0, 0
        self._timed = _NOT_TIMED  # held now by other boxes, or back after an outage: not the pace of those it timed

    def away(self) -> None:
        """No live box holds the model now (evicted for budget, its box restarting): the open span stops, and the
        clock starts again at the first answer once a box holds it again. The seconds it was away answered nothing and
        say nothing of its pace: counted, the open span and the span its first answer back closed read a model
        answered at 13 s p99 as "about 10081s to start" (tester h214). The spans measured while it was served stand:
        measured afresh, each re-load under churn put it back on the rounds of an unmeasured model."""
        self._since, self._done = None, 0

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
        answered ÷ the time since its first request), but no more than twice what that spell answered, or the
        most a spell answered in the last minute: a lone short request answered in a few milliseconds shows a
        pace, not that the model would clear a thousand times its work at it (a slow start, as TCP's, each answer
        letting in at most twice its weight), while a large request it took in a moment ago shows what it can.
        """
        recent = self._most_shown if now - self._most_shown_at <= _SHOWN_MEMORY_S else 0
        shown = min(self._pace * seconds, 2.0 * max(self._shown, recent))
        if self.waiting and self._spell_done and now > self._spell_began:
            pace = self._spell_done / (now - self._spell_began)
            shown = max(shown, min(pace * seconds, 2.0 * self._spell_done))
        return max(shown, (self.rate(now) or 0.0) * seconds)

    def timed_pace(self, now: float, per_row: float) -> float:
        """The weight a second the model was timed at in its last busy spell of at least `_RATE_SPAN_S` (a rate's
        span), from that spell's first request to its last answer; 0 if none was. In the gateway's own weights, so
        the estimate's error is in it (the holders' pace is in padded tokens). No faster than the holders' pace
        now allows against theirs then (a box slower now, its pace read at these rows); past `_SHOWN_MEMORY_S`, only
        for work like that spell's (rows of half to twice its weight) and while the holders say a pace, to follow.
        Its rows go no faster than that spell's did: rows of `per_row` weight, shorter, at its rows a second. Held
        to twice that spell's work (`room`), 10 concurrent reranks of 64 documents on an idle box that had answered
        one such in 2 s had 8 refused (tester h214), 4 s of work let in against a bound of 10 s."""
        pace, spell_per_row, ended, holders_then = self._timed
        like = 0.5 <= per_row / spell_per_row <= 2.0
        followed = holders_then > 0 and self.holders_pace > 0
        if not pace or (now - ended > _SHOWN_MEMORY_S and not (like and followed)):
            return 0.0
        # Rows over twice that spell's may go slower a token (attention, padding); holders that said a pace then and
        # say none now are not those that were timed (a box loading it afresh): review h223.
        if per_row > 2.0 * spell_per_row or (holders_then > 0 and self.holders_pace <= 0):
            return 0.0
        if followed:
            pace *= min(1.0, self.holders_pace / holders_then)
        return pace * min(1.0, per_row / spell_per_row)

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
