"""The `fleetbox tune` command's work: which model, which space and load, progress, Ctrl-C, output.

The one idea: the command is a thin shell around `Tuner`; everything it decides (the model's
folder and task, the default it is compared with, the space for this device, the load) is decided
the way a box would decide it, so the profile written is the one a box will apply.
"""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import logging
import shlex
import signal
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType

from appliance.bus import model_slug
from appliance.catalog import Batching, Catalog, ModelSpec, default_batching
from appliance.configured import configured_specs
from appliance.devices import cpu_cores
from appliance.profiles import SHIPPED_PROFILES_DIR, tunable
from appliance.settings import Settings
from appliance.tune import TuneConfig, Tuner, TuneResult
from appliance.tune_load import Load, read_sample
from appliance.tune_search import OBJECTIVES, Objective, Trial, default_space
from runtimes import RuntimeKind, Task
from runtimes.detect import WEIGHT_FILES, detect_task


@dataclass(slots=True, frozen=True)
class ModelToTune:
    name: str
    path: Path
    task: Task
    batching: Batching  # what the box runs it with when no profile applies


def resolve_model(model: str, settings: Settings, name: str | None = None) -> ModelToTune:
    """A model name or alias the box knows (its config file, the default model), or a model folder.

    Everything that would fail the tune at its end (a name no profile folder can be made of) or at its
    first load (no torch weights) is refused here, before anything runs. An empty MODEL is no model, not the
    current folder (`Path("")` is `.`)."""
    if not model.strip():
        raise ValueError(f"MODEL {model!r} names no model; give a model's name or a model folder")
    spec = Catalog(configured_specs(settings)).get(model)
    if spec is not None:
        if not tunable(spec):
            raise ValueError(_why_not_tunable(spec))
        target = ModelToTune(name or spec.name, spec.path, spec.task, spec.batching)
    else:
        path = Path(model).expanduser()
        if not path.is_dir():
            raise ValueError(f"{model!r} is neither a model the box knows nor a model folder")
        task = detect_task(path)
        if task is Task.GENERATE:
            raise ValueError(f"{path} is a generator; fleetbox tunes encoder models (embed, score, classify, extract)")
        target = ModelToTune(name or path.resolve().name, path.resolve(), task, default_batching(settings))
    try:
        model_slug(target.name)
    except ValueError:
        given = f"--name {name!r}" if name is not None else f"the folder's name {target.name!r} (give one with --name)"
        raise ValueError(
            f"{given} has no ASCII letter or digit: a model's name needs one, for its queue and its profile's folder"
        ) from None
    if not any((target.path / weights).is_file() for weights in WEIGHT_FILES):
        graphs = sorted(graph.name for graph in target.path.glob("*.onnx"))
        found = f"; it holds {', '.join(graphs)}" if graphs else ""
        raise ValueError(
            f"{target.path} has no torch weights to tune from (model.safetensors or pytorch_model.bin, whole or "
            f"sharded{found}): the tuner checks each engine against fp32 torch and exports its ONNX engines from them. "
            "Add them to tune it; served with options.onnx_file, a graph runs as it is, without a profile"
        )
    return target


def _why_not_tunable(spec: ModelSpec) -> str:
    """The one reason `tunable` says no, in the operator's words."""
    if spec.options.get("onnx_file"):
        return (
            f"{spec.name} serves its own ONNX graph (options.onnx_file {spec.options['onnx_file']}), which no profile "
            "applies to; fleetbox tunes a model from its torch weights: tune its folder, and serve it without onnx_file"
        )
    if spec.adapter_of is not None:
        return f"{spec.name} is an adapter of {spec.adapter_of}, which runs with its base's settings: tune the base"
    if spec.runtime not in (RuntimeKind.TORCH, RuntimeKind.ONNX):
        return f"{spec.name} runs on the {spec.runtime} runtime; fleetbox tunes models on torch or ONNX"
    return f"{spec.name} is a {spec.task} model; fleetbox tunes encoder models (embed, score, classify, extract)"


