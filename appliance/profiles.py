"""Per-hardware profiles: the tuned runtime, precision, batching and threads of one model on one machine.

A profile is `profiles/<model-slug>/<hardware-slug>.toml`, written by `fleetbox tune`. The one idea
is the selection rule a box applies at start, per model:

1. **exact**: the file for this box's hardware slug (`cpu-<cores>c`, or `nvidia-<gpu>`);
2. **nearest**: a file of the same kind and family: on a CPU, the profile tuned on the closest core
   count (ties go to the smaller machine), its threads (times its concurrent batches) capped at this
   box's cores; on a GPU, one of the same family (`nvidia-h100` for an `nvidia-h200`: the same
   letters before the model number), the closest model number first. A CPU profile never applies
   to a GPU or the reverse: their runtimes and precisions do not carry over (int8 is CPU-only here,
   float16 GPU-only);
3. **default**: the model's own settings (the box's `max_batch_*` defaults, torch, float32).

A model entry with `profile = "off"` keeps its own settings; `profile = "<hardware-slug>"` takes
that file whatever the box runs on. A model with LoRA adapters keeps the torch runtime (adapters
need it); only the profile's batching applies then.
"""

from __future__ import annotations

import logging
import math
import os
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, get_args

from appliance.catalog import Batching, ModelSpec
from appliance.settings import MAX_BATCH_SIZE, MAX_BATCH_TOKENS, MAX_CONCURRENT_BATCHES, MAX_WAIT_MS, Dtype
from runtimes import RuntimeKind, Task
from runtimes.options import ONNX_OPT_LEVELS

log = logging.getLogger(__name__)

PROFILE_AUTO = "auto"
PROFILE_OFF = "off"
# The repository's own profiles/, shipped beside the packages (a source checkout or /src in the image).
SHIPPED_PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"

_KNOBS = (
    "runtime",
    "dtype",
    "max_batch_tokens",
    "max_batch_size",
    "max_wait_ms",
    "concurrent_batches",
    "threads",
    "onnx_opt_level",
)
_TUNABLE_TASKS = (Task.EMBED, Task.SCORE, Task.CLASSIFY, Task.EXTRACT)


def _cpu_cores_of(slug: str) -> int | None:
    match = re.fullmatch(r"cpu-(\d+)c", slug)
    return int(match.group(1)) if match else None


def _gpu_family(slug: str) -> tuple[str, int] | None:
    """`nvidia-h200` -> (`nvidia-h`, 200); `nvidia-rtx-pro-6000` -> (`nvidia-rtx-pro-`, 6000)."""
    match = re.fullmatch(r"(nvidia-[a-z-]*?)(\d+)([a-z0-9-]*)", slug)
    if not match:
        return None
    return match.group(1), int(match.group(2))


