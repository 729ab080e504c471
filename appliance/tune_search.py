"""What `fleetbox tune` searches and how: the space, the trials, the objective, and the search order.

The one idea: most of the space is not worth measuring. The engine (runtime × precision × threads:
what needs a model load) and the batch shape matter most, and the batching knobs barely interact
with one another. So the search screens every engine at the middle of the batching space (the
box's defaults sit at its large end, where big padded batches hide the differences between
engines), keeps the better half that passed the quality gate (at most `keep`), walks each kept
engine's batching knobs one axis at a time (coordinate descent, until a pass changes nothing), and
finally measures the few best again so a lucky run does not pick the winner. A candidate whose
runs disagree is scored by its worst run. It measures a small share of the grid
(`benchmarks/tune.py` checks how close it lands to the grid's best).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from appliance.catalog import Batching
from appliance.tune_load import Measurement
from appliance.tune_quality import Quality

OBJECTIVES = ("throughput", "latency")


@dataclass(slots=True, frozen=True)
class Engine:
    """What needs a model load: runtime, precision, CPU threads (None: the runtime's own), ONNX level;
    and how many batches run on it at once (one load serves every count)."""

    runtime: str
    dtype: str
    threads: int | None = None
    onnx_opt_level: str | None = None
    concurrent_batches: int = 1

    @property
    def label(self) -> str:
        threads = f"t{self.threads}" if self.threads else "tdefault"
        if self.concurrent_batches > 1:
            threads += f"x{self.concurrent_batches}"
        return "-".join([self.runtime, self.dtype, threads])


@dataclass(slots=True, frozen=True)
class Candidate:
    engine: Engine
    batching: Batching

    @property
    def run_batching(self) -> Batching:
        """The batching the batcher runs: the knobs searched, with the engine's concurrent batches."""
        return replace(self.batching, concurrent_batches=self.engine.concurrent_batches)

    @property
    def label(self) -> str:
        b = self.batching
        return f"{self.engine.label} tokens={b.max_batch_tokens} size={b.max_batch_size} wait={b.max_wait_ms:g}ms"


@dataclass(slots=True)
class Trial:
    """A candidate, its quality verdict, and every measurement taken of it."""

    candidate: Candidate
    quality: Quality
    stage: str  # default, screen, descent, confirm, rejected, grid
    measurements: list[Measurement] = field(default_factory=list)
    # Its runs disagreed by more than the tuner accepts: then every figure is its worst run's, so
    # a lucky run cannot make it win.
    noisy: bool = False

    @property
    def measured(self) -> list[Measurement]:
        return [m for m in self.measurements if m.ok]

    @property
    def ok(self) -> bool:
        return bool(self.measured)

    @property
    def throughput(self) -> float:
        values = [m.throughput for m in self.measured]
        return 0.0 if not values else min(values) if self.noisy else float(np.median(values))

    @property
    def p50_ms(self) -> float:
        return self._latency([m.p50_ms for m in self.measured])

    @property
    def p99_ms(self) -> float:
        return self._latency([m.p99_ms for m in self.measured])

    @property
    def median_throughput(self) -> float:
        """The median run's, noisy or not: how the baseline is reported."""
        values = [m.throughput for m in self.measured]
        return float(np.median(values)) if values else 0.0

    @property
    def median_p99_ms(self) -> float:
        values = [m.p99_ms for m in self.measured]
        return float(np.median(values)) if values else float("inf")

    @property
    def by_median(self) -> Trial:
        """The same runs judged by their median, noisy or not: how two trials are compared like with like."""
        return Trial(self.candidate, self.quality, self.stage, self.measured)

    def _latency(self, values: list[float]) -> float:
        return float("inf") if not values else max(values) if self.noisy else float(np.median(values))

    @property
    def seconds(self) -> float:
        return sum(m.seconds for m in self.measurements)


@dataclass(slots=True, frozen=True)
class Objective:
    """`throughput`: most inputs/s with p99 within the SLO; `latency`: lowest p99 (then throughput)."""

    kind: str = "throughput"
    slo_p99_ms: float | None = None

    def meets_slo(self, trial: Trial) -> bool:
        return self.slo_p99_ms is None or trial.p99_ms <= self.slo_p99_ms

    def key(self, trial: Trial) -> tuple[bool, float, float]:
        """Higher is better: within the SLO first, then the objective's figure, then the other one."""
        if self.kind == "latency":
            return (self.meets_slo(trial), -trial.p99_ms, trial.throughput)
        return (self.meets_slo(trial), trial.throughput, -trial.p99_ms)

    def better(self, a: Trial, b: Trial) -> bool:
        """Whether `best` takes `a` over `b`; a tie keeps `b`."""
        return self.best([b, a]) is a

    def best(self, trials: list[Trial]) -> Trial | None:
        """The best trial that passed the gate, within the SLO; if none is within it, the lowest p99.
        Never one that failed the gate, whatever its speed."""
        usable = [t for t in trials if t.quality.passed and t.ok]
        within = [t for t in usable if self.meets_slo(t)]
        if within:
            return max(within, key=self.key)
        return min(usable, key=lambda t: (t.p99_ms, -t.throughput)) if usable else None


@dataclass(slots=True, frozen=True)
class Space:
    engines: tuple[Engine, ...]
    max_batch_tokens: tuple[int, ...]
    max_batch_size: tuple[int, ...]
    max_wait_ms: tuple[float, ...]

    @property
    def batchings(self) -> list[Batching]:
        return [
            Batching(t, s, w)
            for t, s, w in itertools.product(self.max_batch_tokens, self.max_batch_size, self.max_wait_ms)
        ]

    def grid(self, engines: list[Engine] | None = None) -> Iterator[Candidate]:
        """Every candidate, engine by engine (one model load each)."""
        for engine in engines if engines is not None else self.engines:
            for batching in self.batchings:
                yield Candidate(engine, batching)

    @property
    def middle(self) -> Batching:
        """The middle value of each batching knob: where engines are screened."""
        return Batching(_middle(self.max_batch_tokens), _middle(self.max_batch_size), _middle(self.max_wait_ms))


def _middle(values: tuple) -> Any:  # type: ignore[type-arg]
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def default_space(device: str, cores: int, *, quick: bool = False) -> Space:
    """The knobs worth trying on this device; `quick` is a smaller space for benchmarks and smoke runs."""
    if device.startswith("cuda"):
        import torch

        dtypes = ["float32", "float16"] + (["bfloat16"] if torch.cuda.is_bf16_supported() else [])
        engines = [Engine("torch", d) for d in dtypes] + [
            Engine("onnx", d, None, "all") for d in ("float32", "float16")
        ]
        # A small model's batch on a big GPU is short next to the Python that launches it: two batches
        # at once overlap one's launches with the other's kernels (torch releases the GIL in each op).
        engines += [Engine("torch", d, None, None, 2) for d in dtypes if d != "float32"]
        if quick:
            return Space(tuple(engines), (8192, 32768), (64, 256), (0.0, 2.0))
        return Space(tuple(engines), (4096, 8192, 16384, 32768, 65536), (32, 64, 128, 256, 512), (0.0, 1.0, 2.0, 5.0))
    # Each thread count alone, and (below all the cores) as many batches at once as fill the cores.
    threads = sorted({1, max(1, cores // 4), max(1, cores // 2), cores})
    shapes = [(t, 1) for t in threads] + [(t, cores // t) for t in threads if cores // t > 1]
    engines = [Engine("torch", "float32", t, None, n) for t, n in shapes]
    engines += [Engine("onnx", d, t, "all", n) for d in ("float32", "int8") for t, n in shapes]
    if quick:
        return Space(tuple(engines), (1024, 4096, 16384), (8, 32, 256), (0.0, 2.0, 5.0))
    return Space(tuple(engines), (1024, 2048, 4096, 8192, 16384), (8, 16, 32, 64, 256), (0.0, 1.0, 2.0, 5.0))


Evaluate = Callable[[Candidate, str], Trial]


class ExploringOver(Exception):
    """Raised by `evaluate` when what is left of the budget is kept for confirming the finalists."""


_AXES = ("max_batch_size", "max_batch_tokens", "max_wait_ms")


def search(
    space: Space,
    engines: list[Engine],
    evaluate: Evaluate,
    objective: Objective,
    *,
    keep: int = 2,
    passes: int = 2,
    confirm: int = 3,
) -> list[Candidate]:
    """Screen, halve, descend, confirm (the module docstring); returns the finalists, each measured
    once more in the confirmation round, back to back. `evaluate` measures a candidate once
    (a second call for the same candidate returns the trial as it is, except in stage `confirm`) and
    raises to stop the search, out of budget or interrupted; what was measured so far stays. It raises
    `ExploringOver` when the rest of the budget is for the confirmation round.

    The kept engines descend side by side, one axis at a time; after each axis of the first pass
    the worse half is dropped (successive halving), so the most telling axis (batch size) is
    measured on every kept engine and the rest of the budget goes to the best one."""
    trials: list[Trial] = []
    try:
        for engine in engines:
            trials.append(evaluate(Candidate(engine, space.middle), "screen"))
        ranked = sorted((t for t in trials if t.ok and t.quality.passed), key=objective.key, reverse=True)
        current = ranked[: max(1, min(keep, (len(ranked) + 1) // 2))]
        for first_pass in [True] + [False] * (passes - 1):
            moved = False
            for axis in _AXES:
                for i, best in enumerate(current):
                    current[i], changed = descend_axis(space, best, axis, evaluate, objective, trials)
                    moved = moved or changed
                if first_pass and len(current) > 1:
                    current = sorted(current, key=objective.key, reverse=True)[: (len(current) + 1) // 2]
            if not moved:
                break
    except ExploringOver:
        pass
    finalists = pick_finalists(trials, objective, confirm)
    for candidate in sorted(finalists, key=lambda c: c.engine.label):  # engine by engine: fewer reloads
        evaluate(candidate, "confirm")
    return finalists


def pick_finalists(trials: list[Trial], objective: Objective, count: int) -> list[Candidate]:
    """The best candidate of each engine first, then the next best: engines meet again side by side,
    measured minutes apart no more (a machine's load drifts; a comparison across minutes is not fair)."""
    ranked = sorted((t for t in trials if t.quality.passed and t.ok), key=objective.key, reverse=True)
    finalists: list[Candidate] = []
    for trial in ranked:
        if trial.candidate.engine not in {c.engine for c in finalists}:
            finalists.append(trial.candidate)
    for trial in ranked:
        if trial.candidate not in finalists:
            finalists.append(trial.candidate)
    return finalists[:count]


def descend_axis(
    space: Space, best: Trial, axis: str, evaluate: Evaluate, objective: Objective, trials: list[Trial]
) -> tuple[Trial, bool]:
    """Every value of one batching knob, the others held; the best trial, and whether it moved."""
    moved = False
    for value in getattr(space, axis):
        candidate = replace(best.candidate, batching=replace(best.candidate.batching, **{axis: value}))
        if candidate == best.candidate:
            continue
        trial = evaluate(candidate, "descent")
        trials.append(trial)
        if trial.ok and objective.key(trial) > objective.key(best):
            best, moved = trial, True
    return best, moved
