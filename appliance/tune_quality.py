"""The quality gate of `fleetbox tune`: a candidate's outputs against the fp32 torch reference.

The one idea: speed is only compared between settings that give the same answers. Held-out inputs
(a seed the load never uses, plus mixed-script parity texts) are run once through the model in
float32 on torch; every candidate engine runs the same inputs in the same batches (padding
included) and must reach, per task: embeddings, the least cosine to the reference vector
≥ 0.999; scores, Spearman rank correlation ≥ 0.99; labels (classify, extract), the same argmax
on every input (every token). A candidate that fails is never chosen, whatever its speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from appliance.tune_load import tokenize_inputs
from runtimes import Runtime, Task, Tokenized
from runtimes.onnx_export import PARITY_TEXTS

GATES: dict[Task, tuple[str, float]] = {
    Task.EMBED: ("min_cosine", 0.999),
    Task.SCORE: ("spearman", 0.99),
    Task.CLASSIFY: ("same_argmax", 1.0),
    Task.EXTRACT: ("same_argmax", 1.0),
}
HELD_OUT_SEED = 1001
_BATCH = 8


@dataclass(slots=True, frozen=True)
class Quality:
    metric: str
    value: float
    limit: float

    @property
    def passed(self) -> bool:
        return not math.isnan(self.value) and self.value >= self.limit

    def describe(self) -> str:
        return f"{self.metric} {self.value:.5f} {'≥' if self.passed else '<'} {self.limit}"


class Reference:
    """The fp32 torch outputs on the held-out inputs; `check` grades any runtime against them."""

    def __init__(self, task: Task, inputs: list[Tokenized], outputs: list[np.ndarray]) -> None:
        self.task = task
        self.inputs = inputs
        self.outputs = outputs

    @classmethod
    def build(cls, reference: Runtime, task: Task, count: int = 96) -> Reference:
        inputs = tokenize_inputs(reference, task, count, HELD_OUT_SEED)
        if task is not Task.SCORE:
            inputs = reference.tokenize(list(PARITY_TEXTS)) + inputs
        return cls(task, inputs, run_rows(reference, inputs))

    def check(self, runtime: Runtime) -> Quality:
        metric, limit = GATES[self.task]
        try:
            outputs = run_rows(runtime, self.inputs)
        except Exception as exc:  # a candidate that cannot run the inputs fails the gate, it does not stop the tune
            return Quality(f"{metric} (failed: {exc!r})"[:200], float("nan"), limit)
        return Quality(metric, _compare(self.task, self.outputs, outputs), limit)


def run_rows(runtime: Runtime, inputs: list[Tokenized]) -> list[np.ndarray]:
    """One output per input, run in batches of mixed lengths so padding is part of what is checked."""
    rows: list[np.ndarray] = []
    for at in range(0, len(inputs), _BATCH):
        batch = inputs[at : at + _BATCH]
        output = np.asarray(runtime.run(batch), dtype=np.float64)
        for i, row in enumerate(batch):
            rows.append(output[i, : row.length] if output.ndim == 3 else output[i])
    return rows


def _compare(task: Task, expected: list[np.ndarray], got: list[np.ndarray]) -> float:
    if task is Task.EMBED:
        cosines = [_cosine(a, b) for a, b in zip(expected, got, strict=True)]
        return float(np.min(cosines))  # NaN, if any, wins: a NaN output fails
    if task is Task.SCORE:
        return spearman(np.array([float(x) for x in expected]), np.array([float(x) for x in got]))
    same = [np.argmax(a, axis=-1) == np.argmax(b, axis=-1) for a, b in zip(expected, got, strict=True)]
    return float(np.mean(np.concatenate([np.atleast_1d(s) for s in same])))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norm = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / norm) if norm > 0 else float("nan")


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Rank correlation; NaN when either side is constant (nothing to rank)."""
    ranks_a = np.argsort(np.argsort(a)).astype(np.float64)
    ranks_b = np.argsort(np.argsort(b)).astype(np.float64)
    if np.std(a) == 0 or np.std(b) == 0 or not np.all(np.isfinite(b)):
        return float("nan")
    return float(np.corrcoef(ranks_a, ranks_b)[0, 1])