# -- the profile file ----------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Profile:
    """The knobs of one model on one hardware slug, and the measured figures that chose them."""

    model: str
    hardware: str
    runtime: str
    dtype: str
    max_batch_tokens: int
    max_batch_size: int
    max_wait_ms: float
    threads: int | None = None
    onnx_opt_level: str | None = None
    concurrent_batches: int = 1  # batches on the device at once, each on `threads` threads
    measured: dict[str, Any] = field(default_factory=dict)  # throughput, p50_ms, p99_ms, quality, date, ...
    rejected: dict[str, str] = field(default_factory=dict)  # candidate -> why the quality gate refused it
    path: Path | None = None

    @property
    def batching(self) -> Batching:
        return Batching(self.max_batch_tokens, self.max_batch_size, self.max_wait_ms, self.concurrent_batches)

    @classmethod
    def read(cls, path: Path) -> Profile:
        record = tomllib.loads(path.read_text())
        try:
            return cls(
                model=str(record["model"]),
                hardware=str(record.get("hardware") or path.stem),
                runtime=RuntimeKind(record["runtime"]).value,
                dtype=str(record["dtype"]),
                max_batch_tokens=int(record["max_batch_tokens"]),
                max_batch_size=int(record["max_batch_size"]),
                max_wait_ms=float(record["max_wait_ms"]),
                threads=int(record["threads"]) if record.get("threads") else None,
                onnx_opt_level=record.get("onnx_opt_level"),
                concurrent_batches=int(record.get("concurrent_batches", 1)),
                measured=dict(record.get("measured") or {}),
                rejected={str(k): str(v) for k, v in (record.get("rejected") or {}).items()},
                path=path,
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"profile {path} is not valid: {exc!r}") from exc

    def problem(self, *, on_cpu: bool) -> str | None:
        """Why a box cannot run this profile, or None: knobs out of the bounds a registration is held to, or a
        precision its runtime or hardware lacks. A file edited by hand (or by an older tune) with
        `max_batch_size = 0` was taken as it was, and every request to the model waited to its deadline (tester
        h72); a float16 ONNX profile on a CPU stopped the box at start."""
        if not (1 <= self.max_batch_tokens <= MAX_BATCH_TOKENS and 1 <= self.max_batch_size <= MAX_BATCH_SIZE):
            return f"max_batch_tokens must be 1 to {MAX_BATCH_TOKENS} and max_batch_size 1 to {MAX_BATCH_SIZE}"
        if not 0 <= self.max_wait_ms <= MAX_WAIT_MS:
            return f"max_wait_ms must be 0 to {MAX_WAIT_MS:g}"
        if not 1 <= self.concurrent_batches <= MAX_CONCURRENT_BATCHES:
            return f"concurrent_batches must be 1 to {MAX_CONCURRENT_BATCHES}"
        if self.threads is not None and self.threads < 1:
            return "threads must be at least 1"
        if self.dtype not in get_args(Dtype):
            return f"dtype {self.dtype!r} is not one of {', '.join(get_args(Dtype))}"
        if self.runtime == RuntimeKind.TORCH.value and self.dtype == "int8":
            return "int8 needs the onnx runtime; torch runs float32, float16 or bfloat16"
        if self.runtime == RuntimeKind.ONNX.value and self.dtype == "bfloat16":
            return "bfloat16 is torch's only; the onnx runtime runs float32, float16 or int8"
        if self.onnx_opt_level is not None and self.onnx_opt_level not in ONNX_OPT_LEVELS:
            return f"onnx_opt_level {self.onnx_opt_level!r} is not one of {', '.join(ONNX_OPT_LEVELS)}"
        if self.runtime == RuntimeKind.ONNX.value and self.dtype == "float16" and on_cpu:
            return "float16 ONNX graphs run on a GPU only"
        if self.runtime == RuntimeKind.ONNX.value and self.dtype == "int8" and not on_cpu:
            return "int8 ONNX graphs run on a CPU only"
        return None

    def to_toml(self) -> str:
        lines = [
            f"# fleetbox profile: {self.model} on {self.hardware}. Written by `fleetbox tune`; see docs/tuning.md.",
            f"model = {_toml(self.model)}",
            f"hardware = {_toml(self.hardware)}",
        ]
        for knob in _KNOBS:
            value = getattr(self, knob)
            if value is not None:
                lines.append(f"{knob} = {_toml(value)}")
        for table, values in (("measured", self.measured), ("rejected", self.rejected)):
            if values:
                lines += ["", f"[{table}]"]
                lines += [f"{_toml_key(k)} = {_toml(v)}" for k, v in values.items() if v is not None]
        return "\n".join(lines) + "\n"

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".toml.tmp")
        temporary.write_text(self.to_toml())
        os.replace(temporary, path)
        return path


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(round(value, 6)) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _toml(key)


def profile_path(root: Path, model_slug: str, hardware: str) -> Path:
    return root / model_slug / f"{hardware}.toml"


