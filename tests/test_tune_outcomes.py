"""`fleetbox tune`: what it refuses before it runs, and what it leaves when a tune ends without a better profile.

Bad names and folders it cannot tune are one line and exit 2 before any measurement; a tune interrupted before
it measured anything says so and exits 130; a tune that found nothing better than the default settings writes
no profile, and none replaces a profile that records a higher speedup. Real tiny random-weight models; where the
thing under test is what the command does with a tune's result, the result is made up (each test says so).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

import appliance.tune
import appliance.tune_cli
from appliance.catalog import Batching
from appliance.cli import app
from appliance.devices import hardware_slug
from appliance.tune import Tuner, TuneResult
from appliance.tune_cli import summary
from appliance.tune_load import Measurement
from appliance.tune_quality import Quality
from appliance.tune_search import Candidate, Trial
from runtimes.detect import WEIGHT_FILES
from tests.test_tune import TORCH_1, config

FAST = ["--quick", "--device", "cpu", "--concurrency", "2", "--window-s", "0.05"]
GATE = Quality("min_cosine", 1.0, 0.999)


@pytest.fixture
def tune_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FBX_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("FBX_DEFAULT_MODEL", "false")
    return tmp_path


def run(throughput: float) -> Measurement:
    return Measurement(throughput, 10.0, 40.0, 0.1, (throughput,), 100, 1.0)


def no_tune(*args: object, **kwargs: object) -> TuneResult:
    raise AssertionError("the tune ran")


def test_a_name_with_no_letter_or_digit_is_refused_before_the_tune(
    encoder_dir: Path, tune_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was refused only when the profile was written, after the whole budget, with a traceback."""
    monkeypatch.setattr(appliance.tune_cli, "tune_with_progress", no_tune)
    out = tune_env / "profiles"
    args = ["tune", str(encoder_dir), "--name", "!!!", "--budget-minutes", "0.01", *FAST, "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.output.startswith("fleetbox tune: --name '!!!' has no ASCII letter or digit")
    assert len(result.output.splitlines()) == 1 and not out.exists()


def test_a_folder_with_onnx_weights_only_is_refused_with_the_reason(encoder_dir: Path, tune_env: Path) -> None:
    """It serves with `options.onnx_file`, but the tuner needs torch weights: that was a 128-line traceback."""
    onnx_only = tune_env / "onnx-only"
    shutil.copytree(encoder_dir, onnx_only, ignore=shutil.ignore_patterns(*WEIGHT_FILES))
    (onnx_only / "model.onnx").write_bytes(b"a graph")
    result = CliRunner().invoke(app, ["tune", str(onnx_only), "--budget-minutes", "0.01", *FAST, "--dry-run"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"fleetbox tune: {onnx_only} has no torch weights to tune from")
    assert "model.onnx" in result.output and len(result.output.splitlines()) == 1


def test_an_entry_with_its_own_onnx_file_is_refused_for_that_reason(encoder_dir: Path, tune_env: Path) -> None:
    """It is an encoder: 'is not an encoder model fleetbox can tune' named the wrong reason."""
    shipped = tune_env / "shipped"
    shutil.copytree(encoder_dir, shipped)
    (shipped / "model.onnx").write_bytes(b"a graph")
    toml = tune_env / "fleetbox.toml"
    toml.write_text(
        f'[[models]]\nname = "shipped"\npath = "{shipped}"\nruntime = "onnx"\n'
        'options = { onnx_file = "model.onnx" }\n\n[[models]]\nname = "nothing"\nruntime = "noop"\n'
    )
    result = CliRunner().invoke(app, ["tune", "shipped", "--config", str(toml), "--dry-run"])
    assert result.exit_code == 2, result.output
    assert "onnx_file" in result.output and "not an encoder" not in result.output
    assert len(result.output.splitlines()) == 1
    result = CliRunner().invoke(app, ["tune", "nothing", "--config", str(toml), "--dry-run"])
    assert result.exit_code == 2 and "noop runtime" in result.output, result.output


def test_ctrl_c_before_anything_was_measured_says_so_and_exits_130(
    encoder_dir: Path, tune_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C during the baseline read 'no candidate measured passed the quality gate', exit 1. The press comes
    while the default is measured, where the tuner's stop callback is first asked (as in test_tune.py)."""
    real_measure = appliance.tune.measure
    presses: list[float] = []

    def measure_and_press(runtime, batching, requests, load, stop):  # type: ignore[no-untyped-def]
        def stop_and_press() -> bool:
            if not presses:
                presses.append(time.perf_counter())
                os.kill(os.getpid(), signal.SIGINT)
            return stop()

        return real_measure(runtime, batching, requests, load, stop_and_press)

    monkeypatch.setattr(appliance.tune, "measure", measure_and_press)
    out = tune_env / "new" / "profiles"
    result = CliRunner().invoke(app, ["tune", str(encoder_dir), "--budget-minutes", "1", *FAST, "--out", str(out)])
    assert presses and result.exit_code == 130, result.output
    assert "fleetbox tune: interrupted before anything was measured; nothing written" in result.output
    assert "quality gate" not in result.output
    assert not (tune_env / "new").exists()  # the folder made to check it writable is gone again


def test_a_candidate_whose_second_run_ctrl_c_cut_short_is_shown_before_it_is_chosen(encoder_dir: Path) -> None:
    """Its windows disagreed, so the tuner measured it again; the Ctrl-C ended that run, and the candidate was
    chosen on its first run without its console line. Its figures are made up here (a steady default, then a
    fast candidate whose windows disagree); the runs are real."""
    real_measure = appliance.tune.measure
    shown: list[Trial] = []
    tuner: Tuner

    def measure_then_press(runtime, batching, requests, load, stop):  # type: ignore[no-untyped-def]
        measured = real_measure(runtime, batching, requests, load, stop)
        if not shown:  # the default
            return replace(measured, spread=0.0)
        tuner.stop()  # the first Ctrl-C, while the first candidate after the default is measured
        return replace(measured, throughput=measured.throughput * 100, spread=1.0)

    tuner = Tuner(config(encoder_dir, (TORCH_1,)), on_trial=lambda trial, stage: shown.append(trial))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(appliance.tune, "measure", measure_then_press)
        result = tuner.run()
    assert result.stopped == "interrupted"
    assert result.chosen is not None and result.chosen is not result.default
    assert any(trial is result.chosen for trial in shown), "chosen without its console line"


def test_identical_settings_are_not_slower_than_themselves() -> None:
    """The default's runs disagreed (noisy): as the chosen it was scored by its worst run, as the baseline by its
    median, and the console said `speedup 0.67x` for the same settings. Made-up runs: the arithmetic is under test."""
    default = Trial(Candidate(TORCH_1, Batching(4096, 32, 2.0)), GATE, "default", [run(4000.0), run(2000.0)], True)
    result = TuneResult(config(Path("/models/tiny"), (TORCH_1,)), "cpu-2c", "a CPU", default, default, [default], {},
                        1.0, 1.0, "budget")  # fmt: skip
    assert result.speedup == pytest.approx(1.0) and not result.beats_default
    assert summary(result).splitlines()[0] == "best: the default settings"
    # A noisy chosen is compared by its median run too: like with like.
    chosen = Trial(Candidate(TORCH_1, Batching(256, 4, 0.0)), GATE, "screen", [run(4500.0), run(4000.0)], True)
    steady = Trial(default.candidate, GATE, "default", [run(2000.0)])
    result = replace(result, default=steady, chosen=chosen, trials=[steady, chosen])
    assert result.speedup == pytest.approx(2.125) and result.beats_default


def test_the_shortest_tune_writes_no_profile_of_the_defaults(encoder_dir: Path, tune_env: Path) -> None:
    """`--budget-minutes 0.01` measures the default only; it wrote the defaults as a profile (over a better one)."""
    out = tune_env / "profiles"
    args = ["tune", str(encoder_dir), "--name", "org/tiny", "--budget-minutes", "0.01", *FAST, "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "fleetbox tune: nothing measured beat the default settings" in result.output
    assert "no profile written" in result.output and "best: the default settings" in result.output
    assert not out.exists()


def test_a_profile_that_records_a_higher_speedup_is_kept(
    encoder_dir: Path, tune_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tune that found less than the profile already there prints its profile and keeps the file. The tune's
    result is made up (1.5x over the default): what the command does with it is under test."""
    default = Trial(Candidate(TORCH_1, Batching(16384, 256, 0.0)), GATE, "default", [run(100.0)])
    chosen = Trial(Candidate(TORCH_1, Batching(4096, 32, 1.0)), GATE, "screen", [run(150.0)])

    def tuned(tune_config, console, ctrl_c=None) -> TuneResult:  # type: ignore[no-untyped-def]
        return TuneResult(tune_config, hardware_slug("cpu"), "a CPU", default, chosen, [default, chosen], {}, 1.0,
                          1.0, None)  # fmt: skip

    monkeypatch.setattr(appliance.tune_cli, "tune_with_progress", tuned)
    out = tune_env / "profiles"
    existing = out / "org-tiny" / f"{hardware_slug('cpu')}.toml"
    existing.parent.mkdir(parents=True)
    kept = 'model = "org/tiny"\nruntime = "onnx"\ndtype = "float32"\nmax_batch_tokens = 1024\nmax_batch_size = 8\n'
    existing.write_text(kept + "max_wait_ms = 5.0\n\n[measured]\nspeedup = 7.889\n")
    before = existing.read_text()
    args = ["tune", str(encoder_dir), "--name", "org/tiny", "--device", "cpu", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert f"fleetbox tune: {existing} records a speedup of 7.89x, above this tune's 1.50x: kept" in result.output
    assert existing.read_text() == before and sorted(p.name for p in existing.parent.iterdir()) == [existing.name]
    assert "max_batch_size = 32" in result.stdout  # the new profile, printed rather than lost
    assert "--force writes over it" in result.output
    result = CliRunner().invoke(app, [*args, "--force"])
    assert result.exit_code == 0, result.output
    assert "max_batch_size = 32" in existing.read_text()  # written over, as asked

    existing.write_text(kept + "max_wait_ms = 5.0\n\n[measured]\nspeedup = 1.2\n")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "max_batch_size = 32" in existing.read_text()  # a lower speedup is replaced


def test_a_ctrl_c_while_the_tune_is_set_up_stops_it_before_it_loads_anything(encoder_dir: Path) -> None:
    """The press came before the command handed the tuner to its Ctrl-C handler: it was dropped, and the tune ran
    its whole budget."""
    from rich.console import Console

    from appliance.tune_cli import CtrlC

    def loader(source: object) -> None:
        raise AssertionError("a model was loaded")

    with CtrlC(Console(stderr=True)) as ctrl_c:
        ctrl_c._pressed(signal.SIGINT, None)  # the first press: stop after this run
        tuner = Tuner(config(encoder_dir, (TORCH_1,), budget_s=5.0), loader=loader)  # type: ignore[arg-type]
        ctrl_c.watch(tuner)
        result = tuner.run()
    assert result.stopped == "interrupted" and not result.trials and result.chosen is None


def test_the_console_prints_the_figures_the_profile_records() -> None:
    """A clean-clone CI run: the default's 368.25000001 inputs/s read 368.3 on the console and 368.2 in the profile
    (recorded to 2 places, then shortened). Made-up runs on that edge: the printing is under test."""
    default = Trial(Candidate(TORCH_1, Batching(16384, 256, 30.0)), GATE, "default", [run(368.25000001)])
    chosen = Trial(Candidate(TORCH_1, Batching(4096, 32, 2.0)), GATE, "screen", [run(6403.25000001)])
    result = TuneResult(config(Path("/models/tiny"), (TORCH_1,)), "cpu-2c", "a CPU", default, chosen,
                        [default, chosen], {}, 1.0, 1.0, "budget")  # fmt: skip
    measured = result.profile(None).measured
    lines = summary(result).splitlines()
    assert f": {measured['default_throughput']:.1f} inputs/s" in lines[1], lines
    assert f": {measured['throughput']:.1f} inputs/s" in lines[0], lines
