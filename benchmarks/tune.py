"""Tuning (issue 4): the default settings vs `fleetbox tune`'s choice vs the best of the whole grid.

One command, one run, the default model, one space for both searches:

  1. the tuner (`Tuner.run("search")`: screen, halve, coordinate descent, confirm) over the space;
  2. every candidate of the same space (`Tuner.run("grid")`), engines that fail the quality gate
     skipped after their first candidate, as the tuner skips them;
  3. default, tuned and grid-best measured again, in turns (round-robin, so a noisy neighbour hurts
     all three alike), at the tuner's load, and their throughput at the p99 SLO: the most inputs/s
     over a sweep of closed-loop concurrencies whose p99 stays within the SLO;
  4. torch fp32 vs ONNX fp32 vs ONNX int8 inputs/s at the tuned batching and threads, in turns,
     with int8's quality against fp32.

Targets (issue 4): tuned ≥ 1.25× default at the SLO, within 5% of the grid's best, found in ≤ 30%
of the grid's measuring time.

    python benchmarks/tune.py [--device cpu|cuda] [--quick] [--slo-p99-ms X] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from appliance import __version__  # noqa: E402
from appliance.catalog import DEFAULT_MODEL_NAME, default_batching, default_model_path  # noqa: E402
from appliance.devices import cpu_cores, device_description, hardware_slug  # noqa: E402
from appliance.settings import Settings  # noqa: E402
from appliance.tune import DEFAULT_ENGINE, TuneConfig, Tuner, TuneResult  # noqa: E402
from appliance.tune_cli import _quiet_libraries, default_load  # noqa: E402
from appliance.tune_load import Load, Measurement, make_requests, measure  # noqa: E402
from appliance.tune_quality import Reference  # noqa: E402
from appliance.tune_search import Candidate, Engine, Objective, Space, default_space  # noqa: E402
from runtimes import ModelSource, Runtime, RuntimeKind, Task, load_runtime  # noqa: E402

console = Console(stderr=True)


def benchmark_space(device: str, quick: bool) -> Space:
    """The space both searches run over: the tuner's quick space, or a smaller one for `--quick`."""
    space = default_space(device, cpu_cores(), quick=True)
    if not quick:
        return space
    if device.startswith("cuda"):
        return Space(space.engines, (8192, 32768), (64, 256), (0.0, 2.0))
    return Space(space.engines, (2048, 16384), (16, 256), (0.0, 2.0))


@dataclass(slots=True)
class Contender:
    label: str
    candidate: Candidate
    runtime: Runtime | None = None


def load_engine(engine: Engine, model: Path, device: str, cache_dir: Path) -> Runtime:
    options: dict[str, Any] = {"cache_dir": str(cache_dir)}
    if engine.onnx_opt_level:
        options["onnx_opt_level"] = engine.onnx_opt_level
    source = ModelSource(model, Task.EMBED, RuntimeKind(engine.runtime), device, engine.dtype, engine.threads, options)
    return load_runtime(source)


def in_turns(
    contenders: list[Contender], load: Load, rounds: int, requests: list, default_threads: int
) -> dict[str, list[Measurement]]:
    """Each contender measured `rounds` times, round-robin."""
    import torch

    results: dict[str, list[Measurement]] = {c.label: [] for c in contenders}
    for _ in range(rounds):
        for c in contenders:
            if c.candidate.engine.runtime == "torch":
                torch.set_num_threads(c.candidate.engine.threads or default_threads)
            assert c.runtime is not None
            results[c.label].append(measure(c.runtime, c.candidate.batching, requests, load))
    return results


def at_slo(
    contenders: list[Contender], load: Load, slo_ms: float, levels: list[int], requests: list, default_threads: int
) -> dict[str, dict[str, Any]]:
    """The most inputs/s with p99 within the SLO over a sweep of concurrencies (each level in turns).

    A contender past the SLO at two levels in a row is not driven harder: in a closed loop, more
    clients only lengthen the queue (one breach may be a noisy neighbour)."""
    empty = {"throughput": 0.0, "concurrency": None, "p99_ms": None}
    best: dict[str, dict[str, Any]] = {c.label: dict(empty) for c in contenders}
    breaches = {c.label: 0 for c in contenders}
    for level in levels:
        within = [c for c in contenders if breaches[c.label] < 2]
        if not within:
            break
        readings = in_turns(within, replace(load, concurrency=level), 1, requests, default_threads)
        for label, (m,) in readings.items():
            if m.ok and m.p99_ms <= slo_ms:
                breaches[label] = 0
                if m.throughput > best[label]["throughput"]:
                    best[label] = {"throughput": m.throughput, "concurrency": level, "p99_ms": m.p99_ms}
            else:
                breaches[label] += 1
    return best


