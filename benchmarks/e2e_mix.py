"""A request mix end to end under several tuning-profile folders, side by side (docs/tuning.md).

`fleetbox tune` measures in-process, without the HTTP, JSON and NATS work a box does on the same
cores. This sends requests of the tuner's mix (or `--inputs FILE`, read as `fleetbox tune --inputs`
reads it) over HTTP to `fleetbox serve` with the default model, once per profile folder and
concurrency, in turns, so an operator can check the tuner's pick against an alternative on the
serving path. `shipped` names the profiles shipped with fleetbox.

    python benchmarks/e2e_mix.py shipped /path/to/profiles [--inputs FILE] [--concurrency 16 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import orjson
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))  # e2e_embed, which puts the repository on the path
from e2e_embed import EMBED_MODEL, LoadGenerator, served_box

from appliance.tune_load import mix, read_sample
from runtimes import Task

SHIPPED = "shipped"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", help=f"profile folders (FBX_PROFILES_DIR), or {SHIPPED!r}")
    parser.add_argument("--inputs", type=Path, help="requests of your own traffic (as `fleetbox tune --inputs`)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=1500, help="per phase, the first 200 of them a warm-up")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 140)

    sample = read_sample(args.inputs, Task.EMBED) if args.inputs else None
    requests = mix(Task.EMBED, args.requests, seed=0, sample=sample)
    bodies = [orjson.dumps({"input": list(request), "model": EMBED_MODEL}) for request in requests]
    counts = [len(request) for request in requests]
    warm, measured = (bodies[:200], counts[:200]), (bodies[200:], counts[200:])
    load = LoadGenerator(1)
    results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    workdir = Path(tempfile.mkdtemp(prefix="fbx-mix-"))
    errors = 0
    try:
        for round_ in range(args.rounds):
            for index, folder in enumerate(args.folders):
                if folder == SHIPPED:
                    os.environ.pop("FBX_PROFILES_DIR", None)
                else:
                    os.environ["FBX_PROFILES_DIR"] = str(Path(folder).resolve())
                with served_box(args.device, workdir, f"r{round_}-{index}") as box:
                    for concurrency in args.concurrency:
                        phase = load.phase(box, measured, concurrency, warm)
                        errors += phase.errors
                        rate = phase.inputs / phase.seconds
                        results.setdefault((folder, concurrency), []).append((rate, phase.p50_ms, phase.p99_ms))
                        console.print(
                            f"    round {round_ + 1}, {folder}, c={concurrency}: {rate:,.0f} inputs/s, "
                            f"errors {phase.errors} {phase.error_samples[:1]}"
                        )
    finally:
        load.close()

    what = f"--inputs {args.inputs.name}" if args.inputs else "the tuner's mix"
    table = Table(title=f"Request mix end to end ({what})")
    for column in ("profiles", "clients", "inputs/s, each round", "median p50 ms", "median p99 ms", "vs first"):
        table.add_column(column, justify="left" if column == "profiles" else "right")
    for concurrency in args.concurrency:
        first = statistics.median(r[0] for r in results[(args.folders[0], concurrency)])
        for folder in args.folders:
            runs = results[(folder, concurrency)]
            rate = statistics.median(r[0] for r in runs)
            table.add_row(
                folder, str(concurrency), ", ".join(f"{r[0]:,.0f}" for r in runs),
                f"{statistics.median(r[1] for r in runs):.0f}", f"{statistics.median(r[2] for r in runs):.0f}",
                f"{rate / first:.2f}",
            )  # fmt: skip
    console.print(table)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
