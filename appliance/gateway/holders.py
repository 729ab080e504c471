"""What a gateway's admission is told of the boxes holding a model, from the fleet's heartbeats (`Holders`).

The one idea: until its rate of answers is measured, the work a gateway lets wait for a model is bounded by what the
boxes holding it start at once (a generator's decode slots, an encoder's round of batches, or the pace its holders
measured), and each gateway counts only its share of them (`Fleet.holders_per_gateway`), so that the gateways
together fill the holders once, not once each. A refusal while no live box holds the model, nor any that could load
it is live, is not overload: it is said as a 503. While a live box can load it (it was evicted for budget, or is
cold), a full queue is: a 429, and the seconds the model is away are not read as its pace (`ModelQueue.away`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

from appliance.catalog import ModelSpec
from appliance.errors import ServiceUnavailable, TooManyRequests
from appliance.gateway.admission import Admission, paced_round, unmeasured_budget
from appliance.gateway.model_queue import ModelQueue
from runtimes import Task
from runtimes.base import max_decode_batch


class Holders:
    """The fleet's holders of each model as one gateway's `Admission` reckons with them. Without a fleet (a test's
    dispatcher) none is known of: one box's worth of each model, its rounds by the catalog's knobs."""

    def __init__(
        self,
        admission: Admission,
        max_queue_s: float,
        *,
        holders_per_gateway: Callable[[str], Fraction] | None = None,
        box_round: Callable[[str], int | None] | None = None,
        box_round_rows: Callable[[str], int | None] | None = None,
        pace: Callable[[str, float], tuple[float, float] | None] | None = None,
        holders: Callable[[str], list[str]] | None = None,
        hears_fleet: Callable[[], bool] | None = None,
        can_load: Callable[[str], bool] | None = None,
    ) -> None:
        self._admission = admission
        self._max_queue_s = max_queue_s
        # The boxes' worth of a generator's decode slots this gateway may fill (`Fleet.holders_per_gateway`).
        self._holders_per_gateway = holders_per_gateway or (lambda model: Fraction(1))
        # The tokens a round of an encoder's batches takes on a box holding it (`Fleet.box_round`), None unknown.
        self._box_round = box_round or (lambda model: None)
        self._box_round_rows = box_round_rows or (lambda model: None)  # and the rows it holds
        # The tokens and rows a second its holders compute in rows so long, this gateway's share
        # (`Fleet.pace_per_gateway`), None unknown.
        self._pace = pace or (lambda model, per_row: None)
        self._holders = holders or (lambda model: [])  # the live boxes holding a model (`Fleet.holders`)
        self._knows_holders = holders is not None  # without a fleet (a test's dispatcher), none is known of
        self._hears_fleet = hears_fleet or (lambda: True)  # this box's own heartbeat live in its view (`Fleet`)
        self._can_load = can_load or (lambda model: False)  # a live box would load a model held by none (`Fleet`)
        self._timed_on: dict[str, frozenset[str]] = {}  # model -> the boxes that held it when last admitted to
        self._timed_as: dict[str, tuple[object, ...]] = {}  # model -> what its pace depended on when last admitted to

    def admit(
        self, spec: ModelSpec, priority: str, timeout_s: float, waiting: int, *, weight: int, inputs: int = 1
    ) -> ModelQueue:
        """`Admission.admit` for a request to `spec` bounded by its holders (or the 429, or the 503 with none).

        `weight` is what the request costs its model: its tokens, or a generation's `max_tokens` (see `ModelQueue`);
        `inputs` the rows it takes in a batch (an encoder's); `waiting` the requests this gateway awaits.
        """
        held = self._holders(spec.name)
        self._judge_registration(spec)
        if self._knows_holders:
            self._judge_pace(spec.name, held)
        decode_batch = box_decode_batch = None
        boxes = self._holders_per_gateway(spec.name)
        paced = 0
        if spec.task is Task.GENERATE:
            box_decode_batch = max_decode_batch(spec.options)
            decode_batch = max(1, math.floor(box_decode_batch * boxes))
            budget = unmeasured_budget(spec.batching, decode_batch)
        else:
            per_input = self._admission.per_input(spec.name, priority, weight, inputs)
            pace, rows_pace = self._pace(spec.name, per_input) or (None, None)
            paced = paced_round(pace, rows_pace, per_input, self._max_queue_s)
            budget = unmeasured_budget(
                spec.batching,
                box_round=self._box_round(spec.name),
                box_rows=self._box_round_rows(spec.name),
                per_input=per_input,
                boxes=boxes,
            )
        try:
            return self._admission.admit(
                spec.name,
                priority,
                timeout_s,
                waiting,
                weight=weight,
                budget=budget,
                paced=paced,
                decode_batch=decode_batch,
                box_decode_batch=box_decode_batch,
                holders=frozenset(held) if decode_batch is not None else None,
            )
        except TooManyRequests:
            if self._knows_holders and not held:
                self._refuse_unheld(spec.name)
            raise

    def _judge_registration(self, spec: ModelSpec) -> None:
        """A model registered again on another folder, or with another runtime, dtype, options, profile or batching,
        is another model to its boxes (loaded again where it was): its rate is measured afresh. Held again by the
        same box, the gateway kept the old one's spans and let in `max_queue_s` at its pace. Its aliases or its pin
        changed, it is the same model."""
        paced_as = (spec.load_key(), spec.batching)  # the catalog's spec: a box's profile never reaches a gateway
        if self._timed_as.setdefault(spec.name, paced_as) != paced_as:
            self._admission.restart_rate(spec.name)
            self._timed_as[spec.name] = paced_as

    def _judge_pace(self, model: str, held: list[str]) -> None:
        """Whether the pace timed lately still tells how fast `model` goes. Evicted by a live box that loads it again
        in its turn: the time away is not its pace (`ModelQueue.away`). Held by none and no box live to load it (its
        only worker crashed): the stall stands, and the gateway stops admitting (review h222: the time away dropped,
        the healthy spans before the crash let in 10 s of a dead box's pace once its record expired). Held now only by
        boxes that did not time it (another box, slower or faster): measured afresh (review h222: 100 s of a slower
        box's work let in at the pace of the one before)."""
        if not held:
            if self._can_load(model):
                self._admission.away(model)
            return
        timed_on = self._timed_on.get(model)
        if timed_on is not None and timed_on.isdisjoint(held):
            self._admission.restart_rate(model)
        self._timed_on[model] = frozenset(held)

    def _refuse_unheld(self, model: str) -> None:
        """A refusal while no live box holds `model`, nor any that could load it is live, is not overload: nothing
        answers it (its boxes restarting, or its load failed on each). Said as a 429 "already awaits 60 requests",
        `Retry-After: 1`, with every worker dead (tester h82); a 503 saying so, as a gateway past the grace without
        workers answers. A model a live box evicted for budget, or has not loaded yet, is loaded again in its turn: a
        full queue for it is overload, a 429 (tester h214: 503 "held by no live box" under churn on a live box)."""
        if self._can_load(model):
            return
        count = self._admission.waiting_for(model)
        # Its own heartbeat missing too: the heartbeats are not coming through NATS. Others' may be heard (not of a box
        # holding the model): the message says only what it knows (review h141: "no box's heartbeat" overstated it).
        if not self._hears_fleet():
            raise ServiceUnavailable(
                f"this gateway hears neither its own box's heartbeat now nor any box holding model {model} (NATS "
                "JetStream is not taking or delivering heartbeats, or this box was stalled: see /readyz), and already "
                f"awaits {count} request{'s' if count != 1 else ''} for it; retry in 2s",
                retry_after_s=2,
            )
        raise ServiceUnavailable(
            f"model {model} is held by no live box now, and no box that could load it is live (its boxes restarting "
            f"or draining, or its load failed on each: see load_failed_on in GET /v1/models/{model}), and this gateway "
            f"already awaits {count} request{'s' if count != 1 else ''} for it; retry in 2s",
            retry_after_s=2,
        )
