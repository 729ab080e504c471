"""Encoder runtimes: tokenizer + backend + a task head, composed into one `Runtime`.

Each task's head turns the backend's raw output for a padded batch into one row per input; the
warm-up at load runs the longest batch the model will see, so the measured peak is honest.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runtimes.base import Backend, ModelInfo, ModelSource, Task, Tokenized, pad
from runtimes.tasks.embed import EmbedHead
from runtimes.tokenizer import TextTokenizer

_WARMUP_ROWS = 8


class EmbedRuntime:
    """Sentence embeddings: pooled, normalised as the folder says, float32 rows."""

    def __init__(self, source: ModelSource, backend: Backend) -> None:
        self.tokenizer = TextTokenizer(source.path)
        self.backend = backend
        self.head = EmbedHead.from_folder(source.path)
        probe = self.run(self.tokenize(["warm up"]))
        peak = self._warm_up()
        self.info = ModelInfo(
            task=Task.EMBED,
            max_length=self.tokenizer.max_length,
            nbytes=backend.weight_bytes + peak,
            dimensions=int(probe.shape[1]),
        )

    def tokenize(self, texts: Sequence[str], *, truncate: bool = True) -> list[Tokenized]:
        return self.tokenizer.tokenize(texts, truncate=truncate)

    def run(self, batch: Sequence[Tokenized]) -> np.ndarray:
        ids, mask, types = pad(batch, self.tokenizer.pad_id)
        hidden = self.backend.forward(ids, mask, types)
        return self.head.pool(hidden, mask)

    def _warm_up(self) -> int:
        """Run a full-length batch; return the activation peak (measured on CUDA, estimated on CPU)."""
        row = Tokenized(
            ids=np.full(self.tokenizer.max_length, 100, dtype=np.int64),
            type_ids=np.zeros(self.tokenizer.max_length, dtype=np.int64),
        )
        hidden = self.backend.forward(*pad([row] * _WARMUP_ROWS, self.tokenizer.pad_id))
        measured = getattr(self.backend, "peak_activation_bytes", lambda: None)()
        # On CPU there is no allocator peak to read: count the hidden states of the warm-up batch
        # a few times over (attention and feed-forward intermediates are of that order).
        return measured if measured is not None else int(hidden.nbytes * 8)

    def close(self) -> None:
        self.backend.close()


def build_encoder_runtime(source: ModelSource, backend: Backend) -> EmbedRuntime:
    if source.task is Task.EMBED:
        return EmbedRuntime(source, backend)
    raise NotImplementedError(f"task {source.task} has no runtime yet")
