"""Whether a causal LM attends fully on every layer: the one kind of attention the shared batch cache holds.

Judged twice, to one rule: a layer type other than `full_attention` (a sliding window, linear
attention) is refused. At load, from transformers' config (`runtimes.causal_lm.check_full_attention`
reads the decoder text config's `layer_types`). At registration, from config.json read as JSON
(`layer_types_in` here: no transformers config class, so this judgement needs no torch), so a model
the load would refuse is refused before any request depends on it.

A config.json that lists `layer_types` says it outright. One that does not leaves them to its config
class, which derives them from its own keys: that derivation is repeated here for the families in
`_DERIVED` (Qwen2/Qwen3's `use_sliding_window` past `max_window_layers`, Gemma2/3's and Cohere2's
every-Nth-layer pattern, ...). For any other family (and for a family whose class rewrites the list it
is given), only transformers can tell, so the registration says nothing and the load judges. It never
refuses what the load accepts: a Mistral `sliding_window` without `layer_types`, for one, loads
(transformers' Mistral config lists no layer types), so it is accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from runtimes.base import UnsupportedModel

FULL = "full_attention"
SLIDING = "sliding_attention"
_MOST_LAYERS = 10_000  # a layer count past this is judged by the load, not listed out here
# Config classes that rewrite (halve, cut, rename) a `layer_types` list they are given: only they can say.
_REWRITTEN = frozenset({"cwm", "deepseek_v4", "dory", "dots3_note", "glm5_next", "qwen4_exp", "qwen4_exp_text"})


def refuse_other_layers(layer_types: Iterable[str], folder: Path) -> None:
    """Refuse a model with a layer that is not full attention; the message the load and the registration give."""
    other = sorted({kind for kind in layer_types if kind != FULL})
    if other:
        raise UnsupportedModel(
            f"{folder}: layers of type {', '.join(other)} are not supported for generation yet "
            "(the batch cache assumes full attention on every layer)"
        )


def layer_types_in(config: Mapping[str, Any]) -> list[str] | None:
    """The layer types transformers' config for this config.json would list, or None where JSON alone cannot tell."""
    if any(isinstance(config.get(key), dict) for key in ("decoder", "generator")):
        return None  # an encoder-decoder's decoder: its own class decides
    if _named(config) in _REWRITTEN:
        return None
    text = config.get("text_config")
    if isinstance(text, dict):
        config = text
    model_type = _named(config)
    if model_type in _REWRITTEN:
        return None
    listed = config.get("layer_types")
    if listed is not None:
        if isinstance(listed, list) and all(isinstance(kind, str) for kind in listed):
            return listed
        # transformers' config classes refuse it too: the load would fail on every request
        raise UnsupportedModel(f"config.json: layer_types must be a list of layer type names, not {listed!r:.60}")
    family = _DERIVED.get(model_type) if model_type is not None else None
    if family is None:
        return None
    layers, rule = family
    count = config.get("num_hidden_layers", layers)
    if not _is_int(count) or not 0 <= count <= _MOST_LAYERS:
        return None  # not a count any such model has: the load judges it
    try:
        sliding = rule(config)
    except _CannotTell:
        return None
    return [SLIDING if sliding(i) else FULL for i in range(count)]


def _named(config: Mapping[str, Any]) -> str | None:
    """The config's `model_type` when it is a string (a client's JSON may hold anything there)."""
    model_type = config.get("model_type")
    return model_type if isinstance(model_type, str) else None


class _CannotTell(Exception):
    """A key of a type transformers' config class would refuse or convert: left to the load."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _key(config: Mapping[str, Any], key: str, default: Any, *kinds: type) -> Any:
    value = config.get(key, default)
    if value is None:
        return None
    if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
        raise _CannotTell(key)
    return value


def _qwen(config: Mapping[str, Any]) -> Callable[[int], bool]:
    """Qwen2 and Qwen3: a window only with `use_sliding_window`, on the layers from `max_window_layers` on."""
    window = _key(config, "sliding_window", 4096, int) if _key(config, "use_sliding_window", False, bool) else None
    first = _key(config, "max_window_layers", 28, int)
    return lambda i: window is not None and first is not None and i >= first


def _qwen2_moe(config: Mapping[str, Any]) -> Callable[[int], bool]:
    """Qwen2-MoE: with `use_sliding_window`, every other layer below `max_window_layers`."""
    used = _key(config, "use_sliding_window", False, bool)
    below = _key(config, "max_window_layers", 28, int)
    return lambda i: bool(used) and below is not None and (i + 1) % 2 == 1 and i < below


def _every(default_pattern: int | None) -> Callable[[Mapping[str, Any]], Callable[[int], bool]]:
    """A window on every layer but each `sliding_window_pattern`-th (every other layer without a pattern key)."""

    def rule(config: Mapping[str, Any]) -> Callable[[int], bool]:
        pattern = 2 if default_pattern is None else _key(config, "sliding_window_pattern", default_pattern, int)
        if not pattern:
            raise _CannotTell("sliding_window_pattern")
        return lambda i: (i + 1) % pattern != 0

    return rule


def _ministral(config: Mapping[str, Any]) -> Callable[[int], bool]:
    """Ministral: every layer windowed while `sliding_window` is set."""
    window = _key(config, "sliding_window", 4096, int)
    return lambda i: window is not None


# model_type: (transformers' default `num_hidden_layers`, which layers its config class makes sliding)
_DERIVED: dict[str, tuple[int, Callable[[Mapping[str, Any]], Callable[[int], bool]]]] = {
    "qwen2": (32, _qwen),
    "qwen3": (32, _qwen),
    "qwen2_moe": (24, _qwen2_moe),
    "gemma2": (26, _every(None)),
    "gpt_oss": (36, _every(None)),
    "gemma3_text": (26, _every(6)),
    "cohere2": (40, _every(4)),
    "ministral": (32, _ministral),
}