def median(ms: list[Measurement], field: str) -> float:
    values = [getattr(m, field) for m in ms if m.ok]
    return float(np.median(values)) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--quick", action="store_true", help="a 2x2x2 batching space and fewer repeats (~5 min)")
    parser.add_argument("--slo-p99-ms", type=float, default=None, help="default: 1000 on CPU, 100 on GPU")
    parser.add_argument("--window-s", type=float, default=None, help="seconds per measured window, at least")
    parser.add_argument("--concurrency", type=int, default=None, help="the fixed load [tuner's default; 8 --quick]")
    parser.add_argument("--cache-dir", type=Path, default=Path(".fleetbox/onnx"), help="ONNX export cache")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--model", type=Path, default=None, help="an embedding model folder [the default model]")
    args = parser.parse_args()
    _quiet_libraries()
    import torch

    default_threads = torch.get_num_threads()
    device = args.device
    gpu = device.startswith("cuda")
    slo = args.slo_p99_ms or (100.0 if gpu else 1000.0)
    space = benchmark_space(device, args.quick)
    concurrency = args.concurrency or (8 if args.quick and not gpu else None)
    load = default_load(device, "throughput", concurrency, args.window_s or (0.5 if args.quick else None))
    objective = Objective("throughput", slo)
    model = args.model or default_model_path()
    config = TuneConfig(
        name=DEFAULT_MODEL_NAME if args.model is None else args.model.name,
        path=model,
        task=Task.EMBED,
        space=space,
        default_batching=default_batching(Settings()),  # what a box runs with when no profile applies
        device=device,
        budget_s=3600.0,  # the tuner's own stopping rule decides; the grid must finish
        objective=objective,
        load=load,
        cache_dir=args.cache_dir,
    )
    hardware = hardware_slug(device)
    grid_size = len(space.engines) * len(space.batchings)
    console.print(f"[bold]tune benchmark[/] on {device_description(device)} ({hardware}); space {grid_size} candidates")

    console.print("1/4 the tuner")
    tuned = Tuner(config, on_trial=_print_trial).run("search")
    console.print(f"   chose {_label(tuned)} in {tuned.measure_seconds:.0f} s of measuring")
    console.print("2/4 the grid")
    grid = Tuner(_no_rejected(config), on_trial=_print_trial).run("grid")
    console.print(f"   best {_label(grid)} in {grid.measure_seconds:.0f} s of measuring")
    assert tuned.chosen is not None and grid.chosen is not None

    requests = None
    contenders = [
        Contender("default", Candidate(DEFAULT_ENGINE, config.default_batching)),
        Contender("tuned", tuned.chosen.candidate),
        Contender("grid best", grid.chosen.candidate),
    ]
    runtimes: dict[Engine, Runtime] = {}
    for c in contenders:
        if c.candidate.engine not in runtimes:
            runtimes[c.candidate.engine] = load_engine(c.candidate.engine, model, device, args.cache_dir)
        c.runtime = runtimes[c.candidate.engine]
    requests = make_requests(runtimes[DEFAULT_ENGINE], Task.EMBED, load.requests, load.seed)
    rounds = 2 if args.quick else 3
    console.print(f"3/4 default vs tuned vs grid best, {rounds} rounds in turns, then a concurrency sweep at the SLO")
    fixed = in_turns(contenders, load, rounds, requests, default_threads)
    levels = [1, 2, 4, 8, 16, 32] if not gpu else [1, 8, 32, 64, 128, 256]
    sweep = at_slo(contenders, load, slo, levels, requests, default_threads)

    console.print("4/4 torch vs ONNX fp32 vs ONNX int8")
    t = tuned.chosen.candidate
    threads = t.engine.threads
    engines = [Engine("torch", "float32", threads), Engine("onnx", "float32", threads, "all")]
    if gpu:
        engines.append(Engine("onnx", "float16", threads, "all"))
    else:
        engines.append(Engine("onnx", "int8", threads, "all"))
    kinds = [Contender(e.label, Candidate(e, t.batching)) for e in engines]
    for c in kinds:
        engine = c.candidate.engine
        c.runtime = runtimes.get(engine) or load_engine(engine, model, device, args.cache_dir)
        runtimes[engine] = c.runtime
    reference = Reference.build(runtimes[DEFAULT_ENGINE], Task.EMBED)
    quality = {c.label: reference.check(c.runtime).describe() for c in kinds if c.runtime is not None}
    by_kind = in_turns(kinds, load, rounds, requests, default_threads)

    figures = {
        "date": datetime.date.today().isoformat(),
        "fleetbox_version": __version__,
        "device": device_description(device),
        "hardware": hardware,
        "quick": args.quick,
        "slo_p99_ms": slo,
        "concurrency": load.concurrency,
        "grid_size": grid_size,
        "default": contenders[0].candidate.label,
        "tuner": {
            "chosen": tuned.chosen.candidate.label,
            "measured": sum(1 for x in tuned.trials if x.measurements),
            "measure_s": round(tuned.measure_seconds, 1),
            "wall_s": round(tuned.wall_seconds, 1),
        },
        "grid": {
            "best": grid.chosen.candidate.label,
            "measured": sum(1 for x in grid.trials if x.measurements),
            "measure_s": round(grid.measure_seconds, 1),
            "wall_s": round(grid.wall_seconds, 1),
        },
        "fixed_load": {
            label: {"throughput": median(ms, "throughput"), "p99_ms": median(ms, "p99_ms")}
            for label, ms in fixed.items()
        },
        "at_slo": sweep,
        "engines": {
            label: {"throughput": median(ms, "throughput"), "p99_ms": median(ms, "p99_ms"), "quality": quality[label]}
            for label, ms in by_kind.items()
        },
    }
    d, tu, g = (sweep[k]["throughput"] for k in ("default", "tuned", "grid best"))
    figures["ratios"] = {
        "tuned_vs_default_at_slo": tu / d if d else float("inf"),
        "tuned_vs_grid_at_slo": tu / g if g else float("nan"),
        "tuned_vs_default_fixed": figures["fixed_load"]["tuned"]["throughput"]
        / figures["fixed_load"]["default"]["throughput"],
        "tuned_vs_grid_fixed": figures["fixed_load"]["tuned"]["throughput"]
        / figures["fixed_load"]["grid best"]["throughput"],
        "tuner_vs_grid_measuring_time": tuned.measure_seconds / grid.measure_seconds,
    }
    print(markdown(figures))
    if args.json:
        args.json.write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    return 0


