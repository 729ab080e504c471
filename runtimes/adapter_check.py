"""What a LoRA adapter folder must be for fleetbox to serve it on its base, read from its files before anything is
loaded: a peft LoRA (`adapter_config.json` of fields peft can build from, and weights), saved for the base's kind
of model, that changes nothing every request on the base shares (its biases, a base rewritten by its
initialisation), and whose weights fit the base's layers and head (from the safetensors headers, without torch).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from runtimes.base import HEAD_MODULES, Task, UnsupportedModel, safetensors_files
from runtimes.detect import (
    ADAPTER_WEIGHT_FILES,
    HEAD_WEIGHTS,
    check_safetensors_whole,
    head_labels,
    json_object,
    safetensors_shapes,
)


def check_adapter_folder(folder: Path, *, base_task: Task | None = None, mixed_rows: bool = True) -> None:
    """Raise `UnsupportedModel` unless `folder` holds a LoRA adapter saved by peft (read without torch).

    `base_task`: the base model's task, when known; an adapter peft saved for another kind of model is refused.
    `mixed_rows`: whether the base's calls mix adapters per row (a generator's do: see runtimes/lora.py)."""
    config_file = Path(folder) / "adapter_config.json"
    if not config_file.is_file():
        raise UnsupportedModel(f"{folder} has no adapter_config.json; a LoRA adapter saved by peft is expected")
    config = json_object(config_file)
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise UnsupportedModel(f"{folder} is a {peft_type} adapter; only LoRA adapters are supported")
    if not any((Path(folder) / name).is_file() for name in ADAPTER_WEIGHT_FILES):
        raise UnsupportedModel(f"{folder} has no adapter weights ({' or '.join(ADAPTER_WEIGHT_FILES)})")
    check_safetensors_whole([Path(folder) / "adapter_model.safetensors"], required=False)
    _check_lora_fields(config, config_file)
    _refuse_shared_changes(config, folder)
    if mixed_rows and config.get("use_dora"):
        raise UnsupportedModel(
            f"LoRA adapter {folder} is a DoRA adapter, which peft cannot apply per row of a generation batch"
        )
    task_type = config.get("task_type")
    if task_type is not None and task_type not in _PEFT_TASK_TYPES:
        raise UnsupportedModel(
            f"LoRA adapter {folder} has task_type {task_type!r}, which peft does not know (one of "
            f"{', '.join(_PEFT_TASK_TYPES)}, or none)"
        )
    if base_task is not None and task_type is not None and task_type not in _ADAPTER_TASK_TYPES[base_task]:
        raise UnsupportedModel(
            f"LoRA adapter {folder} was saved for a {task_type} model (peft task_type), not for a base that "
            f"does {base_task}; expected task_type {' or '.join(_ADAPTER_TASK_TYPES[base_task])}"
        )


def check_adapter_fits(adapter: Path, base: Path) -> None:
    """Raise `UnsupportedModel` for an adapter whose weights do not fit the base model in `base`: a head copy
    (`modules_to_save`) of another shape (a 3-label head on a 1-label reranker), or a LoRA sized for other
    layers. Read from the safetensors headers, without torch. Only a shape that contradicts the base's is
    refused here: weights in another format, or names that do not line up (a checkpoint's legacy names, a head
    built otherwise), are judged by the first load, which refuses weights that find no place in the model."""
    adapter_shapes = safetensors_shapes([Path(adapter) / "adapter_model.safetensors"])
    base_shapes = safetensors_shapes(safetensors_files(Path(base)))
    if not adapter_shapes or not base_shapes:
        return
    for key, shape in adapter_shapes.items():
        # peft saves a targeted embedding's or head's own weight under `<module>.base_layer.weight`
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        lora = next(((part, dim) for part, dim in ((".lora_A.", 1), (".lora_B.", 0)) if part in name), None)
        if lora is not None:
            part, dim = lora
            module = name.split(part)[0]
            weight = _matching(base_shapes, f"{module}.weight")
            if weight is None or len(shape) < 2 or len(weight) < 2:
                continue
            # A Linear keeps its weight as (out, in), GPT-2's Conv1D as (in, out): either side may be the match.
            fits = shape[dim] in weight[:2] if len(weight) == 2 else shape[dim] == weight[dim]
            if not fits:
                side = "inputs" if dim == 1 else "outputs"
                raise UnsupportedModel(
                    f"LoRA adapter {adapter} was trained for another model: its LoRA on {module} has "
                    f"{shape[dim]} {side}, where the base's layer is {'x'.join(map(str, weight))}"
                )
            continue
        if "lora_" in name or "magnitude_vector" in name:
            continue
        found = _matching(base_shapes, name)  # a head copy: the base's module, whole
        if found is not None and found != shape:
            raise UnsupportedModel(
                f"LoRA adapter {adapter} saves its own copy of {name} shaped {shape}, where the base's is "
                f"{found}: it was trained on a model with another head (another number of labels?)"
            )


def check_adapter_labels(adapter: Path, base: Path) -> None:
    """Raise `UnsupportedModel` for an adapter of a scorer, classifier or extractor whose head (a `modules_to_save`
    copy, or a LoRA on it) gives another number of labels than the base's config.json: the load builds the head
    the config says, so every request failed with torch's size mismatch (black-box finding, a base whose weights
    hold no head to compare with, where `check_adapter_fits` has nothing to judge). From the safetensors header and
    config.json; an adapter in another format, or a config that states no labels, passes."""
    adapter_shapes = safetensors_shapes([Path(adapter) / "adapter_model.safetensors"])
    labels = _labels_of(Path(base) / "config.json")
    if labels is None or not adapter_shapes:
        return
    count, source = labels
    for key, shape in adapter_shapes.items():
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        module, lora, _ = name.partition(".lora_B.")
        head = f"{module}.weight" if lora else name
        if head not in HEAD_WEIGHTS or len(shape) != 2 or shape[0] == count:
            continue
        what = f"its LoRA on {module}" if lora else f"its own copy of {head}"
        raise UnsupportedModel(
            f"LoRA adapter {adapter} has a head of {shape[0]} labels ({what} is {shape}), where its base's config.json "
            f"says {count} labels ({source}): it was trained on a model with another head; register it on a base "
            f"of {shape[0]} labels"
        )


def _labels_of(config_file: Path) -> tuple[int, str] | None:
    """`head_labels` of a base's config.json; None when it says none, or cannot be read (its load says why)."""
    try:
        labels = head_labels(json_object(config_file))
    except (OSError, UnsupportedModel):
        return None
    return labels if labels is not None and labels[0] > 0 else None


