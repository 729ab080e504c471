"""The no-op runtime: the full serving path with a model that costs nothing (or a set cost).

It exists to measure what gateway + queue + worker add per request (benchmarks/e2e_embed.py, case
d), to model slow or stalled workers in fault tests, and to model a fleet of unequal workers
(benchmarks/pull_vs_push.py). The modelled time of a batch is

    (cost_ms + cost_per_token_us × rows × longest row) / speed  [+ a stall, now and then]

and `run` sleeps for it. Options: `cost_ms` per batch, `cost_per_token_us` per padded token,
`speed` (a multiplier: 2 is twice as fast), stalls (`stall_every`: on average one batch in that
many pauses first for `stall_ms`, like a GC pause; `cold_every`/`cold_ms` the same for rarer, longer
pauses like a model reload), `seed` for the stall draws, and `bytes`, the memory it claims (for
residency tests). Inputs are "tokenised" as one token per word. `fail_on` names a marker: a batch
holding an input that contains it raises, as a model would on a poison request.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtimes.base import InputTooLong, ModelInfo, ModelSource, Task, Tokenized, UnknownAdapter

_DIMENSIONS = 8
_POISON = -1  # the token id of every position of an input that contains the `fail_on` marker


@dataclass(slots=True, frozen=True)
class CostModel:
    """How long a batch takes on one modelled worker."""

    batch_s: float = 0.0
    per_token_s: float = 0.0
    speed: float = 1.0
    stall_every: float = 0.0  # mean batches between stalls; 0: never
    stall_s: float = 0.0
    cold_every: float = 0.0
    cold_s: float = 0.0
    seed: int = 0

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> CostModel:
        speed = float(options.get("speed", 1.0))
        if speed <= 0:
            raise ValueError(f"noop option speed must be positive, not {speed}")
        return cls(
            batch_s=float(options.get("cost_ms", 0.0)) / 1000,
            per_token_s=float(options.get("cost_per_token_us", 0.0)) / 1e6,
            speed=speed,
            stall_every=float(options.get("stall_every", 0.0)),
            stall_s=float(options.get("stall_ms", 0.0)) / 1000,
            cold_every=float(options.get("cold_every", 0.0)),
            cold_s=float(options.get("cold_ms", 0.0)) / 1000,
            seed=int(options.get("seed", 0)),
        )

    def compute_s(self, rows: int, longest: int) -> float:
        return (self.batch_s + self.per_token_s * rows * longest) / self.speed

    def stall_s_now(self, rng: random.Random) -> float:
        """The pause before this batch: usually none."""
        pause = 0.0
        if self.stall_every > 0 and rng.random() < 1.0 / self.stall_every:
            pause += self.stall_s
        if self.cold_every > 0 and rng.random() < 1.0 / self.cold_every:
            pause += self.cold_s
        return pause


class NoopRuntime:
    def __init__(self, source: ModelSource) -> None:
        options = source.options
        max_length = int(options.get("max_length", 512))
        self._fail_on = str(options.get("fail_on") or "")
        self.info = ModelInfo(
            task=Task.EMBED, max_length=max_length, nbytes=int(options.get("bytes", 0)), dimensions=_DIMENSIONS
        )
        self.cost = CostModel()
        self._rng = random.Random(0)
        self.model_worker(options)
        self.batches_run = 0
        self.rows_run = 0
        self.busy_s = 0.0  # time spent in `run` (sleeping the modelled cost), stalls included
        self.stalls = 0

    def model_worker(self, options: Mapping[str, Any]) -> None:
        """Set the cost model (and reseed the stalls) of this one instance.

        Options in the catalog are fleet-wide; a benchmark that runs many in-process boxes on one
        catalog entry calls this on each box's runtime to make the workers unequal.
        """
        self.cost = CostModel.from_options(options)
        self._rng = random.Random(self.cost.seed)

    def predicted_s(self, rows: int, longest: int) -> float:
        """What a batch costs by the options, stalls aside: a box's warm-up reads it rather than sleep it (a no-op
        model's batch may be set to last minutes)."""
        return self.cost.compute_s(rows, longest)

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
        started = time.perf_counter()
        stall = self.cost.stall_s_now(self._rng)
        cost = stall + self.cost.compute_s(len(batch), max(row.length for row in batch))
        if cost > 0:
            time.sleep(cost)
        self.batches_run += 1
        self.rows_run += len(batch)
        self.busy_s += time.perf_counter() - started
        self.stalls += 1 if stall > 0 else 0
        out = np.zeros((len(batch), _DIMENSIONS), dtype=np.float32)
        out[:, 0] = 1.0
        return out

    def close(self) -> None:
        pass
