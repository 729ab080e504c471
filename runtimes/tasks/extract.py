"""Token classification to entity spans: BIO/IOB2 tags grouped into `[{text, label, start, end, score}]`.

The grouping is transformers' `pipeline("token-classification", aggregation_strategy="simple")`,
rule for rule, so a model gives here the spans it gives there: softmax per token, argmax label,
adjacent tokens merge while the tag stays the same and the next one is not a `B-`, the span's score
is the mean of its tokens' scores, and `O` spans are dropped. Offsets are character offsets into
the input text, from the fast tokenizer; `text` is the slice of the input they cover.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import numpy as np

from runtimes.tasks.classify import labels_from_config, softmax

_OUTSIDE = "O"


class Entity(TypedDict):
    text: str
    label: str
    start: int
    end: int
    score: float


@dataclass(slots=True, frozen=True)
class ExtractHead:
    labels: tuple[str, ...]

    @classmethod
    def from_folder(cls, folder: Path) -> ExtractHead:
        return cls(labels=labels_from_config(json.loads((folder / "config.json").read_text())))

    def entities(self, text: str, logits: np.ndarray, offsets: np.ndarray) -> list[Entity]:
        """One input's (tokens, labels) logits and (tokens, 2) offsets to its entity spans."""
        return group_entities(text, logits, offsets, self.labels)


def group_entities(text: str, logits: np.ndarray, offsets: np.ndarray, labels: tuple[str, ...]) -> list[Entity]:
    """Padding rows beyond `len(offsets)` are ignored, so a padded batch row can be passed as it is."""
    tokens = len(offsets)
    scores = softmax(np.asarray(logits[:tokens], dtype=np.float32))
    best = scores.argmax(axis=-1)
    spans: list[Entity] = []
    group: list[tuple[str, float, int, int]] = []  # (tag label, score, start, end) per token
    for index in range(tokens):
        start, end = int(offsets[index, 0]), int(offsets[index, 1])
        if start < 0:  # a special token
            continue
        label = labels[best[index]]
        token = (label, float(scores[index, best[index]]), start, end)
        if group and _continues(group[-1][0], label):
            group.append(token)
            continue
        if group:
            spans.append(_span(text, group))
        group = [token]
    if group:
        spans.append(_span(text, group))
    return [span for span in spans if span["label"] != _OUTSIDE]


def _tag(label: str) -> tuple[str, str]:
    """("B" or "I", entity type); a label without a B-/I- prefix continues like an I-."""
    if label.startswith(("B-", "I-")):
        return label[0], label[2:]
    return "I", label


def _continues(previous: str, label: str) -> bool:
    prefix, tag = _tag(label)
    return prefix != "B" and tag == _tag(previous)[1]


def _span(text: str, group: list[tuple[str, float, int, int]]) -> Entity:
    start, end = group[0][2], group[-1][3]
    return Entity(
        text=text[start:end],
        # The group's type is its first token's, prefix cut at the first dash, as the pipeline names it.
        label=group[0][0].split("-", 1)[-1],
        start=start,
        end=end,
        score=float(np.mean([token[1] for token in group])),
    )
