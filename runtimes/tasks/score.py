"""Cross-encoder rerank: one relevance logit per (query, document) pair, passed through the model's activation.

A reranker is a `*ForSequenceClassification` with a single label: the logit is the relevance. Its score is
what sentence-transformers' `CrossEncoder.predict` returns: the activation its config.json names
(`sentence_transformers.activation_fn`; `sbert_ce_default_activation_function` before v4), a sigmoid when it
names none. `raw_scores` hands back the logit itself, for callers that fuse scores across models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtimes.base import UnsupportedModel

# The activations a CrossEncoder's config names, by their class's name (`torch.nn.modules.activation.Sigmoid`,
# `torch.nn.Sigmoid`), and what each does to a logit.
_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Tanh": "tanh"}


@dataclass(slots=True, frozen=True)
class ScoreHead:
    """The rerank post-processing, held by the runtime as the other tasks hold theirs."""

    activation: str = "sigmoid"

    @classmethod
    def from_config(cls, config: Mapping[str, Any], folder: Path) -> ScoreHead:
        """The activation `CrossEncoder` would apply. A path outside `torch.` is code it runs only with
        `trust_remote_code`, and without it falls back to the sigmoid: so does this (review of a stock-client
        test: a reranker saved with `Identity` answered sigmoids where `CrossEncoder.predict` gives logits)."""
        settings = config.get("sentence_transformers")
        path = settings.get("activation_fn") if isinstance(settings, Mapping) else None
        if path is None:
            path = config.get("sbert_ce_default_activation_function")
        if not isinstance(path, str) or not path.startswith("torch."):
            return cls()
        activation = _ACTIVATIONS.get(path.rsplit(".", 1)[-1])
        if activation is None:
            raise UnsupportedModel(
                f"{folder}/config.json names the activation {path!r} for its scores; fleetbox applies "
                f"{', '.join(_ACTIVATIONS)} to a reranker's logit"
            )
        return cls(activation)

    def scores(self, logits: np.ndarray, *, raw_scores: bool = False) -> np.ndarray:
        return relevance_scores(logits, raw_scores=raw_scores, activation=self.activation)


def relevance_scores(logits: np.ndarray, *, raw_scores: bool = False, activation: str = "sigmoid") -> np.ndarray:
    """(n,) relevance logits to (n,) float32 scores: through `activation`, or the logits as they are."""
    logits = np.asarray(logits, dtype=np.float32).reshape(-1)
    if raw_scores or activation == "identity":
        return logits
    if activation == "tanh":
        return np.tanh(logits)
    return sigmoid(logits)


def sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of a negative magnitude only, so a logit of -1000 neither overflows nor warns.
    z = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + z), z / (1.0 + z)).astype(np.float32)


def check_one_logit(folder: Path, labels: Sequence[str]) -> None:
    """A reranker's head gives one relevance logit: a classifier's labels are no relevance score."""
    if len(labels) != 1:
        raise UnsupportedModel(f"{folder} has {len(labels)} labels; a reranker (score) has exactly one relevance logit")
