"""Pull vs push (issue 6): fleetbox's shared-queue pull path against two push routers, same workers.

Eight modelled workers of unequal speed (0.5x to 2x, geometric) run the no-op runtime, which
sleeps for a batch's modelled time, (fixed cost + cost per padded token) / speed, with occasional
stalls: a short GC-like pause now and then, rarely a long one like a cold model load. Every worker
batches with fleetbox's own `Batcher` (at most 8 rows, 2 ms wait) on its own device thread. The
ways to get requests to them:

  pull     fleetbox as built: a real nats-server (JetStream), 8 worker `Box`es and one gateway `Box`
           in this process. Requests go through the gateway's `Dispatcher` (publish to the stream,
           await the reply); the boxes pull from the shared durable consumer with their `Puller`,
           batch, reply, ack. Settings as shipped (`hold_ms` 150, `worker_capacity` 1024).
  pull-2b  the same with `worker_capacity` = 2 batches (16): a cap in requests on top of the room
           in time (`hold_ms`), which once was the only knob and decided the result.
  rr       a push router: round-robin, straight into each worker's batcher.
  lor      a push router: least outstanding requests, choosing from a view of the workers'
           outstanding counts refreshed every 100 ms (plus its own sends since the refresh): the
           stale view a top-down router has of workers it does not run.
  lor-view (only with --routers) the same router without its own sends: it knows only the view.

The push routers' workers are the same no-op runtime and the same `Batcher`, but in-process with
no transport at all (a function call): the only differences are the dispatch policy and that pull
also pays for NATS. Any advantage pull shows is despite its round trips, not because of them.

"At the same p99": each router's throughput is the highest Poisson (open-loop) offered rate at
which its p99 latency stays within one SLO (default 500 ms). Six bisection trials of 2 s each find
the highest rate whose trial meets the SLO with 10% to spare; a short trial sees fewer of the rare
stalls than a long run, so the full run feeds N requests (default 20,000) 5% below that rate, and
while its p99 still misses the SLO it is run again another 5% slower, up to three full runs (the
same for every router). The table reports the last full run. Latency runs from a
request's scheduled arrival to its answer, so a lagging event loop is charged to the router, never
hidden; a request not answered within its deadline counts as infinitely late.

Why one process: on a 2-core machine, 9 Python processes plus nats-server would fight over the
cores and measure the scheduler; in one process the Python work is the same, nats-server gets the
other core, and each box's runtime can be given its own speed (the catalog's options are
fleet-wide). Every run prints the event loop's lag, the longest garbage collection and this
process's CPU, to show that the loop was not the bottleneck. After start-up the objects alive are
frozen out of the garbage collector (`gc.freeze()`, `--no-gc-freeze` to see without): with torch
imported a full collection takes ~0.3 s, and nine boxes' garbage in one process triggers them
nine times as often as one box would.

    python benchmarks/pull_vs_push.py [--requests N] [--quick] [--slo-ms MS] [--cost-scale X] [--json PATH]

`--cost-scale X` multiplies every duration of the modelled fleet by X (batch cost and stalls, the batcher's wait,
the boxes' hold_ms, the lor router's refresh, the default SLO, trials and deadlines): the same fleet, X times slower,
for a machine whose Python is slow enough that this process's one loop would set the pace.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import itertools
import logging
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import orjson
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere: `appliance` is importable

from appliance.app import Box  # noqa: E402
from appliance.batcher import Batcher  # noqa: E402
from appliance.catalog import Batching, ModelSpec  # noqa: E402
from appliance.envelope import RequestMeta  # noqa: E402
from appliance.errors import FleetboxError  # noqa: E402
from appliance.metrics import Metrics  # noqa: E402
from appliance.natsd import EmbeddedNats, free_port  # noqa: E402
from appliance.settings import ModelEntry, Settings  # noqa: E402
from appliance.work import Job  # noqa: E402
from benchmarks.e2e_embed import git_describe, machine  # noqa: E402
from runtimes import ModelSource, RuntimeKind, Task  # noqa: E402
from runtimes.noop import CostModel, NoopRuntime  # noqa: E402

MODEL = "noop"
SPEEDS = tuple(round(0.5 * 4 ** (i / 7), 2) for i in range(8))  # 0.5x .. 2x, geometric
# Per batch: 30 ms + 250 us per padded token, divided by the worker's speed. A full batch of 8
# rows of 26 tokens takes 82 ms at 1x: ms-level costs, so the sleeping workers dominate the
# Python work per request. Stalls: 1 batch in 250 pauses 150 ms first (a GC pause); 1 in 4000
# pauses 1.5 s (a cold load).
COST: dict[str, float] = {
    "cost_ms": 30.0,
    "cost_per_token_us": 250.0,
    "stall_every": 250,
    "stall_ms": 150.0,
    "cold_every": 4000,
    "cold_ms": 1500.0,
}
# `--cost-scale` multiplies these, and every other duration of the modelled fleet with them (the batcher's wait, the
# boxes' `hold_ms`, the SLO, a search trial's length): the same fleet, that many times slower. On a slower machine,
# where the Python work per request takes a larger share of each modelled millisecond, the loop is then kept from
# setting the pace (run 25). The least-outstanding router's view is refreshed every 100 ms × the scale too: left at
# 100 ms against 3× longer batches it is three times fresher, a different fleet (run 26: lor 0.98 of ideal, not 0.88).
_DURATIONS = ("cost_ms", "cost_per_token_us", "stall_ms", "cold_ms")
BATCHING = Batching(max_batch_tokens=16_384, max_batch_size=8, max_wait_ms=2.0)
WORDS_PER_REQUEST = (8, 24)  # one input each: 10-26 tokens
LOR_REFRESH_S = 0.1  # at --cost-scale 1; `--lor-refresh-ms` sets it
# Past either, the event loop the boxes share, not the fleet, set the pace: this process's CPU a wall second (the loop
# saturated), or the loop's lag at p99 (saturated, or starved by other work on the machine; 1.3-6.9 ms in a fair run).
SATURATED_CPU_SHARE = 0.9
LATE_LOOP_MS = 20.0
ROUTERS = ("pull", "pull-2b", "rr", "lor")
EXTRA_ROUTERS = ("lor-view",)  # run only when named in --routers
TITLES = {
    "pull": "pull: fleetbox, default worker_capacity",
    "pull-2b": "pull: fleetbox, worker_capacity {capacity}",
    "rr": "push: round-robin",
    "lor": "push: least-outstanding, 100 ms view",
    "lor-view": "push: least-outstanding, 100 ms view only",
}
PULLS = ("pull", "pull-2b")
TARGETS = {"rr": 1.5, "lor": 1.2, "lor-view": 1.2}  # pull's throughput over each push router's, at the same p99 SLO
WORDS = "the a of to in model fleet box queue request reply batch token vector worker stream city river".split()


@dataclass(slots=True, frozen=True)
class Request:
    body: bytes
    text: str
    tokens: int


@dataclass(slots=True, frozen=True)
class Plan:
    requests: int
    trial_s: float  # seconds of arrivals per search trial
    search_steps: int
    full_runs: int  # a full run over the SLO is repeated one step slower, up to this many runs in all


PLANS = {"full": Plan(20_000, 2.0, 6, 3), "quick": Plan(3_000, 2.0, 4, 1)}
# A short trial sees fewer of the rare stalls than the full run: it must meet the SLO with 10% to
# spare, and each full run goes 5% slower than the rate before it (the best trial's, first).
_TRIAL_MARGIN = 0.9
_STEP_DOWN = 0.95


def make_requests(count: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    lo, hi = WORDS_PER_REQUEST
    out = []
    for _ in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))
        out.append(Request(orjson.dumps({"model": MODEL, "input": text}), text, len(text.split()) + 2))
    return out


def scaled_cost(scale: float) -> dict[str, float]:
    """The cost model with every duration times `scale` (`--cost-scale`)."""
    return {key: value * scale if key in _DURATIONS else value for key, value in COST.items()}


def batching(scale: float = 1.0) -> Batching:
    """Every worker's batching, its wait scaled with the cost (`--cost-scale`)."""
    return replace(BATCHING, max_wait_ms=BATCHING.max_wait_ms * scale)