def default_load(device: str, objective: str, concurrency: int | None, window_s: float | None) -> Load:
    """Heavy load for throughput, light load for latency (a lone request's p99 is what latency tunes)."""
    gpu = device.startswith("cuda")
    heavy = 128 if gpu else min(64, 8 * cpu_cores())
    return Load(
        concurrency=concurrency or (heavy if objective == "throughput" else 4),
        window_s=window_s or (0.5 if gpu else 1.0),
    )


def run_tune(
    model: str,
    settings: Settings,
    *,
    budget_minutes: float = 10.0,
    slo_p99_ms: float | None = None,
    objective: str = "throughput",
    write: bool = True,
    device: str | None = None,
    out: Path | None = None,
    concurrency: int | None = None,
    window_s: float | None = None,
    quick: bool = False,
    name: str | None = None,
    note: str | None = None,
    inputs: Path | None = None,
    force: bool = False,
) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    console.soft_wrap = not console.is_terminal  # piped or logged: one line stays one line

    def refuse(text: str, code: int = 2) -> int:
        console.print(f"fleetbox tune: {text}", markup=False, highlight=False)
        return code

    if objective not in OBJECTIVES:
        return refuse(f"--objective must be one of {', '.join(OBJECTIVES)}")
    root = out or settings.profiles_dir or SHIPPED_PROFILES_DIR
    with contextlib.ExitStack() as folder:
        if write:
            from appliance.tune_report import writable_folder

            try:
                folder.enter_context(writable_folder(root))
            except OSError as exc:
                return refuse(f"cannot write profiles to {root}: {exc.strerror or exc}")
        _quiet_libraries()
        try:
            target = resolve_model(model, settings, name)
        except (ValueError, FileNotFoundError) as exc:
            return refuse(str(exc))
        from appliance.devices import resolve_device

        chosen_device = resolve_device(device or settings.device)
        load = default_load(chosen_device, objective, concurrency, window_s)
        if inputs is not None:
            try:
                load = replace(load, sample=read_sample(inputs, target.task), sample_source=inputs.name)
            except OSError as exc:  # its words, not Python's `[Errno 2] …: '/x'` (tester h212)
                return refuse(f"--inputs: cannot read {inputs}: {exc.strerror or exc}")
            except ValueError as exc:
                return refuse(f"--inputs: {exc}")
        config = TuneConfig(
            name=target.name,
            path=target.path,
            task=target.task,
            space=default_space(chosen_device, cpu_cores(), quick=quick),
            default_batching=target.batching,
            device=chosen_device,
            budget_s=budget_minutes * 60,
            objective=Objective(objective, slo_p99_ms),
            load=load,
            cache_dir=settings.state_dir / "onnx",  # the cache a box on this machine reads: it exports once
        )
        with CtrlC(console) as ctrl_c:
            try:
                result = tune_with_progress(config, console, ctrl_c)
                if ctrl_c.aborted:  # the second Ctrl-C came during a measurement
                    raise KeyboardInterrupt
                # An interrupted tune that writes nothing exits as an interrupted command does (130, as a second
                # Ctrl-C); one that keeps the best so far has done its work (0).
                failed = 130 if result.stopped == "interrupted" else 1
                if result.chosen is None:
                    if not any(t.ok for t in result.trials) and result.stopped == "interrupted":
                        return refuse("interrupted before anything was measured; nothing written", failed)
                    passed = [t for t in result.trials if t.quality.passed and t.measurements]
                    if not passed:
                        return refuse("no candidate measured passed the quality gate; nothing written", failed)
                    why = passed[0].measurements[-1].error
                    return refuse(f"no candidate could be measured ({why}); nothing written", failed)
                console.print(summary(result), markup=False, highlight=False)
                if not write:
                    sys.stdout.write(result.profile(note).to_toml())
                    if not result.beats_default:  # said, not refused: a dry run prints what it found
                        defaults = "nothing measured beat the default settings: the profile above is the defaults"
                        console.print(f"fleetbox tune: {defaults}", markup=False, highlight=False)
                    return 0
                if not result.beats_default:
                    return refuse(
                        f"nothing measured beat the default settings ({_how_it_ended(result)}); no profile written: "
                        "a box runs a model with its defaults when no profile applies",
                        failed,
                    )
                from appliance.tune_report import better_profile_there, write_outputs

                better = None if force else better_profile_there(result, root)
                if better is not None:
                    sys.stdout.write(result.profile(note).to_toml())
                    return refuse(
                        f"{better[0]} records a speedup of {better[1]:.2f}x, above this tune's {result.speedup:.2f}x: "
                        "kept, and the new profile is printed above; --force writes over it",
                        1,
                    )
                command = shlex.join(["fleetbox", *sys.argv[1:]]) if sys.argv[1:2] == ["tune"] else None
                try:
                    written = write_outputs(result, root, note, command)
                except OSError as exc:  # the folder was writable when the tune started: print what it found
                    sys.stdout.write(result.profile(note).to_toml())
                    return refuse(f"cannot write profiles to {root}: {exc}; the profile is printed above", 1)
            except KeyboardInterrupt:
                return refuse("aborted by a second Ctrl-C; nothing written", 130)
        for path in written:
            console.print(f"wrote {path}", markup=False, highlight=False)
        return 0


