"""The load `fleetbox tune` measures with: realistic requests, closed-loop, through the real batcher.

The one idea: a candidate is measured the way a box runs it, minus the network. `concurrency`
clients each send a request (one to eight inputs, of a seeded spread of lengths, tokenised by the
model's own tokenizer), wait for its answer, and send the next, so the batcher sees the arrivals
and the company it would see behind a queue. The warm-up lasts until every client has had an
answer (the steady state), then the run is cut into equal windows, each at least three typical
request latencies long, so a slow candidate's big batches do not leave a window empty. Throughput
is the inputs answered over the whole measured part; `spread` is how much the windows disagree,
which is what lets the tuner tell a real difference from a noisy neighbour.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from appliance.batcher import Batcher
from appliance.catalog import Batching
from appliance.envelope import RequestMeta
from appliance.metrics import Metrics
from appliance.work import Job
from runtimes import Runtime, Task, Tokenized
from runtimes.base import PairRuntime

# Plain text of the kinds an embedding service sees: queries, product copy, support mail, news,
# code, numbers, other languages. Inputs are word windows cut from it at seeded lengths.
CORPUS = (
    "how do I reset my password if I no longer have access to the email on the account",
    "The new stainless steel kettle boils a full litre in under three minutes and switches off by itself.",
    "Quarterly revenue rose eleven percent, driven by subscriptions in Europe and a stronger dollar.",
    "Photosynthesis converts light energy into chemical energy that is stored in glucose molecules.",
    "def merge(a, b): return sorted(a + b, key=lambda item: (item.priority, item.created_at))",
    "Der Zug nach München fährt heute wegen Bauarbeiten erst um 14:30 von Gleis sieben ab.",
    "Customers who bought this tent also looked at sleeping bags, head torches and folding chairs.",
    "The committee will meet on Thursday to review the budget, the hiring plan and the office move.",
    "Il pleut depuis trois jours et la rivière a débordé dans les champs au sud du village.",
    "Error 503: the upstream service did not answer within 30 seconds; retry with backoff.",
    "Rivers carry sediment from the mountains to the sea, shaping valleys, plains and deltas over time.",
    "best budget noise cancelling headphones for long flights 2024",
    "Patients with mild symptoms should rest, drink fluids and contact a doctor if the fever lasts.",
    "SELECT customer_id, SUM(total) FROM orders WHERE status = 'paid' GROUP BY customer_id;",
    "The archive keeps letters, ledgers and maps from three centuries of trade along the coast.",
    "東京は日本の首都であり、世界で最も人口の多い都市圏のひとつです。",
    "Please find attached the signed contract; the first invoice will follow at the end of the month.",
    "A good night's sleep improves memory, mood and the body's ability to fight infection.",
    "Shipping is free on orders over fifty euros and returns are accepted within thirty days.",
    "The match was postponed after heavy rain left the pitch flooded an hour before kick-off.",
)
_ROWS_PER_REQUEST = (1, 1, 1, 1, 2, 2, 3, 4, 8)


def texts(count: int, seed: int, median_words: float = 14.0, max_words: int = 300) -> list[str]:
    """`count` inputs with a seeded log-normal spread of lengths (a few words to a few hundred)."""
    rng = np.random.default_rng(seed)
    words = " ".join(CORPUS).split()
    lengths = np.clip(np.rint(rng.lognormal(np.log(median_words), 0.9, count)), 2, max_words).astype(int)
    out = []
    for n in lengths:
        start = int(rng.integers(0, len(words)))
        out.append(" ".join(words[(start + i) % len(words)] for i in range(int(n))))
    return out


def pairs(count: int, seed: int) -> list[tuple[str, str]]:
    """(query, document) pairs for a reranker: short queries, documents of the usual spread."""
    queries = texts(count, seed, median_words=6.0, max_words=24)
    documents = texts(count, seed + 1)
    return list(zip(queries, documents, strict=True))


def inputs_for(task: Task, count: int, seed: int) -> list[Any]:
    """`count` inputs of the built-in mix: texts, or (query, document) pairs for a reranker."""
    return pairs(count, seed) if task is Task.SCORE else texts(count, seed)


def tokenize_for(runtime: Runtime, task: Task, inputs: list[Any]) -> list[Tokenized]:
    """Inputs as the model's own tokenizer makes rows of them: pairs for a reranker, texts otherwise."""
    if task is Task.SCORE:
        assert isinstance(runtime, PairRuntime)
        return runtime.tokenize_pairs(inputs)
    return runtime.tokenize(inputs)


