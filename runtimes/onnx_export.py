"""Turns a model folder into a checked, cached ONNX file: export, fuse, quantise, verify, store.

The one idea: an exported graph is a pure function of the folder's weights and config, the head and
the precision, so it is cached under a key made of exactly those (a content hash, never a path or a
date) and a box exports a model once. The file is built in a private temporary folder under a file
lock, trusted only after it reproduces the torch model's outputs on real text, then renamed into
place: a reader sees a complete, verified file or none.

The pipeline: `torch.onnx.export(dynamo=True)` with dynamic batch and sequence axes (the legacy
exporter gives wrong outputs with transformers 5), onnxscript's ONNX Runtime fusions (attention,
skip-layer-norm, bias-GELU: contrib ops with CPU and CUDA kernels alike), then for `int8` smoothed
dynamic quantisation of the matrix products (`onnx_quantize`), for `float16` a float16 graph with
float32 inputs and outputs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np
import torch

from runtimes.base import Task, pad
from runtimes.tasks.embed import EmbedHead, normalize

log = logging.getLogger(__name__)

# What every export warns of, saying nothing an operator can act on (each was a raw line in the box's log).
warnings.filterwarnings("ignore", message=r"# The axis name: .* will not be used", category=UserWarning)
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)

# Bump when the pipeline changes what it writes, so old cache entries are no longer found.
EXPORT_FORMAT = 1
PRECISIONS = ("float32", "float16", "int8")

# Parity limits per precision. Embeddings: the least cosine between a pooled ONNX vector and the
# torch one. Logits: the largest absolute difference, relative to the logits' own scale; meant to
# catch a broken graph, not to grade a quantised one.
_MIN_COSINE = {"float32": 0.9999, "float16": 0.999, "int8": 0.99}
_LOGIT_TOLERANCE = {"float32": 1e-3, "float16": 2e-2, "int8": 0.25}

# Real text of varied shape for the parity check: short, long, code, numbers, non-Latin scripts.
PARITY_TEXTS = (
    "A man is playing a guitar on stage.",
    "hi",
    "The quick brown fox jumps over the lazy dog.",
    "SELECT name, count(*) FROM orders GROUP BY name HAVING count(*) > 3;",
    "Où se trouve la gare la plus proche, s'il vous plaît ?",
    "東京は日本の首都です。",
    "3.14159 2.71828 1.41421 and 42",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "I can't believe it's not butter!!! 🚀🔥",
    " ".join(["The archive keeps letters, ledgers and maps from three centuries of trade."] * 24),
)
# Other text, for the activation peaks int8 smoothing is measured on (see onnx_quantize).
CALIBRATION_TEXTS = (
    "What is the capital of France?",
    "The mitochondria is the powerhouse of the cell.",
    "Please reset my password, I cannot log in since yesterday.",
    "for i in range(10): print(i * i)",
    "Der Zug nach München fährt um 14:30 von Gleis 7 ab.",
    "Stock markets fell sharply after the central bank raised interest rates by 50 basis points.",
    "ok thanks",
    " ".join(["Rivers carry sediment from the mountains to the sea, shaping valleys and deltas."] * 12),
)

Forward = Callable[[np.ndarray, np.ndarray, "np.ndarray | None"], np.ndarray]


class Head(StrEnum):
    """Which network is exported; `score` and `classify` share the sequence-classification head."""

    ENCODER = "encoder"
    SEQUENCE = "sequence-classification"
    TOKEN = "token-classification"


def head_for(task: Task) -> Head:
    heads = {
        Task.EMBED: Head.ENCODER,
        Task.SCORE: Head.SEQUENCE,
        Task.CLASSIFY: Head.SEQUENCE,
        Task.EXTRACT: Head.TOKEN,
    }
    if task not in heads:
        raise ValueError(f"task {task} has no ONNX export; serve it with the torch runtime")
    return heads[task]


class ExportError(RuntimeError):
    """An exported graph does not reproduce the torch model: it is not cached and not served."""


@dataclass(slots=True, frozen=True)
class Parity:
    """How close the ONNX graph came to torch on the parity texts."""

    metric: str  # "min_cosine" (embeddings) or "max_abs_diff" (logits)
    value: float
    limit: float
    rows: int

    @property
    def passed(self) -> bool:
        return self.value >= self.limit if self.metric == "min_cosine" else self.value <= self.limit


@dataclass(slots=True, frozen=True)
class OnnxArtifact:
    """An ONNX file ready to run, and whether this call made it."""

    path: Path
    exported: bool  # True when this call exported it, False when it came from the cache
    parity: Parity | None  # None for a file shipped ready-made


def content_hash(folder: Path) -> str:
    """sha256 over the names and bytes of the files the export reads: config and weights."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file() and _is_exported_input(p.name)):
        digest.update(path.name.encode() + b"\0" + str(path.stat().st_size).encode() + b"\0")
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def _is_exported_input(name: str) -> bool:
    return name == "config.json" or name.endswith((".safetensors", ".bin", ".safetensors.index.json"))


