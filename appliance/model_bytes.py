"""What a model takes on a device before it is measured, and the box's memory budget: the numbers the residency's
eviction rule weighs (`residency.py`) and its refusals say.

The one idea: a model's estimate is the weight files its load will read (not every weight file in its folder:
repositories ship several formats side by side), scaled by the dtype it loads as, plus an allowance for activations
until its warm-up measures them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from appliance.catalog import ModelSpec
from appliance.settings import memory_budget_bytes
from runtimes import RuntimeKind
from runtimes.base import SAFETENSORS_INDEX, safetensors_files, shipped_onnx

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".onnx")  # in the order a load prefers them
_DTYPE_SCALE = {"float32": 1.0, "float16": 0.5, "bfloat16": 0.5, "int8": 0.25}
_ACTIVATION_ALLOWANCE = 1.25  # until measured, assume activations add a quarter of the weights


def parse_budget(raw: str | None, device: str) -> int:
    """The box's memory budget in bytes (`Settings.memory_budget`); None: 90% of a GPU, half the RAM."""
    total = device_memory(device)
    if raw is None:
        return int(total * (0.9 if device.startswith("cuda") else 0.5))
    return memory_budget_bytes(raw, total)


def device_memory(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def estimate_bytes(spec: ModelSpec) -> int:
    """What a model will take before it is measured: its weight files, scaled by dtype, plus an allowance."""
    if spec.runtime is RuntimeKind.NOOP:
        return int(spec.options.get("bytes", 0))
    files = _weight_files(spec)
    weights = sum(f.stat().st_size for f in files) * _DTYPE_SCALE.get(spec.dtype, 1.0)
    return int(weights * _ACTIVATION_ALLOWANCE)


def _weight_files(spec: ModelSpec) -> list[Path]:
    """The files a load reads: a shipped ONNX graph, else the folder's own weights in the format transformers picks
    (safetensors over .bin). Not every weight file under it: repositories ship .bin, safetensors and an onnx/ folder
    side by side, and counted together a model that fit was refused (regression tester: 41 MiB for a 26 MiB model)."""
    folder = spec.path
    if folder.is_file():
        return [folder]
    if not folder.is_dir():
        return []
    shipped = shipped_onnx(folder, spec.options) if spec.runtime is RuntimeKind.ONNX else None
    if shipped is not None:  # and its external data, when its weights are beside it (`model.onnx_data`)
        return [path for path in shipped.parent.glob(f"{shipped.name}*") if path.is_file()]
    if (folder / SAFETENSORS_INDEX).is_file():  # the shards it names, not a consolidated copy beside them
        with contextlib.suppress(OSError):
            if shards := [path for path in safetensors_files(folder) if path.is_file()]:
                return shards
    top = [path for path in folder.iterdir() if path.is_file()]
    for suffix in _WEIGHT_SUFFIXES:
        if files := [path for path in top if path.suffix == suffix]:
            return files
    return [path for path in folder.rglob("*") if path.is_file() and path.suffix in _WEIGHT_SUFFIXES]


def size_text(nbytes: int) -> str:
    """A size as a message says it: bytes, MiB, or GiB past 10."""
    if nbytes < 2**20:
        return f"{nbytes} bytes"
    return f"{nbytes / 2**20:.0f} MiB" if nbytes < 10 * 2**30 else f"{nbytes / 2**30:.1f} GiB"
