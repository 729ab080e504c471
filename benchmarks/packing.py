"""Packing (issue 3): many models under one memory budget, fleetbox's byte budget against count-based LRU.

Twelve embedders of different sizes (three copies of the packaged all-MiniLM-L6-v2 under other
names, 111 MiB each as measured, and nine random BERTs of 12 to 90 MiB) share a budget that
holds about four of them (four times their mean estimated size). Zipf(1.1) traffic (seeded; which
model gets which popularity rank is a seeded shuffle) asks for them one sentence per request.
Every request calls `Residency.ensure_loaded` on the real `appliance.residency.Residency` and then
runs a real forward pass on the returned runtime, on one device thread as a box does; loads run on
the residency's own executor. With one client (the default) each policy decides exactly as written
and hits, loads and evictions depend only on the seed; with `--concurrency C` loads overlap with
other models' requests and with each other, as in a busy box, and any policy that budgets only what
has finished loading can briefly hold more than it allows (that run shows by how much).

Policies, each on a fresh `Residency` and the same request sequence:

  fleetbox     the residency as built: evict unpinned models until the newcomer's estimated bytes
               fit the budget, first the one whose bytes will wait longest for their next request
               (its bytes times the gap between requests its demand says, or its time unused if
               longer: `Residency._idle_cost`); the most popular model is pinned.
  fleetbox-lru the same residency evicting the least recently used first (`RecencyOnly` below):
               fleetbox's order until 2026-12-02.
  count-K      the way Ray Serve's model multiplexing evicts (`max_num_models_per_replica`): keep at
               most K loaded models, whatever their size, evicting the least recently used before a
               load. A small wrapper written for this comparison (`CountLimit` below) drives the
               same `Residency` with an unbounded byte budget; K = 4 is "holds about 4" by count.
  count-safe   the same with the largest K that cannot overflow the budget while loads do not
               overlap (K = budget // the largest model): what an operator must choose to be safe
               from OOM with a count rule.

Both kinds start with the most popular model loaded (not counted). A request is *cold* when its
model is not resident as it arrives (it waits for a load, its own or one in flight). Eviction waits
for the victim's in-flight forward passes to finish, like a box draining a worker (`before_evict`).
"Peak / budget" is the most measured bytes resident at once: above 100% a GPU would have run out.
A model evicted before a request that waited for it could run is loaded again for that request.

    python benchmarks/packing.py [--quick] [--requests N] [--concurrency C] [--threads T]
                                 [--policies fleetbox,fleetbox-lru,count,count-safe] [--seed S] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere: `appliance` is importable
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from appliance.bus import model_slug  # noqa: E402
from appliance.catalog import Batching, ModelSpec  # noqa: E402
from appliance.metrics import Metrics  # noqa: E402
from appliance.model_bytes import estimate_bytes  # noqa: E402
from appliance.residency import Residency, Resident  # noqa: E402
from benchmarks._models import build_embedder, copy_embedder, machine, run_benchmark  # noqa: E402
from runtimes import Runtime, RuntimeKind, Task  # noqa: E402

ZIPF_S = 1.1
BUDGET_MODELS = 4
MINILM_COPIES = 3
# (hidden, layers) of the random BERTs; the 30522-token embedding table dominates the small ones.
RANDOM_SHAPES = ((64, 1), (64, 2), (128, 1), (128, 2), (192, 2), (256, 2), (256, 4), (320, 4), (384, 3))
WORDS = """the a of to in for on with model fleet box queue request reply batch token vector worker stream
city river mountain forest garden kitchen window door street market morning evening night summer winter
quick slow quiet bright dark warm cold small large long short runs reads writes sends waits builds""".split()
_UNBOUNDED = 1 << 62


@dataclass(slots=True, frozen=True)
class Plan:
    requests: int
    concurrency: int


PLANS = {"full": Plan(requests=300, concurrency=1), "quick": Plan(requests=100, concurrency=1)}


@dataclass(slots=True, frozen=True)
class Model:
    spec: ModelSpec
    kind: str
    estimate: int  # bytes, what the residency budgets before a load
    share: float  # of the traffic


@dataclass(slots=True)
class Outcome:
    policy: str
    description: str
    requests: int = 0
    hits: int = 0
    loads: int = 0
    evictions: int = 0
    load_s: float = 0.0
    seconds: float = 0.0
    peak_bytes: int = 0
    max_resident: int = 0
    budget: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    cold_ms: list[float] = field(default_factory=list)
    hot_ms: list[float] = field(default_factory=list)
    measured: dict[str, int] = field(default_factory=dict)  # model -> bytes, as measured at load
    loaded: set[tuple[str, float]] = field(default_factory=set)  # (model, loaded_at) of each load seen
    loaded_bytes: int = 0  # measured bytes of every load during the traffic: the work cold starts did

    def figures(self) -> dict[str, Any]:
        def pct(values: list[float], q: float) -> float | None:
            return float(np.percentile(values, q)) if values else None

        return {
            "policy": self.policy,
            "requests": self.requests,
            "hit_rate": self.hits / self.requests if self.requests else 0.0,
            "loads": self.loads,
            "evictions": self.evictions,
            "load_s": self.load_s,
            "loaded_bytes": self.loaded_bytes,
            "requests_per_s": self.requests / self.seconds if self.seconds else 0.0,
            "p50_ms": pct(self.latencies_ms, 50),
            "hot_p50_ms": pct(self.hot_ms, 50),
            "cold_p50_ms": pct(self.cold_ms, 50),
            "cold_p99_ms": pct(self.cold_ms, 99),
            "cold_requests": len(self.cold_ms),
            "peak_bytes": self.peak_bytes,
            "peak_over_budget": self.peak_bytes / self.budget if self.budget else 0.0,
            "max_resident": self.max_resident,
        }


# ---------------------------------------------------------------------------------------------
# the models and the traffic


def build_models(folder: Path, seed: int) -> list[Model]:
    """Twelve model folders, their specs, and a seeded Zipf popularity rank for each."""
    specs: list[tuple[ModelSpec, str]] = []
    for i in range(MINILM_COPIES):
        name = f"minilm-copy-{i + 1}"
        specs.append((_spec(name, copy_embedder(folder / name)), "all-MiniLM-L6-v2 copy"))
    for i, (hidden, layers) in enumerate(RANDOM_SHAPES):
        name = f"bert-h{hidden}-l{layers}"
        path = build_embedder(folder / name, hidden=hidden, layers=layers, seed=seed + i)
        specs.append((_spec(name, path), f"random BERT {hidden}x{layers}"))
    order = random.Random(seed).sample(range(len(specs)), len(specs))  # order[rank] = model index
    weights = np.array([1.0 / (rank + 1) ** ZIPF_S for rank in range(len(specs))])
    weights /= weights.sum()
    models = []
    for rank, index in enumerate(order):
        spec, kind = specs[index]
        models.append(Model(spec, kind, estimate_bytes(spec), float(weights[rank])))
    return models  # in popularity order: models[0] is the most requested


def _spec(name: str, path: Path) -> ModelSpec:
    return ModelSpec(
        name=name,
        slug=model_slug(name),
        task=Task.EMBED,
        runtime=RuntimeKind.TORCH,
        path=path,
        batching=Batching(max_batch_tokens=16_384, max_batch_size=32, max_wait_ms=2.0),
    )


def make_traffic(models: list[Model], count: int, seed: int) -> list[tuple[int, str]]:
    """(model index, sentence) per request: Zipf(1.1) over the popularity ranks, seeded."""
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(models), size=count, p=[m.share for m in models])
    words = random.Random(seed)
    return [(int(i), " ".join(words.choice(WORDS) for _ in range(words.randint(8, 24)))) for i in picks]


# ---------------------------------------------------------------------------------------------
# the policies


class InFlight:
    """Forward passes running per model; an eviction waits for its victim's to finish (as a box drains).

    A request counts itself in only once its model is resident (`enter` does not yield), so an
    eviction never waits on a request that is itself waiting for room: no cycle.
    """

    def __init__(self) -> None:
        self._running: Counter[str] = Counter()
        self._changed = asyncio.Condition()

    def enter(self, name: str) -> None:
        self._running[name] += 1

    async def leave(self, name: str) -> None:
        self._running[name] -= 1
        async with self._changed:
            self._changed.notify_all()

    async def idle(self, name: str) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._running[name] <= 0)


class CountLimit:
    """Count-based LRU over a `Residency` (for this comparison only): at most `limit` models, any size.

    The residency's byte budget is unbounded, so its own rule never fires. Before a cold model
    loads, this evicts the least recently used loaded models until fewer than `limit` are loaded,
    then loads: the rule of Ray Serve's model multiplexing (`max_num_models_per_replica`), which
    counts loaded models only, so loads that overlap can briefly hold more (as fleetbox's
    residency, which budgets loaded bytes only, can hold more bytes).
    """

    def __init__(self, residency: Residency, limit: int) -> None:
        self.residency = residency
        self.limit = limit
        self._claimed: set[str] = set()  # cold models whose room is being made: one eviction round each

    async def ensure_loaded(self, spec: ModelSpec) -> Runtime:
        residency = self.residency
        name = spec.name
        if not residency.is_resident(name) and not residency.is_loading(name) and name not in self._claimed:
            self._claimed.add(name)
            try:
                while len(residency.residents()) >= self.limit:
                    victims = sorted(residency.residents(), key=lambda r: r.last_used)
                    await residency.evict(victims[0].spec.name, reason="count")
            finally:
                self._claimed.discard(name)
        return await residency.ensure_loaded(spec)


class RecencyOnly(Residency):
    """fleetbox's residency with its eviction order before 2026-12-02, for this comparison: within the same idle and
    turn rules, the least recently used first (every cost the same, ties go least recently used)."""

    def _idle_cost(self, resident: Resident, now: float) -> float:
        return 0.0


@dataclass(slots=True, frozen=True)
class Policy:
    key: str  # what --policies names
    name: str
    description: str
    count_limit: int | None  # None: fleetbox's byte budget with the top model pinned
    recency_only: bool = False  # fleetbox's residency with its order before 2026-12-02 (`RecencyOnly`)


async def run_policy(
    policy: Policy,
    models: list[Model],
    traffic: list[tuple[int, str]],
    budget: int,
    concurrency: int,
    threads: int,
) -> Outcome:
    metrics = Metrics()
    loader = ThreadPoolExecutor(2, thread_name_prefix="bench-load")
    device = ThreadPoolExecutor(1, thread_name_prefix="bench-device")
    in_flight = InFlight()
    kind = RecencyOnly if policy.recency_only else Residency
    residency = kind(
        "cpu",
        threads,
        _UNBOUNDED if policy.count_limit is not None else budget,
        metrics,
        loader,
        before_evict=in_flight.idle,
    )
    counted = CountLimit(residency, policy.count_limit) if policy.count_limit is not None else None
    ensure = counted.ensure_loaded if counted is not None else residency.ensure_loaded
    outcome = Outcome(policy.name, policy.description, budget=budget)
    hot = models[0].spec
    if counted is None:
        residency.pinned.add(hot.name)
    await residency.ensure_loaded(hot)  # a box starts with its pinned model; both policies start alike
    base_loads = _total(metrics.loads)
    base_load_s = _histogram_sum(metrics.load_seconds)
    loop = asyncio.get_running_loop()
    queue = iter(traffic)

    async def client() -> None:
        for index, text in queue:
            spec = models[index].spec
            started = time.perf_counter()
            cold = not residency.is_resident(spec.name)
            runtime = await _acquire(ensure, residency, in_flight, spec)
            resident = residency.get(spec.name)
            if resident is not None:
                outcome.measured[spec.name] = resident.nbytes
                if cold and (spec.name, resident.loaded_at) not in outcome.loaded:
                    outcome.loaded.add((spec.name, resident.loaded_at))
                    outcome.loaded_bytes += resident.nbytes
            try:
                outcome.peak_bytes = max(outcome.peak_bytes, residency.used_bytes)
                outcome.max_resident = max(outcome.max_resident, len(residency.residents()))
                await loop.run_in_executor(device, lambda r=runtime, t=text: r.run(r.tokenize([t])))
                residency.touch(spec.name, answered=1)  # answered, as a box's worker says
            finally:
                await in_flight.leave(spec.name)
            elapsed = (time.perf_counter() - started) * 1000
            outcome.requests += 1
            outcome.latencies_ms.append(elapsed)
            if cold:
                outcome.cold_ms.append(elapsed)
            else:
                outcome.hits += 1
                outcome.hot_ms.append(elapsed)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    outcome.seconds = time.perf_counter() - started
    outcome.loads = int(_total(metrics.loads) - base_loads)
    outcome.load_s = _histogram_sum(metrics.load_seconds) - base_load_s
    outcome.evictions = int(_total(metrics.evictions))
    await residency.close()
    loader.shutdown(wait=True)
    device.shutdown(wait=True)
    return outcome


async def _acquire(
    ensure: Callable[[ModelSpec], Awaitable[Runtime]], residency: Residency, in_flight: InFlight, spec: ModelSpec
) -> Runtime:
    """The model's runtime, counted in flight; again if it was evicted before this request resumed."""
    while True:
        runtime = await ensure(spec)
        in_flight.enter(spec.name)
        resident = residency.get(spec.name)
        if resident is not None and resident.runtime is runtime:
            return runtime
        await in_flight.leave(spec.name)


