"""The LoRA adapter a request names, on the box that took it: judged against the registration its gateway resolved,
then made resident on its base and held for the request (both kinds of worker: `worker_intake.py`,
`generation_intake.py`); and the model's own registration judged the same way (`judge_registration`).

The one idea: a request is answered by the registration of the adapter it was sent for, or not at all. An adapter's
requests share its base's queue, which a deletion cannot purge of them alone, so a request queued for a registration
deleted since meets the new one here; the gateway names the registration it resolved (`Fbx-Adapter-Registered`).
A model's queue is purged by its deletion, but a request its gateway resolved before and published after it, or one a
box whose worker is of the deleted registration takes, meets another registration the same way (`Fbx-Registered`).
"""

from __future__ import annotations

from appliance.adapters import AdapterHold, missing_folder
from appliance.catalog import Catalog, ModelSpec
from appliance.envelope import RequestMeta
from appliance.errors import NotFound, ServiceUnavailable, Unprocessable, model_deleted
from appliance.residency import Residency
from runtimes import RuntimeKind, UnknownAdapter, UnsupportedModel


class RegistrationNotHeard(Exception):
    """The request names a registration of its adapter other than the one this box's catalog holds: one made moments
    ago that the catalog has not heard of yet, or one deleted since. Asked again shortly (`NOT_HEARD_DELAY_S`, maybe
    on another box) until its `NOT_HEARD_DELIVERIES`th delivery, then judged deleted: no clock can say which it is
    (review: the registering boxes' clocks ordered them, and a skew answered a live adapter 404)."""


NOT_HEARD_DELIVERIES = 3
NOT_HEARD_DELAY_S = 0.25  # a catalog hears of a registration within milliseconds of its write


def judge_registration(
    catalog: Catalog, spec: ModelSpec, meta: RequestMeta, deliveries: int | None, max_deliver: int
) -> None:
    """Raise unless the request is for the registration of its model that `spec` (its worker's) is, when it names one.

    Another than this box's catalog holds: asked again (`RegistrationNotHeard`) until its `NOT_HEARD_DELIVERIES`th
    delivery (the catalog may not have heard of it yet), then 404, deleted (tester h121: its name registered again
    for another task, it was a 422 `wrong_task`). The one the catalog holds, where the worker is of an older one
    being retired: asked again, maybe of another box, and on its last delivery a 503 to retry. No clock orders them.
    The one the catalog holds, of the worker's folder and task, is the worker's: a box keeps a worker across such a
    registration (its deletion missed, or made while it loaded), and it answered every request 503 (review h132).
    """
    sent_for = meta.registered_ms
    if not sent_for or sent_for == spec.registered_ms:
        return
    current = catalog.get(spec.name)
    if current is not None and current.registered_ms == sent_for and current.same_source(spec):
        return
    retiring = current is not None and current.registered_ms == sent_for
    if (deliveries or 1) < (max_deliver if retiring else min(NOT_HEARD_DELIVERIES, max_deliver)):
        raise RegistrationNotHeard(spec.name)
    if retiring:
        raise ServiceUnavailable(f"model {spec.name!r} was registered again just now; retry", retry_after_s=1)
    raise model_deleted(spec.name)


async def hold_adapter(
    catalog: Catalog,
    residency: Residency,
    base: ModelSpec,
    meta: RequestMeta,
    deliveries: int | None = 1,
    max_deliver: int = NOT_HEARD_DELIVERIES,
) -> AdapterHold:
    """The request's LoRA adapter (`meta.adapter`) made resident on its base model and held there for the request
    until it is released (appliance/adapters.py); `hold.key` is the adapter's name for the runtime. `deliveries`:
    of the request's message, this one's number; `max_deliver`: the most it may have (its consumer's), the last
    never handed back: asked again then, it was dead-lettered and its client told it failed on every delivery
    (review h110, `max_deliver` 2), where a deleted registration is a 404."""
    assert meta.adapter is not None
    name = meta.adapter
    sent_for = meta.adapter_registered_ms  # the registration its gateway resolved; 0: none said (see below)
    # Asked again for this box's catalog to hear of it, but never on its last delivery.
    waits = sent_for and (deliveries or 1) < min(NOT_HEARD_DELIVERIES, max_deliver)
    try:
        adapter = _adapter_spec(catalog, base, name)
    except NotFound:  # its gateway resolved it (one it does not know is its own 404): deleted since it was sent
        if waits:
            raise RegistrationNotHeard(name) from None
        if not sent_for:  # a config file's (no registration said): this box's may not list it (review h201)
            raise NotFound(
                f"adapter {name!r} is not in the catalog of the box that took this request: deleted while it waited, "
                "or a config file's adapter that this box's config file does not list (list it on every box that "
                "serves its base model)",
                code="model_not_found",
            ) from None
        raise adapter_deleted(name) from None
    if sent_for and adapter.registered_ms != sent_for:
        # Not the registration its gateway resolved: its requests share its base's queue, which a deletion cannot
        # purge of them alone, and the new folder's weights answered them (h102).
        if waits:
            raise RegistrationNotHeard(name)
        raise adapter_deleted(name)
    if not sent_for and adapter.registered_ms and 0 < meta.sent_ms < adapter.registered_ms:
        # Its gateway resolved a registration without a time (a config file's) or names none (an older gateway):
        # sent before this registration by the boxes' clocks, it was for one deleted since (review).
        raise adapter_deleted(name)
    if (missing := missing_folder(adapter)) is not None:  # the box's fault, not the request's: not a 422 (h73)
        raise ServiceUnavailable(f"adapter {adapter.name}: {missing}", code="adapter_folder_missing")
    try:
        return await residency.hold_adapter(base.name, adapter)
    except (UnsupportedModel, UnknownAdapter) as exc:
        raise Unprocessable(f"adapter {adapter.name}: {exc}", code="bad_adapter") from None


def adapter_deleted(name: str) -> NotFound:
    """The answer to a request whose adapter registration was deleted while it waited."""
    return NotFound(f"adapter {name!r} was deleted while this request waited for it", code="model_not_found")


def _adapter_spec(catalog: Catalog, base: ModelSpec, name: str) -> ModelSpec:
    adapter = catalog.get(name)
    if adapter is None or adapter.adapter_of != base.name:  # deleted since the gateway sent the request its way
        raise catalog.unknown(name)
    registered = catalog.get(base.name)
    if base.runtime is not RuntimeKind.TORCH and registered is not None and registered.runtime is RuntimeKind.TORCH:
        # A profile put the base on ONNX before it had adapters: the box loads it again on torch (Workers).
        raise ServiceUnavailable(
            f"model {base.name} runs on {base.runtime} here and is being loaded again on torch for its LoRA "
            "adapters; try again in a moment",
            retry_after_s=1,
        )
    return adapter
