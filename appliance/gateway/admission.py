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
has shown it starts within the bound if that is more; never nothing, never unbounded. Where its pace is known
(the holders' heartbeats, halved for the estimate's error, or a busy spell this gateway timed, as they follow it),
a request goes whose work *ahead* starts within the bound at that pace: its own work does not delay its start.
Batch-priority work, bounded by its deadline instead of `max_queue_s`, gets those rounds times deadline ÷
`max_queue_s`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator
from fractions import Fraction

from appliance.catalog import Batching
from appliance.envelope import BATCH
from appliance.errors import TooManyRequests
from appliance.gateway.decode_admission import DecodeQueue, Decoder
from appliance.gateway.model_queue import ModelQueue
from appliance.metrics import Metrics

# While a model's rate is not measured, what arrives together (a burst: `ModelQueue.together`) may fill this many
# rounds of its batches; what keeps coming after, one.
_BURST_ROUNDS = 4
# A generator's round, while its pace is not measured: tokens a decode slot makes in a quarter of the default
# bound (2.5 s) at 20 a second, a small model on a CPU or a full decode batch of a larger one on a GPU. Counted
# in requests (each the decode batch's `max_batch_size`), 80 long generations sent at once to 8 decode slots
# were all let in, and half of them waited out their deadline (a 504 at 30 s, not a 429 at once).
GENERATION_ROUND_TOKENS = 50


def _retry_s(seconds: float) -> int:
    """A Retry-After: whole seconds, 1 to 60."""
    return max(1, min(60, math.ceil(seconds)))


def unmeasured_budget(
    batching: Batching,
    decode_batch: int | None = None,
    *,
    box_round: int | None = None,
    box_rows: int | None = None,
    per_input: float | None = None,
    boxes: Fraction = Fraction(1),
) -> int:
    """One round of a model's batches: what `Admission` scales its bound by while the model's rate is not measured.

    For an encoder, a batch on each of its `concurrent_batches`, `max_batch_tokens` tokens each (a request
    weighs its tokens), on each of the `boxes`' worth of holders this gateway may fill: as a box holding it runs
    them (`box_round`, its profile's), else the catalog's knobs. The catalog's alone let a burst of 200 requests
    in against a profile's 1,024-token batches: four rounds of 16,384 tokens were 64 of the box's batches, and
    184 of them waited over the 10 s bound (black-box finding). A round holds at most `box_rows` inputs (the
    profile's `max_batch_size` × `concurrent_batches`, else the catalog's), so of inputs of `per_input` tokens it
    holds no more than that many: counted in tokens alone, a model of 4-row batches let 600 short requests of a
    burst in, 30 s of its work (black-box finding). For a generator, its `decode_batch` requests
    (the fleet's share already) each making `GENERATION_ROUND_TOKENS` tokens (a generation weighs its
    `max_tokens`): a round of its decode batch lasts as long as its longest answers. Where the holders have
    measured their pace, `Admission` lets in at least what they compute in half the bound (`paced_round`).
    """
    if decode_batch is not None:
        return decode_batch * GENERATION_ROUND_TOKENS
    one_box = box_round or batching.max_batch_tokens * batching.concurrent_batches
    if per_input is not None:  # a round holds so many rows, however short: inputs of `per_input` tokens fill it first
        rows = box_rows or batching.max_batch_size * batching.concurrent_batches
        one_box = min(one_box, max(1, math.ceil(rows * per_input)))
    return max(1, math.floor(one_box * boxes))


