"""The seam between serving and model execution: tasks, tokenised inputs, and the runtime protocol.

A runtime runs one batch of one task for one model on one device. It is called from a worker
thread, never from the event loop, and knows nothing of NATS or HTTP: what crosses this seam is
plain token ids in and numpy arrays out. The batcher above packs `Tokenized` rows by their
`length`; everything a runtime needs to pad and run a batch is in those rows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np


class Task(StrEnum):
    EMBED = "embed"
    SCORE = "score"
    CLASSIFY = "classify"
    EXTRACT = "extract"
    GENERATE = "generate"


class RuntimeKind(StrEnum):
    TORCH = "torch"
    ONNX = "onnx"
    NOOP = "noop"


class InputTooLong(ValueError):
    """An input is longer than the model allows and the caller asked not to truncate.

    `what` names the input as the client sent it (`the query with document 3`); by default `input INDEX`.
    The advice holds on every route: where `truncate` defaults to true, the client set it to false.
    """

    def __init__(self, index: int, max_length: int, *, what: str | None = None) -> None:
        super().__init__(
            f"{what or f'input {index}'} is longer than the model's maximum of {max_length} tokens; "
            'shorten it, or send "truncate": true to cut it to the maximum'
        )
        self.index = index
        self.max_length = max_length

    @staticmethod
    def index_in(message: str) -> int | None:
        """The index a message of the default naming (`input INDEX is longer...`) names, once the error has crossed
        the bus as text; None for another message. A caller that queued its inputs in another shape (TEI's
        `/similarity`: the source sentence, then the sentences) renames it from this."""
        match = _DEFAULT_NAMING.match(message)
        return int(match.group(1)) if match else None


_DEFAULT_NAMING = re.compile(r"input (\d+) is longer than the model's maximum")


class UnsupportedModel(ValueError):
    """A model folder fleetbox cannot serve (architecture, missing files, or an adapter that does not fit)."""


class ModelFolderMissing(FileNotFoundError):
    """The folder a model was registered with is not there (moved or deleted since); the message names it."""


class AdapterConflict(UnsupportedModel):
    """An adapter that fits the base but not beside `adapters` resident on it: peft wraps a module one way for them
    (a LoRA layer, a `modules_to_save` copy, trainable tokens) and another way for it. It loads once they are gone."""

    def __init__(self, message: str, adapters: tuple[str, ...]) -> None:
        super().__init__(message)
        self.adapters = adapters


class AdapterInUse(ValueError):
    """An adapter's unload refused while a request runs with it (a generation): try again once it ends."""


class UnknownAdapter(LookupError):
    """A request named a LoRA adapter that is not loaded on this runtime."""

    def __init__(self, name: str) -> None:
        super().__init__(f"LoRA adapter {name!r} is not loaded on this model")
        self.name = name


def shipped_onnx(folder: Path, options: Mapping[str, Any]) -> Path | None:
    """The `.onnx` file an `onnx_file` option names (relative to the model folder), or None."""
    shipped = options.get("onnx_file")
    if not shipped:
        return None
    path = Path(str(shipped)).expanduser()
    return path if path.is_absolute() else Path(folder) / path


SAFETENSORS_INDEX = "model.safetensors.index.json"
# The head modules peft's classification adapters copy (`modules_to_save`), which a LoRA base's weights may lack.
# Only these: DeBERTa's `pooler`, beside its classifier and in no adapter, loaded random on every load.
HEAD_MODULES = frozenset({"classifier", "score"})


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files a load of `folder` reads: the shards its index names ([] for an index that is not one),
    else `model.safetensors`. Whether they exist is the caller's to judge."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (ValueError, AttributeError):
            return []
        return [folder / shard for shard in sorted(shards)]
    return [folder / "model.safetensors"]


def max_decode_batch(options: Mapping[str, Any]) -> int:
    """The most requests a generator decodes together: its `max_batch_size` option, else 32."""
    return int(options.get("max_batch_size", 32))