def check_adapter_brings_head(adapter: Path, base: Path) -> None:
    """Raise `UnsupportedModel` for an adapter of a scorer, classifier or extractor whose base's weights hold no head
    when the adapter brings none either (saved without `task_type`): it would answer with the random head the load
    fills in, another noise on every load (review finding). From the safetensors headers; unknown formats pass."""
    base_shapes = safetensors_shapes(safetensors_files(Path(base)))
    adapter_shapes = safetensors_shapes([Path(adapter) / "adapter_model.safetensors"])
    if not base_shapes or not adapter_shapes or any(key.split(".")[0] in HEAD_MODULES for key in base_shapes):
        return
    if any(part in HEAD_MODULES for key in adapter_shapes for part in key.split(".")):
        return
    raise UnsupportedModel(
        f"LoRA adapter {adapter} brings no head (classifier or score in modules_to_save) and its base's weights hold "
        "none: it would answer with a random head. Save it with task_type SEQ_CLS or TOKEN_CLS, which saves the head "
        "it trained, or register it on a base whose folder holds a trained head"
    )


def _matching(shapes: Mapping[str, list[int]], name: str) -> list[int] | None:
    """The shape of the base weight `name` names, allowing for a prefix one side's saved names carry."""
    if name in shapes:
        return shapes[name]
    for key, shape in shapes.items():
        if key.endswith(f".{name}") or name.endswith(f".{key}"):
            return shape
    return None


_PEFT_TASK_TYPES = ("SEQ_CLS", "SEQ_2_SEQ_LM", "CAUSAL_LM", "TOKEN_CLS", "QUESTION_ANS", "FEATURE_EXTRACTION")

# peft's `task_type` of an adapter (its PeftModel class: which head it wraps) that fits a base of each task.
_ADAPTER_TASK_TYPES: dict[Task, tuple[str, ...]] = {
    Task.EMBED: ("FEATURE_EXTRACTION",),
    Task.SCORE: ("SEQ_CLS",),
    Task.CLASSIFY: ("SEQ_CLS",),
    Task.EXTRACT: ("TOKEN_CLS",),
    Task.GENERATE: ("CAUSAL_LM",),
}

# The most a rank that sizes no saved layer may be: peft's default r is 8, and adapters are trained at 4 to 256.
_MOST_UNUSED_RANK = 256
_MOST_LORA_RANK = 65_536  # past any layer's width (`_MOST`'s hidden size): peft allocates r x width per layer first