def _how_it_ended(result: TuneResult) -> str:
    measured = sum(1 for t in result.trials if t.ok)
    ended = f"stopped: {result.stopped}" if result.stopped else "the search ran to its end"
    return f"{measured} candidate{'s' if measured != 1 else ''} measured, {ended}"


class CtrlC:
    """SIGINT during a tune: the first ends it after the run in progress (the best so far is kept);
    the second aborts it, nothing written.

    The second marks the tune aborted, which the command checks before it writes anything, and
    raises KeyboardInterrupt unless a measurement's event loop is running (that one ends by itself).
    Python runs a signal handler between any two bytecodes, so the interrupt may land in a weakref
    callback or a `__del__`, where Python cannot raise: it prints "Exception ignored ... Traceback"
    and drops it. Such a dropped interrupt is caught on its way to that print and asked for again,
    so it lands in the tune's own flow a moment later, and the command says its one line only.
    """

    def __init__(self, console: object) -> None:
        self._console = console
        self._tuner: Tuner | None = None
        self._presses = 0
        self._previous: object = None
        self._previous_unraisable = sys.unraisablehook

    @property
    def aborted(self) -> bool:
        return self._presses >= 2

    def watch(self, tuner: Tuner) -> None:
        self._tuner = tuner
        if self._presses:  # pressed while the tune was being set up: it stops before it begins
            tuner.stop()

    def __enter__(self) -> CtrlC:
        self._previous = signal.signal(signal.SIGINT, self._pressed)
        self._previous_unraisable, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, *_: object) -> None:
        if self._previous is not None:  # None: the handler was not set from Python; nothing to put back
            signal.signal(signal.SIGINT, self._previous)  # type: ignore[arg-type]
        sys.unraisablehook = self._previous_unraisable

    def _unraisable(self, unraisable: sys.UnraisableHookArgs) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and self.aborted:
            # This handler again, once the main flow has left the callback (a moment later, from another
            # thread: run from here it would raise in this hook, and be dropped again).
            again = threading.Timer(0.01, _thread.interrupt_main, args=(signal.SIGINT,))
            again.daemon = True
            again.start()
            return
        self._previous_unraisable(unraisable)

    def _pressed(self, signum: int, frame: FrameType | None) -> None:
        self._presses += 1
        if self._presses == 1:
            self._console.print("stopping after this run; a second Ctrl-C aborts")  # type: ignore[attr-defined]
            if self._tuner is not None:
                self._tuner.stop()
            return
        if self._tuner is not None:
            self._tuner.stop()
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # loading or grading an engine: stop right here
            raise KeyboardInterrupt from None
        # Inside a measurement's event loop an interrupt would strand its tasks; the measurement
        # ends at once by itself (the tuner is stopping), and the command sees `aborted`.


