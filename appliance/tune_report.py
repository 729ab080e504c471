"""What a tune leaves behind: `<hw>.toml` (the profile a box applies), `<hw>.md` and `<hw>.png` beside it.

The one idea: a profile is only as trustworthy as the evidence next to it, so the report shows
every candidate measured (not just the winner), the quality verdict of every engine, the default it
is compared with, and how the figures were taken; the plot puts throughput against p99 for all
of them with the chosen and the default marked.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from appliance.profiles import profile_path
from appliance.tune import TuneResult
from appliance.tune_load import Load
from appliance.tune_search import Trial


def write_outputs(result: TuneResult, root: Path, note: str | None = None, command: str | None = None) -> list[Path]:
    """Write the profile, its report and its plot under `root/<model-slug>/`; returns the paths.

    All or nothing: all three are written beside their places first, then moved in (renames, the
    profile, which a box applies, last), so a write cut short (a second Ctrl-C, a full disk) leaves
    what was there before.
    """
    toml = profile_path(root, result.slug, result.hardware)
    png, md = toml.with_suffix(".png"), toml.with_suffix(".md")
    drafts = {final: final.with_name(f".{final.name}.tmp") for final in (png, md, toml)}
    folder_was_there = toml.parent.is_dir()
    try:
        toml.parent.mkdir(parents=True, exist_ok=True)
        plot(result, drafts[png])
        drafts[md].write_text(report(result, png.name, note, command))
        drafts[toml].write_text(result.profile(note).to_toml())
        for final, draft in drafts.items():
            os.replace(draft, final)
    except BaseException:
        for draft in drafts.values():
            draft.unlink(missing_ok=True)
        if not folder_was_there and toml.parent.is_dir() and not any(toml.parent.iterdir()):
            toml.parent.rmdir()
        raise
    return [toml, md, png]


@contextlib.contextmanager
def writable_folder(root: Path) -> Iterator[None]:
    """`check_writable(root)` now, and the folders it made taken away again at the end if they are still empty:
    a tune that fails, is aborted or finds nothing worth writing leaves no empty folder behind."""
    made = check_writable(root)
    try:
        yield
    finally:
        if made is not None:
            remove_if_empty(root, made)


def check_writable(root: Path) -> Path | None:
    """Create `root` if missing and prove a file can be written in it; raises OSError saying why not.

    Checked before a tune starts, so that a folder that cannot take the results does not cost the
    whole tune. Returns the outermost folder it made (None: `root` was there).
    """
    import errno
    import tempfile

    if root.exists() and not root.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "it is a file, not a folder", str(root))
    missing = [folder for folder in (root, *root.parents) if not folder.exists()]
    made = missing[-1] if missing else None
    root.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError:
        if made is not None:
            remove_if_empty(root, made)
        raise
    return made


def remove_if_empty(root: Path, made: Path) -> None:
    """Remove `root` and its parents up to `made`, innermost first, as long as each is empty."""
    for folder in (root, *root.parents):
        try:
            folder.rmdir()
        except OSError:  # not empty (a profile was written there, or by another hand), or gone already
            return
        if folder == made:
            return


def better_profile_there(result: TuneResult, root: Path) -> tuple[Path, float] | None:
    """The profile this tune would replace and its recorded speedup, when that is higher than this tune's.

    A short or unlucky tune must not silently replace a better profile (a 0.01-minute tune replaced a
    committed 7.9x ONNX profile with the defaults). An unreadable file, or one without a speedup, is replaced.
    """
    import tomllib

    path = profile_path(root, result.slug, result.hardware)
    try:
        recorded = tomllib.loads(path.read_text()).get("measured", {}).get("speedup")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(recorded, int | float) and math.isfinite(recorded) and recorded > round(result.speedup, 3):
        return path, float(recorded)
    return None


def plot(result: TuneResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    groups: dict[str, list[Trial]] = {"passed the gate": [], "noisy (worst run shown)": [], "failed the gate": []}
    for trial in result.trials:
        if not trial.ok:
            continue
        if not trial.quality.passed:
            groups["failed the gate"].append(trial)
        elif trial.noisy:
            groups["noisy (worst run shown)"].append(trial)
        else:
            groups["passed the gate"].append(trial)
    styles = {
        "passed the gate": {"marker": "o", "color": "tab:blue", "alpha": 0.7},
        "noisy (worst run shown)": {"marker": "o", "facecolors": "none", "edgecolors": "tab:gray"},
        "failed the gate": {"marker": "x", "color": "tab:red"},
    }
    for label, trials in groups.items():
        if trials:
            ax.scatter([t.p99_ms for t in trials], [t.throughput for t in trials], label=label, s=30, **styles[label])
    d = result.default
    if d.ok:  # its median run, as in the report's table: the baseline is not judged by its worst minute
        ax.scatter([d.median_p99_ms], [d.median_throughput], marker="s", s=110, color="black", label="default")
    if result.chosen is not None and result.chosen.ok:
        c = result.chosen
        ax.scatter([c.p99_ms], [c.throughput], marker="*", s=260, color="tab:green", label="chosen", zorder=6)
        ax.annotate(c.candidate.label, (c.p99_ms, c.throughput), fontsize=7, xytext=(6, 6), textcoords="offset points")
    slo = result.config.objective.slo_p99_ms
    if slo is not None:
        ax.axvline(slo, color="tab:orange", linestyle="--", label=f"p99 SLO {slo:g} ms")
    ax.set_xscale("log")
    ax.set_xlabel("p99 request latency (ms, log scale)")
    ax.set_ylabel("throughput (inputs/s)")
    ax.set_title(f"{result.config.name} on {result.hardware}: every candidate tried", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def report(result: TuneResult, png_name: str, note: str | None = None, command: str | None = None) -> str:
    c = result.config
    profile = result.profile(note)
    m = profile.measured
    load = c.load
    slo = f"p99 ≤ {c.objective.slo_p99_ms:g} ms" if c.objective.slo_p99_ms is not None else "no p99 SLO"
    lines = [
        f"# {c.name} on {result.hardware}",
        "",
        f"Tuned by `{command or 'fleetbox tune'}` (fleetbox {m['fleetbox_version']}) on {m['date']}, "
        f"on {result.device_name}, device `{c.device}`.",
        "",
        f"- **Objective**: {c.objective.kind}, {slo}.",
        f"- **Load**: closed loop, {load.concurrency} clients, {_load_text(load)}, tokenised by the model's "
        "own tokenizer, run through the real batcher and runtime.",
        f"- **Each measurement**: a warm-up of at least {load.warmup_s:g} s (until every client has had an answer), "
        f"then {load.windows} windows of at least {load.window_s:g} s (and three typical request latencies); "
        "throughput is the inputs answered over all windows. A run whose windows disagree by more than "
        f"{c.max_spread:.0%} is run again, and a candidate whose runs disagree by more is marked noisy and "
        "scored by its worst run.",
        f"- **Quality gate** against fp32 torch on held-out inputs: {_gate_text(result)}.",
        f"- **Search**: measured {m['candidates_measured']} candidates of a {m['grid_size']}-candidate grid in "
        f"{m['measure_seconds']} s of measuring ({m['search_seconds']} s in all, budget {m['budget_minutes']} min); "
        f"{'stopped: ' + str(result.stopped) if result.stopped else 'the search ran to its end'}.",
    ]
    if note:
        lines += ["", f"> {note}"]
    lines += [
        "",
        "## Result",
        "",
        "| | runtime | dtype | threads | max_batch_tokens | max_batch_size | max_wait_ms | inputs/s | p50 ms | p99 ms |"
        " quality |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        _result_row("default", result.default, median=True),
    ]
    if result.chosen is not None:
        lines.append(_result_row("**chosen**", result.chosen))
        lines += [
            "",
            f"The chosen settings give **{result.speedup:.2f}×** the default's throughput under the same load "
            "(median runs of both)"
            + ("" if m["slo_met"] else f" (no candidate met {slo}; the lowest p99 was chosen)")
            + ".",
        ]
    else:
        lines += ["", "No candidate passed the quality gate with a measurement: no profile is worth writing."]
    lines += ["", f"![throughput against p99 for every candidate]({png_name})", "", "## Quality gate, per engine", ""]
    lines += ["| engine | verdict |", "| --- | --- |"]
    for engine, quality in sorted(result.engine_quality.items(), key=lambda item: item[0].label):
        verdict = "passed" if quality.passed else "**rejected**"
        lines.append(f"| {engine.label} | {verdict}: {quality.describe()} |")
    lines += ["", "## Every candidate measured", ""]
    lines += ["| stage | candidate | inputs/s | p50 ms | p99 ms | runs | window spread | notes |"]
    lines += ["| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for trial in sorted(result.trials, key=lambda t: -t.throughput):
        if not trial.measurements:
            continue
        notes = []
        if not trial.quality.passed:
            notes.append("failed the gate")
        if trial.noisy:
            notes.append("noisy: worst run")
        if trial is result.chosen:
            notes.append("**chosen**")
        if trial is result.default:
            notes.append("default")
        spread = max((x.spread for x in trial.measured), default=math.inf)
        lines.append(
            f"| {trial.stage} | {trial.candidate.label} | {trial.throughput:.1f} | {_ms(trial.p50_ms)} | "
            f"{_ms(trial.p99_ms)} | {len(trial.measurements)} | {spread:.0%} | {', '.join(notes)} |"
        )
    return "\n".join(lines) + "\n"


def _gate_text(result: TuneResult) -> str:
    from appliance.tune_quality import GATES

    metric, limit = GATES[result.config.task]
    return f"{metric} ≥ {limit:g}"


def _load_text(load: Load) -> str:
    if load.sample is None:
        return "each request 1–8 inputs of a seeded log-normal spread of lengths (median 14 words, up to 300)"
    return f"each request one of {load.described} (drawn at random, seeded)"


def _result_row(label: str, trial: Trial, median: bool = False) -> str:
    """One row of the result table; `median`: the median run even when noisy (the baseline)."""
    e, b = trial.candidate.engine, trial.candidate.batching
    runs = trial.measured
    if median and runs:
        throughput = trial.median_throughput
        p50, p99 = float(np.median([m.p50_ms for m in runs])), trial.median_p99_ms
    else:
        throughput, p50, p99 = trial.throughput, trial.p50_ms, trial.p99_ms
    threads = f"{e.threads or 'default'}" + (f" × {e.concurrent_batches} batches" if e.concurrent_batches > 1 else "")
    return (
        f"| {label} | {e.runtime} | {e.dtype} | {threads} | {b.max_batch_tokens} | {b.max_batch_size} | "
        f"{b.max_wait_ms:g} | {throughput:.1f} | {_ms(p50)} | {_ms(p99)} | {trial.quality.describe()} |"
    )


def _ms(value: float) -> str:
    return f"{value:.1f}" if math.isfinite(value) else "-"