def ideal_rate(scale: float = 1.0) -> float:
    """Requests/s the fleet could do with every worker busy on full batches of the longest rows."""
    longest = WORDS_PER_REQUEST[1] + 2
    full = BATCHING.max_batch_size
    cost = scaled_cost(scale)
    return sum(full / CostModel.from_options({**cost, "speed": s}).compute_s(full, longest) for s in SPEEDS)


def worker_options(index: int, seed: int, scale: float = 1.0) -> dict[str, float]:
    return {**scaled_cost(scale), "speed": SPEEDS[index], "seed": seed * 1000 + index}


# ---------------------------------------------------------------------------------------------
# the ways to reach the workers

Done = Callable[[float, bool], None]  # (loop time answered, ok)


class Target(Protocol):
    name: str

    def send(self, request: Request, deadline_s: float, done: Done) -> None: ...

    def runtimes(self) -> list[NoopRuntime]: ...

    def idle(self) -> bool: ...

    def pull_requests(self) -> int | None: ...

    async def close(self) -> None: ...


class PullFleet:
    """fleetbox as built: 8 worker boxes and a gateway box on one embedded nats-server."""

    def __init__(
        self,
        name: str,
        workdir: Path,
        seed: int,
        worker_capacity: int | None,
        cost_scale: float,
        hold_ms: float,
    ) -> None:
        self.name = name
        self._workdir = workdir
        self._seed = seed
        self._scale = cost_scale
        self._hold_ms = hold_ms
        self._worker_capacity = worker_capacity
        self.natsd: EmbeddedNats | None = None
        self.boxes: list[Box] = []
        self.gateway: Box | None = None
        self._spec: ModelSpec | None = None
        self._calls: set[asyncio.Task[None]] = set()

    def _settings(self, name: str, **overrides: Any) -> Settings:
        assert self.natsd is not None
        entry = ModelEntry(
            name=MODEL,
            runtime="noop",
            pinned=True,
            options=scaled_cost(self._scale),
            max_batch_tokens=BATCHING.max_batch_tokens,
            max_batch_size=BATCHING.max_batch_size,
            max_wait_ms=batching(self._scale).max_wait_ms,
        )
        values: dict[str, Any] = {
            "nats": self.natsd.url,
            "host": "127.0.0.1",
            "port": 0,
            "device": "cpu",
            "box_id": name,
            "state_dir": self._workdir / self.name / name,
            "default_model": False,
            "models": [entry],
            "log_level": "WARNING",
            "hold_ms": self._hold_ms,
        }
        if self._worker_capacity is not None:
            values["worker_capacity"] = self._worker_capacity
        values.update(overrides)
        return Settings(**values)

    async def start(self) -> None:
        self.natsd = EmbeddedNats(store_dir=self._workdir / self.name / "nats", port=free_port())
        await self.natsd.start()
        for index in range(len(SPEEDS)):
            box = Box(self._settings(f"w{index}", role="worker"))
            await box.start()
            self.boxes.append(box)
            # The catalog entry (and its options) is fleet-wide; each box's runtime gets its own speed.
            self._runtime(box).model_worker(worker_options(index, self._seed, self._scale))
        self.gateway = Box(self._settings("gateway", role="gateway"))
        await self.gateway.start()
        self._spec = self.gateway.catalog.get(MODEL)
        assert self._spec is not None and self.gateway.dispatcher is not None

    @staticmethod
    def _runtime(box: Box) -> NoopRuntime:
        resident = box.residency.get(MODEL)
        assert resident is not None and isinstance(resident.runtime, NoopRuntime)
        return resident.runtime

    def send(self, request: Request, deadline_s: float, done: Done) -> None:
        task = asyncio.create_task(self._call(request, deadline_s, done))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _call(self, request: Request, deadline_s: float, done: Done) -> None:
        assert self.gateway is not None and self.gateway.dispatcher is not None and self._spec is not None
        try:
            reply = await self.gateway.dispatcher.call(
                spec=self._spec, task="embed", body=request.body, timeout_s=deadline_s, tokens=request.tokens
            )
            ok = reply.meta.status == 200
        except FleetboxError:
            ok = False
        done(asyncio.get_running_loop().time(), ok)

    def runtimes(self) -> list[NoopRuntime]:
        return [self._runtime(box) for box in self.boxes]

    def idle(self) -> bool:
        return not self._calls and all(worker.held == 0 for box in self.boxes for worker in box.workers.values())

    def pull_requests(self) -> int | None:
        """Pull requests the boxes' `Puller`s have published so far (their sequence numbers)."""
        return sum(getattr(w.puller, "_seq", 0) for box in self.boxes for w in box.workers.values())

    def nats_pid(self) -> int | None:
        process = self.natsd.process if self.natsd is not None else None
        return process.pid if process is not None else None

    async def close(self) -> None:
        for box in [self.gateway, *reversed(self.boxes)]:
            if box is not None:
                await box.stop()
        if self.natsd is not None:
            await self.natsd.stop()


