"""Sequence classification: logits per input to `[{label, score}]`, best first.

The model's config decides the squashing, as transformers' text-classification pipeline does:
the outputs as they are for `problem_type == "regression"`, an independent sigmoid per label for
`"multi_label_classification"` or a model with one label, a softmax over the labels otherwise.
`raw_scores` returns the logits unchanged (still sorted), and `top_k` keeps the best k.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypedDict

import numpy as np

from runtimes.base import UnsupportedModel
from runtimes.tasks.score import sigmoid


class LabelScore(TypedDict):
    label: str
    score: float


Squash = Literal["softmax", "sigmoid", "none"]


@dataclass(slots=True, frozen=True)
class ClassifyHead:
    labels: tuple[str, ...]
    squash: Squash = "softmax"

    @classmethod
    def from_folder(cls, folder: Path) -> ClassifyHead:
        config = json.loads((folder / "config.json").read_text())
        labels = labels_from_config(config)
        return cls(labels=labels, squash=squash_for(config, len(labels)))

    def predictions(
        self, logits: np.ndarray, *, raw_scores: bool = False, top_k: int | None = None, squash: Squash | None = None
    ) -> list[list[LabelScore]]:
        """(n, labels) logits to, per input, labels with scores sorted from best to worst; `squash` instead of the
        model's own (transformers' `function_to_apply`)."""
        return label_scores(logits, self.labels, squash=squash or self.squash, raw_scores=raw_scores, top_k=top_k)


def label_scores(
    logits: np.ndarray,
    labels: tuple[str, ...],
    *,
    squash: Squash = "softmax",
    raw_scores: bool = False,
    top_k: int | None = None,
) -> list[list[LabelScore]]:
    logits = np.asarray(logits, dtype=np.float32)
    if raw_scores or squash == "none":
        scores = logits
    elif squash == "sigmoid":
        scores = sigmoid(logits)
    else:
        scores = softmax(logits)
    keep = len(labels) if top_k is None else max(0, min(top_k, len(labels)))
    # A stable sort keeps the label order of the config among equal scores.
    order = np.argsort(-scores, axis=-1, kind="stable")[:, :keep]
    return [
        [LabelScore(label=labels[j], score=float(row_scores[j])) for j in row_order]
        for row_scores, row_order in zip(scores, order, strict=True)
    ]


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (shifted / shifted.sum(axis=-1, keepdims=True)).astype(np.float32)


# transformers' count of labels for a config that names none, which is also why it leaves them out of a config
# it saves with two: a binary classifier's config.json says nothing of its labels.
_DEFAULT_NUM_LABELS = 2


def labels_from_config(config: dict) -> tuple[str, ...]:
    """Label names in index order from `id2label`; `LABEL_i` when a config has only `num_labels`, or neither
    (transformers' two).

    Raises `UnsupportedModel` for an `id2label` that is not an object or a `num_labels` that is not a
    count: transformers could not load such a config either.
    """
    id2label = config.get("id2label") or {}
    if not isinstance(id2label, dict):
        raise UnsupportedModel(f"config.json: id2label must be an object of index to label, not {id2label!r}")
    num_labels = config.get("num_labels") or 0
    if not isinstance(num_labels, int) or isinstance(num_labels, bool) or num_labels < 0:
        raise UnsupportedModel(f"config.json: num_labels must be a whole number of labels, not {num_labels!r}")
    indexes = sorted(_index(key) for key in id2label)
    if indexes != list(range(len(indexes))):
        # transformers counts the labels as the entries: a gap left a label of the model's output unnamed, and one
        # past it unread (tester h121: {"0": "neg", "2": "pos"} answered "LABEL_1" and never "pos").
        raise UnsupportedModel(
            f"config.json: id2label must name the labels 0 to {len(indexes) - 1}, one each; its keys are "
            f"{', '.join(map(str, id2label))}"
        )
    named = config.get("id2label") is not None or config.get("num_labels") is not None
    count = max(len(id2label), num_labels) if named else _DEFAULT_NUM_LABELS
    return tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))


def _index(key: object) -> int:
    """An `id2label` key as its label's index (JSON keys are strings: "0"); -1 for one that names none."""
    try:
        return int(key)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return -1


def squash_for(config: dict, num_labels: int) -> Squash:
    """What transformers' text-classification pipeline applies to this model's logits by default."""
    problem = config.get("problem_type")
    if problem == "regression":
        return "none"
    if problem == "multi_label_classification" or num_labels == 1:
        return "sigmoid"
    return "softmax"
