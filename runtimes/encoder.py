"""Encoder runtimes: tokenizer + backend + a task head, composed into one `Runtime`.

Each task's head turns the backend's raw output for a padded batch into one row per input; the
warm-up at load runs the longest batch the model will see, so the measured peak is honest.
What `run` returns, per task, and how the serving side turns it into an answer:

- embed: (n, dimensions) float32 vectors, pooled (and through the folder's Dense layers), not yet normalised;
  `finish_vectors(rows, folder_normalizes=info.unit_vectors, ...)`.
- score: (n,) relevance logits for `tokenize_pairs` rows; `head.scores(logits, raw_scores=...)`.
- classify: (n, labels) logits; `head.predictions(logits, raw_scores=..., top_k=...)`.
- extract: (n, tokens, labels) logits, padded; `head.entities(text, logits[i], batch[i].offsets)`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runtimes.base import Backend, ModelInfo, ModelSource, Task, Tokenized, UnknownAdapter, UnsupportedModel, pad
from runtimes.detect import refuse_tokens_past_vocab
from runtimes.tasks.classify import ClassifyHead
from runtimes.tasks.embed import EmbedHead
from runtimes.tasks.extract import ExtractHead
from runtimes.tasks.score import ScoreHead, check_one_logit
from runtimes.tokenizer import TextTokenizer

_WARMUP_ROWS = 8


class EncoderRuntime:
    """What every encoder task shares: tokenisation, padding, LoRA adapters, warm-up, close.

    A subclass sets `task` and turns the backend's padded output into its rows in `_rows`.
    """

    task: Task

    def __init__(self, source: ModelSource, backend: Backend) -> None:
        self.tokenizer = TextTokenizer(source.path)
        self.backend = backend
        config = _config(source.path)
        # A model of a box's config file reaches here unjudged; another model's tokenizer fails every batch.
        refuse_tokens_past_vocab(source.path, self.tokenizer.regular_vocab, config)
        self._hidden_size = _int_field(config, "hidden_size")
        self._vocab_size = _int_field(config, "vocab_size")

    def _measure(self, **info: object) -> ModelInfo:
        """Warm up, then describe the model; subclasses call this last in their `__init__`."""
        return ModelInfo(
            task=self.task,
            max_length=self.tokenizer.max_length,
            nbytes=self.backend.weight_bytes + self._warm_up(),
            untrained_head=getattr(self.backend, "untrained_head", ()),
            vocab_size=self._vocab_size,
            **info,  # type: ignore[arg-type]
        )

    def tokenize(self, texts: Sequence[str], *, truncate: bool = True) -> list[Tokenized]:
        return self.tokenizer.tokenize(texts, truncate=truncate)

    def run(self, batch: Sequence[Tokenized], adapter: str | None = None) -> np.ndarray:
        ids, mask, types = pad(batch, self.tokenizer.pad_id)
        return self._rows(self._forward(ids, mask, types, adapter), mask)

    def _rows(self, output: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return output

    def _forward(self, ids: np.ndarray, mask: np.ndarray, types: np.ndarray | None, adapter: str | None) -> np.ndarray:
        if adapter is None:
            return self.backend.forward(ids, mask, types)
        if getattr(self.backend, "adapters", None) is None:
            raise UnknownAdapter(adapter)
        return self.backend.forward(ids, mask, types, adapter=adapter)  # type: ignore[call-arg]

    # LoRA adapters (torch backend only): see runtimes/lora.py.
    def load_adapter(self, name: str, path: Path) -> int:
        """Load a LoRA adapter onto this model; returns the bytes it added."""
        adapters = getattr(self.backend, "adapters", None)
        if adapters is None:
            raise UnsupportedModel(f"LoRA adapters need the torch runtime; {name!r} cannot be loaded here")
        return adapters.load(name, path)

    def evict_adapter(self, name: str) -> None:
        adapters = getattr(self.backend, "adapters", None)
        if adapters is None:
            raise UnknownAdapter(name)
        adapters.evict(name)

    @property
    def adapters(self) -> tuple[str, ...]:
        adapters = getattr(self.backend, "adapters", None)
        return () if adapters is None else adapters.names

    def _warm_up(self) -> int:
        """Run a full-length batch; return the activation peak (measured on CUDA, estimated on CPU)."""
        row = Tokenized(
            ids=np.full(self.tokenizer.max_length, 100, dtype=np.int64),
            type_ids=np.zeros(self.tokenizer.max_length, dtype=np.int64),
        )
        getattr(self.backend, "start_peak", lambda: None)()
        output = self.backend.forward(*pad([row] * _WARMUP_ROWS, self.tokenizer.pad_id))
        expected = self._output_shape(_WARMUP_ROWS, self.tokenizer.max_length)
        if expected is not None and tuple(output.shape) not in expected:
            # A shipped ONNX graph that is not the folder's model (an encoder's graph in a reranker's folder, a
            # head of another label count) answered made-up scores, or failed each request as the client's 422.
            raise UnsupportedModel(
                f"the model's output for {_WARMUP_ROWS} inputs has the shape {tuple(output.shape)}, where its"
                f" folder's {self.task.value} model gives {' or '.join(str(shape) for shape in expected)};"
                " is its ONNX file this folder's model?"
            )
        measured = getattr(self.backend, "peak_activation_bytes", lambda: None)()
        if measured is not None:
            return measured
        # On CPU there is no allocator peak to read: count the hidden states of the warm-up batch
        # a few times over (attention and feed-forward intermediates are of that order).
        width = self._hidden_size or output.shape[-1]
        return int(_WARMUP_ROWS * self.tokenizer.max_length * width * 4 * 8)

    def _output_shape(self, rows: int, length: int) -> list[tuple[int, ...]] | None:
        """The shapes the model's output may have for `rows` inputs of `length` tokens; None: not judged."""
        return None

    def close(self) -> None:
        self.backend.close()


