"""Changing a registered model in place: `PATCH /v1/models/{name}` and the `update` control verb (the CLI).

The one idea: only what leaves the loaded weights alone changes in place: the aliases, the pin, and an
encoder's batching knobs, which every box's batcher for the model takes at its next batch (the catalog's
watch brings the change; `Workers.retune`). Whatever changes what is loaded (folder, task, runtime, dtype,
options, profile, base, concurrent batches: the batcher's own threads) is refused, named, since it needs a
new registration. Aliases are judged by registration's own rules, and the write is a compare-and-set on the
model's catalog entry (`CatalogStore.update`), so a change racing a delete never brings the model back.
"""

from __future__ import annotations

from typing import Any

import msgspec

from appliance.catalog import Catalog, ModelChange, ModelSpec
from appliance.catalog_store import CatalogStore
from appliance.errors import Conflict, Unprocessable
from appliance.registration import check_aliases, check_integers, refuse_taken
from appliance.schemas import ModelUpdate
from runtimes.base import Task

# Registration's fields that choose what is loaded (or how many batches run at once: the batcher's threads).
NEEDS_REGISTRATION = (
    "name",
    "path",
    "task",
    "runtime",
    "dtype",
    "options",
    "profile",
    "adapter_of",
    "concurrent_batches",
)
_BATCHING = ("max_batch_tokens", "max_batch_size", "max_wait_ms")


def update_from(payload: Any) -> ModelUpdate:
    """A change that came as JSON already parsed (a PATCH's body, the `update` verb's `change`), validated."""
    if isinstance(payload, dict):
        loaded = [field for field in NEEDS_REGISTRATION if field in payload]
        if loaded:
            raise Unprocessable(
                f"{', '.join(loaded)} cannot change in place: {'they change' if len(loaded) > 1 else 'it changes'} "
                "what is loaded; register the model again (DELETE /v1/models/{name}, then POST /v1/models) to change "
                f"{'them' if len(loaded) > 1 else 'it'}",
                code="needs_registration",
            )
    try:
        return msgspec.convert(payload, ModelUpdate)
    except msgspec.ValidationError as exc:
        raise Unprocessable(f"invalid request: {exc}") from None


async def change_model(spec: ModelSpec, update: ModelUpdate, catalog: Catalog, store: CatalogStore) -> ModelSpec:
    """Judge `update` for the model and write it to the fleet's catalog; the model as written."""
    knobs = {field: getattr(update, field) for field in _BATCHING if getattr(update, field) is not None}
    if update.aliases is None and update.pinned is None and not knobs:
        # What this model takes: an adapter its aliases alone, a generator no batching knobs (tester h224).
        takes = "aliases, pinned, max_batch_tokens, max_batch_size or max_wait_ms"
        if spec.adapter_of is not None:
            takes = "aliases (an adapter's pin and batching are its base model's)"
        elif spec.task is Task.GENERATE:
            takes = "aliases or pinned (a generator's decode batch is set by its options, at registration)"
        raise Unprocessable(f"nothing to change: give {takes}", code="nothing_to_change")
    check_integers(knobs)
    if spec.adapter_of is not None:
        if update.pinned is not None:  # as the pin and unpin verbs refuse it
            raise Conflict(f"{spec.name} is an adapter; pin or unpin its base model {spec.adapter_of}")
        if knobs:
            raise Unprocessable(
                f"{spec.name} is an adapter: it runs in its base model's batches; change "
                f"{', '.join(knobs)} on {spec.adapter_of}",
                code="needs_registration",
            )
    elif knobs and spec.task is Task.GENERATE:
        raise Unprocessable(
            f"model {spec.name} generates: its decode batch is set when it loads, by its options max_batch_size "
            f"and max_prefill_tokens, and {', '.join(knobs)} {'does' if len(knobs) == 1 else 'do'} not apply to it; "
            "register it again with new "
            "options to change it",
            code="needs_registration",
        )
    aliases = None
    if update.aliases is not None:
        check_aliases(spec.name, update.aliases, catalog)
        aliases = tuple(update.aliases)
        await refuse_taken(aliases, catalog, store, owner=spec.name)
    return await store.update(spec, ModelChange(aliases=aliases, pinned=update.pinned, batching=knobs))