def tokenize_inputs(runtime: Runtime, task: Task, count: int, seed: int) -> list[Tokenized]:
    return tokenize_for(runtime, task, inputs_for(task, count, seed))


# Requests of an operator's own traffic: each a tuple of its inputs (texts; for a reranker, (query, document) pairs).
Sample = tuple[tuple[Any, ...], ...]


def read_sample(path: Path, task: Task) -> Sample:
    """Requests from a file, one a line: a request body as the API takes it (`{"input": ...}`, a string
    or a list; for a reranker `{"query": ..., "documents": [...]}`), or a plain line of text (one input)."""
    requests: list[tuple[Any, ...]] = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            requests.append((line,))
            continue
        try:
            body = orjson.loads(line)
            if task is Task.SCORE:
                query, documents = body["query"], body["documents"]
                inputs: tuple[Any, ...] = tuple((query, d if isinstance(d, str) else d["text"]) for d in documents)
            else:
                given = body["input"]
                inputs = (given,) if isinstance(given, str) else tuple(given)
            if not inputs or not all(isinstance(i, str | tuple) for i in inputs):
                raise ValueError("no inputs")
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            field = '"query" and "documents"' if task is Task.SCORE else '"input" (a string or a list of strings)'
            raise ValueError(f"{path}:{number}: not a request body with {field} ({exc})") from None
        requests.append(inputs)
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return tuple(requests)


def mix(task: Task, count: int, seed: int, sample: Sample | None = None) -> list[tuple[Any, ...]]:
    """`count` requests, each a tuple of inputs: one to eight of the built-in mix, or drawn from an
    operator's `sample` of requests (seeded). A benchmark can send the same requests over HTTP."""
    rng = np.random.default_rng(seed + 7)
    if sample is not None:
        return [sample[int(i)] for i in rng.integers(0, len(sample), count)]
    sizes = [int(rng.choice(_ROWS_PER_REQUEST)) for _ in range(count)]
    inputs = inputs_for(task, sum(sizes), seed)
    at = list(itertools.accumulate(sizes, initial=0))
    return [tuple(inputs[a:b]) for a, b in itertools.pairwise(at)]


def make_requests(
    runtime: Runtime, task: Task, count: int, seed: int, sample: Sample | None = None
) -> list[list[Tokenized]]:
    """The requests of `mix`, tokenised by the model's own tokenizer."""
    requests = mix(task, count, seed, sample)
    inputs = [item for request in requests for item in request]
    rows = tokenize_for(runtime, task, inputs)
    at = list(itertools.accumulate((len(request) for request in requests), initial=0))
    return [rows[a:b] for a, b in itertools.pairwise(at)]


@dataclass(slots=True, frozen=True)
class Load:
    """How hard and how long a candidate is driven."""

    concurrency: int = 16
    warmup_s: float = 0.5  # at least; and until every client has had an answer
    window_s: float = 1.0  # at least; and three typical request latencies
    windows: int = 3
    requests: int = 512  # distinct requests, cycled
    seed: int = 0
    max_window_s: float = 20.0  # a candidate slower than this per window is not worth the wait
    sample: Sample | None = None  # requests of the operator's own traffic instead of the built-in mix
    sample_source: str | None = None  # where they came from, for the profile and report

    @property
    def described(self) -> str:
        if self.sample is None:
            return "built-in mix"
        return f"{len(self.sample)} requests from {self.sample_source or 'a sample'}"

    @property
    def seconds(self) -> float:
        """The shortest a measurement can take (the budget's estimate for the next one)."""
        return self.warmup_s + self.window_s * self.windows


@dataclass(slots=True, frozen=True)
class Measurement:
    throughput: float  # inputs per second over the measured part
    p50_ms: float  # request latency, every window pooled
    p99_ms: float
    spread: float  # (max - min) / median of the windows' throughputs
    windows: tuple[float, ...]
    requests: int
    seconds: float  # wall time of the run, warm-up included
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.requests > 0