class EmbedRuntime(EncoderRuntime):
    """Sentence embeddings: pooled float32 rows; `info.unit_vectors` says whether the folder normalises them."""

    task = Task.EMBED

    def __init__(self, source: ModelSource, backend: Backend) -> None:
        super().__init__(source, backend)
        self.head = EmbedHead.from_folder(source.path)
        probe = self.run(self.tokenize(["warm up", "and a second, longer sentence to warm up with"]))
        # A shipped graph that pools by itself may normalise too: its rows are unit vectors whatever the input.
        unit_only = bool(np.allclose(np.linalg.norm(probe, axis=1), 1.0, atol=1e-4))
        self.info = self._measure(
            dimensions=int(probe.shape[1]), unit_vectors=self.head.normalize or unit_only, unit_only=unit_only
        )

    def _rows(self, output: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return self.head.pool(output, mask)


class ScoreRuntime(EncoderRuntime):
    """Cross-encoder rerank: rows are (query, document) pairs, the output one relevance logit each."""

    task = Task.SCORE

    def __init__(self, source: ModelSource, backend: Backend) -> None:
        super().__init__(source, backend)
        check_one_logit(source.path, ClassifyHead.from_folder(source.path).labels)
        self.head = ScoreHead.from_config(json.loads((source.path / "config.json").read_text()), source.path)
        self.info = self._measure()

    def _output_shape(self, rows: int, length: int) -> list[tuple[int, ...]] | None:
        return [(rows, 1)]  # one relevance logit per pair

    def tokenize_pairs(
        self, pairs: Sequence[tuple[str, str]], *, truncate: bool = True, most_document_tokens: int | None = None
    ) -> list[Tokenized]:
        """(query, document) pairs; over-long pairs lose document tokens first (longest-first). With
        `most_document_tokens`, each document is cut to that many tokens first."""
        if most_document_tokens is not None:
            documents = self.tokenizer.first_tokens([document for _, document in pairs], most_document_tokens)
            pairs = [(query, document) for (query, _), document in zip(pairs, documents, strict=True)]
        return self.tokenizer.tokenize_pairs(pairs, truncate=truncate)

    def _rows(self, output: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(output[:, 0], dtype=np.float32)


class ClassifyRuntime(EncoderRuntime):
    """Sequence classification: one row of label logits per input."""

    task = Task.CLASSIFY

    def __init__(self, source: ModelSource, backend: Backend) -> None:
        super().__init__(source, backend)
        self.head = ClassifyHead.from_folder(source.path)
        self.info = self._measure(labels=self.head.labels)

    def _output_shape(self, rows: int, length: int) -> list[tuple[int, ...]] | None:
        return [(rows, len(self.head.labels))]


class ExtractRuntime(EncoderRuntime):
    """Token classification: rows carry character offsets, the output is label logits per token."""

    task = Task.EXTRACT

    def __init__(self, source: ModelSource, backend: Backend) -> None:
        super().__init__(source, backend)
        self.head = ExtractHead.from_folder(source.path)
        self.info = self._measure(labels=self.head.labels)

    def _output_shape(self, rows: int, length: int) -> list[tuple[int, ...]] | None:
        return [(rows, length, len(self.head.labels))]

    def tokenize(self, texts: Sequence[str], *, truncate: bool = True) -> list[Tokenized]:
        return self.tokenizer.tokenize(texts, truncate=truncate, with_offsets=True)


_RUNTIMES: dict[Task, type[EncoderRuntime]] = {
    Task.EMBED: EmbedRuntime,
    Task.SCORE: ScoreRuntime,
    Task.CLASSIFY: ClassifyRuntime,
    Task.EXTRACT: ExtractRuntime,
}


def build_encoder_runtime(source: ModelSource, backend: Backend) -> EncoderRuntime:
    runtime = _RUNTIMES.get(source.task)
    if runtime is None:
        raise NotImplementedError(f"task {source.task} is not an encoder task")
    try:
        return runtime(source, backend)
    except BaseException:
        backend.close()  # the caller never gets the backend to close when its runtime fails to build
        raise


def _config(folder: Path) -> dict[str, Any]:
    config = folder / "config.json"
    return json.loads(config.read_text()) if config.is_file() else {}


def _int_field(config: dict[str, Any], field: str) -> int | None:
    value = config.get(field)
    return value if isinstance(value, int) and not isinstance(value, bool) else None