# -- choosing one --------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Choice:
    """Which profile a box applies to a model, and why: `exact`, `nearest`, `forced`, `default` or `off`."""

    match: str
    hardware: str  # this box's slug
    profile: Profile | None = None

    def describe(self, spec: ModelSpec) -> dict[str, Any]:
        """What GET /v1/models shows: the match, which profile, and the settings the model runs with.

        The profile is named as under a profiles folder (`<model-slug>/<hardware-slug>`), never by its path:
        where a box keeps its files is none of an API client's business (the `profile chosen` log says it).
        """
        return {
            "match": self.match,
            "hardware": self.hardware,
            "profile_hardware": self.profile.hardware if self.profile else None,
            "name": self.name,
            "tuned": self.profile is not None,
            "runtime": spec.runtime.value,
            "dtype": spec.dtype,
            "max_batch_tokens": spec.batching.max_batch_tokens,
            "max_batch_size": spec.batching.max_batch_size,
            "max_wait_ms": spec.batching.max_wait_ms,
            "concurrent_batches": spec.batching.concurrent_batches,
            "threads": spec.threads,
        }

    @property
    def name(self) -> str | None:
        if self.profile is None:
            return None
        if self.profile.path is None:
            return f"{self.profile.model}/{self.profile.hardware}"
        return f"{self.profile.path.parent.name}/{self.profile.path.stem}"


def available(roots: list[Path], model_slug: str) -> dict[str, list[Path]]:
    """Hardware slug -> profile files for one model, an earlier root's first (it wins, if it is usable)."""
    found: dict[str, list[Path]] = {}
    for root in roots:
        folder = root / model_slug
        if folder.is_dir():
            for path in sorted(folder.glob("*.toml")):
                found.setdefault(path.stem, []).append(path)
    return found


def nearest_hardware(hardware: str, candidates: list[str]) -> str | None:
    """The closest hardware slug of the same kind and family, or None (see the module docstring)."""
    cores = _cpu_cores_of(hardware)
    if cores is not None:
        cpus = [(c, n) for c in candidates if (n := _cpu_cores_of(c)) is not None]
        if not cpus:
            return None
        return min(cpus, key=lambda item: (abs(math.log(item[1] / cores)), item[1]))[0]
    family = _gpu_family(hardware)
    if family is None:
        return None
    same = [(c, f[1]) for c in candidates if (f := _gpu_family(c)) is not None and f[0] == family[0]]
    if not same:
        return None
    return min(same, key=lambda item: (abs(item[1] - family[1]), item[1]))[0]


def choose(model_slug: str, hardware: str, roots: list[Path], wanted: str = PROFILE_AUTO) -> Choice:
    """The profile for a model on this hardware: exact, else nearest, else none (the defaults)."""
    if wanted == PROFILE_OFF:
        return Choice(PROFILE_OFF, hardware)
    files = available(roots, model_slug)
    if wanted != PROFILE_AUTO:
        if wanted not in files:
            log.warning("forced profile missing; using defaults", extra={"model": model_slug, "profile": wanted})
            return Choice("default", hardware)
        return _first_usable("forced", hardware, files[wanted])
    if hardware in files:
        return _first_usable("exact", hardware, files[hardware])
    near = nearest_hardware(hardware, list(files))
    if near is not None:
        return _first_usable("nearest", hardware, files[near])
    return Choice("default", hardware)


def _first_usable(match: str, hardware: str, paths: list[Path]) -> Choice:
    """The first of one hardware's profile files (an earlier root's first) a box can run, else the defaults: an
    operator's broken file in `profiles_dir` gave way to the defaults, not to the shipped profile beside it."""
    for path in paths:
        try:
            profile = Profile.read(path)
        except (OSError, ValueError) as exc:  # a broken file must not stop a box
            log.warning("profile unreadable; not applied", extra={"file": str(path), "error": repr(exc)})
            continue
        problem = profile.problem(on_cpu=_cpu_cores_of(hardware) is not None)
        if problem is not None:
            log.warning("profile not usable here; not applied", extra={"file": str(path), "error": problem})
            continue
        return Choice(match, hardware, profile)
    return Choice("default", hardware)