def measure(
    runtime: Runtime,
    batching: Batching,
    requests: list[list[Tokenized]],
    load: Load,
    stop: Callable[[], bool] = lambda: False,
) -> Measurement:
    """Drive one runtime with one batching under the closed-loop load; blocking."""
    import uvloop

    return uvloop.run(_closed_loop(runtime, batching, requests, load, stop))


async def _closed_loop(
    runtime: Runtime, batching: Batching, requests: list[list[Tokenized]], load: Load, stop: Callable[[], bool]
) -> Measurement:
    loop = asyncio.get_running_loop()
    records: list[tuple[float, float, int]] = []  # (sent, answered, inputs), loop time
    errors: list[str] = []
    counter = itertools.count()

    def on_done(job: Job, error: Exception | None) -> None:
        if not job.handle.done():
            job.handle.set_result(error)

    started = loop.time()
    end = float("inf")  # set once warm: the clients stop sending then
    answered_clients: set[int] = set()

    async def client(index: int) -> None:
        while loop.time() < end and not stop() and not errors:
            n = next(counter)
            now_ms = int(time.time() * 1000)
            meta = RequestMeta(
                id=f"tune-{n}", task="tune", model="tune", reply="", deadline_ms=now_ms + 600_000, sent_ms=now_ms
            )
            answered: asyncio.Future[Exception | None] = loop.create_future()
            rows = requests[n % len(requests)]
            sent = loop.time()
            batcher.submit(Job(meta=meta, rows=rows, handle=answered))
            error = await answered
            if error is not None:
                errors.append(repr(error))
                return
            records.append((sent, loop.time(), len(rows)))
            answered_clients.add(index)

    async def warm_up() -> tuple[float, float]:
        """Wait for the steady state; then the measured part's start and window length."""
        nonlocal end
        give_up = started + load.warmup_s + load.max_window_s
        while loop.time() < give_up and not stop() and not errors:
            if loop.time() >= started + load.warmup_s and len(answered_clients) == load.concurrency:
                break
            await asyncio.sleep(0.01)  # a timer, not a synchronisation: the clients run regardless
        typical = float(np.median([b - a for a, b, _ in records])) if records else load.max_window_s
        window = min(max(load.window_s, 3 * typical), load.max_window_s)
        measured_from = loop.time()
        end = measured_from + window * load.windows
        return measured_from, window

    with ThreadPoolExecutor(1, thread_name_prefix="fbx-tune-device") as executor:
        batcher = Batcher("tune", runtime, batching, executor, Metrics(), on_done)
        batcher.start()
        try:
            clients = asyncio.gather(*(client(i) for i in range(load.concurrency)))
            measured_from, window = await warm_up()
            await clients
        finally:
            await batcher.drain()
    seconds = loop.time() - started
    if errors:
        return _failed(errors[0], seconds)
    if stop() and loop.time() < end:
        return _failed("interrupted", seconds)
    return summarise(records, measured_from, window, load.windows, seconds)


def summarise(
    records: list[tuple[float, float, int]], measured_from: float, window_s: float, windows: int, seconds: float
) -> Measurement:
    """Per-window throughput (inputs answered in the window) and pooled latency of the measured part."""
    per_window = [0] * windows
    latencies = []
    for sent, answered, inputs in records:
        window = int((answered - measured_from) // window_s)
        if 0 <= window < windows:
            per_window[window] += inputs
            if sent >= measured_from:  # a request sent during warm-up waited behind the warm-up
                latencies.append((answered - sent) * 1000)
    rates = [count / window_s for count in per_window]
    median = float(np.median(rates))
    if not latencies or median <= 0:
        return _failed("no request finished inside the measured windows", seconds)
    return Measurement(
        throughput=sum(per_window) / (window_s * windows),
        p50_ms=float(np.percentile(latencies, 50)),
        p99_ms=float(np.percentile(latencies, 99)),
        spread=(max(rates) - min(rates)) / median,
        windows=tuple(rates),
        requests=len(latencies),
        seconds=seconds,
    )


def _failed(error: str, seconds: float) -> Measurement:
    return Measurement(0.0, float("inf"), float("inf"), float("inf"), (), 0, seconds, error=error)
