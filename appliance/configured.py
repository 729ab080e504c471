"""The models a box's config file declares, and the packaged default model, as catalog entries.

Read before a box starts (a bad `[[models]]` entry is a settings error, exit 2) and offered to the
fleet's catalog at start, where an entry already registered wins. Each folder's task is detected as
a registration through the API detects it, and an adapter serves its base's task.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from appliance.catalog import (
    DEFAULT_MODEL_ALIAS,
    DEFAULT_MODEL_NAME,
    ModelSpec,
    batching_of,
    default_batching,
    default_model_path,
    knobs_given,
    spec_of,
)
from appliance.settings import ModelEntry, Settings
from appliance.settings_load import SettingsProblems
from runtimes import RuntimeKind, Task, UnsupportedModel
from runtimes.detect import detect_task
from runtimes.options import option_problems


def configured_specs(settings: Settings) -> list[ModelSpec]:
    """The models of the config file, with the packaged default model first unless turned off."""
    entries = list(settings.models)
    places = [f"models.{index}" for index in range(len(entries))]  # where each entry is set, for a refusal
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
        places.insert(0, "default_model")
    # An adapter's base may be named by an alias, as through the API; the catalog keeps the base's name.
    names = {alias: entry.name for entry in entries for alias in entry.aliases}
    entries = [
        entry.model_copy(update={"adapter_of": names[entry.adapter_of]}) if entry.adapter_of in names else entry
        for entry in entries
    ]
    specs, problems = [], []
    for place, entry in zip(places, entries, strict=True):
        try:
            specs.append(spec_from_entry(entry, settings))
        except ValueError as exc:  # named as a field pydantic refuses is: `models.0: model 'g': ...`
            problems.append(f"{place}: {exc}")
    if problems:  # every entry's at once, not one a start
        raise SettingsProblems(problems)
    tasks = {spec.name: spec.task for spec in specs}  # an adapter serves its base's task, as through the API
    return [replace(spec, task=tasks[spec.adapter_of]) if spec.adapter_of in tasks else spec for spec in specs]


def spec_from_entry(entry: ModelEntry, settings: Settings) -> ModelSpec:
    runtime = RuntimeKind(entry.runtime)
    path = entry.path
    if path is None:
        if runtime is not RuntimeKind.NOOP:
            raise ValueError(f"model {entry.name!r} needs a path")
        path = Path(".")
    defaults = default_batching(settings)
    if entry.task is not None:
        task = Task(entry.task)
    elif runtime is RuntimeKind.NOOP or entry.adapter_of is not None:
        task = Task.EMBED  # an adapter's task is its base's, set when it is resolved
    else:
        try:
            task = detect_task(path)  # the same detection as registration through the API
        except UnsupportedModel as exc:
            raise UnsupportedModel(f"model {entry.name!r}: {exc}") from None
    for option, problem in option_problems(task, runtime, entry.options).items():
        raise ValueError(f"model {entry.name!r}: options.{option} {problem}")
    if entry.adapter_of is not None and entry.options:
        raise ValueError(f"model {entry.name!r} is an adapter: it runs with its base's options (set them there)")
    knobs = knobs_given(entry)
    if knobs and (entry.adapter_of is not None or task is Task.GENERATE):  # as a registration through the API
        where = "its base's batches" if entry.adapter_of is not None else "a decode batch set by its options"
        raise ValueError(f"model {entry.name!r} runs in {where}: {', '.join(knobs)} would not apply to it")
    return spec_of(entry, task=task, path=path, batching=batching_of(entry, defaults), adapter_of=entry.adapter_of)
