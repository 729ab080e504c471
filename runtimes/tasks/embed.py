"""Sentence embeddings: pooling and normalisation as the model folder says, and matryoshka truncation.

The folder's sentence-transformers files (`modules.json`, `1_Pooling/config.json`) decide the
pooling and whether vectors are normalised, so fleetbox returns what `SentenceTransformer.encode`
returns for the same folder. A plain transformers folder gets mean pooling, normalised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np


class PoolingMode(StrEnum):
    MEAN = "mean"
    CLS = "cls"
    MAX = "max"
    LAST = "last"


@dataclass(slots=True, frozen=True)
class EmbedHead:
    pooling: PoolingMode
    normalize: bool

    @classmethod
    def from_folder(cls, folder: Path) -> EmbedHead:
        modules_file = folder / "modules.json"
        if not modules_file.is_file():
            return cls(PoolingMode.MEAN, normalize=True)
        modules = json.loads(modules_file.read_text())
        normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        pooling = PoolingMode.MEAN
        for module in modules:
            if module.get("type", "").endswith(".Pooling"):
                config_file = folder / module.get("path", "") / "config.json"
                if config_file.is_file():
                    pooling = _pooling_from_config(json.loads(config_file.read_text()))
        return cls(pooling, normalize)

    def pool(self, hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """(batch, tokens, width) hidden states and (batch, tokens) mask to (batch, width) float32.

        A (batch, width) array comes from a network that pools by itself (a shipped ONNX
        sentence-embedding graph): it is only normalised, as the folder says.
        """
        hidden = hidden.astype(np.float32, copy=False)
        if hidden.ndim == 2:
            pooled = hidden
        elif self.pooling is PoolingMode.CLS:
            pooled = hidden[:, 0]
        elif self.pooling is PoolingMode.LAST:
            last = mask.sum(axis=1) - 1
            pooled = hidden[np.arange(hidden.shape[0]), last]
        elif self.pooling is PoolingMode.MAX:
            pooled = np.where(mask[..., None] > 0, hidden, -np.inf).max(axis=1)
        else:
            weights = mask[..., None].astype(np.float32)
            pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        return normalize(pooled) if self.normalize else np.ascontiguousarray(pooled, dtype=np.float32)


def _pooling_from_config(config: dict) -> PoolingMode:
    if config.get("pooling_mode_cls_token"):
        return PoolingMode.CLS
    if config.get("pooling_mode_max_tokens"):
        return PoolingMode.MAX
    if config.get("pooling_mode_lasttoken"):
        return PoolingMode.LAST
    return PoolingMode.MEAN


def normalize(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return np.ascontiguousarray(vectors / np.clip(norms, 1e-12, None), dtype=np.float32)


def truncate_dimensions(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Matryoshka: keep the first `dimensions` components, then re-normalise."""
    if dimensions is None or dimensions >= vectors.shape[1]:
        return vectors
    return normalize(vectors[:, :dimensions])
