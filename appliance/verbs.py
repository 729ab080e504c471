"""The control verbs one box answers on `fbx.ctl.<box>.<verb>`: how the admin routes, the CLI and the TUI
steer a box (appliance/control.py carries them over NATS).

Each verb acts on this box alone (load and evict a model here, drain, report), or on the fleet's
catalog through this box (pin, unpin, update, register, delete), judged by the same rules as the HTTP routes.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from appliance.box_status import heartbeat
from appliance.catalog import ModelChange, ModelSpec
from appliance.control import Handler
from appliance.errors import Conflict, FleetboxError, Unprocessable
from appliance.model_update import change_model, update_from
from appliance.pin_fits import PinJudge
from appliance.placement import load_failed
from appliance.registration import register, registration_from

if TYPE_CHECKING:
    from appliance.app import Box


def control_verbs(box: Box) -> dict[str, Handler]:
    async def load(payload: dict[str, Any]) -> dict[str, Any]:
        spec = await _model(box, payload)
        _runs_models(box)
        if box.draining:  # a box going away takes no new model: it would pull for it as it drains
            raise Conflict(f"box {box.box_id} is draining; load {spec.name} on another box")
        try:
            await box.workers.serve(spec)
        except FleetboxError:
            raise  # its own status: an adapter (409), a model too big for the budget (507)
        except Exception as exc:
            raise load_failed(spec.name, box.box_id, exc) from None
        if box.placement is not None:
            box.placement.served(spec.name)
        resident = box.residency.get(spec.name)
        return {"model": spec.name, "state": "resident", "bytes": resident.nbytes if resident else None}

    async def evict(payload: dict[str, Any]) -> dict[str, Any]:
        spec = await _model(box, payload)
        refuse_adapter(spec, "evict")
        if payload.get("where") == "every holder" and not box.settings.runs_models:
            # Asked for want of a live box that runs models (`FleetOps.evict`): held by none, so evicted from every
            # one, as the HTTP route says it; the model's name judged as anywhere (tester h120's case, every worker
            # dead or draining: exit 1, "a gateway; it runs no models").
            return {"model": spec.name, "evicted": False}
        _runs_models(box)
        if spec.name in box.residency.pinned:
            raise Conflict(f"model {spec.name} is pinned; unpin it before evicting it")
        if box.residency.is_loading(spec.name):  # not resident yet: a caller naming this box is told (409)
            return {"model": spec.name, "evicted": False, "loading": True}
        return {"model": spec.name, "evicted": await box.workers.evict(spec.name)}

    async def pin(payload: dict[str, Any]) -> dict[str, Any]:
        assert box.store is not None
        spec, judge = await _model(box, payload), pin_judge(box)
        await judge.pin(spec)
        spec = await box.store.update(spec, ModelChange(pinned=True))
        return {"model": spec.name, "pinned": True} | judge.said()

    async def fits(payload: dict[str, Any]) -> dict[str, Any]:
        """Whether this box could hold the model pinned beside its own pinned models: 507 if not (`pin_fits.py`), with
        why its last load here failed, if it did. The model as the asking box sent it (`spec`: a registration's,
        before the catalog has it), else by name."""
        sent = payload.get("spec")
        spec = ModelSpec.from_json(sent.encode()) if isinstance(sent, str) else await _model(box, payload)
        _runs_models(box)
        await box.residency.check_fits(spec)
        failed = box.residency.load_error(spec.name)
        return {"model": spec.name, "fits": True} | ({"load_error": failed} if failed is not None else {})

    async def unpin(payload: dict[str, Any]) -> dict[str, Any]:
        assert box.store is not None
        spec = await _model(box, payload)
        refuse_adapter(spec, "unpin")
        spec = await box.store.update(spec, ModelChange(pinned=False))
        return {"model": spec.name, "pinned": False}

    async def update(payload: dict[str, Any]) -> dict[str, Any]:
        """`PATCH /v1/models/{name}` over NATS (the CLI): `{"model": NAME, "change": {...}}`, judged on this box."""
        assert box.store is not None
        spec, change, judge = await _model(box, payload), update_from(payload.get("change")), pin_judge(box)
        if change.pinned:
            await judge.pin(spec)
        spec = await change_model(spec, change, box.catalog, box.store)
        return {
            "model": spec.name,
            "aliases": list(spec.aliases),
            "pinned": spec.pinned,
            "batching": asdict(box.catalog.batching_for(spec)),
        } | judge.said()

    async def delete(payload: dict[str, Any]) -> dict[str, Any]:
        """`DELETE /v1/models/{name}` over NATS (the TUI and CLI): a base only once its adapters are gone."""
        spec = await _model(box, payload)
        box.catalog.check_deletable(spec, named=payload["model"])
        adapters = await box.queue.delete_model(spec)
        return {"model": spec.name, "deleted": True} | ({"adapters_deleted": adapters} if adapters else {})

    async def register_verb(payload: dict[str, Any]) -> dict[str, Any]:
        """`POST /v1/models` over NATS (the TUI and CLI): the same checks, judged on this box."""
        assert box.store is not None
        judge = pin_judge(box)  # pinned or not, a model no box could hold is refused
        spec = await register(
            registration_from(payload), box.catalog, box.store, box.settings, judge, box.queue.open_model
        )
        return {"model": spec.name, "task": spec.task.value, "adapter_of": spec.adapter_of} | judge.said()

    async def drain(payload: dict[str, Any]) -> dict[str, Any]:
        box.draining = True
        box.stop_requested.set()
        return {"draining": True}

    async def status(payload: dict[str, Any]) -> dict[str, Any]:
        return heartbeat(box)

    return {
        "load": load,
        "evict": evict,
        "pin": pin,
        "fits": fits,
        "unpin": unpin,
        "update": update,
        "register": register_verb,
        "delete": delete,
        "drain": drain,
        "status": status,
    }


async def _model(box: Box, payload: dict[str, Any]) -> ModelSpec:
    """The model a verb names, looked up in the catalog's bucket when this box has not heard of it yet."""
    name = payload.get("model")
    if not isinstance(name, str) or not name:
        raise Unprocessable('name a model: {"model": NAME}')
    spec = await box.store.find(name) if box.store is not None else box.catalog.get(name)
    if spec is None:
        raise box.catalog.unknown(name)
    return spec


def pin_judge(box: Box) -> PinJudge:
    """How a pin or a registration through this box is judged, by the verbs and the admin routes alike: by this
    box (unless it drains) and every other live box that runs models (`pin_fits.py`)."""
    assert box.nc is not None
    here = box.residency.check_fits if box.settings.runs_models and not box.draining else None
    live = box.fleet.live_boxes() if box.fleet is not None else []
    return PinJudge(here=here, box_id=box.box_id, nc=box.nc, live_boxes=live, load_error=box.residency.load_error)


def refuse_adapter(spec: ModelSpec, verb: str) -> None:
    """An adapter is loaded, evicted and pinned with its base (its own are refused, 409, as load and pin are)."""
    if spec.adapter_of is not None:
        raise Conflict(f"{spec.name} is an adapter; {verb} its base model {spec.adapter_of}")


def _runs_models(box: Box) -> None:
    """A verb that acts on this box's models (load, evict) is refused by a box in the gateway role."""
    if not box.settings.runs_models:
        raise Conflict(f"box {box.box_id} is a gateway; it runs no models")
