"""`fleetbox tune`: the command writes a valid profile that passes the gate, a candidate with broken outputs
is never chosen however fast it is, Ctrl-C and the budget keep the best so far, and the search policy
finds a grid's best while measuring a fraction of it. Real tiny random-weight models, real batcher."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from appliance.catalog import Batching
from appliance.cli import app
from appliance.devices import hardware_slug
from appliance.profiles import Profile
from appliance.tune import TuneConfig, Tuner, TuneResult
from appliance.tune_cli import summary
from appliance.tune_load import Load, Measurement, make_requests, read_sample
from appliance.tune_quality import Quality, Reference, spearman
from appliance.tune_report import write_outputs
from appliance.tune_search import Candidate, Engine, Objective, Space, Trial, default_space, search
from runtimes import ModelSource, Runtime, RuntimeKind, Task, Tokenized, load_runtime

FAST_LOAD = Load(concurrency=4, warmup_s=0.05, window_s=0.1, windows=3, requests=48, max_window_s=2.0)
TORCH_1 = Engine("torch", "float32", 1)
BROKEN = Engine("torch", "bfloat16", 1)  # stands for any engine whose outputs drift: see BrokenRuntime


class BrokenRuntime:
    """A runtime that answers instantly with the wrong vectors: the fastest candidate there could be."""

    def __init__(self, real: Runtime) -> None:
        self.info = real.info
        self._real = real
        self._rng = np.random.default_rng(0)

    def tokenize(self, texts: Sequence[str], *, truncate: bool = True) -> list[Tokenized]:
        return self._real.tokenize(texts, truncate=truncate)

    def run(self, batch: Sequence[Tokenized], adapter: str | None = None) -> np.ndarray:
        assert self.info.dimensions is not None
        vectors = self._rng.standard_normal((len(batch), self.info.dimensions)).astype(np.float32)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    def close(self) -> None:
        self._real.close()


def loader_with_a_broken_engine(source: ModelSource) -> Runtime:
    if source.dtype == BROKEN.dtype:
        return BrokenRuntime(load_runtime(replace(source, dtype="float32")))
    return load_runtime(source)


def config(folder: Path, engines: tuple[Engine, ...], budget_s: float = 60.0, **changes: object) -> TuneConfig:
    space = Space(engines, (256, 4096), (4, 32), (0.0, 2.0))
    values: dict[str, object] = {
        "name": "tiny",
        "path": folder,
        "task": Task.EMBED,
        "space": space,
        "default_batching": Batching(4096, 32, 2.0),
        "budget_s": budget_s,
        "load": FAST_LOAD,
        "cache_dir": folder.parent / "onnx-cache",
    }
    return TuneConfig(**(values | changes))  # type: ignore[arg-type]


def test_tune_command_writes_a_profile_that_passes_the_gate(encoder_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FBX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FBX_DEFAULT_MODEL", "false")
    # A default that waits 30 ms for company per batch: whatever the machine's load, a candidate beats it (a
    # profile is written only then).
    monkeypatch.setenv("FBX_MAX_WAIT_MS", "30")
    out = tmp_path / "profiles"
    result = CliRunner().invoke(
        app,
        [
            "tune", str(encoder_dir), "--name", "org/tiny", "--budget-minutes", "0.4", "--quick", "--device", "cpu",
            "--concurrency", "4", "--window-s", "0.1", "--out", str(out), "--note", "a test run",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    hardware = hardware_slug("cpu")
    written = Profile.read(out / "org-tiny" / f"{hardware}.toml")
    assert written.model == "org/tiny" and written.hardware == hardware
    assert written.runtime in ("torch", "onnx") and written.dtype in ("float32", "int8")
    assert written.max_batch_tokens in (1024, 4096, 16384) and written.max_batch_size in (8, 32, 256)
    assert written.measured["quality_metric"] == "min_cosine" and written.measured["quality"] >= 0.999
    assert written.measured["throughput"] > 0 and written.measured["p99_ms"] >= written.measured["p50_ms"] > 0
    assert written.measured["fleetbox_version"] and written.measured["date"]
    report = (out / "org-tiny" / f"{hardware}.md").read_text()
    assert "**chosen**" in report and "## Quality gate, per engine" in report and "a test run" in report
    assert (out / "org-tiny" / f"{hardware}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The console: the default's figure is the speedup's baseline (the confirm label: the test below).
    default_line = next(line for line in result.output.splitlines() if line.startswith("default: "))
    assert f": {written.measured['default_throughput']:.1f} inputs/s" in default_line, result.output


def test_the_confirmation_round_is_reported_as_such(encoder_dir: Path) -> None:
    """The console labelled the second pass over the finalists `screen`, the stage that had found each: the
    tuner now tells its listener the stage of the run just done."""
    stages: list[tuple[Candidate, str]] = []
    # A budget that only a stalled machine could spend: the plan (8 candidates of one engine) runs out first.
    tuning = config(encoder_dir, (TORCH_1,), budget_s=900.0)
    result = Tuner(tuning, on_trial=lambda t, stage: stages.append((t.candidate, stage))).run()
    assert result.stopped is None, result.stopped
    confirmed = {candidate for candidate, stage in stages if stage == "confirm"}
    assert confirmed and all(any(c == seen and s != "confirm" for seen, s in stages) for c in confirmed), stages


def test_the_summary_puts_the_chosen_beside_the_defaults_median_run() -> None:
    """A noisy default is reported by its worst run in its own line, but the speedup is over its median run:
    the summary's `default:` line shows that median, or the two lines on the screen contradict each other."""

    def run(throughput: float) -> Measurement:
        return Measurement(throughput, 10.0, 40.0, 0.1, (throughput,), 100, 1.0)

    gate = Quality("min_cosine", 1.0, 0.999)
    default = Trial(Candidate(TORCH_1, Batching(4096, 32, 2.0)), gate, "default", [run(4000.0), run(2000.0)], True)
    chosen = Trial(Candidate(TORCH_1, Batching(256, 4, 0.0)), gate, "screen", [run(4500.0)])
    tune = config(Path("/models/tiny"), (TORCH_1,))
    result = TuneResult(tune, "cpu-2c", "a CPU", default, chosen, [], {}, 1.0, 1.0, None)
    lines = summary(result).splitlines()
    assert lines[1] == f"default: {default.candidate.label}: 3000.0 inputs/s, p99 40.0 ms (median of 2 runs)"
    assert lines[2].startswith("speedup 1.50x")