def paced_round(pace: float | None, rows_pace: float | None, per_input: float | None, max_queue_s: float = 10.0) -> int:
    """A round by the holders' measured pace (`pace`: the tokens a second they compute in rows of `per_input` tokens,
    this gateway's share): a `_BURST_ROUNDS`th of what they compute in half of `max_queue_s`, 0 where no pace is
    known. Four of the profile's 1,024-token rounds, a fraction of a second of a box's work, refused half of 8
    requests of 32 inputs its box answered in under one (review r41), where four rounds of the catalog's were a
    minute of it. Half: the pace is the device's, in padded tokens where a request weighs an estimate; a burst
    unlike the rows it has timed waits longer than it says (review r42). Inputs of `per_input` tokens go no faster
    than `rows_pace` rows a second: read in tokens alone, the warm-up's 40-token rows let thousands of 3-token
    requests of a burst in on a model of 2-row batches (review r51)."""
    if pace and per_input is not None and rows_pace:
        pace = min(pace, rows_pace * per_input)
    return math.floor(pace * max_queue_s / (2 * _BURST_ROUNDS)) if pace else 0


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
        paced: int = 0,
        decode_batch: int | None = None,
        box_decode_batch: int | None = None,
        holders: frozenset[str] | None = None,
    ) -> ModelQueue:
        """The request's model queue, or the 429: it would wait too long to start, or the gateway awaits too many.

        `waiting` is how many requests the gateway awaits now; `weight` is the request's, and `budget` the
        weight its model may have awaited while its rate is not measured (`unmeasured_budget`), `paced` the part of
        it its holders' measured pace gives (`paced_round`). A generator's
        queue (one with a `decode_batch`: the decode slots it may fill, `box_decode_batch` of them on each box)
        is a `DecodeQueue`; `holders` the boxes holding it (its pace is kept over a pause while they are the same).
        """
        queue = self._queue(model, priority, decode_batch, box_decode_batch)
        queue.holders_pace = paced * 2 * _BURST_ROUNDS / self._max_queue_s  # `paced_round`'s pace, a second
        if holders is not None and isinstance(queue, DecodeQueue):
            queue.decoder.holders = holders
        self._bound(model, queue, timeout_s, priority, weight, budget, paced)
        if waiting >= self._max_waiting:
            raise self.overloaded(
                f"this gateway already waits on {waiting} request{'s' if waiting != 1 else ''}", waiting
            )
        return queue

    def answered(self, now: float) -> None:
        """A request was answered (a stream: its last chunk) at monotonic time `now`."""
        self._answered.append(now)

    def restart_rates(self, models: Collection[str] | None = None) -> None:
        """The gateway was cut off from NATS, or is back on it: every model's rate is measured afresh; or, of
        `models` only, held again by a live box after none held them, the time away is not counted (`away`)."""
        now = self._clock()
        for (model, _), queue in self._queues.items():
            if models is None:
                queue.restart_rate(now)
            elif model in models:
                queue.away()
        # None came meanwhile (from those models): not a backlog draining slowly. Those from before an outage shorter
        # than the 10 s they are counted over read as a rate halved: Retry-After 37 s for a backlog cleared in 8 s
        # (review h211). Another model's answers are measured again within a second.
        self._answered.clear()

    def restart_rate(self, model: str) -> None:
        """`model`'s rate measured afresh: it is held now by other boxes than those that answered it."""
        now = self._clock()
        for queue in self._queues_of(model):
            queue.restart_rate(now)

    def away(self, model: str) -> None:
        """No live box holds `model` now: its rate is not diluted by the time until one does (`ModelQueue.away`)."""
        for queue in self._queues_of(model):
            queue.away()

    def waiting_for(self, model: str) -> int:
        """The requests for `model` this gateway awaits, every priority (a generation: until its answer starts)."""
        return sum(len(queue.waiting) for queue in self._queues_of(model))

    def _queues_of(self, model: str) -> Iterator[ModelQueue]:
        """`model`'s queues, one a priority."""
        return (queue for (name, _), queue in self._queues.items() if name == model)

    def per_input(self, model: str, priority: str, weight: int, inputs: int) -> float:
        """The tokens an input weighs in the work `model`'s queue would await with a request of `weight` over
        `inputs` joined: what a round of rows holds is judged on all of it. On the new request's alone, one short
        input sent while 100 long ones were awaited read as a queue of 101 short rows, refused (tester h70)."""
        queue = self._queues.get((model, priority))
        if queue is None or not queue.waiting:
            return weight / max(1, inputs)
        return (queue.weight + weight) / max(1, queue.rows + inputs)

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
                others = self._queues_of(model)
                shared = next((other.decoder for other in others if isinstance(other, DecodeQueue)), Decoder())
                queue = DecodeQueue(decoder=shared)
            self._queues[(model, priority)] = queue
        if isinstance(queue, DecodeQueue) and decode_batch is not None:
            queue.decoder.slots = decode_batch  # as the model's options and the fleet say now
            queue.decoder.box_slots = box_decode_batch
        return queue

    def _bound(
        self, model: str, queue: ModelQueue, timeout_s: float, priority: str, weight: int, budget: int, paced: int
    ) -> None:
        """429 when a new request would wait longer than the queue bound (or its own deadline) to start.

        Batch-priority work is meant to wait behind interactive work, so only its deadline bounds it.
        While the estimate is not trusted yet, the work awaited (this request's included) is held to
        `_BURST_ROUNDS` rounds of batches (`budget` is one) for a request sent with the busy spell's first
        (a burst), to one round for one sent later (a flood), or to what the model is known to start
        within the bound (`ModelQueue.room`) if that is more; batch priority gets those rounds times its
        deadline ÷ `max_queue_s` (a bulk job with a long deadline is not a flood), interactive work with a
        deadline short of `max_queue_s` those rounds times deadline ÷ `max_queue_s` (a burst of 200 with 5 s
        deadlines was let in whole and 197 ended 504, black-box finding). Where the holders have timed their batches
        (`paced`), what they compute in half the bound is let in for a flood as for a burst: held to one round, a
        short request sent while a long one ran on an idle box was refused (tester h70). Where this gateway timed
        the model in a busy spell (`ModelQueue.timed_pace`: as the holders' pace follows it), what that pace starts
        within the bound. Either pace is held to the work ahead of the request, not its own too: 8 of 10 concurrent
        reranks of 64 documents, 2 s each, were refused on an idle box that starts about 5 of them within 10 s
        (tester h214).
        A request alone always goes. Refused by a pace, the 429 says the wait at it and its Retry-After is the
        seconds past the bound; refused by the rounds alone, Retry-After is 1: the rate is soon measured, or the
        burst answered.

        A generation's deadline covers its answer too: it must start in time to be made, with an answer's length to
        spare (batch generations with 300 s deadlines were let in to start at 290 s, then at 293 s against an
        estimate of 287 s, and cut), and a batch job's rounds are not scaled by it.
        """
        limit = timeout_s if priority == BATCH else min(self._max_queue_s, timeout_s)
        over = f"over {limit:g}s"
        generation = isinstance(queue, DecodeQueue)
        if generation:  # and an answer's length of slack: the estimate may be off by a slot's free
            answer_s = queue.answer_s(weight)
            if timeout_s - 2 * answer_s < limit:  # said so: "over 0s" read as a bound of nothing (tester h81)
                limit = max(0.0, timeout_s - 2 * answer_s)
                answer = f"an answer of about {answer_s:.0f}s"
                over = f"over the {limit:.0f}s its {timeout_s:g}s deadline leaves to start {answer}"
        now = self._clock()
        wait_s = queue.wait_s(now)
        if wait_s is not None:
            if wait_s > limit:
                # Back under the limit as the work drains, or once what is awaited now has started or been
                # dropped at its deadline, whichever is sooner (a generation may wait on slots alone).
                gone_s = queue.latest_deadline() - now if queue.waiting else math.inf
                retry = _retry_s(min(wait_s, gone_s) - limit)
                # Said as the Retry-After reckons it: "about 10081s", retry in 60s, was no wait it would advise (h214).
                said_s = min(wait_s, limit + retry)
                why = f"what this gateway awaits for it would take about {said_s:.0f}s to start, {over}"
                self._refuse(model, why, retry)
            return
        scale = 1.0
        if priority == BATCH and not generation:
            scale = max(1.0, limit / self._max_queue_s)
        elif priority != BATCH:  # the rounds meant to start within the bound, fewer for a deadline short of it
            scale = min(1.0, limit / self._max_queue_s)
        rounds = (_BURST_ROUNDS if queue.together(now) else 1) * scale
        held = queue.held(weight)
        if held is None or held <= max(budget * rounds, queue.room(now, limit)):
            return
        # A pace known (the holders', halved for the estimate's error, or the one this gateway timed the model at):
        # the work *ahead* of the request is what must start within the bound, not its own as well.
        ahead, count = queue.weight, len(queue.waiting)
        timed = 0.0 if generation else queue.timed_pace(now, ahead / max(1, queue.rows))
        by_pace = 0.0 if generation else max(paced * _BURST_ROUNDS * scale, timed * limit)
        if by_pace > 0:
            if ahead <= by_pace:
                return
            awaits = f"the {count} request{'s' if count != 1 else ''} this gateway awaits for it"
            wait_s = ahead * limit / by_pace
            whose = "this gateway timed its answers at" if timed * limit >= by_pace else "its holders measured, halved"
            retry = _retry_s(wait_s - limit)
            why = f"{awaits} would take about {min(wait_s, limit + retry):.0f}s to start at the pace {whose}, {over}"
            self._refuse(model, why, retry)
        generating = len(queue.decoder.running) if isinstance(queue, DecodeQueue) else 0
        also = f" and {generating} generating" if generating else ""
        # Not "would wait too long": nothing is known of its pace yet (the box may clear them in a blink).
        why = f"this gateway already awaits {count} request{'s' if count != 1 else ''} for it{also}"
        self._refuse(model, f"{why}, as much as it lets wait before its pace is known", 1)

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
