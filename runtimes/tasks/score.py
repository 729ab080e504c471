"""Cross-encoder rerank: one relevance logit per (query, document) pair, squashed to (0, 1).

A reranker is a `*ForSequenceClassification` with a single label: the logit is the relevance, and
the sigmoid of it is what sentence-transformers' `CrossEncoder.predict` and TEI's `/rerank` return.
`raw_scores` hands back the logit itself, for callers that fuse scores across models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtimes.base import UnsupportedModel


@dataclass(slots=True, frozen=True)
class ScoreHead:
    """The rerank post-processing, held by the runtime as the other tasks hold theirs."""

    def scores(self, logits: np.ndarray, *, raw_scores: bool = False) -> np.ndarray:
        return relevance_scores(logits, raw_scores=raw_scores)


def relevance_scores(logits: np.ndarray, *, raw_scores: bool = False) -> np.ndarray:
    """(n,) relevance logits to (n,) float32 scores: sigmoid, or the logits as they are."""
    logits = np.asarray(logits, dtype=np.float32).reshape(-1)
    if raw_scores:
        return logits
    return sigmoid(logits)


def sigmoid(x: np.ndarray) -> np.ndarray:
    # exp of a negative magnitude only, so a logit of -1000 neither overflows nor warns.
    z = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + z), z / (1.0 + z)).astype(np.float32)


def check_one_logit(folder: Path, labels: Sequence[str]) -> None:
    """A reranker's head gives one relevance logit: a classifier's labels are no relevance score."""
    if len(labels) != 1:
        raise UnsupportedModel(f"{folder} has {len(labels)} labels; a reranker (score) has exactly one relevance logit")