def test_dry_run_writes_nothing(encoder_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FBX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FBX_DEFAULT_MODEL", "false")
    args = ["tune", str(encoder_dir), "--budget-minutes", "0.05", "--device", "cpu", "--dry-run", "--quick"]
    result = CliRunner().invoke(app, [*args, "--concurrency", "2", "--window-s", "0.05", "--out", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    assert "max_batch_tokens = " in result.stdout and not (tmp_path / "p").exists()


def test_a_candidate_with_broken_outputs_is_never_chosen(encoder_dir: Path, tmp_path: Path, monkeypatch) -> None:
    tuner = Tuner(config(encoder_dir, (TORCH_1, BROKEN)), loader=loader_with_a_broken_engine)
    result = tuner.run()
    broken = [t for t in result.trials if t.candidate.engine == BROKEN]
    assert broken and all(not t.quality.passed for t in broken)
    assert broken[0].throughput > 0  # measured, for the report: it would have won on speed alone
    assert result.chosen is not None and result.chosen.candidate.engine != BROKEN
    assert result.chosen.quality.passed and result.chosen.quality.value >= 0.999
    profile = result.profile()
    assert profile.dtype == "float32" and BROKEN.label in profile.rejected
    paths = write_outputs(result, tmp_path / "profiles")
    assert "failed the gate" in paths[1].read_text()

    # All or nothing: a write that fails at the profile (the last part made) leaves the last write's report
    # and plot, where they used to be replaced already.
    before = {path: path.read_bytes() for path in paths}

    def fails(self: object) -> str:
        raise OSError("no space left on device")

    monkeypatch.setattr(type(profile), "to_toml", fails)
    with pytest.raises(OSError, match="no space"):
        write_outputs(result, tmp_path / "profiles", note="a second tune")
    assert {path: path.read_bytes() for path in paths} == before
    assert sorted(p.name for p in paths[0].parent.iterdir()) == sorted(p.name for p in paths)  # no drafts left


def test_ctrl_c_and_the_budget_keep_the_best_so_far(encoder_dir: Path) -> None:
    seen: list[Trial] = []
    tuner: Tuner

    def on_trial(trial: Trial, stage: str) -> None:
        seen.append(trial)
        if len(seen) == 3:
            tuner.stop()  # what the first Ctrl-C does

    tuner = Tuner(config(encoder_dir, (TORCH_1,)), on_trial=on_trial)
    interrupted = tuner.run()
    assert interrupted.stopped == "interrupted" and len(interrupted.trials) == 3
    assert interrupted.chosen in interrupted.trials and interrupted.chosen.ok

    started = time.perf_counter()
    spent = Tuner(config(encoder_dir, (TORCH_1,), budget_s=0.1)).run()  # room for the default only
    assert spent.stopped == "budget" and spent.chosen is spent.default
    assert time.perf_counter() - started < 30


def test_quality_gates_for_scores_and_labels(cross_encoder_dir: Path, classifier_dir: Path) -> None:
    scorer = load_runtime(ModelSource(cross_encoder_dir, Task.SCORE))
    reference = Reference.build(scorer, Task.SCORE, count=32)
    assert reference.check(scorer).passed
    assert not reference.check(Transformed(scorer, lambda out: -out)).passed  # ranks reversed
    classifier = load_runtime(ModelSource(classifier_dir, Task.CLASSIFY))
    labels = Reference.build(classifier, Task.CLASSIFY, count=32)
    assert labels.check(Transformed(classifier, lambda out: out * 1.001)).passed
    swapped = labels.check(Transformed(classifier, lambda out: np.roll(out, 1, axis=1)))  # another argmax
    assert swapped.metric == "same_argmax" and not swapped.passed
    assert spearman(np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0, 30.0])) == pytest.approx(1.0)
    assert np.isnan(spearman(np.array([1.0, 2.0]), np.array([5.0, 5.0])))  # nothing to rank: fails the gate


class Transformed:
    """A real runtime whose outputs pass through `change`."""

    def __init__(self, real: Runtime, change) -> None:  # type: ignore[no-untyped-def]
        self.info, self._real, self._change = real.info, real, change

    def tokenize(self, texts: Sequence[str], *, truncate: bool = True) -> list[Tokenized]:
        return self._real.tokenize(texts, truncate=truncate)

    def run(self, batch: Sequence[Tokenized], adapter: str | None = None) -> np.ndarray:
        return np.ascontiguousarray(self._change(self._real.run(batch)))

    def close(self) -> None:
        self._real.close()


def trial(engine: Engine, batching: Batching, throughput: float, p99_ms: float, passed: bool = True) -> Trial:
    from appliance.tune_quality import Quality

    measurement = Measurement(throughput, p99_ms / 2, p99_ms, 0.0, (throughput,), 100, 1.0)
    quality = Quality("min_cosine", 1.0 if passed else 0.5, 0.999)
    return Trial(Candidate(engine, batching), quality, "test", [measurement])


def test_objective_never_picks_a_gate_failure_and_honours_the_slo() -> None:
    b = Batching(1024, 8, 0.0)
    fast_wrong = trial(BROKEN, b, 9000, 1, passed=False)
    quick_but_slow_tail = trial(TORCH_1, b, 500, 300)
    steady = trial(TORCH_1, replace(b, max_batch_size=16), 400, 90)
    assert Objective("throughput").best([fast_wrong, quick_but_slow_tail, steady]) is quick_but_slow_tail
    assert Objective("throughput", slo_p99_ms=100).best([fast_wrong, quick_but_slow_tail, steady]) is steady
    assert Objective("latency").best([fast_wrong, quick_but_slow_tail, steady]) is steady
    # Nothing meets the SLO: the lowest p99 that passed the gate, still never the broken one.
    assert Objective("throughput", slo_p99_ms=10).best([fast_wrong, quick_but_slow_tail, steady]) is steady
    assert Objective("throughput").best([fast_wrong]) is None


def test_search_finds_the_grids_best_measuring_a_fraction_of_it() -> None:
    """The search policy alone, against a made-up throughput surface (no model: the order is under test)."""
    engines = (Engine("torch", "float32", 1), Engine("torch", "float32", 2), Engine("onnx", "float32", 1, "all"))
    space = Space(engines, (1024, 2048, 4096, 8192, 16384), (8, 16, 32, 64, 256), (0.0, 1.0, 2.0, 5.0))
    speed = {engines[0]: 1.0, engines[1]: 0.8, engines[2]: 1.6}

    def surface(c: Candidate) -> float:
        b = c.batching
        return (
            speed[c.engine]
            * (1000 - abs(np.log2(b.max_batch_tokens / 4096)) * 80 - abs(np.log2(b.max_batch_size / 32)) * 60)
            - 20 * b.max_wait_ms
        )

    measured: dict[Candidate, Trial] = {}

    def evaluate(candidate: Candidate, stage: str) -> Trial:
        if candidate not in measured:
            measured[candidate] = trial(candidate.engine, candidate.batching, surface(candidate), 50)
        return measured[candidate]

    search(space, list(engines), evaluate, Objective())
    best_in_grid = max(space.grid(), key=surface)
    found = Objective().best(list(measured.values()))
    assert found is not None and found.candidate == best_in_grid
    assert len(measured) <= 0.3 * len(list(space.grid()))


def test_onnx_engines_are_tuned_too(encoder_dir: Path) -> None:
    onnx = Engine("onnx", "float32", 1, "all")
    # A budget that only a stalled machine could spend (60 s was spent in 117 under a heavy load): the whole search.
    result = Tuner(config(encoder_dir, (TORCH_1, onnx), budget_s=900.0)).run()
    assert result.engine_quality[onnx].passed and result.engine_quality[onnx].value >= 0.9999
    assert any(t.candidate.engine == onnx and t.ok for t in result.trials)
    assert result.chosen is not None and result.chosen.quality.passed
    assert result.stopped is None
    kinds = {t.candidate.engine.runtime for t in result.trials if t.ok}
    assert kinds == {RuntimeKind.TORCH.value, RuntimeKind.ONNX.value}


def test_concurrent_batches_are_an_engine_shape_the_profile_keeps(encoder_dir: Path, monkeypatch) -> None:
    labels = {engine.label for engine in default_space("cpu", 4).engines}
    assert {"onnx-float32-t1", "onnx-float32-t1x4", "onnx-float32-t2x2", "onnx-float32-t4"} <= labels
    assert "onnx-float32-t4x1" not in labels and all("t4x" not in label for label in labels)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    gpu = {engine.label for engine in default_space("cuda", 16).engines}
    assert {"torch-float16-tdefaultx2", "torch-bfloat16-tdefaultx2", "torch-float32-tdefault"} <= gpu
    assert "torch-float32-tdefaultx2" not in gpu
    shared = Engine("onnx", "float32", 1, "all", concurrent_batches=2)
    result = Tuner(config(encoder_dir, (shared,))).run()
    assert any(t.candidate.engine == shared and t.ok for t in result.trials)  # measured with 2 batches at once
    assert result.chosen is not None
    assert result.profile().concurrent_batches == result.chosen.candidate.engine.concurrent_batches


def test_a_sample_of_your_own_traffic_is_the_load(encoder_dir: Path, tmp_path: Path, monkeypatch) -> None:
    sample = tmp_path / "traffic.jsonl"
    sample.write_text(
        'how do I reset my password\n{"input": "one sentence"}\n\n{"input": ["two", "inputs here"], "model": "m"}\n'
    )
    expected = (("how do I reset my password",), ("one sentence",), ("two", "inputs here"))
    assert read_sample(sample, Task.EMBED) == expected
    rerank = tmp_path / "rerank.jsonl"
    rerank.write_text('{"query": "q", "documents": ["d1", {"text": "d2"}]}\n')
    assert read_sample(rerank, Task.SCORE) == ((("q", "d1"), ("q", "d2")),)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"input": "fine"}\n{"inputs": "misspelt"}\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: not a request body"):
        read_sample(broken, Task.EMBED)

    runtime = load_runtime(ModelSource(path=encoder_dir, task=Task.EMBED))
    requests = make_requests(runtime, Task.EMBED, 50, 0, read_sample(sample, Task.EMBED))
    assert len(requests) == 50 and {len(r) for r in requests} == {1, 2}  # the sample's shapes, drawn at random
    runtime.close()

    monkeypatch.setenv("FBX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FBX_DEFAULT_MODEL", "false")
    args = ["tune", str(encoder_dir), "--budget-minutes", "0.05", "--device", "cpu", "--dry-run", "--quick"]
    result = CliRunner().invoke(app, [*args, "--concurrency", "2", "--window-s", "0.05", "--inputs", str(sample)])
    assert result.exit_code == 0, result.output
    assert 'load = "3 requests from traffic.jsonl"' in result.stdout
    result = CliRunner().invoke(app, [*args, "--inputs", str(broken)])
    assert result.exit_code == 2 and "broken.jsonl:2" in result.output


