"""The fleet's catalog in NATS: KV bucket `fbx_models`, mirrored into a box's `Catalog`.

Every box (and the TUI) watches the bucket, so a model registered on any box is servable by every box,
with no restart; what is heard is applied to the catalog in revision order (`appliance/catalog_mirror.py`). A
registration also claims its name and aliases (`appliance/names.py`), so two racing for one name are not both
written.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from contextlib import suppress
from dataclasses import fields
from typing import Any

import orjson
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import (
    BadRequestError,
    BucketNotFoundError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
)
from nats.js.kv import KeyValue

from appliance import bus
from appliance.catalog import DEFAULT_MODEL_NAME, Catalog, ModelChange, ModelSpec, slug_taken
from appliance.catalog_mirror import CatalogMirror
from appliance.errors import Conflict, NotFound
from appliance.names import Claim, NameClaims
from appliance.tasks import cancel_and_wait

log = logging.getLogger(__name__)

_UPDATE_TRIES = 8  # a change reads the model and writes it back; this many times when others write in between
_UPDATE_BACKOFF_S = 0.005  # before try n it waits a random part of this times 2**n (0.64 s at most, before the last)
_WRONG_LAST_SEQUENCE = 10071  # JetStream's error code when a conditional write (a delete) finds a newer revision
_ONE_READ_S = 2.0  # a one-off read's consumer is removed this long after its watcher stops


class CatalogStore:
    """Mirrors KV bucket `fbx_models` into a `Catalog`, and writes registrations to it.

    Keys are model slugs; values are `ModelSpec.to_json()`. Models from a box's config file are
    created only if missing, so a pin or a registration made through the API survives restarts.
    """

    def __init__(
        self,
        js: JetStreamContext,
        catalog: Catalog,
        *,
        replicas: int = 1,
        file_storage: bool = False,
        registers: bool = False,
    ) -> None:
        self._js = js
        self.catalog = catalog
        self._replicas = replicas
        self._file_storage = file_storage
        self._kv: KeyValue | None = None
        # Only a box registers and deletes models; a reader (the TUI) must not create the claims' bucket.
        self._names = NameClaims(js, replicas=replicas, lists=self._lists) if registers else None
        self._task: asyncio.Task[None] | None = None
        self._watcher: KeyValue.KeyWatcher | None = None
        self._mirror = CatalogMirror(catalog)
        self._bucket_made: Any = None  # when the bucket this box follows was made: another one is a remade bucket

    async def _lists(self, model: str, name: str) -> bool:
        """Whether `model` has `name` as its name or an alias, as the bucket holds it now (looked up and applied
        here, as `still_holds` does: this box's catalog may not have heard of a change made elsewhere yet); True
        where the bucket cannot be read."""
        try:
            entry = await self._look_again(bus.model_slug(model))
        except NatsError:
            return True
        spec = self.catalog.get(model) if entry is not None else None
        return spec is not None and spec.name == model and name in (spec.name, *spec.aliases)

    def on_change(self, listener: Callable[[str, ModelSpec | None], None]) -> None:
        """Call `listener(name, spec)` after every change; spec is None for a removal."""
        self._mirror.on_change(listener)

    async def open(self, configured: list[ModelSpec], *, judged: bool = False) -> None:
        """Follow the bucket, after adding the `configured` models it lacks. `judged` (a box's start, its config
        file's models): one whose name or alias another model holds, or whose slug another model has, is refused
        (`Conflict`), as `POST /v1/models` refuses it; one the bucket holds already that the config file describes
        otherwise is logged (the bucket wins)."""
        self._kv = await bus.ensure_bucket(
            self._js,
            KeyValueConfig(
                bucket=bus.MODELS_BUCKET,
                history=1,
                replicas=self._replicas,
                storage=StorageType.FILE if self._file_storage else StorageType.MEMORY,
            ),
        )
        self._bucket_made = await self._made()
        if self._names is not None:
            await self._names.open()
        self._watcher = watcher = await self._kv.watchall()
        # The watcher replays every current key: the catalog is complete after it. A model missing from the replay
        # is not forgotten: a bucket another box is making again after a NATS restart may be replayed before that
        # box has written it back, and a removal here is a deletion to listeners.
        for entry in await bus.replay(self._js, bus.MODELS_BUCKET, watcher):
            self._mirror.apply(entry)
        for spec in configured:  # judged against the whole catalog; what they add comes through the watch again
            await self._add_configured(spec, judged)
        self._task = asyncio.create_task(self._follow(watcher), name="catalog-watch")

    async def _add_configured(self, spec: ModelSpec, judged: bool) -> None:
        """Add a model of a box's config file unless the bucket holds it (by another box, or before a restart: the
        bucket wins). Judged, it may take no name, alias or slug of another model: a `[[models]]` entry with
        another model's alias took the alias over on every box, unsaid, and its deletion left the alias to no one
        (tester h73)."""
        assert self._kv is not None
        held = self.catalog.by_slug(spec.slug) if judged else None  # a reopen writes back what this box knew
        if held is not None:
            if held.name != spec.name:
                raise self._config_refused(spec, f"its slug {spec.slug!r} is model {held.name!r}'s")
            if held != spec:
                log.warning(
                    "a model of the config file differs from the fleet's catalog, which stands (change it with"
                    " PATCH /v1/models/{name} where PATCH can, else delete it and restart)",
                    extra={"model": spec.name, "differing": _differing(spec, held)},
                )
            return
        claims: list[Claim] = []
        if judged:
            for name in (spec.name, *spec.aliases):
                holder = self.catalog.get(name)
                if holder is not None:
                    held_as = "its name" if holder.name == name else "an alias"
                    raise self._config_refused(spec, f"{name!r} is taken: model {holder.name!r} has it as {held_as}")
                owner = self.catalog.adapter_address_owner(name) if spec.adapter_of is None else None
                if owner is not None:  # `POST /v1/models` refuses it 422; taken, it kept that adapter out (h74)
                    raise self._config_refused(spec, f"{name!r} is the address of an adapter of {owner}")
            if self._names is not None:  # a registration of one of its names under way on another box
                try:
                    claims = await self._names.claim(spec.name, spec.aliases)
                except Conflict as exc:
                    raise self._config_refused(spec, exc.message) from None
        try:
            revision = await self._kv.create(spec.slug, spec.to_json())
        except KeyWrongLastSequenceError:  # created meanwhile (a box with the same config starting): it stands
            if self._names is not None:
                await self._names.give_back(claims)
            return
        self._mirror.added(spec, revision)

    @staticmethod
    def _config_refused(spec: ModelSpec, why: str) -> Conflict:
        if spec.name == DEFAULT_MODEL_NAME:  # no config file to rename it in (tester h74)
            what, instead = f"the packaged default model {spec.name}", "start the box with default_model = false"
        else:
            what, instead = f"model {spec.name!r} of this box's config", "rename it in the config"
        return Conflict(f"{what}: {why}; {instead}, or delete that model", code="model_exists")

    async def reopen(self) -> None:
        """After a reconnect: watch afresh. A bucket that survived is the truth (this box may have missed
        changes); one lost with a server's memory (no --durable) is made again from this box's view."""
        await self.close()
        try:
            await self._js.key_value(bus.MODELS_BUCKET)
            # Made again since this box opened it (another box reconnected first to a server that lost it): it
            # holds only that box's view, so this box writes its own back too, as if it had found none.
            remade = self._bucket_made is not None and await self._made() != self._bucket_made
            known: list[ModelSpec] = list(self.catalog) if remade else []
        except BucketNotFoundError:
            known = list(self.catalog)
        # The bucket may have been made again (here, or by another box first), counting revisions from 1: the
        # replay brings every key's revision afresh, and each model is acted on again (its queue settled).
        self._mirror.forget_revisions()
        await self.open(known)

    async def _made(self) -> Any:
        """When the catalog bucket's stream was made (None when that cannot be read)."""
        try:
            return (await self._js.stream_info(f"KV_{bus.MODELS_BUCKET}")).created
        except NatsError:
            return None

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
        async for entry in watcher:
            if entry is not None:
                self._mirror.apply(entry)

    async def put(self, spec: ModelSpec) -> None:
        assert self._kv is not None
        self._mirror.added(spec, await self._kv.put(spec.slug, spec.to_json()))

    async def create(self, spec: ModelSpec) -> None:
        """Add a model whose slug, name and aliases no model holds yet, fleet-wide: of two registrations
        racing for one slug (one name twice, or `Foo` and `foo`) or one name or alias (A and B both with
        alias `x`, or B named `x`) on any boxes, the second is refused, never written over the first."""
        assert self._kv is not None and self._names is not None
        claims = await self._names.claim(spec.name, spec.aliases)
        try:
            revision = await self._kv.create(spec.slug, spec.to_json())
        except KeyWrongLastSequenceError:
            await self._names.give_back(claims)
            read = True
            try:  # who won is read, to be named as a refusal without a race names it
                await self._look_again(spec.slug)
            except NatsError:
                read = False
            holder = self.catalog.by_slug(spec.slug)
            if holder is None and not read:  # unread, the winner is there for all this box knows (review h201)
                raise Conflict(
                    f"a model with slug {spec.slug!r} was registered meanwhile (by a registration racing this one); "
                    "delete it first, or choose another name",
                    code="model_exists",
                ) from None
            raise Conflict(
                slug_taken(spec.name, spec.slug, holder.name if holder else None), code="model_exists"
            ) from None
        # Any other failure (a timeout, a cancel) may come after the server stored the model: its claims
        # are kept, to lapse with their TTL, rather than freed under a model that may exist.
        self._mirror.added(spec, revision)

    async def update(self, spec: ModelSpec, change: ModelChange) -> ModelSpec:
        """Apply `change` to the model as the bucket holds it now, only if nobody changed it meanwhile (a pin, a
        PATCH): a change racing a delete made on another box must not bring the model back (404), and one racing
        another change is made again over it, up to `_UPDATE_TRIES` times, a little apart (then 409).

        Every alias of a new list is claimed on every try, after the entry it writes over is read
        (`appliance/names.py`; the model's own claims are taken over): an alias the model had when the change was
        judged may have been dropped and claimed by another model since, and the try that writes it must find
        that out. Aliases the change drops are given back once it is written, each only at the revision its claim
        had before the write: a change that put one back meanwhile renewed it, and keeps it."""
        if change.pinned and spec.adapter_of is not None:
            raise Conflict(f"{spec.name} is an adapter; pin its base model {spec.adapter_of}")
        assert self._kv is not None
        claims: list[Claim] = []
        try:
            for attempt in range(_UPDATE_TRIES):
                if attempt:  # changes racing on several boxes: spread apart, so that one gets through each round
                    await asyncio.sleep(random.uniform(0, _UPDATE_BACKOFF_S * 2**attempt))
                written = await self._write_over(spec, change, claims)
                if written is not None:
                    updated, dropped = written
                    if self._names is not None:
                        await self._names.give_back(dropped)
                    return updated
        except (NotFound, Conflict):  # surely not written; any other failure may come after the write: claims kept
            if self._names is not None:
                await self._names.give_back(claims)
            raise
        if self._names is not None:
            await self._names.give_back(claims)
        raise Conflict(f"model {spec.name} keeps changing (on other boxes?); send the change again")

    async def _write_over(
        self, spec: ModelSpec, change: ModelChange, claims: list[Claim]
    ) -> tuple[ModelSpec, list[Claim]] | None:
        """One try: the entry read, the new aliases claimed (into `claims`, renewing the last try's), the changed
        entry written over the one read (compare-and-set). The model as written and the claims of the aliases it
        dropped, as read before the write; None when another write got in first."""
        assert self._kv is not None
        try:
            entry = await self._kv.get(spec.slug)
        except KeyNotFoundError:
            raise self._gone(spec) from None
        current = ModelSpec.from_json(entry.value) if entry.value else None
        if current is None or current.name != spec.name:
            raise self._gone(spec)
        updated = change.apply(current)
        dropped: list[Claim] = []
        if self._names is not None:
            if change.aliases is not None:
                claims[:] = await self._names.claim(spec.name, updated.aliases, renewing=claims, own_name=False)
            dropped = await self._names.held(spec.name, set(current.aliases) - set(updated.aliases))
        try:
            revision = await self._kv.update(spec.slug, updated.to_json(), last=entry.revision)
        except KeyWrongLastSequenceError:
            return None  # changed since it was read: read it again (it may be gone now)
        self._mirror.added(updated, revision)
        return updated, dropped

    @staticmethod
    def _gone(spec: ModelSpec) -> NotFound:
        return NotFound(f"model {spec.name!r} does not exist (deleted meanwhile)", code="model_not_found")

    async def _look_again(self, slug: str) -> KeyValue.Entry | None:
        """What the bucket holds under `slug` now (a deletion included, with its revision), applied here at once;
        None when the key never was. Raises NATS errors."""
        assert self._kv is not None
        try:
            entry: KeyValue.Entry | None = await self._kv.get(slug)
        except KeyNotFoundError as exc:  # a deleted key's error carries the deletion, with its revision
            entry = exc.entry
        if entry is not None:
            self._mirror.apply(entry)
        return entry

    async def find(self, name: str) -> ModelSpec | None:
        """The model `name` names (a name or an alias) as this box's catalog holds it, else as the bucket holds it
        now: a box hears of a registration made on another box milliseconds late, and a DELETE sent to it
        meanwhile answered 404 while the model stayed registered (tester h89, 3 of 10). What the lookup finds is
        applied here at once. An alias this box has not heard of is not looked up: the bucket's keys are slugs."""
        spec = self.catalog.get(name)
        if spec is not None or self._kv is None:
            return spec
        try:
            slug = bus.model_slug(name)
        except ValueError:  # no model may have such a name
            return None
        try:
            await self._look_again(slug)
        except NatsError as exc:
            log.info("catalog lookup failed", extra={"model": name, "error": repr(exc)})
        return self.catalog.get(name)

    async def still_holds(self, spec: ModelSpec) -> bool:
        """Whether the fleet's catalog still holds `spec`, looked up in the bucket now. A box hears of a change
        made on another box through its watch, milliseconds late: a registration refused because this box still
        sees a name taken looks again first (a DELETE on one box, then the same name registered on another, was
        refused 409 in about 1 try in 400). What the lookup finds is applied here at once; a lookup that fails
        (NATS away) leaves the name held, as this box's catalog says."""
        try:
            entry = await self._look_again(spec.slug)
        except NatsError as exc:
            log.warning("catalog lookup failed; the name counts as taken", extra={"error": repr(exc)})
            return True
        current = self.catalog.by_slug(spec.slug)
        return entry is not None and current is not None and current.name == spec.name

    async def adapters_in_bucket(self, base: str) -> list[ModelSpec]:
        """The adapters of `base` the bucket holds now, those a box has not heard of yet included (a registration
        on another box racing the base's deletion). Reads every entry up to the bucket's last revision, not
        `KeyValue.keys()`: its watcher may end its replay early (nats.py #842, #995), and a clean-clone CI run
        missed an adapter registered a moment before, left in the bucket without its base. For deletions: rare.
        Its consumer is deleted after the read, or seconds later where that delete fails: at nats-py's 5 minutes,
        each deletion left one on the catalog's stream, and a burst of them reached the stream's 1,000 (tester h94:
        then a DELETE was 503)."""
        assert self._kv is not None
        watcher = await self._kv.watchall(inactive_threshold=_ONE_READ_S)
        try:
            entries = {entry.key: entry.value for entry in await bus.replay(self._js, bus.MODELS_BUCKET, watcher)}
        finally:
            await bus.stop_watch(self._js, watcher)
        specs = [ModelSpec.from_json(value) for value in entries.values() if value]  # a delete's marker has none
        return [spec for spec in specs if spec.adapter_of == base]

    async def delete(self, spec: ModelSpec) -> bool:
        """Take the model out of the bucket, as the bucket holds it: the claims of that entry's name and aliases
        are given back first, then the entry is deleted only at the revision read (a change written meanwhile,
        with an alias it claimed, is read again and its claims given back too). False when it was not there to
        delete: another deletion took it a moment before (two DELETEs at once were both answered 200)."""
        assert self._kv is not None
        known = self._mirror.revision(spec.slug)
        deleted = False
        for _ in range(_UPDATE_TRIES + 1):
            try:
                entry = await self._kv.get(spec.slug)
            except KeyNotFoundError:
                break  # deleted already (on another box)
            current = ModelSpec.from_json(entry.value) if entry.value else None
            if current is None or current.name != spec.name:
                break  # another model holds the slug now: not this deletion's to take
            if self._names is not None:
                # Before the model goes: once it is gone a new registration may claim its names, and a claim
                # holds only the model's name, so a release after would free the newcomer's. Meanwhile every
                # box's catalog still refuses the names.
                await self._names.release(spec.name, (spec.name, *current.aliases))
            try:
                await self._kv.delete(spec.slug, last=entry.revision)
                deleted = True
                break
            except BadRequestError as exc:
                if exc.err_code != _WRONG_LAST_SEQUENCE:
                    raise
                # changed since it was read (a PATCH on another box): read it again
        else:
            raise Conflict(f"model {spec.name} keeps changing (on other boxes?); delete it again")
        # The deletion as the bucket has it, with its revision, so that a re-registration made since on another
        # box (and heard already) is not taken away here. Heard nothing newer (NATS away, a lagging replica):
        # the model this box deleted goes, as this box knows it.
        with suppress(NatsError):
            await self._look_again(spec.slug)
        if self._mirror.revision(spec.slug) == known and self.catalog.remove(spec.name) is not None:
            self._mirror.notify(spec.name, None)
        return deleted

    async def close(self, *, connected: bool = True) -> None:
        await cancel_and_wait([self._task])
        if self._watcher is not None:
            await bus.stop_watch(self._js, self._watcher, connected=connected)
            self._watcher = None


_NOT_COMPARED = {field.name for field in fields(ModelSpec) if not field.compare}  # when it was made, not what


def _differing(configured: ModelSpec, held: ModelSpec) -> list[str]:
    """The fields in which the catalog's entry differs from the config file's."""
    ours, theirs = orjson.loads(configured.to_json()), orjson.loads(held.to_json())
    keys = (ours.keys() | theirs.keys()) - _NOT_COMPARED
    return sorted(key for key in keys if ours.get(key) != theirs.get(key))
