"""A box's `Catalog` as the mirror of KV bucket `fbx_models` (which `appliance/catalog_store.py` watches and
writes): each change of a key, heard through the watch or made by this box, applied to the catalog and told to
its listeners.

A key's changes are applied in revision order, so a change the watch brings late never undoes a newer one this
box wrote or looked up already.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import orjson
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from appliance.catalog import Catalog, ModelSpec

# The lines keep the logger they had when this was part of the store: a log's `logger` field is what an operator
# filters on, and the split changed no behaviour.
log = logging.getLogger("appliance.catalog_store")


class CatalogMirror:
    """Applies the bucket's entries to a `Catalog`, each key's in revision order, and tells the listeners."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._listeners: list[Callable[[str, ModelSpec | None], None]] = []
        # The bucket's revision this box last applied per key: the watch may bring a change late, after this
        # box wrote (or looked up) a newer one, and a late word must not undo the newer.
        self._revisions: dict[str, int] = {}

    def on_change(self, listener: Callable[[str, ModelSpec | None], None]) -> None:
        """Call `listener(name, spec)` after every change; spec is None for a removal."""
        self._listeners.append(listener)

    def revision(self, slug: str) -> int:
        """The bucket's revision of `slug` this box last applied (0 for none)."""
        return self._revisions.get(slug, 0)

    def forget_revisions(self) -> None:
        """For a bucket that may have been made again, counting revisions from 1."""
        self._revisions.clear()

    def apply(self, entry: KeyValue.Entry) -> None:
        if entry.revision is not None:
            if entry.revision <= self._revisions.get(entry.key, 0):
                return  # this box has applied the same change or a newer one already
            self._revisions[entry.key] = entry.revision
        if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
            spec = self.catalog.by_slug(entry.key)
            if spec is not None:
                self.catalog.remove(spec.name)
                self.notify(spec.name, None)
            return
        try:
            spec = ModelSpec.from_json(entry.value)
        except (orjson.JSONDecodeError, KeyError, ValueError, TypeError) as exc:
            log.warning("bad catalog entry ignored", extra={"key": entry.key, "error": repr(exc)})
            return
        replaced = self.catalog.by_slug(entry.key)
        if replaced is not None and replaced.name != spec.name:  # its deletion came late, or never came here
            self.catalog.remove(replaced.name)
            self.notify(replaced.name, None)
        self.catalog.add(spec)
        self.notify(spec.name, spec)

    def notify(self, name: str, spec: ModelSpec | None) -> None:
        for listener in self._listeners:
            try:
                listener(name, spec)
            except Exception:
                log.exception("catalog listener failed", extra={"model": name})

    def added(self, spec: ModelSpec, revision: int) -> None:
        """This box's own write, at `revision`: acted on here at once, unless the watch brought a newer change
        of the key meanwhile (another box deleted the model just after this box pinned it, say)."""
        if revision < self._revisions.get(spec.slug, 0):
            return
        self._revisions[spec.slug] = revision
        self.catalog.add(spec)  # visible (and acted on) here at once; the watch confirms it
        self.notify(spec.name, spec)