@dataclass(slots=True, frozen=True)
class PushWorker:
    runtime: NoopRuntime
    executor: ThreadPoolExecutor
    batcher: Batcher


class PushFleet:
    """A push router over 8 in-process workers: the same runtime and batcher, no transport."""

    def __init__(self, policy: str, seed: int, cost_scale: float = 1.0, refresh_s: float = LOR_REFRESH_S) -> None:
        self.name = policy
        self._policy = policy
        self._seed = seed
        self._scale = cost_scale
        self._refresh_s = refresh_s
        self.workers: list[PushWorker] = []
        self._outstanding: list[int] = []  # per worker, sent and not answered: the truth a view lags behind
        self._next = itertools.count()
        self._ids = itertools.count()
        self._view: list[int] = []  # outstanding per worker, as of the last refresh
        self._sent_since: list[int] = []  # the router's own sends since that refresh
        self._refresher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for index in range(len(SPEEDS)):
            options = worker_options(index, self._seed, self._scale)
            source = ModelSource(path=Path("."), task=Task.EMBED, runtime=RuntimeKind.NOOP, options=options)
            runtime = NoopRuntime(source)
            executor = ThreadPoolExecutor(1, thread_name_prefix=f"push-w{index}")
            batcher = Batcher(MODEL, runtime, batching(self._scale), executor, Metrics(), self._answered(index))
            batcher.start()
            self.workers.append(PushWorker(runtime, executor, batcher))
        self._outstanding = [0] * len(self.workers)
        self._view = [0] * len(self.workers)
        self._sent_since = [0] * len(self.workers)
        if self._policy.startswith("lor"):
            self._refresher = asyncio.create_task(self._refresh())

    def _answered(self, index: int) -> Callable[[Job, Exception | None], None]:
        def on_done(job: Job, error: Exception | None) -> None:
            self._outstanding[index] -= 1
            job.handle(asyncio.get_running_loop().time(), error is None)

        return on_done

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            self._view = list(self._outstanding)
            self._sent_since = [0] * len(self.workers)

    def _choose(self) -> int:
        turn = next(self._next)
        count = len(self.workers)
        if self._policy == "rr":
            return turn % count
        # Least outstanding as the router believes it; ties go round the workers, not to worker 0.
        # "lor-view" knows only the refreshed view, as a router that does not count its own sends
        # (one of several router replicas, say): it herds a whole 100 ms onto the same workers.
        order = [(turn + k) % count for k in range(count)]
        if self._policy == "lor-view":
            return min(order, key=lambda i: self._view[i])
        return min(order, key=lambda i: self._view[i] + self._sent_since[i])

    def send(self, request: Request, deadline_s: float, done: Done) -> None:
        index = self._choose()
        worker = self.workers[index]
        self._sent_since[index] += 1
        self._outstanding[index] += 1
        now_ms = int(time.time() * 1000)
        meta = RequestMeta(
            id=f"r{next(self._ids)}",
            task="embed",
            model=MODEL,
            reply="",
            deadline_ms=now_ms + int(deadline_s * 1000),
            sent_ms=now_ms,
            tokens=request.tokens,
        )
        # Tokenised here as the pull worker does on receipt; the handle is how the worker answers.
        worker.batcher.submit(Job(meta=meta, rows=worker.runtime.tokenize([request.text]), handle=done))

    def runtimes(self) -> list[NoopRuntime]:
        return [worker.runtime for worker in self.workers]

    def idle(self) -> bool:
        return not any(self._outstanding)

    def pull_requests(self) -> int | None:
        return None

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        for worker in self.workers:
            await worker.batcher.drain()
            worker.executor.shutdown(wait=True)