def tune_with_progress(config: TuneConfig, console: object, ctrl_c: CtrlC | None = None) -> TuneResult:
    """Run a tune under a rich progress bar; `ctrl_c` stops it (first press) or aborts it (second)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("[bold]tune[/]"),
        BarColumn(),
        TimeElapsedColumn(),
        TextColumn("of {task.fields[budget]}"),
        TextColumn("{task.description}"),
        console=console,  # type: ignore[arg-type]
        transient=True,
    ) as progress:
        task = progress.add_task("starting", total=config.budget_s, budget=f"{config.budget_s / 60:g} min")
        tuner: Tuner

        def status(text: str) -> None:
            progress.update(task, completed=min(tuner.elapsed, config.budget_s), description=text[:90])

        def trial_done(trial: Trial, stage: str) -> None:
            progress.update(task, completed=min(tuner.elapsed, config.budget_s))
            progress.console.print(_trial_line(trial, stage))

        tuner = Tuner(config, on_trial=trial_done, on_status=status)
        if ctrl_c is not None:
            ctrl_c.watch(tuner)
        return tuner.run()


def _trial_line(trial: Trial, stage: str) -> str:
    if not trial.measurements:
        return f"  {stage:8} {trial.candidate.engine.label:28} [red]{trial.quality.describe()}[/]"
    if not trial.ok:
        return f"  {stage:8} {trial.candidate.label:62} [red]{trial.measurements[-1].error}[/]"
    mark = "[red]✗ gate[/]" if not trial.quality.passed else "[yellow]~ noisy[/]" if trial.noisy else "[green]✓[/]"
    return f"  {stage:8} {trial.candidate.label:62} {trial.throughput:9.1f}/s  p99 {trial.p99_ms:8.1f} ms  {mark}"


def summary(result: TuneResult) -> str:
    """The default by its median run, noisy or not: the speedup's baseline, as in the profile and the report."""
    chosen, default = result.chosen, result.default
    assert chosen is not None
    runs = len(default.measured)
    # Figures as the profile records them (to 2 places), then shortened: printed from the unrounded value, 368.2500001
    # read 368.3 on the console and 368.2 in the profile (a clean-clone CI run of the tune test).
    default_line = (
        f"default: {default.candidate.label}: {round(default.median_throughput, 2):.1f} inputs/s, "
        f"p99 {default.median_p99_ms:.1f} ms{f' (median of {runs} runs)' if runs > 1 else ''}\n"
    )
    count = len([t for t in result.trials if t.measurements])
    measured = (
        f"{count} candidate{'s' if count != 1 else ''} measured in "
        f"{result.measure_seconds:.0f} s ({result.wall_seconds:.0f} s in all"
        f"{', stopped: ' + result.stopped if result.stopped else ''})"
    )
    if chosen.candidate == default.candidate:  # its own speedup would only say how noisy its runs were
        return f"best: the default settings\n{default_line}{measured}"
    noisy = f", noisy: its worst of {len(chosen.measured)} runs" if chosen.noisy else ""
    return (
        f"chosen: {chosen.candidate.label}: {round(chosen.throughput, 2):.1f} inputs/s, p50 {chosen.p50_ms:.1f} ms, "
        f"p99 {chosen.p99_ms:.1f} ms ({chosen.quality.describe()}{noisy})\n"
        f"{default_line}"
        f"speedup {result.speedup:.2f}x (median runs); {measured}"
    )


def _quiet_libraries() -> None:
    """The tune prints its own progress; library chatter (load reports, quantiser hints) would bury it."""
    logging.basicConfig(level=logging.ERROR)
    for name in ("transformers", "onnxruntime", "torch.onnx", "onnxscript"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except (ImportError, AttributeError):
        pass