def test_an_unusable_out_folder_is_refused_before_the_tune(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FBX_STATE_DIR", str(tmp_path / "state"))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for out in (a_file, a_file / "sub", Path("/proc/fleetbox-profiles")):
        started = time.perf_counter()
        result = CliRunner().invoke(app, ["tune", "no-such-model", "--out", str(out)])
        assert result.exit_code == 2, result.output
        assert result.output.startswith(f"fleetbox tune: cannot write profiles to {out}: ")
        assert len(result.output.splitlines()) == 1 and time.perf_counter() - started < 10
    fresh = tmp_path / "new" / "profiles"
    result = CliRunner().invoke(app, ["tune", "no-such-model", "--out", str(fresh)])
    assert result.exit_code == 2 and "neither a model" in result.output
    assert not (tmp_path / "new").exists()  # made to check it writable, taken away again: nothing was written


@pytest.mark.parametrize(
    "args",
    [
        ["--budget-minutes", "0"],
        ["--budget-minutes", "-1"],
        ["--concurrency", "0"],
        ["--concurrency", "-3"],
        ["--window-s", "0"],
        ["--slo-p99-ms", "-5"],  # ran a whole tune against an SLO no candidate can meet
        ["--slo-p99-ms", "0"],
        ["--budget-minutes", "inf"],
        ["--window-s", "inf"],
    ],
)
def test_nonsense_numbers_are_usage_errors(args: list[str], tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["tune", str(tmp_path), "--dry-run", *args])
    assert result.exit_code == 2 and "Invalid value" in result.output, result.output


def test_a_binary_inputs_file_is_named_on_one_unwrapped_line(encoder_dir: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("FBX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FBX_DEFAULT_MODEL", "false")
    binary = tmp_path / ("traffic-" + "x" * 80 + ".jsonl")
    binary.write_bytes(b'{"input": "fine"}\n\xcb\xff\x00')
    result = CliRunner().invoke(
        app, ["tune", str(encoder_dir), "--device", "cpu", "--dry-run", "--inputs", str(binary)]
    )
    assert result.exit_code == 2
    assert result.output == f"fleetbox tune: --inputs: {binary}:2: not UTF-8 text (byte 18 is 0xcb)\n"


def test_a_second_ctrl_c_aborts_and_writes_nothing(encoder_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """The presses come while a candidate is measured (inside the measuring event loop), as an
    operator's would; the stop callback the tuner passes in is where this test presses."""
    import os
    import signal

    import appliance.tune

    real_measure = appliance.tune.measure
    presses: list[float] = []

    def measure_and_press(runtime, batching, requests, load, stop):  # type: ignore[no-untyped-def]
        def stop_and_press() -> bool:
            stopping = stop()
            if not presses or (stopping and len(presses) == 1):  # the second once the first was taken
                presses.append(time.perf_counter())
                os.kill(os.getpid(), signal.SIGINT)
            return stopping

        return real_measure(runtime, batching, requests, load, stop_and_press)

    monkeypatch.setattr(appliance.tune, "measure", measure_and_press)
    monkeypatch.setenv("FBX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FBX_DEFAULT_MODEL", "false")
    out = tmp_path / "profiles"
    args = ["tune", str(encoder_dir), "--name", "org/tiny", "--budget-minutes", "1", "--quick", "--device", "cpu"]
    result = CliRunner().invoke(app, [*args, "--concurrency", "2", "--window-s", "0.1", "--out", str(out)])
    assert len(presses) == 2
    assert result.exit_code == 130, result.output
    assert "a second Ctrl-C aborts" in result.output and "aborted by a second Ctrl-C; nothing written" in result.output
    assert not out.exists()  # made to check it writable up front, taken away again: no empty folder left behind


def test_a_second_ctrl_c_landing_in_a_weakref_callback_still_aborts_without_a_traceback(capfd) -> None:
    """Python runs the SIGINT handler between any two bytecodes; in a weakref callback its
    KeyboardInterrupt was dropped with an "Exception ignored ... Traceback" block (and the abort with
    it). Here the handler is called inside such a callback, as a signal arriving there would run it."""
    import signal
    import weakref

    from rich.console import Console

    from appliance.tune_cli import CtrlC

    class Thing:
        pass

    ctrl_c = CtrlC(Console(stderr=True))
    thing = Thing()
    landed = []

    def on_collect(_: object) -> None:
        landed.append(True)
        ctrl_c._pressed(signal.SIGINT, None)  # the second press

    with pytest.raises(KeyboardInterrupt), ctrl_c:  # the interrupt arrives a moment after the callback
        ctrl_c._pressed(signal.SIGINT, None)  # the first press: stop after this run
        ref = weakref.ref(thing, on_collect)
        del thing
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the tune's own flow goes on, where the interrupt may land
            pass
    assert landed and ref() is None and ctrl_c.aborted
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "Traceback" not in err, err


@pytest.mark.parametrize("model", ["", "  "])
def test_an_empty_model_is_named_as_no_model_not_taken_as_the_current_folder(model: str, tmp_path: Path) -> None:
    """Tester h212: `fleetbox tune ""` tuned the current folder (`. has no config.json…`), where every other verb
    says the MODEL names no model."""
    result = CliRunner().invoke(app, ["tune", model, "--dry-run"])
    assert result.exit_code == 2, result.output
    assert result.output == f"fleetbox tune: MODEL {model!r} names no model; give a model's name or a model folder\n"


def test_an_inputs_file_that_cannot_be_read_is_one_clear_line(encoder_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """Tester h212: `--inputs /nonexistent` showed Python's `[Errno 2] No such file or directory: '/nonexistent'`."""
    monkeypatch.setenv("FBX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FBX_DEFAULT_MODEL", "false")
    args = ["tune", str(encoder_dir), "--device", "cpu", "--dry-run", "--inputs"]
    missing = tmp_path / "missing.jsonl"
    for given, why in ((missing, "No such file or directory"), (tmp_path, "Is a directory")):
        result = CliRunner().invoke(app, [*args, str(given)])
        assert result.exit_code == 2, result.output
        assert result.output == f"fleetbox tune: --inputs: cannot read {given}: {why}\n"