def apply(spec: ModelSpec, choice: Choice, *, cores: int | None = None, has_adapters: bool = False) -> ModelSpec:
    """The spec with the chosen profile's knobs; unchanged for the defaults or a model no profile fits."""
    profile = choice.profile
    if profile is None or not tunable(spec):
        return spec
    threads, batching = profile.threads, profile.batching
    if threads is not None and cores is not None and _cpu_cores_of(choice.hardware) is not None:
        # A nearest profile from a bigger machine: no more threads than this box has cores, in all.
        threads = min(threads, cores)
        batching = replace(batching, concurrent_batches=max(1, min(batching.concurrent_batches, cores // threads)))
    updated = replace(spec, batching=batching, threads=threads)
    if has_adapters and profile.runtime != RuntimeKind.TORCH.value:
        return updated  # LoRA adapters need the torch runtime: keep the model's own runtime and dtype
    options = {k: v for k, v in spec.options.items() if k != "onnx_opt_level"}
    if profile.onnx_opt_level:
        options["onnx_opt_level"] = profile.onnx_opt_level
    return replace(updated, runtime=RuntimeKind(profile.runtime), dtype=profile.dtype, options=options)


def tunable(spec: ModelSpec) -> bool:
    """Encoder models on torch or ONNX; not the no-op runtime, generation, or a shipped ONNX file."""
    return (
        spec.task in _TUNABLE_TASKS
        and spec.runtime in (RuntimeKind.TORCH, RuntimeKind.ONNX)
        and not spec.options.get("onnx_file")
        and spec.adapter_of is None
    )


class ProfileBook:
    """One box's profile choices: chosen once per model, logged once, shown in GET /v1/models.

    `threads` is the box's own setting: it wins over a profile's at the load (`ModelSpec.source`), so the
    specs this book hands out carry it, and the log and the record say the threads the model runs with.
    """

    def __init__(self, hardware: str, roots: list[Path], cores: int | None = None, threads: int | None = None) -> None:
        self.hardware = hardware
        self.roots = roots
        self.cores = cores
        self.threads = threads
        self._chosen: dict[str, tuple[Choice, ModelSpec]] = {}  # applied at a load
        self._previews: dict[tuple[str, str], Choice] = {}  # looked up for GET /v1/models, read once

    def apply(self, spec: ModelSpec, has_adapters: bool = False) -> ModelSpec:
        choice = choose(spec.slug, self.hardware, self.roots, spec.profile) if tunable(spec) else None
        if choice is None:
            return spec
        applied = self._applied(spec, choice, has_adapters)
        previous = self._chosen.get(spec.name)
        self._chosen[spec.name] = (choice, applied)
        if previous is None or previous[0] != choice:
            log.info(
                "profile chosen",
                extra={
                    "model": spec.name,
                    "hardware": self.hardware,
                    "match": choice.match,
                    "file": str(choice.profile.path) if choice.profile else None,
                    "runtime": applied.runtime.value,
                    "dtype": applied.dtype,
                    "batching": f"{applied.batching.max_batch_tokens}/{applied.batching.max_batch_size}"
                    f"/{applied.batching.max_wait_ms}ms x{applied.batching.concurrent_batches}",
                    "threads": applied.threads,
                },
            )
        return applied

    def describe(self, spec: ModelSpec, has_adapters: bool = False) -> dict[str, Any] | None:
        """The choice applied to a model on this box, or the one a load would make; None if none fits.

        `has_adapters` as for `apply`: a base with LoRA adapters keeps torch, and the preview must say so.
        """
        if not tunable(spec):
            return None
        chosen = self._chosen.get(spec.name)
        if chosen is not None:  # what runs, with the batching `spec` gets (a PATCH's answer: before it is applied)
            batching = self._applied(spec, chosen[0], has_adapters).batching
            return chosen[0].describe(replace(chosen[1], batching=batching))
        key = (spec.slug, spec.profile)
        if key not in self._previews:
            self._previews[key] = choose(spec.slug, self.hardware, self.roots, spec.profile)
        choice = self._previews[key]
        return choice.describe(self._applied(spec, choice, has_adapters))

    def _applied(self, spec: ModelSpec, choice: Choice, has_adapters: bool) -> ModelSpec:
        applied = apply(spec, choice, cores=self.cores, has_adapters=has_adapters)
        return applied if self.threads is None else replace(applied, threads=self.threads)
