"""What a causal LM's folder says about generating with it: the tokens that end a completion, the
sampling a request gets by default, and whether its attention suits the shared batch cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtimes.attention import refuse_other_layers
from runtimes.tasks.generate import SamplingParams
from runtimes.tokenizer import TextTokenizer


def check_full_attention(config: Any, folder: Path) -> None:
    """Refuse a model whose layers are not all full attention (sliding windows, linear attention).

    The registration judges config.json by the same rule (`runtimes.attention.layer_types_in`): a change
    here is a change there."""
    refuse_other_layers(getattr(config.get_text_config(decoder=True), "layer_types", None) or (), folder)


def eos_ids(model: Any, tokenizer: TextTokenizer, folder: Path) -> frozenset[int]:
    """The ids that end a completion: the generation config's, else the tokenizer's EOS token."""
    value = getattr(model.generation_config, "eos_token_id", None)
    if value is None:
        value = getattr(model.config, "eos_token_id", None)
    ids = {value} if isinstance(value, int) else set(value or ())
    if not ids:
        config_file = folder / "tokenizer_config.json"
        token = json.loads(config_file.read_text()).get("eos_token") if config_file.is_file() else None
        if isinstance(token, dict):
            token = token.get("content")
        found = tokenizer.token_id(token) if isinstance(token, str) else None
        if found is not None:
            ids.add(found)
    return frozenset(ids)


def default_params(folder: Path) -> SamplingParams:
    """The sampling a request gets where it says nothing: the model's `generation_config.json` values (temperature,
    top_p, top_k, min_p, repetition_penalty, as vLLM takes them), else none."""
    config_file = folder / "generation_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return SamplingParams(
        temperature=float(config.get("temperature", 1.0)),
        top_p=float(config.get("top_p", 1.0)),
        top_k=max(0, int(config.get("top_k") or 0)),
        min_p=float(config.get("min_p") or 0.0),
        repetition_penalty=float(config.get("repetition_penalty") or 1.0),
    )
