"""The units of work a worker hands its batcher: a `Job` per request, a `WorkItem` per row of it.

The one idea: a request is split into rows that are batched apart (with rows of other requests)
and gathered back by index. Each `WorkItem` points at its `Job` and its place in it, so a row's
output lands at `job.results[index]` whichever batch ran it, and the job is answered once its
`remaining` count reaches zero.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from appliance.envelope import RequestMeta
from runtimes import Tokenized


@dataclass(slots=True, eq=False)
class Job:
    """One request being served: its rows, its results as they come, and what to answer with."""

    meta: RequestMeta
    rows: list[Tokenized]
    params: Any = None
    handle: Any = None  # the NATS message, for the worker to reply and ack
    results: list[np.ndarray | None] = field(default_factory=list)
    remaining: int = 0
    started_ms: float = 0.0  # unix ms when its first row entered a batch
    compute_ms: float = 0.0
    done: bool = False

    def __post_init__(self) -> None:
        self.results = [None] * len(self.rows)
        self.remaining = len(self.rows)

    @property
    def expired(self) -> bool:
        return time.time() * 1000 >= self.meta.deadline_ms


@dataclass(slots=True, eq=False)
class WorkItem:
    job: Job
    index: int
    row: Tokenized
    arrived: float  # loop time

    @property
    def length(self) -> int:
        return self.row.length
