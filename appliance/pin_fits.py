"""Whether a model about to be pinned fits every box that runs models (`check_pin_fits`).

A pin promises that every box that runs models loads the model and never evicts it. The box that took the pin
judged only its own budget (a gateway none), and a box whose budget could not hold the model beside its own pinned
models said so only in its log and its record's `load_error`, while the pin answered ok. Each live box
that runs models is asked (the `fits` control verb) by its own measure; one that does not answer in time is not
waited for: its refusal, if any, stays in its record as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS

from appliance.catalog import ModelSpec
from appliance.control import call_box
from appliance.errors import InsufficientMemory
from appliance.fleet import taking_work
from appliance.settings import MODEL_ROLES

log = logging.getLogger(__name__)

_ASK_S = 5.0  # a box answers `fits` from its catalog and a walk of the model's folder


async def check_pin_fits(
    spec: ModelSpec,
    *,
    here: Callable[[ModelSpec], Awaitable[None]] | None,
    box_id: str,
    nc: NATS,
    live_boxes: list[dict[str, Any]],
) -> None:
    """Raise 507 naming the boxes that could not hold `spec` pinned: this one first (`here`, None on a gateway),
    then each other live box that runs models and is not draining. A model pinned already, or an adapter (refused
    elsewhere), is not judged."""
    if spec.pinned or spec.adapter_of is not None:
        return
    if here is not None:
        await here(spec)
    others = sorted({str(record["box"]) for record in taking_work(live_boxes, MODEL_ROLES)} - {box_id})
    answers = await asyncio.gather(
        *(call_box(nc, other, "fits", {"model": spec.name}, timeout_s=_ASK_S) for other in others),
        return_exceptions=True,
    )
    refused: list[tuple[str, InsufficientMemory]] = []
    for other, answer in zip(others, answers, strict=True):
        if isinstance(answer, InsufficientMemory):
            refused.append((other, answer))
        elif isinstance(answer, BaseException):
            log.warning("pin not judged by a box", extra={"model": spec.name, "box": other, "error": repr(answer)})
    if refused:
        said = "; ".join(f"box {other}: {error.message}" for other, error in refused)
        raise InsufficientMemory(
            f"model {spec.name} is not pinned: every box that runs models would keep it loaded, and "
            f"{len(refused)} of them cannot hold it beside the models pinned there ({said}); unpin one there first"
        )