# ---------------------------------------------------------------------------------------------
# one run: Poisson arrivals at a rate, every answer timed


@dataclass(slots=True)
class RunResult:
    router: str
    offered: float  # requests/s
    requests: int
    answered: int
    failed: int
    seconds: float  # first arrival to last answer
    p50_ms: float
    p99_ms: float
    busy: list[float]  # per worker: share of the run spent in the runtime (stalls included)
    rows: list[int]  # per worker
    batches: list[int]  # per worker
    stalls: int
    loop_lag_p99_ms: float
    loop_lag_max_ms: float
    cpu_share: float  # this process's CPU seconds per wall second (1.0 = one core)
    pull_requests: int | None
    gc_max_ms: float  # the longest garbage collection (the event loop stood still)
    nats_cpu_share: float | None

    @property
    def throughput(self) -> float:
        return self.answered / self.seconds if self.seconds else 0.0

    def meets(self, slo_ms: float) -> bool:
        return self.failed == 0 and self.p99_ms <= slo_ms


class LagProbe:
    """How late the event loop wakes a task that asked to sleep 10 ms: a saturated loop shows here first."""

    def __init__(self, period_s: float = 0.01) -> None:
        self._period_s = period_s
        self.lags_ms: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self._period_s)
            self.lags_ms.append((loop.time() - before - self._period_s) * 1000)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class GcWatch:
    """Python's garbage collections during a run: a full one stops the event loop (0.3 s here with torch loaded)."""

    def __init__(self) -> None:
        self.pauses_ms: list[float] = []
        self._began = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses_ms.append((time.perf_counter() - self._began) * 1000)

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def process_cpu_s(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def wait_idle(target: Target, timeout_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not target.idle():
        if loop.time() > deadline:
            raise RuntimeError(f"{target.name}: still busy {timeout_s}s after the last answer")
        await asyncio.sleep(0.02)


async def run_once(target: Target, requests: Sequence[Request], rate: float, seed: int, deadline_s: float) -> RunResult:
    loop = asyncio.get_running_loop()
    await wait_idle(target)
    rng = random.Random(seed)
    offsets = list(itertools.accumulate(rng.expovariate(rate) for _ in requests))
    latencies: list[float] = []
    failed = 0
    last_answer = 0.0
    all_answered = asyncio.Event()

    def answered(at: float, ok: bool, arrival: float) -> None:
        nonlocal failed, last_answer
        latencies.append((at - arrival) * 1000 if ok else math.inf)
        failed += 0 if ok else 1
        last_answer = max(last_answer, at)
        if len(latencies) == len(requests):
            all_answered.set()

    runtimes = target.runtimes()
    busy0 = [r.busy_s for r in runtimes]
    rows0 = [r.rows_run for r in runtimes]
    batches0 = [r.batches_run for r in runtimes]
    stalls0 = sum(r.stalls for r in runtimes)
    pulls0 = target.pull_requests()
    nats_pid = target.nats_pid() if isinstance(target, PullFleet) else None
    nats0 = process_cpu_s(nats_pid)
    cpu0 = time.process_time()
    probe = LagProbe()
    probe.start()
    with GcWatch() as gc_watch:
        start = loop.time() + 0.02
        sent = 0
        while sent < len(requests):
            now = loop.time()
            while sent < len(requests) and start + offsets[sent] <= now:
                arrival = start + offsets[sent]
                target.send(requests[sent], deadline_s, lambda at, ok, arrival=arrival: answered(at, ok, arrival))
                sent += 1
            if sent < len(requests):
                await asyncio.sleep(max(0.0, start + offsets[sent] - loop.time()))
        await asyncio.wait_for(all_answered.wait(), deadline_s + 30.0)
    seconds = last_answer - start
    cpu = time.process_time() - cpu0
    nats1 = process_cpu_s(nats_pid)
    pulls1 = target.pull_requests()
    await probe.stop()
    lags = probe.lags_ms or [0.0]
    ordered = np.sort(np.array(latencies))
    return RunResult(
        router=target.name,
        offered=rate,
        requests=len(requests),
        answered=len(requests) - failed,
        failed=failed,
        seconds=seconds,
        p50_ms=float(ordered[int(0.50 * (len(ordered) - 1))]),
        p99_ms=float(ordered[math.ceil(0.99 * (len(ordered) - 1))]),
        busy=[(r.busy_s - b) / seconds for r, b in zip(runtimes, busy0, strict=True)],
        rows=[r.rows_run - n for r, n in zip(runtimes, rows0, strict=True)],
        batches=[r.batches_run - n for r, n in zip(runtimes, batches0, strict=True)],
        stalls=sum(r.stalls for r in runtimes) - stalls0,
        loop_lag_p99_ms=float(np.percentile(lags, 99)),
        loop_lag_max_ms=float(max(lags)),
        cpu_share=cpu / seconds,
        pull_requests=pulls1 - pulls0 if pulls0 is not None and pulls1 is not None else None,
        gc_max_ms=max(gc_watch.pauses_ms, default=0.0),
        nats_cpu_share=(nats1 - nats0) / seconds if nats0 is not None and nats1 is not None else None,
    )


# ---------------------------------------------------------------------------------------------
# the highest rate within the SLO, then the full run


@dataclass(slots=True)
class RouterResult:
    router: str
    trials: list[RunResult] = field(default_factory=list)
    finals: list[RunResult] = field(default_factory=list)  # the last one is the result

    @property
    def final(self) -> RunResult | None:
        return self.finals[-1] if self.finals else None


async def measure(
    target: Target,
    requests: list[Request],
    plan: Plan,
    slo_ms: float,
    seed: int,
    console: Console,
    cost_scale: float = 1.0,
) -> RouterResult:
    """Bisect the offered rate on short trials to the highest one within the SLO; then the full run. Trials last
    `plan.trial_s` × `cost_scale` (a slower fleet's few seconds hold as many batches)."""
    result = RouterResult(target.name)
    ideal = ideal_rate(cost_scale)
    # lo always met the SLO here; hi never does ("ideal" runs every batch at the longest rows: a box that
    # holds rows enough to pack them by length does better, and pull's boxes did pass 1.2 × ideal).
    lo, hi = 0.25 * ideal, 1.5 * ideal
    trial_deadline_s = 10 * slo_ms / 1000  # later than this is a failure anyway: keep trials short
    for step in range(plan.search_steps):
        rate = math.sqrt(lo * hi)
        count = max(400, int(rate * plan.trial_s * cost_scale))
        trial = await run_once(target, requests[:count], rate, seed + 7919 * (step + 1), trial_deadline_s)
        result.trials.append(trial)
        ok = trial.meets(slo_ms * _TRIAL_MARGIN)
        console.print(
            f"  {target.name:>4} trial {step + 1}: {rate:6.0f} req/s offered -> p99 {_ms(trial.p99_ms)} "
            f"{'≤' if ok else '>'} {slo_ms * _TRIAL_MARGIN:.0f} ms"
        )
        lo, hi = (rate, hi) if ok else (lo, rate)
    rate = lo * _STEP_DOWN
    for attempt in range(plan.full_runs):
        final = await run_once(target, requests, rate, seed, 30.0 * cost_scale)
        result.finals.append(final)
        console.print(
            f"  {target.name:>4} full run: {len(requests)} requests at {rate:.0f} req/s -> "
            f"{final.throughput:.0f} req/s, p50 {_ms(final.p50_ms)}, p99 {_ms(final.p99_ms)}, "
            f"loop lag p99 {final.loop_lag_p99_ms:.1f} ms, CPU {final.cpu_share:.0%} of a core"
        )
        if final.meets(slo_ms) or attempt + 1 == plan.full_runs:
            break
        rate *= _STEP_DOWN
    return result


def _ms(value: float) -> str:
    return "lost" if math.isinf(value) else f"{value:.0f} ms"


async def run_all(args: argparse.Namespace, console: Console) -> dict[str, RouterResult]:
    plan = PLANS["quick" if args.quick else "full"]
    if args.requests:
        plan = replace(plan, requests=args.requests)
    requests = make_requests(plan.requests, args.seed)
    results: dict[str, RouterResult] = {}
    with tempfile.TemporaryDirectory(prefix="fbx-pull-vs-push-") as tmp:
        for router in args.routers:
            target: PullFleet | PushFleet
            if router == "pull":
                target = PullFleet(router, Path(tmp), args.seed, None, args.cost_scale, args.hold_ms)
            elif router == "pull-2b":
                target = PullFleet(router, Path(tmp), args.seed, args.worker_capacity, args.cost_scale, args.hold_ms)
            else:
                target = PushFleet(router, args.seed, args.cost_scale, args.lor_refresh_ms / 1000)
            console.print(f"[bold]{title(router, args.worker_capacity)}[/]")
            try:
                await target.start()
                if args.gc_freeze:
                    # Nine boxes' garbage in one process: without this, full collections walk every
                    # object torch and transformers left behind and stop the loop for ~0.3 s each.
                    gc.collect()
                    gc.freeze()
                results[router] = await measure(
                    target, requests, plan, args.slo_ms, args.seed, console, args.cost_scale
                )
            finally:
                await target.close()
    return results


# ---------------------------------------------------------------------------------------------
# the report


def load_average() -> str:
    """The machine's 1-minute load average: other work on a small shared machine shows here."""
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except (OSError, IndexError):
        return "?"


def title(router: str, worker_capacity: int) -> str:
    return TITLES[router].format(capacity=worker_capacity)


def report(console: Console, results: dict[str, RouterResult], slo_ms: float, worker_capacity: int) -> None:
    finals = {router: result.final for router, result in results.items() if result.final is not None}
    table = Table(title=f"Pull vs push: 8 unequal workers, at the highest Poisson rate with p99 ≤ {slo_ms:g} ms")
    for column in ("router", "offered req/s", "throughput req/s", "p50 ms", "p99 ms", "within SLO", "lost"):
        table.add_column(column, justify="left" if column == "router" else "right")
    for router, final in finals.items():
        table.add_row(
            title(router, worker_capacity),
            f"{final.offered:.0f}",
            f"{final.throughput:.0f}",
            f"{final.p50_ms:.0f}",
            _ms(final.p99_ms).removesuffix(" ms"),
            "yes" if final.meets(slo_ms) else "[red]no[/]",
            str(final.failed),
        )
    console.print(table)

    ratios = Table(title="Pull's throughput over each push router's, at the same p99 SLO")
    ratios.add_column("pull")
    for push, target in TARGETS.items():
        if push in finals:
            ratios.add_column(f"× {push} (target ≥ {target})", justify="right")
    for pull in PULLS:
        if pull not in finals:
            continue
        cells = []
        for push, target in TARGETS.items():
            if push not in finals:
                continue
            ratio = finals[pull].throughput / finals[push].throughput
            met = ratio >= target and finals[pull].meets(slo_ms)
            cells.append(f"{ratio:.2f} " + ("[green]met[/]" if met else "[red]not met[/]"))
        ratios.add_row(title(pull, worker_capacity), *cells)
    if ratios.row_count:
        console.print(ratios)

    workers = Table(title="Each worker in the full run: busy = share of the time in the runtime, stalls included")
    workers.add_column("router")
    workers.add_column("")
    for index, speed in enumerate(SPEEDS):
        workers.add_column(f"w{index} {speed:g}×", justify="right")
    workers.add_column("stalls", justify="right")
    for router, final in finals.items():
        total = sum(final.rows) or 1
        workers.add_row(router, "busy", *(f"{b:.0%}" for b in final.busy), str(final.stalls))
        workers.add_row("", "share of rows", *(f"{n / total:.1%}" for n in final.rows), "")
        per_batch = (f"{n / b:.1f}" if b else "-" for n, b in zip(final.rows, final.batches, strict=True))
        workers.add_row("", "rows per batch", *per_batch, "", end_section=True)
    console.print(workers)

    health = Table(title="The measuring process in each full run (is the event loop the bottleneck?)")
    columns = (
        "router",
        "loop lag p99 ms",
        "loop lag max ms",
        "longest gc ms",
        "this process CPU",
        "nats-server CPU",
        "msgs per pull",
    )
    for column in columns:
        health.add_column(column, justify="left" if column == "router" else "right")
    for router, final in finals.items():
        nats = f"{final.nats_cpu_share:.0%}" if final.nats_cpu_share is not None else "-"
        per_pull = f"{final.requests / final.pull_requests:.1f}" if final.pull_requests else "-"
        health.add_row(
            router,
            f"{final.loop_lag_p99_ms:.1f}",
            f"{final.loop_lag_max_ms:.1f}",
            f"{final.gc_max_ms:.1f}",
            f"{final.cpu_share:.0%}",
            nats,
            per_pull,
        )
    console.print(health)
    bound = [
        router
        for router, final in finals.items()
        if final.cpu_share >= SATURATED_CPU_SHARE or final.loop_lag_p99_ms > LATE_LOOP_MS
    ]
    if bound:
        console.print(
            f"[bold yellow]warning:[/] in the full runs of {', '.join(bound)} this process ran at "
            f"{SATURATED_CPU_SHARE:.0%} of a core or more, or its event loop was late by over {LATE_LOOP_MS:.0f} ms at "
            "p99: the one loop the boxes share (saturated, or starved by other work on this machine) set the pace, so "
            "those figures measure the machine, not how the fleet dispatches (docs/benchmarks.md, run 25); run again "
            "with a --cost-scale above 1 (slower modelled workers, the SLO scaled with them)"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=0, help="requests in each full run (default 20,000)")
    parser.add_argument("--quick", action="store_true", help="3,000 requests, shorter and fewer search trials")
    parser.add_argument(
        "--slo-ms", type=float, default=None, help="the p99 every router must meet (default: 500 × --cost-scale)"
    )
    parser.add_argument(
        "--hold-ms",
        type=float,
        default=None,
        help="the pull boxes' hold_ms (default: as shipped, 150, × --cost-scale)",
    )
    parser.add_argument(
        "--lor-refresh-ms",
        type=float,
        default=None,
        help="how often the least-outstanding router's view is refreshed (default: 100 × --cost-scale)",
    )
    parser.add_argument(
        "--cost-scale",
        type=float,
        default=1.0,
        help="multiply the modelled workers' durations (batch cost, stalls): 3 on a machine whose Python is slow "
        "enough that this process's loop sets the pace (the run warns so)",
    )
    parser.add_argument("--seed", type=int, default=6)
    parser.add_argument(
        "--routers",
        default=",".join(ROUTERS),
        type=lambda s: [r for r in s.split(",") if r],
        help=f"comma-separated, from {', '.join(ROUTERS + EXTRA_ROUTERS)} (default: {','.join(ROUTERS)})",
    )
    parser.add_argument(
        "--worker-capacity",
        type=int,
        default=2 * BATCHING.max_batch_size,
        help="the pull-2b boxes' worker_capacity (default: 2 × max_batch_size)",
    )
    parser.add_argument(
        "--gc-freeze",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="move the objects alive after start-up out of the collector's reach (default: yes)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write every trial and run here")
    args = parser.parse_args(argv)
    if args.cost_scale <= 0:
        parser.error("--cost-scale must be above 0")
    if args.slo_ms is None:
        args.slo_ms = 500.0 * args.cost_scale
    if args.lor_refresh_ms is None:
        args.lor_refresh_ms = LOR_REFRESH_S * 1000 * args.cost_scale
    if args.hold_ms is None:  # as shipped, scaled
        args.hold_ms = Settings.model_fields["hold_ms"].default * args.cost_scale
    unknown = set(args.routers) - set(ROUTERS) - set(EXTRA_ROUTERS)
    if unknown:
        parser.error(f"unknown routers: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("appliance").setLevel(logging.ERROR)  # boxes stopping say "nats disconnected"
    console = Console(width=None if sys.stdout.isatty() else 150)
    started = time.perf_counter()
    info = machine()
    commit = git_describe()  # the code measured: read before the run, as HEAD may move during it
    console.print(
        f"pull vs push on {info.get('cpu', '?')} ({info['nproc']} cores, load average {load_average()}), "
        f"commit {commit}; "
        f"speeds {', '.join(f'{s:g}×' for s in SPEEDS)}; cost model {scaled_cost(args.cost_scale)}; "
        f"batches of ≤ {BATCHING.max_batch_size}; "
        f"ideal fleet rate {ideal_rate(args.cost_scale):.0f} req/s; "
        f"lor's view refreshed every {args.lor_refresh_ms:g} ms; pull boxes' hold_ms {args.hold_ms:g}"
    )
    console.print(
        "push routers' workers: the same no-op runtime and Batcher, in-process, reached by a function call "
        "(no transport); pull goes through real NATS JetStream and real boxes"
    )
    results = asyncio.run(run_all(args, console))
    report(console, results, args.slo_ms, args.worker_capacity)
    elapsed = time.perf_counter() - started
    info["load_average_end"] = load_average()
    console.print(
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}, {elapsed:.0f} s in all, "
        f"load average {info['load_average_end']} at the end"
    )
    if args.json is not None:
        figures = {
            "machine": info,
            "commit": commit,
            "slo_ms": args.slo_ms,
            "speeds": SPEEDS,
            "cost": scaled_cost(args.cost_scale),
            "cost_scale": args.cost_scale,
            "lor_refresh_ms": args.lor_refresh_ms,
            "hold_ms": args.hold_ms,
            "results": {router: asdict(result) for router, result in results.items()},
        }
        args.json.write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    return 0


if __name__ == "__main__":
    sys.exit(main())