def _check_lora_fields(config: Mapping[str, Any], config_file: Path) -> None:
    """Refuse the LoRA fields peft would fail on at the first request, with its own words (`'<=' not supported
    between instances of 'str' and 'int'`), or allocate for before it reads a weight (r of 10^12: 128 TB). h102."""

    def rank(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= _MOST_LORA_RANK

    def scale(value: Any) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        try:  # a whole number past a float's range (10^400) is no scale peft can divide by r
            return math.isfinite(float(value))
        except OverflowError:
            return False

    def refuse(field: str, value: Any, expected: str) -> NoReturn:
        said = json.dumps(value)
        said = said if len(said) <= 40 else f"{said[:37]}... ({len(said)} characters)"  # not a shorter number
        raise UnsupportedModel(f"{config_file}: {field} is {said}; {expected} is expected")

    if "r" in config and not rank(config["r"]):
        refuse("r", config["r"], f"a whole number from 1 to {_MOST_LORA_RANK}")
    if "lora_alpha" in config and not scale(config["lora_alpha"]):
        refuse("lora_alpha", config["lora_alpha"], "a number")
    targets = config.get("target_modules")
    if targets is not None and not isinstance(targets, str):
        if not isinstance(targets, list) or not all(isinstance(name, str) for name in targets):
            refuse("target_modules", targets, "a module name, a pattern or a list of module names")
    for field, judge, expected in (
        ("rank_pattern", rank, f"a whole number from 1 to {_MOST_LORA_RANK}"),
        ("alpha_pattern", scale, "a number"),
    ):
        pattern = config.get(field)
        if pattern is None:
            continue
        if not isinstance(pattern, dict):
            refuse(field, pattern, "an object of module patterns to values")
        for key, value in pattern.items():
            if not judge(value):
                refuse(f"{field}[{key!r}]", value, expected)
    _check_ranks_saved(config, config_file)


def _check_ranks_saved(config: Mapping[str, Any], config_file: Path) -> None:
    """Refuse a config whose rank for a saved layer (its `rank_pattern` entry, else `r`) is not that layer's saved
    LoRA rank: peft allocates each targeted layer's A and B at the configured rank before it reads a weight, and the
    load then fails on their shapes (every request a 422 in peft's words, tester h109); `_MOST_LORA_RANK` alone let
    r = 65,536 allocate hundreds of GB on a 4,096-wide model (review). A rank no saved layer takes (peft writes `r`,
    8 by default, beside a `rank_pattern` that sets every layer's: review h110) still sizes any layer
    `target_modules` selects that has no saved weights: it may not pass `_MOST_UNUSED_RANK` or the saved ranks.
    From the safetensors header; an adapter saved otherwise is judged at its load."""
    saved: dict[str, int] = {}
    for key, shape in safetensors_shapes([config_file.parent / "adapter_model.safetensors"]).items():
        for marker in (".lora_A.", ".lora_embedding_A"):  # a Linear's A is (r, in); an embedding's (r, vocab)
            if marker in key and len(shape) == 2:
                # peft matches patterns against the module's name in the base model, without the saved prefix.
                saved[key.removeprefix("base_model.model.").split(marker)[0]] = shape[0]
    if not saved:
        return
    pattern = config.get("rank_pattern") or {}
    ranks = {"r": config.get("r")} | {f"rank_pattern[{key!r}]": value for key, value in pattern.items()}
    taken: set[str] = set()
    for layer, saved_rank in saved.items():
        key = _pattern_key(pattern, layer, config_file)
        field = "r" if key is None else f"rank_pattern[{key!r}]"
        taken.add(field)
        if isinstance(ranks[field], int) and ranks[field] != saved_rank:
            said = f"{field} is {ranks[field]}, but the adapter's saved LoRA weights have rank {saved_rank} at {layer}"
            raise UnsupportedModel(f"{config_file}: {said}: the config is not the one these weights were saved with")
    most = max(_MOST_UNUSED_RANK, *saved.values())
    for field, rank in ranks.items():
        if field not in taken and isinstance(rank, int) and rank > most:
            raise UnsupportedModel(
                f"{config_file}: {field} is {rank} and sizes no saved layer, only layers target_modules may select "
                f"without saved weights; at most {most} is taken (the saved LoRA weights' ranks: "
                f"{', '.join(str(n) for n in sorted(set(saved.values())))})"
            )


def _pattern_key(pattern: Mapping[str, Any], layer: str, config_file: Path) -> str | None:
    """The `rank_pattern` key that sets `layer`'s rank, matched as peft matches it (`get_pattern_key`: the key a
    regular expression for the layer name's last dotted parts); None: `r` sets it."""
    for key in pattern:
        try:
            if re.match(rf"(.*\.)?({key})$", layer):
                return key
        except re.error as exc:
            raise UnsupportedModel(
                f"{config_file}: rank_pattern key {key!r} is not a regular expression: {exc}"
            ) from None
    return None


# Initialisations that rewrite the base weights the adapter was trained against: its A/B only make sense
# against that rewritten base, which every other request shares (peft can convert such an adapter to plain LoRA).
_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "eva")


def _refuse_shared_changes(config: Mapping[str, Any], folder: Path) -> None:
    """Refuse an adapter that would change what every request on its base shares: judged from
    adapter_config.json, at registration and again before a load."""
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_REWRITING_INITS):
        raise UnsupportedModel(
            f"LoRA adapter {folder} was trained against a base its {init!r} initialisation rewrote; convert it to "
            "a plain LoRA with peft (save_pretrained with path_initial_model_for_weight_conversion)"
        )
    bias = config.get("bias", "none")
    if bias != "none":
        raise UnsupportedModel(
            f"LoRA adapter {folder} trains biases (bias={bias!r}): they are the base's own, shared by every "
            "request; only bias='none' adapters are served"
        )