@dataclass(slots=True, frozen=True)
class ModelSource:
    """Where a model's files are and how to run them; everything a runtime needs to load it."""

    path: Path
    task: Task
    runtime: RuntimeKind = RuntimeKind.TORCH
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = None
    # Runtime-specific knobs (e.g. the no-op runtime's simulated cost); plain data only.
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class Tokenized:
    """One input after tokenisation: the unit the batcher sorts and packs."""

    ids: np.ndarray  # int64 token ids, special tokens included
    type_ids: np.ndarray | None = None
    # (length, 2) int64 character spans into the input text, (-1, -1) for special tokens; `extract` only.
    offsets: np.ndarray | None = None

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What the serving side may know about a loaded model."""

    task: Task
    max_length: int
    nbytes: int  # weights plus the activation peak measured at warm-up
    dimensions: int | None = None  # embedding width, for `embed`
    unit_vectors: bool = False  # `embed`: the folder normalises its vectors (its rows from `run` are not yet)
    unit_only: bool = False  # `embed`: its network normalises them itself (a shipped graph), so none come unnormalised
    labels: tuple[str, ...] = ()
    # score/classify/extract: the head weights its folder lacks; it answers only through adapters bringing their own
    untrained_head: tuple[str, ...] = ()
    vocab_size: int | None = None  # an encoder's embedding rows (config.json): a token id past them cannot be looked up


class Backend(Protocol):
    """A network on a device: padded token ids in, the model's main output out. Knows no task."""

    weight_bytes: int

    def forward(self, ids: np.ndarray, mask: np.ndarray, type_ids: np.ndarray | None) -> np.ndarray:
        """`last_hidden_state` for an encoder, `logits` for a classification head."""
        ...

    def close(self) -> None: ...


class Runtime(Protocol):
    """A loaded model. `tokenize` and `run` are called from worker threads."""

    info: ModelInfo

    def tokenize(self, texts: Sequence[str], *, truncate: bool = True) -> list[Tokenized]:
        """Tokenise; raises `InputTooLong` for an over-long input when `truncate` is false."""
        ...

    def run(self, batch: Sequence[Tokenized], adapter: str | None = None) -> np.ndarray:
        """One forward pass over a batch; returns one output row per input, in order.

        `adapter` names a loaded LoRA adapter to apply to the whole batch; `UnknownAdapter` otherwise.
        """
        ...

    def close(self) -> None: ...


@runtime_checkable
class PairRuntime(Runtime, Protocol):
    """A runtime whose rows are (query, document) pairs: a reranker."""

    def tokenize_pairs(
        self, pairs: Sequence[tuple[str, str]], *, truncate: bool = True, most_document_tokens: int | None = None
    ) -> list[Tokenized]: ...


@runtime_checkable
class HeadedRuntime(Runtime, Protocol):
    """A runtime whose outputs its task head reads (labels for classify, spans for extract)."""

    head: Any


@runtime_checkable
class AdapterHost(Protocol):
    """A runtime that carries LoRA adapters on its model (torch only)."""

    @property
    def adapters(self) -> tuple[str, ...]: ...

    def load_adapter(self, name: str, path: Path) -> int: ...

    def evict_adapter(self, name: str) -> None: ...


def pad(batch: Sequence[Tokenized], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Right-pad a batch to its longest row: (input_ids, attention_mask, token_type_ids)."""
    width = max(row.length for row in batch)
    ids = np.full((len(batch), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(batch), width), dtype=np.int64)
    with_types = batch[0].type_ids is not None
    types = np.zeros((len(batch), width), dtype=np.int64) if with_types else None
    for i, row in enumerate(batch):
        ids[i, : row.length] = row.ids
        mask[i, : row.length] = 1
        if types is not None and row.type_ids is not None:
            types[i, : row.length] = row.type_ids
    return ids, mask, types
