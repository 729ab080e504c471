"""Whether a model about to be pinned, or registered, fits the boxes that run models (`PinJudge`).

A pin asks every box that runs models to load the model and never evict it. The box that took the pin judged
only its own budget (a gateway none): a box whose budget could not hold the model beside its own pinned models
said so only in its log and its record's `load_error`, while the pin answered ok. Now each live box that runs
models and is not draining judges it by its own measure (the `fits` control verb). No box able to hold it: the pin
is refused, 507, naming each box and why, since every request for the model would be a 503. Some able to: the pin
is made, and its answer names the others (`not_held_by`); refusing it there would leave a fleet of unequal boxes
unable to pin a model its large boxes hold (review h178). A box that does not answer within `_ASK_S` is not
waited for, and the pin is made (`not_judged_by`): its refusal, if any, stays in its record as before. A box whose
last load of the model failed says so with its verdict, and the pin's answer names it (`load_failed_on`): the pin is
still made, as it is what has every box try the load again (every 30 s, for a folder mended or mounted late), but it
answered 200 saying nothing of a failure the fleet already knew (review h197).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS

from appliance.box_status import LOAD_ERROR_CHARS, one_line
from appliance.catalog import ModelSpec
from appliance.control import call_box
from appliance.errors import InsufficientMemory
from appliance.fleet import taking_work
from appliance.settings import MODEL_ROLES

log = logging.getLogger(__name__)

_ASK_S = 5.0  # a box answers `fits` from the spec sent and a walk of the model's folder


@dataclass(kw_only=True)
class PinJudge:
    """Judges the pin of one call (a pin, a change that pins, a pinned registration). `here` is this box's own
    check (None on a gateway, or on a box that drains); `not_held_by` keeps, once called, the boxes that could not
    hold the model, with why, and `not_judged_by` those that did not answer (not counted as refusals: a large box
    slow to answer left the small one's refusal to speak for the fleet, review h179)."""

    here: Callable[[ModelSpec], Awaitable[None]] | None
    box_id: str
    nc: NATS
    live_boxes: list[dict[str, Any]]
    load_error: Callable[[str], str | None] = lambda name: None  # why this box's last load of a model failed
    not_held_by: dict[str, str] = field(default_factory=dict)
    not_judged_by: list[str] = field(default_factory=list)
    load_failed_on: dict[str, str] = field(default_factory=dict)

    def said(self) -> dict[str, Any]:
        """What a pin's answer adds: the boxes that will not hold the model, those that did not say, and those whose
        last load of it failed, if any."""
        said: dict[str, Any] = {"not_held_by": self.not_held_by} if self.not_held_by else {}
        said |= {"not_judged_by": self.not_judged_by} if self.not_judged_by else {}
        return said | ({"load_failed_on": self.load_failed_on} if self.load_failed_on else {})

    async def pin(self, spec: ModelSpec) -> None:
        """Judge the pin of a model as the catalog holds it: one pinned already is not judged again."""
        if not spec.pinned:
            await self(spec)

    async def __call__(self, spec: ModelSpec) -> None:
        """Raise 507 when no box judged could hold `spec` pinned; keep those that could not in `not_held_by`. An
        adapter (refused elsewhere) is not judged. A registration's `spec` is pinned if it asks to be: `pin` skips those
        pinned already."""
        if spec.adapter_of is not None:
            return
        verdicts: dict[str, InsufficientMemory | None] = {}
        if self.here is not None:
            try:
                await self.here(spec)
                verdicts[self.box_id] = None
                if (failed := self.load_error(spec.name)) is not None:
                    self.load_failed_on[self.box_id] = one_line(failed, LOAD_ERROR_CHARS)
            except InsufficientMemory as exc:
                verdicts[self.box_id] = exc
        others = sorted({str(record["box"]) for record in taking_work(self.live_boxes, MODEL_ROLES)} - {self.box_id})
        asked = {"model": spec.name, "spec": spec.to_json().decode()}
        answers = await asyncio.gather(
            *(call_box(self.nc, other, "fits", asked, timeout_s=_ASK_S) for other in others), return_exceptions=True
        )
        for other, answer in zip(others, answers, strict=True):
            if isinstance(answer, InsufficientMemory):
                verdicts[other] = answer
            elif isinstance(answer, BaseException):  # slow, stopping, or older than the `fits` verb: may hold it
                log.warning("pin not judged by a box", extra={"model": spec.name, "box": other, "error": repr(answer)})
                self.not_judged_by.append(other)
            else:
                verdicts[other] = None
                if isinstance(answer, dict) and isinstance(answer.get("load_error"), str):  # from `fits`
                    self.load_failed_on[other] = one_line(answer["load_error"], LOAD_ERROR_CHARS)
        self.not_held_by = {box: error.message for box, error in verdicts.items() if error is not None}
        if verdicts and len(self.not_held_by) == len(verdicts) and not self.not_judged_by:
            said = "; ".join(f"box {box}: {why}" for box, why in self.not_held_by.items())
            raise InsufficientMemory(
                f"model {spec.name}: no box that runs models could hold it beside the models pinned there ({said}); "
                "unpin a model there, or give a box a larger memory budget"
            )