def _total(metric: Any) -> float:
    return sum(s.value for m in metric.collect() for s in m.samples if s.name.endswith("_total"))


def _histogram_sum(metric: Any) -> float:
    return sum(s.value for m in metric.collect() for s in m.samples if s.name.endswith("_sum"))


# ---------------------------------------------------------------------------------------------
# the report


def mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def render(models: list[Model], outcomes: list[Outcome], budget: int, info: dict[str, Any], console: Console) -> None:
    measured: dict[str, int] = {}
    for outcome in outcomes:
        measured |= outcome.measured
    table = Table(title=f"Models (budget {mib(budget)} MiB = {BUDGET_MODELS} x mean estimate)")
    for column in ("rank", "model", "kind", "estimate MiB", "measured MiB", "traffic"):
        table.add_column(column, justify="left" if column in ("model", "kind") else "right")
    for rank, model in enumerate(models, start=1):
        seen = measured.get(model.spec.name)
        table.add_row(
            f"{rank}{' (pinned)' if rank == 1 else ''}",
            model.spec.name,
            model.kind,
            mib(model.estimate),
            mib(seen) if seen is not None else "-",
            f"{model.share:.1%}",
        )
    console.print(table)

    table = Table(title=f"Packing: {info['requests']} requests, Zipf({ZIPF_S}), {info['concurrency']} client(s)")
    columns = (
        "policy",
        "hit rate",
        "loads",
        "evictions",
        "load s",
        "MiB loaded",
        "req/s",
        "hot p50 ms",
        "cold p50 ms",
        "cold p99 ms",
        "peak / budget",
        "max resident",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "policy" else "right")
    for outcome in outcomes:
        f = outcome.figures()
        table.add_row(
            outcome.policy,
            f"{f['hit_rate']:.1%}",
            str(f["loads"]),
            str(f["evictions"]),
            f"{f['load_s']:.1f}",
            mib(f["loaded_bytes"]),
            f"{f['requests_per_s']:.2f}",
            _ms(f["hot_p50_ms"]),
            _ms(f["cold_p50_ms"]),
            _ms(f["cold_p99_ms"]),
            f"{f['peak_over_budget']:.0%}",
            str(f["max_resident"]),
        )
    console.print(table)
    reference = outcomes[0].figures()
    for outcome in outcomes[1:]:
        f = outcome.figures()
        console.print(
            f"fleetbox vs {outcome.policy}: throughput x{_ratio(reference['requests_per_s'], f['requests_per_s'])}, "
            f"loads x{_ratio(reference['loads'], f['loads'])}, "
            f"hit rate {reference['hit_rate']:.1%} vs {f['hit_rate']:.1%}, "
            f"peak {reference['peak_over_budget']:.0%} vs {f['peak_over_budget']:.0%} of the budget"
        )
    for outcome in outcomes:
        console.print(f"  {outcome.policy}: {outcome.description}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "inf"


# ---------------------------------------------------------------------------------------------


async def main_async(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    plan = PLANS["quick" if args.quick else "full"]
    requests = args.requests or plan.requests
    concurrency = args.concurrency or plan.concurrency
    with tempfile.TemporaryDirectory(prefix="fbx-packing-") as tmp:
        console.print("building 12 model folders ...")
        models = build_models(Path(tmp), args.seed)
        budget = int(BUDGET_MODELS * np.mean([m.estimate for m in models]))
        largest = max(m.estimate for m in models)
        policies = [
            Policy(
                "fleetbox",
                "fleetbox",
                "byte budget, longest idle bytes first (appliance.residency), most popular model pinned",
                None,
            ),
            Policy(
                "fleetbox-lru",
                "fleetbox-lru",
                "the same residency, least recently used first (fleetbox until 2026-12-02)",
                None,
                recency_only=True,
            ),
            Policy(
                "count",
                f"count-{BUDGET_MODELS}",
                f"count-based LRU, at most {BUDGET_MODELS} models (Ray-style)",
                BUDGET_MODELS,
            ),
            Policy(
                "count-safe",
                f"count-safe-{budget // largest}",
                f"count-based LRU, at most {budget // largest} models (budget // largest model: never over budget "
                "while loads do not overlap)",
                budget // largest,
            ),
        ]
        wanted = set(args.policies.split(",")) if args.policies else None
        policies = [p for p in policies if wanted is None or p.key in wanted]
        traffic = make_traffic(models, requests, args.seed)
        outcomes = []
        for policy in policies:
            console.print(f"running {policy.name} ...")
            outcomes.append(await run_policy(policy, models, traffic, budget, concurrency, args.threads))
    info = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "requests": requests,
        "concurrency": concurrency,
        "threads": args.threads,
        "seed": args.seed,
        "budget_bytes": budget,
    }
    render(models, outcomes, budget, info, console)
    return {
        **info,
        "models": [{"name": m.spec.name, "kind": m.kind, "estimate": m.estimate, "share": m.share} for m in models],
        "outcomes": [o.figures() | {"description": o.description} for o in outcomes],
        "policies": [asdict(p) for p in policies],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--requests", type=int, help="requests per policy (default 300; 100 with --quick)")
    parser.add_argument("--concurrency", type=int, help="concurrent clients (default 1: every policy exact)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per model (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", help="comma-separated subset: fleetbox,fleetbox-lru,count,count-safe")
    run_benchmark(parser, main_async)


if __name__ == "__main__":
    main()