def ensure_exported(
    folder: Path, task: Task, dtype: str, cache_dir: Path, open_graph: Callable[[Path], Forward]
) -> OnnxArtifact:
    """The cached ONNX file for this folder, head and precision; exported and verified if missing.

    `open_graph` opens a file on the device it will serve on and returns its forward function,
    so the parity check runs the graph the way it will be run.
    """
    if dtype not in PRECISIONS:
        raise ValueError(f"the ONNX runtime runs {', '.join(PRECISIONS)}, not {dtype!r}")
    head = head_for(task)
    key = f"{content_hash(folder)[:24]}-{head}-{_kind(dtype)}-v{EXPORT_FORMAT}"
    target = cache_dir / f"{key}.onnx"
    if target.is_file():
        return OnnxArtifact(target, exported=False, parity=_read_parity(target))
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache_dir / f"{key}.lock"):
        if target.is_file():  # another process exported it while this one waited for the lock
            return OnnxArtifact(target, exported=False, parity=_read_parity(target))
        for stale in cache_dir.glob(f".{key}.*"):  # left by an export killed midway: nobody holds the lock
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=f".{key}.") as work:
            started = time.perf_counter()
            built, parity, fusions = _build(folder, task, dtype, Path(work), open_graph)
            report = {
                "source": str(folder),
                "head": str(head),
                "dtype": dtype,
                "parity": asdict(parity),
                "fusions": fusions,
                "seconds": round(time.perf_counter() - started, 2),
                "torch": torch.__version__,
                "onnxruntime": _onnxruntime_version(),
            }
            _write_atomically(target.with_suffix(".json"), json.dumps(report, indent=2).encode())
            os.replace(built, target)
    log.info(
        "model exported to onnx",
        extra={
            "folder": str(folder),
            "file": str(target),
            "seconds": round(report["seconds"], 1),
            parity.metric: parity.value,
        },
    )
    return OnnxArtifact(target, exported=True, parity=parity)


def _build(
    folder: Path, task: Task, dtype: str, work: Path, open_graph: Callable[[Path], Forward]
) -> tuple[Path, Parity, dict[str, int]]:
    from runtimes.torch_backend import load_torch_model

    head = head_for(task)
    model = load_torch_model(folder, task, torch.float32)
    with_types = getattr(model.config, "type_vocab_size", 0) > 0
    network = _MainOutput(model, head).eval()
    exported = _export(network, with_types, work / "exported.onnx")
    fused, fusions = _fuse(exported, work / "fused.onnx")
    # A fusion that misreads an architecture it was not written for shows up as a parity miss:
    # then the plain graph is tried before the export is given up.
    candidates = [("fused", fused, fusions)] if fused != exported else []
    candidates.append(("unfused", exported, {}))
    misses = []
    for label, graph, applied in candidates:
        path = _at_precision(graph, dtype, folder, with_types)
        parity = check_parity(network, open_graph(path), folder, head, dtype, with_types)
        if parity.passed:
            return path, parity, applied
        misses.append(f"{parity.metric} {parity.value:.6g} ({label})")
        log.warning(
            "onnx graph does not match torch",
            extra={"graph": label, "dtype": dtype, "folder": str(folder), "miss": misses[-1]},
        )
    raise ExportError(
        f"the {dtype} ONNX export of {folder} does not match torch: {', '.join(misses)} against a limit "
        f"of {parity.limit:.6g} over {parity.rows} rows; nothing was cached"
    )


def _kind(dtype: str) -> str:
    """The precision as the cache names it: int8 with the weights this CPU's export makes (`weight_kind`), so a cache
    carried to a CPU that needs the other kind exports its own."""
    if dtype != "int8":
        return dtype
    from runtimes.onnx_quantize import weight_kind

    return f"int8{weight_kind()}"


def _at_precision(graph: Path, dtype: str, folder: Path, with_types: bool) -> Path:
    out = graph.with_name(f"{graph.stem}-{dtype}.onnx")
    if dtype == "int8":
        from runtimes.onnx_quantize import quantize_int8

        ids, mask, types = text_batch(folder, CALIBRATION_TEXTS, with_types)
        calibration = {"input_ids": ids, "attention_mask": mask} | ({} if types is None else {"token_type_ids": types})
        return quantize_int8(graph, out, calibration)
    if dtype == "float16":
        return _to_float16(graph, out)
    return graph


