"""The gateway's admission control: whether a new request may wait for an answer, or gets a 429 now.

The one idea: refuse on the expected wait, not on a full queue. A queue that only refuses when it
is full lets every accepted request wait out its deadline under overload (a 504 after 30 s, not a
429 at once), so the gateway estimates how long a new request would wait, by Little's law over what
it sees of each model's queue: the work it awaits for that model (weighed by cost) ÷ the rate it is
answered. Past `max_queue_s` (or the request's own deadline) it answers 429 with the seconds until
the estimate would be back under the bound. Every gateway sees its own share of a shared queue and
of its answers, so the ratio holds without any gateway knowing the others.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from appliance.envelope import BATCH
from appliance.errors import TooManyRequests
from appliance.metrics import Metrics

_RATE_SPAN_S = 0.5  # the answer rate is kept in spans at least this long (shorter busy spells are not load)
_RATE_WINDOW_S = 2.0  # the spans that ended this recently give a model's current rate
_QUEUE_SETTLE_S = 0.5  # the oldest request must have waited this long before the estimate is trusted


def _retry_s(seconds: float) -> int:
    """A Retry-After: whole seconds, 1 to 60."""
    return max(1, min(60, math.ceil(seconds)))


@dataclass(slots=True)
class ModelQueue:
    """What one gateway sees of one model's queue (one priority): work awaited, and how fast it is answered.

    Work is weighed by what it costs the model: an encoder request by its tokens (one request of 250
    long inputs must not count as one of a word), a generation as one (what delays its start is a
    free decode slot). The rate is weight answered per second *while work waited*, timed from the
    first answer of a busy spell (the wait before it, a cold load say, says nothing of the model's
    pace): over the spans that ended in the last `_RATE_WINDOW_S`, or the last one when answers come
    seconds apart (large requests), and the span still open. Idle time does not dilute it; a stall
    does, so a queue that stops being answered stops admitting. A spell that starts after an idle
    gap forgets the old spans: the model may be elsewhere now, or reloading.
    """

    waiting: dict[str, tuple[float, int]] = field(default_factory=dict)  # id -> (monotonic send time, weight)
    weight: int = 0  # of the work waiting
    spans: deque[tuple[float, float, int]] = field(default_factory=deque)  # (ended, seconds, weight answered)
    _since: float | None = None  # the open span began (None: nothing answered yet in this busy spell)
    _done: int = 0  # weight answered in the open span

    def add(self, request_id: str, now: float, weight: int) -> None:
        if not self.waiting:
            self._since, self._done = None, 0
            if self.spans and self.spans[-1][0] < now - _RATE_WINDOW_S:
                self.spans.clear()
        self.waiting[request_id] = (now, weight)
        self.weight += weight

    def remove(self, request_id: str, now: float, *, answered: bool) -> None:
        """The request is answered (a generation: started), or no longer awaited."""
        entry = self.waiting.pop(request_id, None)
        if entry is None:
            return
        self.weight -= entry[1]
        if not answered:
            return
        if self._since is None:  # the spell's first answer starts the clock
            self._since = now
            return
        self._done += entry[1]
        if now - self._since >= _RATE_SPAN_S:
            self.spans.append((now, now - self._since, self._done))
            self._since, self._done = now, 0

    def rate(self, now: float) -> float | None:
        """Weight answered per second while work waited, lately; None before anything was answered."""
        while len(self.spans) > 1 and self.spans[0][0] < now - _RATE_WINDOW_S:
            self.spans.popleft()
        done = self._done + sum(answered for _, _, answered in self.spans)
        open_s = now - self._since if self.waiting and self._since is not None else 0.0
        seconds = open_s + sum(span for _, span, _ in self.spans)
        return done / seconds if done and seconds > 0 else None

    def wait_s(self, now: float) -> float | None:
        """Expected wait of a request sent now (Little's law), or None while there is nothing to go by.

        Not trusted until the oldest awaited request has waited a while: a burst the box clears in a
        blink must not be refused on a rate measured when the work came a little at a time.
        """
        if not self.waiting:
            return None
        oldest = next(iter(self.waiting.values()))[0]
        if now - oldest < _QUEUE_SETTLE_S:
            return None
        rate = self.rate(now)
        return None if rate is None else self.weight / rate


class Admission:
    """One gateway's admission decision: its per-model queues, its recent answers and the stream's backlog.

    The dispatcher asks it before publishing (`admit`), tells it of each answer (`answered`), and
    asks it for the 429 when the stream itself refuses (`overloaded`).
    """

    def __init__(self, metrics: Metrics, *, max_waiting: int, max_queue_s: float) -> None:
        self._metrics = metrics
        self._max_waiting = max_waiting
        self._max_queue_s = max_queue_s
        self._queues: dict[tuple[str, str], ModelQueue] = {}
        self._answered: deque[float] = deque(maxlen=4096)  # reply times, for the Retry-After estimate
        self.backlog = 0  # messages in the request stream, kept fresh by the box's stream monitor

    def admit(self, model: str, priority: str, timeout_s: float, waiting: int) -> ModelQueue:
        """The request's model queue, or the 429: it would wait too long to start, or the gateway awaits too many.

        `waiting` is how many requests the gateway awaits now.
        """
        queue = self._queue(model, priority)
        self._bound(model, queue, timeout_s, priority)
        if waiting >= self._max_waiting:
            raise self.overloaded(f"this gateway already waits on {waiting} requests", waiting)
        return queue

    def answered(self, now: float) -> None:
        """A request was answered (a stream: its last chunk) at monotonic time `now`."""
        self._answered.append(now)

    def forget(self, model: str) -> list[ModelQueue]:
        """A deleted model's queues, taken out of the reckoning (their requests are answered by the caller)."""
        keys = [key for key in self._queues if key[0] == model]
        return [self._queues.pop(key) for key in keys]

    def _queue(self, model: str, priority: str) -> ModelQueue:
        queue = self._queues.get((model, priority))
        if queue is None:  # not setdefault: that would build a ModelQueue on every request
            queue = self._queues[(model, priority)] = ModelQueue()
        return queue

    def _bound(self, model: str, queue: ModelQueue, timeout_s: float, priority: str) -> None:
        """429 when a new request would wait longer than the queue bound (or its own deadline) to start.

        Batch-priority work is meant to wait behind interactive work, so only its deadline bounds it.
        """
        limit = timeout_s if priority == BATCH else min(self._max_queue_s, timeout_s)
        wait_s = queue.wait_s(time.monotonic())
        if wait_s is not None and wait_s > limit:
            self._metrics.refused.labels(model).inc()
            retry = _retry_s(wait_s - limit)
            raise TooManyRequests(
                f"model {model} is overloaded: a request sent now would wait about {wait_s:.0f}s "
                f"to start, over the limit of {limit:g}s; retry in {retry}s",
                retry_after_s=retry,
            )

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