def _no_rejected(config: TuneConfig) -> TuneConfig:
    return replace(config, measure_rejected=False)


def _label(result: TuneResult) -> str:
    return result.chosen.candidate.label if result.chosen else "nothing"


def _print_trial(trial: Any, stage: str) -> None:
    if trial.measurements:
        line = f"{stage:8} {trial.candidate.label:62} {trial.throughput:8.1f}/s p99 {trial.p99_ms:7.1f}"
        console.print("   " + line)


def markdown(f: dict[str, Any]) -> str:
    r = f["ratios"]
    lines = [
        f"{f['date']}, fleetbox {f['fleetbox_version']}, {f['device']} (`{f['hardware']}`), "
        f"{'--quick, ' if f['quick'] else ''}p99 SLO {f['slo_p99_ms']:g} ms, fixed load {f['concurrency']} clients, "
        f"space of {f['grid_size']} candidates.",
        "",
        "| settings | candidate | inputs/s at fixed load | p99 ms | inputs/s within SLO | at concurrency | p99 ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    names = {"default": f["default"], "tuned": f["tuner"]["chosen"], "grid best": f["grid"]["best"]}
    for label in ("default", "tuned", "grid best"):
        fixed, slo = f["fixed_load"][label], f["at_slo"][label]
        lines.append(
            f"| {label} | {names[label]} | "
            f"{fixed['throughput']:.1f} | {fixed['p99_ms']:.0f} | {slo['throughput']:.1f} | {slo['concurrency']} | "
            f"{slo['p99_ms'] if slo['p99_ms'] is None else round(slo['p99_ms'])} |"
        )
    lines += [
        "",
        "| search | candidates measured | measuring time (s) | wall time (s) |",
        "| --- | --- | --- | --- |",
        f"| tuner | {f['tuner']['measured']} | {f['tuner']['measure_s']} | {f['tuner']['wall_s']} |",
        f"| grid | {f['grid']['measured']} | {f['grid']['measure_s']} | {f['grid']['wall_s']} |",
        "",
        f"- tuned / default within the SLO: **{r['tuned_vs_default_at_slo']:.2f}×** (target ≥ 1.25×); "
        f"at the fixed load: {r['tuned_vs_default_fixed']:.2f}×",
        f"- tuned / grid best within the SLO: **{r['tuned_vs_grid_at_slo']:.2f}** (target ≥ 0.95); "
        f"at the fixed load: {r['tuned_vs_grid_fixed']:.2f}",
        f"- tuner's measuring time / grid's: **{r['tuner_vs_grid_measuring_time']:.0%}** (target ≤ 30%)",
        "",
        "| engine (tuned batching and threads) | inputs/s | p99 ms | quality vs fp32 torch |",
        "| --- | --- | --- | --- |",
    ]
    for label, e in f["engines"].items():
        lines.append(f"| {label} | {e['throughput']:.1f} | {e['p99_ms']:.0f} | {e['quality']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
