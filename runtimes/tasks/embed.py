"""Sentence embeddings: pooling and normalisation as the model folder says, and matryoshka truncation.

The folder's sentence-transformers files (`modules.json`, `1_Pooling/config.json`, a Dense module's
config and weights) decide the pooling, any dense layer after it and whether vectors are normalised,
so fleetbox returns what `SentenceTransformer.encode` returns for the same folder; a module it cannot
run is refused rather than skipped. A plain transformers folder gets mean pooling, normalised.

The runtime's rows stop before normalisation (`EmbedHead.pool`); `finish_vectors` applies it per
request, after any matryoshka truncation, so one batch can answer a request that wants the folder's
unit vectors and one that wants them as pooled (TEI's `normalize: false`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np

from runtimes.base import UnsupportedModel


class PoolingMode(StrEnum):
    MEAN = "mean"
    CLS = "cls"
    MAX = "max"
    LAST = "lasttoken"
    MEAN_SQRT_LEN = "mean_sqrt_len_tokens"
    WEIGHTED_MEAN = "weightedmean"


# sentence-transformers' pooling config before its `pooling_mode` key, in the order it concatenates the modes.
_LEGACY_POOLING = {
    "pooling_mode_cls_token": PoolingMode.CLS,
    "pooling_mode_max_tokens": PoolingMode.MAX,
    "pooling_mode_mean_tokens": PoolingMode.MEAN,
    "pooling_mode_mean_sqrt_len_tokens": PoolingMode.MEAN_SQRT_LEN,
    "pooling_mode_weightedmean_tokens": PoolingMode.WEIGHTED_MEAN,
    "pooling_mode_lasttoken": PoolingMode.LAST,
}
# The activations a sentence-transformers Dense module may name, as numpy functions.
_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": np.tanh,
    "torch.nn.modules.linear.Identity": lambda x: x,
    "torch.nn.modules.activation.ReLU": lambda x: np.maximum(x, 0),
    "torch.nn.modules.activation.Sigmoid": lambda x: 1 / (1 + np.exp(-x)),
}
_SUFFIXES = (".Transformer", ".Pooling", ".Dense", ".Normalize")


@dataclass(slots=True, frozen=True)
class DenseLayer:
    """A sentence-transformers Dense module: a linear layer and its activation, applied after pooling."""

    weight: np.ndarray  # (out, in)
    bias: np.ndarray | None
    activation: str

    def __call__(self, vectors: np.ndarray) -> np.ndarray:
        out = vectors @ self.weight.T
        if self.bias is not None:
            out = out + self.bias
        return np.asarray(_ACTIVATIONS[self.activation](out), dtype=np.float32)


@dataclass(slots=True, frozen=True)
class EmbedHead:
    pooling: tuple[PoolingMode, ...]
    normalize: bool
    dense: tuple[DenseLayer, ...] = ()

    @classmethod
    def from_folder(cls, folder: Path, *, weights: bool = True) -> EmbedHead:
        """The folder's sentence-transformers modules as `SentenceTransformer.encode` runs them; `UnsupportedModel`
        for a module fleetbox cannot run (it would answer other vectors with a 200). `weights=False` judges the
        configs only (registration, without torch), with no Dense weights read."""
        modules_file = folder / "modules.json"
        if not modules_file.is_file():
            return cls((PoolingMode.MEAN,), normalize=True)
        modules = json.loads(modules_file.read_text())
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise UnsupportedModel(f"{modules_file} is not a list of sentence-transformers modules")
        pooling: tuple[PoolingMode, ...] = (PoolingMode.MEAN,)
        dense: list[DenseLayer] = []
        for module in modules:
            kind = str(module.get("type", ""))
            where = folder / str(module.get("path", ""))
            if not kind.endswith(_SUFFIXES):
                raise UnsupportedModel(
                    f"{modules_file} has a {kind or 'nameless'} module; fleetbox runs Transformer, Pooling, Dense "
                    "and Normalize modules only (vectors without it would not be the model's)"
                )
            if kind.endswith(".Pooling"):
                config_file = where / "config.json"
                if config_file.is_file():
                    pooling = _pooling_from_config(json.loads(config_file.read_text()), config_file)
            elif kind.endswith(".Dense"):
                layer = _dense(where, weights)
                if layer is not None:
                    dense.append(layer)
        return cls(pooling, any(m.get("type", "").endswith(".Normalize") for m in modules), tuple(dense))

    def pool(self, hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """(batch, tokens, width) hidden states and (batch, tokens) mask to (batch, width) float32.

        A (batch, width) array comes from a network that pools by itself (a shipped ONNX
        sentence-embedding graph): it holds the folder's whole pipeline, Dense layers included, and is
        passed through (a square Dense layer applied again gave other vectors). Not normalised here:
        `finish_vectors` does it per request, as the folder says (`normalize`) unless the request says.
        """
        hidden = hidden.astype(np.float32, copy=False)
        if hidden.ndim == 2:
            pooled = hidden
        else:
            parts = [_pool(mode, hidden, mask) for mode in self.pooling]
            pooled = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
            for layer in self.dense:
                pooled = layer(pooled)
        return np.ascontiguousarray(pooled, dtype=np.float32)


def _pool(mode: PoolingMode, hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    if mode is PoolingMode.CLS:
        return hidden[:, 0]
    if mode is PoolingMode.LAST:
        last = mask.sum(axis=1) - 1
        return hidden[np.arange(hidden.shape[0]), last]
    if mode is PoolingMode.MAX:
        return np.where(mask[..., None] > 0, hidden, -np.inf).max(axis=1)
    weights = mask[..., None].astype(np.float32)
    if mode is PoolingMode.WEIGHTED_MEAN:  # positions 1, 2, ... from the first token (rows are padded on the right)
        weights = weights * np.arange(1, hidden.shape[1] + 1, dtype=np.float32)[None, :, None]
    summed = (hidden * weights).sum(axis=1)
    count = np.clip(weights.sum(axis=1), 1e-9, None)
    return summed / (np.sqrt(count) if mode is PoolingMode.MEAN_SQRT_LEN else count)


def _pooling_from_config(config: dict, config_file: Path) -> tuple[PoolingMode, ...]:
    """The pooling modes, in the order sentence-transformers concatenates them: its `pooling_mode` (a name or a
    list) or, in folders saved before it, the `pooling_mode_*` flags."""
    given = config.get("pooling_mode")
    if given is not None:
        names = [given] if isinstance(given, str) else given if isinstance(given, list) else [None]
    else:
        names = [mode.value for key, mode in _LEGACY_POOLING.items() if config.get(key)] or ["mean"]
    try:
        return tuple(PoolingMode(name) for name in names)
    except ValueError:
        raise UnsupportedModel(f"{config_file}: pooling mode {given!r} is none fleetbox knows") from None


def _dense(folder: Path, weights: bool) -> DenseLayer | None:
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    rewired = bool(config.get("use_residual")) or any(
        config.get(key, "sentence_embedding") != "sentence_embedding"
        for key in ("module_input_name", "module_output_name")
    )
    if activation not in _ACTIVATIONS or rewired:
        known = ", ".join(name.rsplit(".", 1)[1] for name in _ACTIVATIONS)
        raise UnsupportedModel(
            f"{config_file}: a Dense module with {activation!r}{' and a residual or another input' if rewired else ''} "
            f"is not one fleetbox runs (plain Dense layers with {known})"
        )
    if not weights:
        return None
    tensors = _dense_weights(folder)
    return DenseLayer(tensors["linear.weight"], tensors.get("linear.bias"), activation)


def _dense_weights(folder: Path) -> dict[str, np.ndarray]:
    import torch  # not numpy's reader: it has no bfloat16

    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(folder / "model.safetensors")
    else:
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    return {key: value.float().numpy() for key, value in state.items()}


def normalize(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return np.ascontiguousarray(vectors / np.clip(norms, 1e-12, None), dtype=np.float32)


def finish_vectors(
    pooled: np.ndarray, *, folder_normalizes: bool, normalize_to_unit: bool | None = None, dimensions: int | None = None
) -> np.ndarray:
    """A request's vectors from the runtime's pooled rows: matryoshka truncation to the first `dimensions`
    components, then unit length when `normalize_to_unit` says so, or, when it is None, when the folder
    normalises or the vectors were truncated (a cut vector is re-normalised, as OpenAI's `dimensions` are)."""
    cut = dimensions is not None and dimensions < pooled.shape[1]
    vectors = pooled[:, :dimensions] if cut else pooled
    unit = (folder_normalizes or cut) if normalize_to_unit is None else normalize_to_unit
    return normalize(vectors) if unit else np.ascontiguousarray(vectors, dtype=np.float32)
