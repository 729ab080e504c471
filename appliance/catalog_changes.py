"""What a change of the catalog does on this box: the models it holds follow their registrations.

Every box hears every change of `fbx_models` (`CatalogStore.on_change`) and squares what it holds with it on its
own: a deleted model is unloaded and its pin let go (a deleted adapter leaves every base that holds it), its
metrics series dropped a while later; a resident model registered again on another folder or task goes, to load
from the new one; a change of pin or batching is taken live, without a reload. Apart from `app.py` because the box
reaches it through its one listener (a gateway has its own), and it reaches the box only through the box's public
parts.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from appliance.catalog import ModelSpec

if TYPE_CHECKING:
    from appliance.app import Box

_FORGET_METRICS_S = 30.0  # a deleted model's series stay this long (its eviction, under way, still counts in them)


def _forget_metrics(box: Box, name: str) -> None:
    registered = box.catalog.get(name)
    if registered is None or registered.name != name:  # not registered again meanwhile
        box.metrics.forget(name)


def on_catalog_change(box: Box, name: str, spec: ModelSpec | None) -> None:
    if box.placement is not None:
        box.placement.forget_failure(name, spec)  # deleted or registered again: a load is a new try
        if spec is None or not spec.pinned:
            box.placement.memory_freed()  # a pin let go: a load refused for memory may fit now
    if spec is None:
        # Its series go a while after it (its eviction, under way, still counts): scraped meanwhile as they were.
        asyncio.get_running_loop().call_later(_FORGET_METRICS_S, _forget_metrics, box, name)
        box.residency.pinned.discard(name)
        box.residency.retire_adapter(name)  # a deleted adapter leaves every base that holds it
        box.workers.adapters_retired()  # and its generations still waiting for a decode slot are answered 404
        if box.residency.is_resident(name):
            box.spawn(box.workers.evict(name))
        return
    if spec.adapter_of is not None:
        box.residency.retire_adapter(name, keep=spec)  # registered again on another folder
        box.workers.adapters_retired()  # its generations waiting for a slot are handed back, judged again
        if box.settings.runs_models and not box.draining:
            box.spawn(box.workers.reload_for_adapters(spec.adapter_of))  # a base a profile put on ONNX
    if spec.pinned:
        box.residency.pinned.add(name)
    else:
        box.residency.pinned.discard(name)
    if spec.adapter_of is None:
        box.spawn(box.queue.settle_model(spec))
        resident = box.residency.get(name)
        if resident is not None and not spec.same_source(resident.spec):
            box.spawn(_load_registered_again(box, spec))
            return
        if spec.name in box.workers:  # its batching may have changed (a PATCH): taken live, no reload
            box.spawn(box.workers.retune(spec))
        if spec.pinned and box.settings.runs_models and not box.draining:
            box.spawn(box.workers.serve(spec))


async def _load_registered_again(box: Box, spec: ModelSpec) -> None:
    """The model resident here was registered again on another folder or task, its deletion unheard (a watch
    that missed it, or the bucket read again after a reconnect, holds the new entry only): heard as a change, it
    kept the old folder's model, whose worker asked every request for the new registration again and at last
    answered 503 (planning note). The old one goes; the new one loads as any model does (now, if pinned)."""
    await box.workers.evict(spec.name)
    current = box.catalog.get(spec.name)
    if current is not None and current.pinned and box.settings.runs_models and not box.draining:
        await box.workers.serve(current)