class _MainOutput(torch.nn.Module):
    """The model with plain tensors in and its main output out, as the ONNX graph will have it."""

    def __init__(self, model: torch.nn.Module, head: Head) -> None:
        super().__init__()
        self.model = model
        self.head = head

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        output = self.model(**inputs)
        return output.last_hidden_state if self.head is Head.ENCODER else output.logits


# torch.export traces through process-wide state: two exports at once in one process (two pinned models that
# need one, at a box's start) failed each other with TorchExportError.
_EXPORTING = threading.Lock()


def _export(network: _MainOutput, with_types: bool, path: Path) -> Path:
    with _EXPORTING:
        return _export_alone(network, with_types, path)


def _export_alone(network: _MainOutput, with_types: bool, path: Path) -> Path:
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if with_types else [])
    example = {name: torch.ones(2, 16, dtype=torch.long) for name in names}
    if with_types:
        example["token_type_ids"].zero_()
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    output = "last_hidden_state" if network.head is Head.ENCODER else "logits"
    program = torch.onnx.export(
        network,
        (),
        kwargs=example,
        input_names=names,
        output_names=[output],
        dynamic_shapes={name: {0: batch, 1: sequence} for name in names},
        dynamo=True,
        verbose=False,
    )
    if program is None:  # only the legacy exporter returns nothing
        raise ExportError("torch.onnx.export returned no program")
    program.save(str(path), external_data=False)
    return path


def _fuse(path: Path, out: Path) -> tuple[Path, dict[str, int]]:
    """ONNX Runtime's transformer fusions; an architecture they do not know keeps its plain graph."""
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    model = ir.load(str(path))
    try:
        model, counts = optimize_for_ort(model)
    except Exception as error:  # a fusion bug must not stop an export that is correct without it
        log.warning(
            "onnx runtime fusions failed; keeping the unfused graph", extra={"file": str(path), "error": str(error)}
        )
        return path, {}
    ir.save(model, str(out))
    return out, {name: count for name, count in counts.items() if count}


def _to_float16(path: Path, out: Path) -> Path:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    # float32 in and out, so the backend and the heads see the same arrays at every precision.
    model = convert_float_to_float16(onnx.load(str(path)), keep_io_types=True)
    onnx.save(model, str(out))
    return out


def text_batch(
    folder: Path, texts: tuple[str, ...], with_types: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """`texts` tokenised by the folder's tokenizer and padded; seeded random ids if it has none."""
    if (folder / "tokenizer.json").is_file():
        from runtimes.tokenizer import TextTokenizer

        tokenizer = TextTokenizer(folder)
        ids, mask, types = pad(tokenizer.tokenize(texts), tokenizer.pad_id)
    else:
        vocab = json.loads((folder / "config.json").read_text()).get("vocab_size", 1000)
        rng = np.random.default_rng(len(texts))
        ids = rng.integers(1, vocab, size=(len(texts), 64), dtype=np.int64)
        mask = (np.arange(64)[None, :] < rng.integers(4, 65, size=(len(texts), 1))).astype(np.int64)
        types = np.zeros_like(ids)
    return ids, mask, (types if with_types else None)


def check_parity(
    network: torch.nn.Module, graph: Forward, folder: Path, head: Head, dtype: str, with_types: bool
) -> Parity:
    """Run torch and the graph on the parity texts and measure how far apart they are."""
    ids, mask, types = text_batch(folder, PARITY_TEXTS, with_types)
    with torch.inference_mode():
        inputs = [torch.from_numpy(ids), torch.from_numpy(mask)]
        if types is not None:
            inputs.append(torch.from_numpy(types))
        expected = network(*inputs).float().numpy()
    actual = graph(ids, mask, types)
    return compare(expected, actual, mask, head, dtype, EmbedHead.from_folder(folder))


def compare(
    expected: np.ndarray, actual: np.ndarray, mask: np.ndarray, head: Head, dtype: str, pooling: EmbedHead
) -> Parity:
    """Embeddings: least cosine after pooling. Logits: greatest absolute difference on real tokens."""
    rows = int(expected.shape[0])
    if head is Head.ENCODER:
        cosines = (normalize(pooling.pool(expected, mask)) * normalize(pooling.pool(actual, mask))).sum(axis=1)
        return Parity("min_cosine", float(cosines.min()), _MIN_COSINE[dtype], rows)
    diff = np.abs(expected - actual)
    scale = max(1.0, float(np.abs(expected).max()))
    if head is Head.TOKEN:
        diff = diff[mask > 0]
    return Parity("max_abs_diff", float(diff.max()), _LOGIT_TOLERANCE[dtype] * scale, rows)


def _onnxruntime_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def _read_parity(target: Path) -> Parity | None:
    report = target.with_suffix(".json")
    if not report.is_file():
        return None
    return Parity(**json.loads(report.read_text())["parity"])


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An exclusive lock across processes (and threads: each call opens its own description)."""
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is as readable as the files beside it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
