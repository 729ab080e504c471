"""How peft has wrapped a base model's modules for its resident LoRA adapters, and which of them a new adapter collides
with.

peft wraps a module one way per module: a LoRA layer, a `modules_to_save` copy, or trainable tokens. Two adapters
that need one module (or a module and one inside it) wrapped two ways cannot be resident together: peft refuses the
second with its own words ("Target module ModulesToSaveWrapper is not supported"), or, for trainable tokens, looks
every other adapter up in their wrapper and fails. What an adapter needs is read from its saved weights' names, before
anything is injected; what the resident ones hold, from the model's modules.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

Wrapping = tuple[str, set[str]]  # how a module is wrapped (`lora`, `copy`, `tokens`) and for which adapters

_LORA_MARKERS = (
    ".lora_A.",
    ".lora_B.",
    ".lora_embedding_A",
    ".lora_embedding_B",
    ".lora_magnitude_vector",
    ".base_layer.",
)
_TOKENS_MARKER = ".token_adapter."
# The heads peft puts in `modules_to_save` for a task type (its PeftModelFor... classes), as the config may not say.
_TASK_HEADS = {
    "SEQ_CLS": ("classifier", "score"),
    "TOKEN_CLS": ("classifier", "score"),
    "QUESTION_ANS": ("qa_outputs",),
}


def wrapping(module: torch.nn.Module) -> Wrapping | None:
    """How peft wrapped this module, if it did, and for which adapters."""
    from peft.tuners.lora.layer import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper, TrainableTokensWrapper

    if isinstance(module, LoraLayer):
        return "lora", {name for layers in LoraLayer.adapter_layer_names for name in getattr(module, layers)}
    if isinstance(module, ModulesToSaveWrapper):
        return "copy", set(module.modules_to_save)
    if isinstance(module, TrainableTokensWrapper):
        return "tokens", set(module.token_adapter.trainable_tokens_delta)
    return None


def unwrapped(module: Any) -> torch.nn.Module:
    """The base's own module inside a peft wrapper (see `wrapping`)."""
    from peft.tuners.lora.layer import LoraLayer

    return module.get_base_layer() if isinstance(module, LoraLayer) else module.original_module


def wrapped_modules(model: torch.nn.Module) -> dict[str, Wrapping]:
    """Every module peft has wrapped in `model`, by name."""
    return {name: found for name, module in model.named_modules() if (found := wrapping(module)) is not None}


def modules_adapted(path: Path, config: Any) -> dict[str, str]:
    """The modules the adapter in `path` (its LoraConfig `config`) adapts, by their peft name, and how. A copy's weights
    name the layers inside the module copied (`classifier.dense.weight`): the module is the outermost one whose name
    ends with an entry of its `modules_to_save` (or its task's heads), as peft picks it."""
    copied = (*(config.modules_to_save or ()), *_TASK_HEADS.get(str(config.task_type), ()))
    adapted = {}
    for key in _weight_names(path):
        lora = next((marker for marker in _LORA_MARKERS if marker in key), None)
        if lora is not None:
            adapted[key.split(lora)[0]] = "lora"
        elif _TOKENS_MARKER in key:
            adapted[key.split(_TOKENS_MARKER)[0]] = "tokens"
        else:
            adapted[_copied_module(key.rpartition(".")[0], copied)] = "copy"
    return adapted


def in_the_way(wrapped: dict[str, Wrapping], adapted: dict[str, str]) -> dict[str, set[str]]:
    """The resident adapters in the way of a new one, by the module they collide at: wrapped another way at the same
    module, one inside the other; trainable tokens also stand in the way of an adapter that trains none there."""
    blocked: dict[str, set[str]] = {}
    for name, kind in adapted.items():
        for other, (other_kind, adapters) in wrapped.items():
            if adapters and other_kind != kind and _overlap(name, other):
                blocked.setdefault(name, set()).update(adapters)
    for other, (other_kind, adapters) in wrapped.items():
        if other_kind == "tokens" and adapters and adapted.get(other) != "tokens":
            blocked.setdefault(other, set()).update(adapters)
    return blocked


def _weight_names(path: Path) -> Iterable[str]:
    weights = path / "adapter_model.safetensors"
    if weights.is_file():
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as saved:
            return list(saved.keys())
    from peft.utils import load_peft_weights

    return list(load_peft_weights(str(path), device="cpu"))


def _copied_module(module_name: str, copied: Sequence[str]) -> str:
    parts = module_name.split(".")
    for end in range(1, len(parts) + 1):
        prefix = ".".join(parts[:end])
        if any(prefix == entry or prefix.endswith(f".{entry}") for entry in copied):
            return prefix
    return module_name


def _overlap(one: str, other: str) -> bool:
    """Whether two modules are one, or one holds the other."""
    return one == other or one.startswith(f"{other}.") or other.startswith(f"{one}.")
