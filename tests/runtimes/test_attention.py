"""A generator is refused at registration for attention that is not full on every layer exactly when its
load would refuse it: the JSON judgement (runtimes/attention.py) held against transformers' own config
classes, which the load reads (`AutoConfig.from_pretrained`, then `check_full_attention`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig
from transformers.models.auto import modeling_auto

from runtimes.attention import layer_types_in, refuse_other_layers
from runtimes.base import UnsupportedModel
from runtimes.causal_lm import check_full_attention

SLIDING = ["full_attention", "sliding_attention"]


def _registration_refuses(config: dict[str, Any]) -> bool:
    try:
        refuse_other_layers(layer_types_in(config) or (), Path("folder"))
    except UnsupportedModel:
        return True
    return False


def _load_refuses(folder: Path, config: dict[str, Any]) -> bool | None:
    """Whether the load refuses this config.json for its attention; None when transformers cannot read it at all."""
    (folder / "config.json").write_text(json.dumps(config))
    try:
        loaded = AutoConfig.from_pretrained(folder)
    except Exception:  # a config its class rejects never loads: nothing to compare
        return None
    try:
        check_full_attention(loaded, folder)
    except UnsupportedModel:
        return True
    return False


@pytest.mark.parametrize(
    ("config", "refused"),
    [
        ({"model_type": "qwen2", "use_sliding_window": True, "num_hidden_layers": 4, "max_window_layers": 2}, True),
        ({"model_type": "qwen2", "use_sliding_window": True}, True),  # 32 layers, windowed from the 28th
        ({"model_type": "qwen2", "use_sliding_window": True, "num_hidden_layers": 4, "max_window_layers": 4}, False),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": None}, False),
        ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 4096}, False),  # Qwen2.5's Hub config
        ({"model_type": "qwen3", "use_sliding_window": True, "num_hidden_layers": 2, "max_window_layers": 1}, True),
        ({"model_type": "qwen3", "sliding_window": 4096}, False),
        ({"model_type": "qwen2_moe", "use_sliding_window": True, "num_hidden_layers": 2}, True),
        ({"model_type": "qwen2_moe", "use_sliding_window": True, "max_window_layers": 0}, False),
        ({"model_type": "mistral", "sliding_window": 4096}, False),  # no layer types: the load accepts it
        ({"model_type": "mistral", "num_hidden_layers": 2, "layer_types": SLIDING}, True),
        ({"model_type": "mixtral", "sliding_window": 4096}, False),
        ({"model_type": "starcoder2", "sliding_window": 4096}, False),
        ({"model_type": "llama", "num_hidden_layers": 2, "layer_types": SLIDING}, True),
        ({"model_type": "llama", "num_hidden_layers": 2, "layer_types": ["full_attention"] * 2}, False),
        ({"model_type": "ministral", "num_hidden_layers": 2}, True),
        ({"model_type": "ministral", "num_hidden_layers": 2, "sliding_window": None}, False),
        ({"model_type": "gemma2", "num_hidden_layers": 2}, True),
        ({"model_type": "gemma3_text", "num_hidden_layers": 2, "sliding_window_pattern": 6}, True),
        ({"model_type": "gemma3_text", "num_hidden_layers": 2, "sliding_window_pattern": 1}, False),
        ({"model_type": "cohere2", "num_hidden_layers": 4}, True),
        ({"model_type": "cohere2", "num_hidden_layers": 4, "sliding_window_pattern": 1}, False),
        ({"model_type": "gpt_oss", "num_hidden_layers": 2}, True),
        ({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 2}}, True),
    ],
)
def test_a_family_judged_from_config_json_is_judged_as_its_load_judges_it(
    tmp_path: Path, config: dict[str, Any], refused: bool
) -> None:
    assert _load_refuses(tmp_path, config) is refused
    assert _registration_refuses(config) is refused


def test_no_causal_lm_config_transformers_ships_is_refused_at_registration_where_its_load_accepts_it(
    tmp_path: Path,
) -> None:
    """Every family, as transformers saves it (layer types listed), with them left to its class to derive,
    and listed by hand: a family the JSON cannot judge is left to the load, never refused on a guess."""
    wrong = []
    for model_type in sorted(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            saved = AutoConfig.for_model(model_type).to_dict()
        except Exception:  # a family whose defaults alone make no config: nothing to save
            continue
        derived = {key: value for key, value in saved.items() if key != "layer_types"}
        for name, config in {
            "saved": saved,
            "derived": derived,
            "windowed": derived | {"use_sliding_window": True, "num_hidden_layers": 4, "max_window_layers": 2},
            "listed": saved | {"num_hidden_layers": 2, "layer_types": SLIDING},
            "listed full": saved | {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2},
            "bare": {"model_type": model_type},
        }.items():
            loaded = _load_refuses(tmp_path, config)
            if loaded is not None and _registration_refuses(config) and not loaded:
                wrong.append(f"{model_type} ({name})")
    assert not wrong, f"refused at registration, accepted by the load: {', '.join(wrong)}"


@pytest.mark.parametrize(
    ("config", "listed"),
    [
        ({"model_type": ["llama"]}, None),
        ({"model_type": {"name": "qwen2"}, "layer_types": ["sliding_attention"]}, ["sliding_attention"]),
        ({"model_type": "gemma2", "text_config": {"model_type": ["llama"]}}, None),
        ({"model_type": "qwen2", "text_config": {"model_type": {"x": 1}, "num_hidden_layers": 2}}, None),
        ({"model_type": "gemma2", "num_hidden_layers": 10_001}, None),
        ({"model_type": "gemma2", "num_hidden_layers": -3}, None),
    ],
)
def test_a_config_json_of_the_wrong_shape_is_left_to_the_load_not_an_error(
    config: dict[str, Any], listed: list[str] | None
) -> None:
    """A client's config.json may hold anything: registration must not raise (a 500) or list a billion layers."""
    assert layer_types_in(config) == listed


@pytest.mark.parametrize("layer_types", [["sliding_attention", 3], "full_attention", {"0": "full_attention"}])
def test_layer_types_that_are_not_a_list_of_names_are_refused_at_registration(layer_types: Any) -> None:
    """transformers' config class refuses them as well: registered, the model would fail on every request."""
    with pytest.raises(UnsupportedModel, match="layer_types must be a list"):
        layer_types_in({"model_type": "llama", "layer_types": layer_types})
