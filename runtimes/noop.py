"""The no-op runtime: the full serving path with a model that costs nothing (or a set cost).

It exists to measure what gateway + queue + worker add per request (benchmarks/e2e_embed.py, case
d) and to model slow or stalled workers in fault tests: `options.cost_ms` sleeps per batch,
`options.cost_per_token_us` per padded token, and `options.bytes` is the memory it claims (for
residency tests). Inputs are "tokenised" as one token per word. `fail_on` names a marker: a batch
holding an input that contains it raises, as a model would on a poison request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from runtimes.base import InputTooLong, ModelInfo, ModelSource, Task, Tokenized, UnknownAdapter

_DIMENSIONS = 8
_POISON = -1  # the token id of every position of an input that contains the `fail_on` marker


class NoopRuntime:
    def __init__(self, source: ModelSource) -> None:
        options = source.options
        self._cost_s = float(options.get("cost_ms", 0.0)) / 1000
        self._per_token_s = float(options.get("cost_per_token_us", 0.0)) / 1e6
        max_length = int(options.get("max_length", 512))
        self._fail_on = str(options.get("fail_on") or "")
        self.info = ModelInfo(
            task=Task.EMBED, max_length=max_length, nbytes=int(options.get("bytes", 0)), dimensions=_DIMENSIONS
        )
        self.batches_run = 0
        self.rows_run = 0

    def tokenize(self, texts: Sequence[str], *, truncate: bool = True) -> list[Tokenized]:
        rows = []
        for index, text in enumerate(texts):
            length = len(text.split()) + 2
            if length > self.info.max_length:
                if not truncate:
                    raise InputTooLong(index, self.info.max_length)
                length = self.info.max_length
            ids = np.ones(length, dtype=np.int64)
            if self._fail_on and self._fail_on in text:
                ids[:] = _POISON
            rows.append(Tokenized(ids=ids))
        return rows

    def run(self, batch: Sequence[Tokenized], adapter: str | None = None) -> np.ndarray:
        if adapter is not None:
            raise UnknownAdapter(adapter)
        if any(row.ids[0] == _POISON for row in batch):
            raise RuntimeError("a poison input: the no-op runtime fails on the `fail_on` marker")
        cost = self._cost_s + self._per_token_s * len(batch) * max(row.length for row in batch)
        if cost > 0:
            time.sleep(cost)
        self.batches_run += 1
        self.rows_run += len(batch)
        out = np.zeros((len(batch), _DIMENSIONS), dtype=np.float32)
        out[:, 0] = 1.0
        return out

    def close(self) -> None:
        pass
