"""The admin API: register, change, delete, pin, unpin, load and evict models, fleet-wide.

Registration judges the folder by the rules of appliance/registration.py. Load and evict act on one
box through its control subject, so any box's API can steer any box.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import msgspec
from aiohttp import web

from appliance.catalog import ADAPTER_SEPARATOR, Batching, ModelChange, ModelSpec
from appliance.control import call_box
from appliance.errors import FleetboxError, MethodNotAllowed, ServiceUnavailable, not_evicted
from appliance.fleet import taking_work
from appliance.gateway.context import GatewayContext
from appliance.gateway.http import decode, json_response, read_body
from appliance.model_update import change_model, update_from
from appliance.pin_fits import PinJudge
from appliance.registration import MODEL_VERBS, register
from appliance.schemas import BoxTarget, ModelRegistration
from appliance.settings import MODEL_ROLES
from appliance.verbs import refuse_adapter
from runtimes import Task
from runtimes.base import max_decode_batch

_registration = msgspec.json.Decoder(ModelRegistration)
_target = msgspec.json.Decoder(BoxTarget)
_json_object = msgspec.json.Decoder(dict[str, Any])  # a change's fields are judged by `update_from`


# A model's `created` (OpenAI's Model has one) when the catalog has no date for it (a config file's): when this box
# started (api.md).
_STARTED = int(time.time())


def model_record(ctx: GatewayContext, spec: ModelSpec) -> dict[str, Any]:
    batching = ctx.catalog.batching_for(spec)
    return {
        "id": spec.name,
        "object": "model",
        "created": spec.registered_ms // 1000 or _STARTED,
        "owned_by": "fleetbox",
        "task": spec.task.value,
        "runtime": spec.runtime.value,
        "aliases": list(spec.aliases),
        "pinned": spec.pinned,
        "batching": asdict(batching),
        "adapter_of": spec.adapter_of,
        "adapters": [a.name for a in ctx.catalog.adapters_of(spec.name)],
        **ctx.model_state(spec.name, spec),
        "stats": _stats(ctx, spec, batching),
    }


def judged_record(ctx: GatewayContext, spec: ModelSpec, judge: PinJudge) -> dict[str, Any]:
    """The model's record with what judging its pin found: each box whose last load of it failed as that box said it
    just now, over what the heartbeats say (a box that did not answer in time stays as its heartbeat has it; review
    h225: the judge's replaced the record's whole)."""
    record = model_record(ctx, spec)
    said = judge.said()
    failed = dict(sorted((record["load_failed_on"] | said.pop("load_failed_on", {})).items()))
    state = "failed" if failed and record["state"] == "cold" else record["state"]
    return record | said | {"state": state, "load_failed_on": failed}


def _stats(ctx: GatewayContext, spec: ModelSpec, batching: Batching) -> dict[str, int | None]:
    """Infinity's model list gives each model a `stats` object (its client fails on a record without one): here the
    figures this gateway has, never estimates of another box's: the catalog's batch size (a generator's decode batch,
    from its options: its `batching` is not what it runs with), and the requests for the model this gateway awaits now
    (an adapter's count on its base: they share its queue)."""
    waiting = ctx.dispatcher.waiting_for(spec.name) if ctx.dispatcher is not None else None
    batch_size = batching.max_batch_size
    if spec.task is Task.GENERATE:
        base = ctx.catalog.get(spec.adapter_of) if spec.adapter_of is not None else spec
        batch_size = max_decode_batch((base or spec).options)
    return {"batch_size": batch_size, "waiting_here": waiting}


async def register_model(request: web.Request) -> web.Response:
    ctx = GatewayContext.of(request)
    registration = decode(await read_body(request, ctx.settings), _registration)
    judge = ctx.pin_judge()  # pinned or not, a model no box could hold is refused
    spec = await register(registration, ctx.catalog, ctx.store, ctx.settings, judge, ctx.open_queue)
    return json_response(judged_record(ctx, spec, judge), status=201)


async def named_model(ctx: GatewayContext, request: web.Request) -> ModelSpec:
    """The model the route's `{name}` names (a name or an alias), else its 404: looked up in the catalog's bucket
    when this box has not heard of it yet (`CatalogStore.find`)."""
    name = request.match_info["name"]
    spec = await ctx.store.find(name) or _adapter_addressed(ctx, name)
    if spec is None:
        # A verb's route, which takes POST: no model may be named so (h99). Not said to a POST, whose `/` before the
        # verb was escaped (`/v1/models/noop%2Fpin/load`): the model it names does not exist.
        if name.rpartition("/")[2] in MODEL_VERBS and request.method != "POST":
            raise MethodNotAllowed.allowing("POST")
        raise ctx.catalog.unknown(name)
    return spec


def _adapter_addressed(ctx: GatewayContext, name: str) -> ModelSpec | None:
    """The adapter `<model>:<adapter>` addresses with `<model>` an alias (`sentiment:l1` for `cls:l1`), as a request's
    `model` names it: its routes said 404 where `/v1/classify` answered it (tester h189)."""
    if ADAPTER_SEPARATOR not in name:
        return None
    try:
        return ctx.catalog.resolve(name).adapter
    except FleetboxError:
        return None


def known_model(ctx: GatewayContext, request: web.Request) -> ModelSpec:
    """The model the route's `{name}` names, as this box's catalog holds it (an inference route's: no lookup)."""
    name = request.match_info["name"]
    spec = ctx.catalog.get(name)
    if spec is None:
        raise ctx.catalog.unknown(name)
    return spec


async def get_model(request: web.Request) -> web.Response:
    ctx = GatewayContext.of(request)
    return json_response(model_record(ctx, await named_model(ctx, request)))


async def update_model(request: web.Request) -> web.Response:
    """`PATCH /v1/models/{name}`: aliases, the pin, batching knobs, changed in place (appliance/model_update.py)."""
    ctx = GatewayContext.of(request)
    spec = await named_model(ctx, request)
    update = update_from(decode(await read_body(request, ctx.settings), _json_object))
    judge = ctx.pin_judge()
    if update.pinned:
        await judge.pin(spec)
    spec = await change_model(spec, update, ctx.catalog, ctx.store)
    return json_response(judged_record(ctx, spec, judge))


async def delete_model(request: web.Request) -> web.Response:
    ctx = GatewayContext.of(request)
    spec = await named_model(ctx, request)
    ctx.catalog.check_deletable(spec, named=request.match_info["name"])
    adapters = await ctx.delete_model(spec)
    answer: dict[str, Any] = {"id": spec.name, "object": "model", "deleted": True}
    if adapters:  # registered on another box while this deletion was judged
        answer["adapters_deleted"] = adapters
    return json_response(answer)


async def pin_model(request: web.Request) -> web.Response:
    return await _set_pinned(request, True)


async def unpin_model(request: web.Request) -> web.Response:
    return await _set_pinned(request, False)


async def _set_pinned(request: web.Request, pinned: bool) -> web.Response:
    ctx = GatewayContext.of(request)
    spec = await named_model(ctx, request)
    judge = ctx.pin_judge()
    if not pinned:
        refuse_adapter(spec, "unpin")  # as a pin is: an adapter is never pinned
    else:
        await judge.pin(spec)
    spec = await ctx.store.update(spec, ModelChange(pinned=pinned))
    return json_response(judged_record(ctx, spec, judge))


async def _target_box(request: web.Request) -> str | None:
    if not request.can_read_body:
        return None
    return decode(await read_body(request, GatewayContext.of(request).settings), _target).box


async def load_model(request: web.Request) -> web.Response:
    ctx = GatewayContext.of(request)
    spec = await named_model(ctx, request)
    box = await _target_box(request)
    if box is None:
        box = _choose_box(ctx)
    result = await call_box(ctx.nc, box, "load", {"model": spec.name})
    return json_response({**model_record(ctx, spec), "loaded_on": result["box"]})


async def evict_model(request: web.Request) -> web.Response:
    ctx = GatewayContext.of(request)
    spec = await named_model(ctx, request)
    refuse_adapter(spec, "evict")
    box = await _target_box(request)
    # Every holder, a draining one too: it keeps the model loaded until it exits (review h228).
    boxes = [box] if box is not None else ctx.model_state(spec.name, draining=True)["boxes"]
    evicted = []
    for target in boxes:
        result = await call_box(ctx.nc, target, "evict", {"model": spec.name})
        if result.get("evicted"):
            evicted.append(target)
        elif box is not None:  # as `fleetbox models evict --box` says it
            raise not_evicted(spec.name, box, result)
    return json_response({"id": spec.name, "evicted_from": evicted})


def _choose_box(ctx: GatewayContext) -> str:
    """This box when it runs models, else the live worker with the most free memory."""
    if ctx.settings.runs_models:
        return ctx.box_id
    workers = taking_work(ctx.live_boxes(), MODEL_ROLES)
    if not workers:
        raise ServiceUnavailable("no live box runs models; start one with --role worker or all")

    def free(record: dict[str, Any]) -> int:
        device = (record.get("devices") or [{}])[0]
        return int(device.get("budget_bytes", 0)) - int(device.get("used_bytes", 0))

    return str(max(workers, key=free)["box"])
