"""`fleetbox tune`: finds the fastest settings of one model on this machine that keep its answers.

The one idea: every number the tuner trusts comes from the serving path itself, and only after
the answers were checked. A `Tuner` owns one model's runs: it loads each engine (runtime ×
precision × threads) once, grades it against the fp32 torch reference (`tune_quality`), measures
candidates through the real `Batcher` under a closed-loop load (`tune_load`) in the order the
search asks (`tune_search`), and stops when the budget is spent or on Ctrl-C, keeping everything
measured so far. `TuneResult.profile()` is what `tune_report` writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from appliance import __version__
from appliance.bus import model_slug
from appliance.catalog import Batching
from appliance.devices import device_description, hardware_slug
from appliance.profiles import Profile
from appliance.tune_load import Load, Measurement, make_requests, measure
from appliance.tune_quality import Quality, Reference
from appliance.tune_search import Candidate, Engine, ExploringOver, Objective, Space, Trial, search
from runtimes import ModelSource, Runtime, RuntimeKind, Task, Tokenized, load_runtime

log = logging.getLogger(__name__)

DEFAULT_ENGINE = Engine("torch", "float32")  # what a box runs a model with when no profile applies
_STAGES_WITHOUT_BUDGET = ("default",)


class SearchStopped(Exception):
    """The budget is spent or the user pressed Ctrl-C: keep what was measured."""


@dataclass(slots=True, frozen=True)
class TuneConfig:
    name: str
    path: Path
    task: Task
    space: Space
    default_batching: Batching
    device: str = "cpu"
    budget_s: float = 600.0
    objective: Objective = field(default_factory=Objective)
    load: Load = field(default_factory=Load)
    cache_dir: Path = Path(".fleetbox/onnx")
    max_spread: float = 0.25  # runs of one candidate disagreeing by more: noisy, scored by its worst run
    keep: int = 2
    confirm: int = 3
    measure_rejected: bool = True  # measure a gate-failing engine once, for the report only


@dataclass(slots=True)
class TuneResult:
    config: TuneConfig
    hardware: str
    device_name: str
    default: Trial
    chosen: Trial | None
    trials: list[Trial]
    engine_quality: dict[Engine, Quality]
    measure_seconds: float
    wall_seconds: float
    stopped: str | None  # "budget", "interrupted" or None (the search ran to its end)

    @property
    def speedup(self) -> float:
        """The chosen's median run over the default's: like with like. The chosen's worst run (its score, when
        noisy) over the default's median made the default's own settings slower than themselves (0.85x)."""
        if self.chosen is None or self.default.median_throughput <= 0:
            return 0.0
        return self.chosen.median_throughput / self.default.median_throughput

    @property
    def beats_default(self) -> bool:
        """Whether the chosen settings do better than the default's by the objective, median runs on both sides.
        A profile that does not is not worth writing: a box without one runs the defaults."""
        chosen, default = self.chosen, self.default
        if chosen is None or chosen.candidate == default.candidate:
            return False
        return not default.ok or self.config.objective.better(chosen.by_median, default.by_median)

    @property
    def rejected(self) -> dict[Engine, Quality]:
        return {engine: q for engine, q in self.engine_quality.items() if not q.passed}

    def profile(self, note: str | None = None) -> Profile:
        chosen = self.chosen or self.default
        engine, batching = chosen.candidate.engine, chosen.candidate.batching
        c = self.config
        measured: dict[str, Any] = {
            "objective": c.objective.kind,
            "slo_p99_ms": c.objective.slo_p99_ms,
            "slo_met": c.objective.meets_slo(chosen),
            "concurrency": c.load.concurrency,
            "load": c.load.described,
            "throughput": round(chosen.throughput, 2),  # inputs per second
            "p50_ms": round(chosen.p50_ms, 2),
            "p99_ms": round(chosen.p99_ms, 2),
            "quality_metric": chosen.quality.metric,
            "quality": chosen.quality.value,
            "default_throughput": round(self.default.median_throughput, 2),
            "default_p99_ms": round(self.default.median_p99_ms, 2),
            "speedup": round(self.speedup, 3),
            "candidates_measured": sum(1 for t in self.trials if t.measurements),
            "grid_size": len(c.space.engines) * len(c.space.batchings),
            "measure_seconds": round(self.measure_seconds, 1),
            "search_seconds": round(self.wall_seconds, 1),
            "budget_minutes": round(c.budget_s / 60, 2),
            "stopped": self.stopped or "finished",
            "device_name": self.device_name,
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "fleetbox_version": __version__,
            "note": note,
        }
        return Profile(
            model=c.name,
            hardware=self.hardware,
            runtime=engine.runtime,
            dtype=engine.dtype,
            max_batch_tokens=batching.max_batch_tokens,
            max_batch_size=batching.max_batch_size,
            max_wait_ms=batching.max_wait_ms,
            concurrent_batches=engine.concurrent_batches,
            threads=engine.threads,
            onnx_opt_level=engine.onnx_opt_level if engine.runtime == RuntimeKind.ONNX.value else None,
            measured=measured,
            rejected={e.label: q.describe() for e, q in self.rejected.items()},
        )

    @property
    def slug(self) -> str:
        return model_slug(self.config.name)


Loader = Callable[[ModelSource], Runtime]


class Tuner:
    """One model's tune: loads engines, grades them, measures candidates, keeps the trials."""

    def __init__(
        self,
        config: TuneConfig,
        loader: Loader = load_runtime,
        on_trial: Callable[[Trial, str], None] | None = None,  # a trial just measured, and the stage that did
        on_status: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self._loader = loader
        self._on_trial = on_trial or (lambda trial, stage: None)
        self._on_status = on_status or (lambda text: None)
        self._trials: dict[Candidate, Trial] = {}
        self._quality: dict[Engine, Quality] = {}
        self._shown_rejected: set[Engine] = set()
        self._confirmed: set[Candidate] = set()  # measured in the confirmation round: its last run is that one
        self._runtimes: dict[tuple[Any, ...], Runtime] = {}
        self._reference_key: tuple[Any, ...] | None = None
        self._requests: list[list[Tokenized]] = []
        self._stopping = False
        self._cut_short = False  # the search left some of its plan for the confirmation round
        self._started = 0.0
        self._measure_s = 0.0
        self._torch_threads = _torch_threads()

    def stop(self) -> None:
        """Ask the tune to end after the current run (a signal handler may call this)."""
        self._stopping = True

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._started

    def run(self, strategy: str = "search", engines: list[Engine] | None = None) -> TuneResult:
        """`search` (the tuner) or `grid` (every candidate of the space, for the benchmark)."""
        c = self.config
        self._started = time.perf_counter()
        baseline = Candidate(DEFAULT_ENGINE, c.default_batching)
        stopped = None
        finalists: list[Candidate] = []
        try:
            if self._stopping:  # Ctrl-C before the tune began: not even the reference is worth loading
                raise SearchStopped("interrupted")
            self._on_status("loading the fp32 torch reference")
            reference_runtime = self._runtime(DEFAULT_ENGINE)
            self._reference_key = _runtime_key(DEFAULT_ENGINE)
            self._reference = Reference.build(reference_runtime, c.task)
            self._requests = make_requests(reference_runtime, c.task, c.load.requests, c.load.seed, c.load.sample)
            self.evaluate(baseline, "default")
            if strategy == "grid":
                self._grid(engines if engines is not None else list(c.space.engines))
            else:
                finalists = search(
                    c.space,
                    engines if engines is not None else list(c.space.engines),
                    self.evaluate,
                    c.objective,
                    keep=c.keep,
                    confirm=c.confirm,
                )
                # The baseline once more, later: one unlucky minute must not make the speedup.
                self.evaluate(baseline, "confirm")
        except SearchStopped as why:
            stopped = str(why)
        finally:
            self._close()
        trials = list(self._trials.values())
        default = self._trials.get(baseline) or Trial(baseline, Quality("not measured", float("nan"), 1.0), "default")
        return TuneResult(
            config=c,
            hardware=hardware_slug(c.device),
            device_name=device_description(c.device),
            default=default,
            chosen=self._choose(trials, finalists),
            trials=trials,
            engine_quality=dict(self._quality),
            measure_seconds=self._measure_s,
            wall_seconds=self.elapsed,
            stopped=stopped or ("budget" if self._cut_short else None),
        )

    def _choose(self, trials: list[Trial], finalists: list[Candidate]) -> Trial | None:
        """The best finalist by its confirmation run (all taken back to back, so a drifting load
        favours none), when the round was run; else the best trial by all its runs."""
        objective = self.config.objective
        confirmed = [self._trials[c] for c in finalists if c in self._confirmed]
        if not finalists or len(confirmed) < len(finalists):
            return objective.best(trials)
        last_runs = [Trial(t.candidate, t.quality, t.stage, [t.measurements[-1]]) for t in confirmed]
        best = objective.best(last_runs)
        return self._trials[best.candidate] if best is not None else objective.best(trials)

    def _grid(self, engines: list[Engine]) -> None:
        for engine in engines:
            for candidate in self.config.space.grid([engine]):
                trial = self.evaluate(candidate, "grid")
                if not trial.quality.passed:
                    break  # the rest of this engine's grid would fail the same gate

    # -- one candidate ---------------------------------------------------------------------------

    def evaluate(self, candidate: Candidate, stage: str) -> Trial:
        """Measure a candidate (once; again in stage `confirm`); gate its engine on first use."""
        trial = self._trials.get(candidate)
        if trial is not None and stage != "confirm":
            return trial
        self._check_budget(stage)
        if stage in ("screen", "descent") and not self._budget_left(stage, reserve=self.config.confirm + 1):
            self._cut_short = True
            raise ExploringOver
        runtime, quality = self._gated(candidate.engine)
        if trial is None:
            trial = Trial(candidate, quality, stage if quality.passed else "rejected")
            self._trials[candidate] = trial
        if not quality.passed:
            if not self.config.measure_rejected or runtime is None or candidate.engine in self._shown_rejected:
                self._on_trial(trial, trial.stage)
                return trial
            self._shown_rejected.add(candidate.engine)  # measured once, for the report
        self._on_status(f"{stage}: {candidate.label}")
        first = self._measure(runtime, candidate)
        trial.measurements.append(first)
        if stage == "confirm":
            self._confirmed.add(candidate)
        try:
            if stage == "confirm" and len(trial.measured) > 1:
                trial.noisy = _disagree(trial.measured, self.config.max_spread)
            elif first.ok and first.spread > self.config.max_spread and self._budget_left(stage) and not self._stopping:
                # Its windows disagree: measure it once more; two runs that disagree too mean noise.
                second = self._measure(runtime, candidate)
                trial.measurements.append(second)
                trial.noisy = _disagree(trial.measured, self.config.max_spread)
        finally:
            # Shown even when a Ctrl-C cut its second run short: it has a run, so it may be chosen. The trial
            # keeps the stage that found it; the line shown says which stage measured it just now.
            self._on_trial(trial, stage if quality.passed else trial.stage)
        return trial

    def _measure(self, runtime: Runtime | None, candidate: Candidate) -> Measurement:
        assert runtime is not None
        if candidate.engine.runtime == RuntimeKind.TORCH.value:
            _set_torch_threads(candidate.engine.threads or self._torch_threads)
        started = time.perf_counter()
        try:
            result = measure(runtime, candidate.run_batching, self._requests, self.config.load, lambda: self._stopping)
        finally:
            self._measure_s += time.perf_counter() - started
        if result.error == "interrupted":
            raise SearchStopped("interrupted")
        return result

    def _check_budget(self, stage: str) -> None:
        if self._stopping:
            raise SearchStopped("interrupted")
        if not self._budget_left(stage):
            raise SearchStopped("budget")

    def _budget_left(self, stage: str, reserve: int = 0) -> bool:
        """Room for one more measurement, and `reserve` more after it (the confirmation round)."""
        if stage in _STAGES_WITHOUT_BUDGET:
            return True
        measured = [m.seconds for t in self._trials.values() for m in t.measurements]
        typical = max(self.config.load.seconds, float(np.median(measured)) if measured else 0.0)
        return self.elapsed + typical * (1 + reserve) * 1.1 <= self.config.budget_s

    # -- engines ---------------------------------------------------------------------------------

    def _gated(self, engine: Engine) -> tuple[Runtime | None, Quality]:
        """The engine's runtime and its quality verdict; a runtime that fails to load fails the gate."""
        try:
            runtime = self._runtime(engine)
        except Exception as exc:  # an export that misses parity, a precision the device lacks: not servable
            log.warning("engine failed to load", extra={"engine": engine.label, "error": repr(exc)})
            quality = self._quality.setdefault(engine, Quality(f"load failed: {exc!r}"[:200], float("nan"), 1.0))
            return None, quality
        if engine not in self._quality:
            self._on_status(f"quality gate: {engine.label}")
            self._quality[engine] = self._reference.check(runtime)
        return runtime, self._quality[engine]

    def _runtime(self, engine: Engine) -> Runtime:
        key = _runtime_key(engine)
        runtime = self._runtimes.get(key)
        if runtime is not None:
            return runtime
        for old in [k for k in self._runtimes if k != self._reference_key]:
            self._runtimes.pop(old).close()  # one engine besides the reference in memory at a time
        self._on_status(f"loading {engine.label}")
        options: dict[str, Any] = {"cache_dir": str(self.config.cache_dir)}
        if engine.onnx_opt_level:
            options["onnx_opt_level"] = engine.onnx_opt_level
        source = ModelSource(
            path=self.config.path,
            task=self.config.task,
            runtime=RuntimeKind(engine.runtime),
            device=self.config.device,
            dtype=engine.dtype,
            threads=engine.threads,
            options=options,
        )
        runtime = self._loader(source)
        self._runtimes[key] = runtime
        return runtime

    def _close(self) -> None:
        for runtime in self._runtimes.values():
            runtime.close()
        self._runtimes.clear()
        _set_torch_threads(self._torch_threads)


def _runtime_key(engine: Engine) -> tuple[Any, ...]:
    # torch's thread count is a process setting applied before each run: one load serves every count.
    if engine.runtime == RuntimeKind.TORCH.value:
        return (engine.runtime, engine.dtype)
    return (engine.runtime, engine.dtype, engine.threads, engine.onnx_opt_level)


def _disagree(measurements: list[Measurement], limit: float) -> bool:
    rates = [m.throughput for m in measurements]
    return (max(rates) - min(rates)) / max(min(rates), 1e-9) > limit


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _set_torch_threads(threads: int) -> None:
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
