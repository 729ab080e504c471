"""End-to-end embeddings (issue 2): what fleetbox delivers over HTTP next to what the model can do.

One command, one run, the same seeded sentences for every case, so the ratios are comparable even
on a noisy machine:

  (a) the raw limit: the default model in this process through `runtimes.load_runtime`, on the
      engine the box runs it with (its tuning profile for this hardware: runtime, dtype, threads;
      `--raw-engine torch` for fp32 torch whatever the profile says), length-sorted, at the best
      of a few static batch sizes (tokenisation counted);
  (b) `fleetbox serve` as a subprocess, one sentence per request at concurrency 64;
  (c) the same box, 32 sentences per request at concurrency 8;
  (d) a box serving only the no-op runtime: requests/s at concurrency 64, and the latency a lone
      request pays (concurrency 1), which is all overhead: gateway, queue, worker, batcher.

The raw limit is read again between and after the boxes (neighbours on a shared machine come and
go) and the best reading is the denominator of every ratio: the conservative choice. The load
generator runs in this process (or in `--client-procs N` processes): on a small machine it
competes with the box for the same cores.
`FBX_*` variables in the environment pass through to the box, so knobs are tried with e.g.
`FBX_MAX_WAIT_MS=0 python benchmarks/e2e_embed.py --cases bd`.

    python benchmarks/e2e_embed.py [--device cpu|cuda] [--quick] [--json PATH] [--client-procs N]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime
import multiprocessing
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere: `runtimes` is importable

from benchmarks._faultkit import BoxProcess  # noqa: E402

# A fixed vocabulary, so sentences (and their token lengths) are the same on every machine.
WORDS = """
the a an of to in for on with at by from about into over after under between through during
without before around among model models fleet box boxes queue queues request requests reply
replies batch batches token tokens vector vectors sentence sentences latency throughput device
devices memory kernel network server servers client clients worker workers stream streams message
messages cache caches disk file files data record records index search query queries result
results answer answers engineer engineers team teams city cities river rivers mountain mountains
forest forests garden gardens kitchen window windows door doors street streets market markets
morning evening night day week month year summer winter spring autumn weather rain snow wind
sun moon star stars light shadow music song songs book books letter letters story stories
friend friends family child children teacher student students doctor patient nurse farmer
quick slow quiet loud bright dark warm cold early late small large long short heavy light
simple careful patient curious busy tired happy calm strange old new young fast steady
runs walks reads writes sends answers waits builds measures carries opens closes finds keeps
holds takes gives moves starts stops learns teaches watches listens speaks grows falls rises
turns breaks fixes checks counts sorts packs loads stores serves pulls pushes joins leaves
and but or so because while although when where which that then also still often never always
again together quickly slowly carefully quietly suddenly almost nearly perhaps really very
""".split()

SENTENCE_WORDS = (8, 24)
# Down to 8: the shipped CPU profile batches 8 rows, and on a 2-core VM (a)'s best was the smallest size swept
# (16, in 2026-12-05's run), so a smaller one could be the true limit.
BATCH_SIZES = (8, 16, 32, 64, 128, 256)
EMBED_MODEL = "all-minilm-l6-v2"
NOOP_MODEL = "noop"
NOOP_CONFIG = f"""default_model = false

[[models]]
name = "{NOOP_MODEL}"
runtime = "noop"
pinned = true
"""
TARGETS = {"b": 0.85, "c": 0.90, "d_rps": 3000.0, "d_p50_ms": 2.0}


@dataclass(slots=True, frozen=True)
class Plan:
    sentences: int
    sweep_sentences: int  # the batch-size sweep runs on the first of them; the limit on all
    warmup_sentences: int
    noop_requests: int
    noop_warmup: int
    lone_requests: int


PLANS = {
    "full": Plan(2000, 800, 256, noop_requests=20_000, noop_warmup=2000, lone_requests=1000),
    "quick": Plan(400, 400, 128, noop_requests=3000, noop_warmup=500, lone_requests=300),
    # A GPU runs the model tens of times faster: more work, so each phase lasts long enough to measure.
    "full-cuda": Plan(20_000, 5000, 2048, noop_requests=40_000, noop_warmup=4000, lone_requests=2000),
    "quick-cuda": Plan(4000, 4000, 512, noop_requests=5000, noop_warmup=1000, lone_requests=500),
}


def make_sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lo, hi = SENTENCE_WORDS
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(count)]


# ---------------------------------------------------------------------------------------------
# (a) the raw limit


@dataclass(slots=True, frozen=True)
class Trial:
    sentences_per_s: float
    tokenize_share: float  # of the wall time
    cpu_s: float  # this process, all threads
    seconds: float
    padding_efficiency: float  # real tokens / (rows × longest row), over all batches

    @property
    def per_cpu_s(self) -> float:
        """Sentences per CPU-second: how much work each sentence costs, whatever share of the cores we got."""
        return self.sentences_per_s * self.seconds / self.cpu_s if self.cpu_s else 0.0


@dataclass(slots=True)
class RawResult:
    per_batch_size: dict[int, float]  # sentences/s in the sweep
    best_batch_size: int
    # At the best batch size: the sweep's reading, then all the sentences before, between and after the boxes.
    readings: list[Trial]

    @property
    def reference(self) -> Trial:
        """The better reading: the conservative denominator for every ratio."""
        return max(self.readings, key=lambda trial: trial.sentences_per_s)

    def figures(self) -> dict[str, Any]:
        ref = self.reference
        return {
            "per_batch_size": self.per_batch_size,
            "best_batch_size": self.best_batch_size,
            "readings": [trial.sentences_per_s for trial in self.readings],
            "limit": ref.sentences_per_s,
            "per_cpu_s": ref.per_cpu_s,
            "cores": ref.cpu_s / ref.seconds,
            "padding_efficiency": ref.padding_efficiency,
            "tokenize_share": ref.tokenize_share,
        }


class RawModel:
    """The default model in this process: the ceiling any serving path can reach on this device.

    On the engine the box picks (its profile's runtime, dtype, threads and concurrent batches), so
    the ratios measure the serving path and not a difference of engines; `engine="torch"` is fp32
    torch regardless, one batch at a time.
    """

    def __init__(self, device: str, threads: int | None, engine: str, cache_dir: Path) -> None:
        from appliance.catalog import DEFAULT_MODEL_NAME
        from appliance.configured import configured_specs
        from appliance.devices import cpu_cores, hardware_slug
        from appliance.profiles import SHIPPED_PROFILES_DIR, ProfileBook
        from appliance.settings import Settings
        from runtimes import RuntimeKind, load_runtime

        settings = Settings(models=[], default_model=True)  # FBX_* from the environment, as the box reads them
        spec = next(s for s in configured_specs(settings) if s.name == DEFAULT_MODEL_NAME)
        if engine == "box":  # the profiles the box looks in, in its order
            roots = [root for root in (settings.profiles_dir, SHIPPED_PROFILES_DIR) if root is not None]
            spec = ProfileBook(hardware_slug(device), roots, cpu_cores()).apply(spec)
        source = spec.source(device, threads)
        if source.runtime is RuntimeKind.ONNX:
            source = replace(source, options={**source.options, "cache_dir": str(cache_dir)})
        self.concurrent = spec.batching.concurrent_batches if engine == "box" else 1
        self.engine = f"{source.runtime.value} {source.dtype}, threads {source.threads or 'default'}"
        if self.concurrent > 1:
            self.engine += f" × {self.concurrent} batches at once"
        self.runtime = load_runtime(source)
        self._threads = concurrent.futures.ThreadPoolExecutor(self.concurrent, thread_name_prefix="raw")

    def trial(self, sentences: list[str], batch_size: int) -> Trial:
        """Text in, vectors out: tokenise, sort by length, run at one static batch size (as many at once
        as the box runs)."""
        # Warm the allocator (and CUDA kernels) at this batch size on the longest rows first.
        rows = sorted(self.runtime.tokenize(sentences[: batch_size * 2]), key=lambda row: row.length)
        self.runtime.run(rows[-batch_size:])
        cpu0, started = time.process_time(), time.perf_counter()
        rows = sorted(self.runtime.tokenize(sentences), key=lambda row: row.length)
        tokenized = time.perf_counter()
        batches = [rows[at : at + batch_size] for at in range(0, len(rows), batch_size)]
        list(self._threads.map(self.runtime.run, batches))
        padded = sum(len(batch) * batch[-1].length for batch in batches)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu0
        real = sum(row.length for row in rows)
        return Trial(len(sentences) / elapsed, (tokenized - started) / elapsed, cpu, elapsed, real / padded)

    def close(self) -> None:
        self._threads.shutdown()
        self.runtime.close()


def raw_limit(model: RawModel, sentences: list[str], sweep: int) -> RawResult:
    """Sweep the batch sizes on the first `sweep` sentences, then measure the best one on all of them."""
    trials = {size: model.trial(sentences[:sweep], size) for size in BATCH_SIZES}
    best = max(trials, key=lambda size: trials[size].sentences_per_s)
    per_size = {size: trial.sentences_per_s for size, trial in trials.items()}
    return RawResult(per_size, best, [trials[best], model.trial(sentences, best)])


# ---------------------------------------------------------------------------------------------
# The box under test


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads), from /proc; 0 where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    children: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += [int(c) for c in (task / "children").read_text().split()]
    return children


@dataclass(slots=True)
class BoxStats:
    """What the box's /metrics say about one measured phase, plus the CPU each process spent."""

    batches: float = 0.0
    rows: float = 0.0
    padded_tokens: float = 0.0  # rows × longest row, summed over batches
    box_cpu_s: float = 0.0
    nats_cpu_s: float = 0.0


class ServedBox:
    """`fleetbox serve` in a subprocess with its own embedded NATS and state dir; stopped with SIGTERM."""

    def __init__(self, device: str, workdir: Path, name: str, config: str | None = None) -> None:
        # The box logs at its default level here (INFO), as a box an operator runs does.
        env = {"FBX_DEVICE": device, "FBX_LOG_LEVEL": os.environ.get("FBX_LOG_LEVEL", "INFO")}
        self._box = BoxProcess.spawn(workdir / name, name, config or "", nats_urls=None, role="all", env=env)
        self.process = self._box.process
        self.url = self._box.url

    def wait_ready(self, timeout_s: float = 300.0) -> float:
        started = time.monotonic()
        asyncio.run(self._box.wait_ready(timeout_s))
        return time.monotonic() - started

    def log_tail(self, chars: int = 3000) -> str:
        return self._box.log_tail(chars)

    def stats(self) -> BoxStats:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(("fbx_batch_size_count", "fbx_batch_size_sum", "fbx_batch_tokens_sum")):
                name = line.split("{", 1)[0].split(" ", 1)[0]
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        nats = child_pids(self.process.pid)
        return BoxStats(
            batches=values.get("fbx_batch_size_count", 0.0),
            rows=values.get("fbx_batch_size_sum", 0.0),
            padded_tokens=values.get("fbx_batch_tokens_sum", 0.0),
            box_cpu_s=cpu_seconds(self.process.pid),
            nats_cpu_s=sum(cpu_seconds(pid) for pid in nats),
        )

    def settings(self) -> dict[str, Any]:
        """Per model, what GET /v1/models says it runs with (the tuning profile applied, if any)."""
        with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as response:
            models = orjson.loads(response.read())["data"]
        return {model["id"]: model.get("profile") for model in models}

    def stop(self) -> None:
        self._box.terminate(timeout_s=20)


@contextlib.contextmanager
def served_box(device: str, workdir: Path, name: str, config: str | None = None) -> Iterator[ServedBox]:
    box = ServedBox(device, workdir, name, config)
    try:
        box.wait_ready()
        yield box
    finally:
        box.stop()


# ---------------------------------------------------------------------------------------------
# The load generator


@dataclass(slots=True)
class Drive:
    """One client's share of a phase: the bodies it sends, how many at once, what a good answer holds."""

    url: str
    bodies: list[bytes]
    inputs: list[int]  # inputs per body: a 200 must hold exactly that many vectors
    concurrency: int


@dataclass(slots=True)
class DriveResult:
    latencies_s: list[float]
    errors: int
    error_samples: list[str]
    started: float  # time.monotonic(): CLOCK_MONOTONIC is one clock for every process on the host
    finished: float
    cpu_s: float
    tokens: int  # as the answers' `usage` counts them: real tokens, no padding


async def _drive(drive: Drive) -> DriveResult:
    import aiohttp

    latencies: list[float] = []
    errors = tokens = 0
    samples: list[str] = []
    cursor = iter(range(len(drive.bodies)))
    headers = {"Content-Type": "application/json"}

    async def one_client(session: aiohttp.ClientSession) -> None:
        nonlocal errors, tokens
        for index in cursor:
            sent = time.perf_counter()
            try:
                async with session.post(drive.url, data=drive.bodies[index], headers=headers) as response:
                    payload = await response.read()
                    status = response.status
            except aiohttp.ClientError as exc:
                status, payload = 0, repr(exc).encode()
            latencies.append(time.perf_counter() - sent)
            used = _answered(status, payload, drive.inputs[index])
            if used is None:
                errors += 1
                if len(samples) < 3:
                    samples.append(f"{status}: {payload[:200]!r}")
            else:
                tokens += used

    connector = aiohttp.TCPConnector(limit=max(64, drive.concurrency), limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=120)
    cpu0 = time.process_time()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.monotonic()
        await asyncio.gather(*(one_client(session) for _ in range(drive.concurrency)))
        finished = time.monotonic()
    return DriveResult(latencies, errors, samples, started, finished, time.process_time() - cpu0, tokens)


def _answered(status: int, payload: bytes, inputs: int) -> int | None:
    """The tokens a good answer (a 200 with one vector per input) says it used; None for anything else."""
    if status != 200:
        return None
    try:
        answer = orjson.loads(payload)
        if len(answer["data"]) != inputs:
            return None
        return int(answer["usage"]["total_tokens"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


def run_drive(drive: Drive) -> DriveResult:
    """Entry point of a client process (and of the in-process client)."""
    with contextlib.suppress(ImportError):
        import uvloop

        return uvloop.run(_drive(drive))
    return asyncio.run(_drive(drive))


@dataclass(slots=True)
class Phase:
    """One measured phase: throughput and latency over a fixed count of requests."""

    requests: int
    inputs: int
    seconds: float
    errors: int
    p50_ms: float
    p99_ms: float
    error_samples: list[str]
    client_cpu_s: float
    box: dict[str, float] = field(default_factory=dict)


class LoadGenerator:
    """Sends a phase's bodies from this process, or split over `procs` client processes."""

    def __init__(self, procs: int) -> None:
        self.procs = procs
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        if procs > 1:
            context = multiprocessing.get_context("spawn")  # no fork of a process holding torch threads
            self._pool = concurrent.futures.ProcessPoolExecutor(procs, mp_context=context)
            list(self._pool.map(time.sleep, [0.0] * procs))  # start them now, not inside a measurement

    def run(self, url: str, bodies: list[bytes], inputs: list[int], concurrency: int) -> list[DriveResult]:
        if self._pool is None:
            return [run_drive(Drive(url, bodies, inputs, concurrency))]
        procs = min(self.procs, concurrency)
        drives = [
            Drive(url, bodies[i::procs], inputs[i::procs], concurrency // procs + (i < concurrency % procs))
            for i in range(procs)
        ]
        return list(self._pool.map(run_drive, drives))

    def phase(
        self,
        box: ServedBox,
        requests: tuple[list[bytes], list[int]],
        concurrency: int,
        warmup: tuple[list[bytes], list[int]],
    ) -> Phase:
        """Warm up, then send every body once at `concurrency`; `requests` is (bodies, inputs per body)."""
        url = f"{box.url}/v1/embeddings"
        bodies, inputs = requests
        if warmup[0]:
            self.run(url, *warmup, concurrency)
        before = box.stats()
        results = self.run(url, bodies, inputs, concurrency)
        after = box.stats()
        latencies = np.array([t for r in results for t in r.latencies_s]) * 1000
        seconds = max(r.finished for r in results) - min(r.started for r in results)
        batches = after.batches - before.batches
        return Phase(
            requests=len(bodies),
            inputs=sum(inputs),
            seconds=seconds,
            errors=sum(r.errors for r in results),
            p50_ms=float(np.percentile(latencies, 50)),
            p99_ms=float(np.percentile(latencies, 99)),
            error_samples=[s for r in results for s in r.error_samples][:3],
            client_cpu_s=sum(r.cpu_s for r in results),
            box={
                "mean_batch_rows": (after.rows - before.rows) / batches if batches else 0.0,
                "padded_tokens": after.padded_tokens - before.padded_tokens,
                "tokens": sum(r.tokens for r in results),
                "box_cpu_s": after.box_cpu_s - before.box_cpu_s,
                "nats_cpu_s": after.nats_cpu_s - before.nats_cpu_s,
            },
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def bodies_for(sentences: list[str], per_request: int, model: str) -> tuple[list[bytes], list[int]]:
    if per_request == 1:
        return [orjson.dumps({"input": s, "model": model}) for s in sentences], [1] * len(sentences)
    chunks = [sentences[at : at + per_request] for at in range(0, len(sentences), per_request)]
    return [orjson.dumps({"input": chunk, "model": model}) for chunk in chunks], [len(c) for c in chunks]


# ---------------------------------------------------------------------------------------------
# Report


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["ram_gib"] = round(int(line.split()[1]) / 2**20, 1)
    with contextlib.suppress(OSError):
        info["loadavg_at_start"] = Path("/proc/loadavg").read_text().split()[:3]
    import torch

    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def git_describe() -> str:
    """The commit measured, with "+dirty" when the working tree differs from it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit or "unknown") + ("+dirty" if dirty else "")


def verdict(ok: bool) -> str:
    return "[green]met[/]" if ok else "[red]not met[/]"


def report(console: Console, figures: dict[str, Any]) -> None:
    raw: dict[str, Any] = figures["raw"]
    limit = raw["limit"]
    engine = figures.get("raw_engine", "torch float32")
    sweep = Table(title=f"(a) raw limit: in-process ({engine}), length-sorted, static batches (sentences/s)")
    for size in raw["per_batch_size"]:
        sweep.add_column(f"batch {size}", justify="right")
    sweep.add_column("at the best: sweep / before / between / after the boxes", justify="right")
    sweep.add_row(
        *(f"{value:,.0f}" + (" *" if int(size) == raw["best_batch_size"] else "")
          for size, value in raw["per_batch_size"].items()),
        " / ".join(f"{value:,.0f}" for value in raw["readings"]),
    )  # fmt: skip
    console.print(sweep)

    table = Table(title=f"End to end embeddings, device {figures['device']} (ratios against the raw limit)")
    for name in ("case", "load", "throughput", "p50 ms", "p99 ms", "errors", "ratio / figure", "target", ""):
        table.add_column(name, justify="left" if name in ("case", "load", "target") else "right")
    table.add_row("(a) raw", f"batch {raw['best_batch_size']}", f"{limit:,.0f} sent/s", "", "", "", "1.00", "", "")
    cases = figures["cases"]
    for key, label, load in (("b", "(b) box, 1/request", "c=64"), ("c", "(c) box, 32/request", "c=8")):
        if key in cases:
            case = cases[key]
            ratio = case["inputs_per_s"] / limit
            table.add_row(
                label, load, f"{case['inputs_per_s']:,.0f} sent/s", f"{case['p50_ms']:.1f}", f"{case['p99_ms']:.1f}",
                str(case["errors"]), f"{ratio:.2f}", f"≥ {TARGETS[key]:.2f}", verdict(ratio >= TARGETS[key]),
            )  # fmt: skip
    if "d" in cases:
        loaded, lone = cases["d"], cases["d_lone"]
        table.add_row(
            "(d) no-op box", "c=64", f"{loaded['requests_per_s']:,.0f} req/s", f"{loaded['p50_ms']:.2f}",
            f"{loaded['p99_ms']:.2f}", str(loaded["errors"]), f"{loaded['requests_per_s']:,.0f} req/s",
            f"≥ {TARGETS['d_rps']:,.0f} req/s", verdict(loaded["requests_per_s"] >= TARGETS["d_rps"]),
        )  # fmt: skip
        table.add_row(
            "(d) no-op, added", "c=1", f"{lone['requests_per_s']:,.0f} req/s", f"{lone['p50_ms']:.2f}",
            f"{lone['p99_ms']:.2f}", str(lone["errors"]), f"{lone['p50_ms']:.2f} ms p50",
            f"≤ {TARGETS['d_p50_ms']:.0f} ms p50", verdict(lone["p50_ms"] <= TARGETS["d_p50_ms"]),
        )  # fmt: skip
    console.print(table)

    inside = Table(title="Where the CPU went in each measured phase (from /proc; rows per batch from /metrics)")
    columns = (
        "case", "rows/batch", "real/padded tokens", "box cores", "box ms/req", "nats ms/req", "client ms/req",
        "sent/CPU-s", "vs raw",
    )  # fmt: skip
    for name in columns:
        inside.add_column(name, justify="left" if name == "case" else "right")
    inside.add_row(
        "(a) raw", str(raw["best_batch_size"]), f"{raw['padding_efficiency']:.0%}", f"{raw['cores']:.2f}",
        "", "", "", f"{raw['per_cpu_s']:,.0f}", "1.00",
    )  # fmt: skip
    for key in ("b", "c", "d", "d_lone"):
        if key in cases:
            case, box = cases[key], cases[key]["box"]
            per = 1000 / case["requests"]
            serving_cpu = box["box_cpu_s"] + box["nats_cpu_s"]
            per_cpu = case["inputs"] / serving_cpu if serving_cpu else 0.0
            inside.add_row(
                key, f"{box['mean_batch_rows']:.1f}",
                f"{box['tokens'] / box['padded_tokens']:.0%}" if box["padded_tokens"] else "-",
                f"{box['box_cpu_s'] / case['seconds']:.2f}",
                f"{box['box_cpu_s'] * per:.2f}", f"{box['nats_cpu_s'] * per:.2f}", f"{case['client_cpu_s'] * per:.2f}",
                f"{per_cpu:,.0f}" if key in "bc" else "", f"{per_cpu / raw['per_cpu_s']:.2f}" if key in "bc" else "",
            )  # fmt: skip
    console.print(inside)
    m = figures["machine"]
    console.print(
        f"machine: {m.get('cpu', '?')}, {m['nproc']} CPUs, {m.get('ram_gib', '?')} GiB"
        + (f", {m['gpu']}" if "gpu" in m else "")
        + f"; torch {m['torch']}; box env {figures['box_env'] or '(defaults)'}; "
        f"{figures['sentences']} sentences of {SENTENCE_WORDS[0]}-{SENTENCE_WORDS[1]} words (seed {figures['seed']}); "
        f"code {figures['git']}; load average {' '.join(m.get('loadavg_at_start', []))} at start, "
        f"{' '.join(figures.get('loadavg_at_end', []))} at end"
    )
    console.print(
        f"note: the load generator runs in {figures['client_procs']} client process(es) on this same machine; "
        f"with {m['nproc']} cores it competes with the box for CPU. Latency at c=64 is mostly queueing "
        "(Little's law: p50 ≈ 64 / throughput); the no-op c=1 row is the latency the serving path adds. "
        "sent/CPU-s counts the box's and nats-server's CPU: it moves less than sentences/s when neighbours "
        "take some of the cores, so 'vs raw' is the steadier measure of what serving costs."
    )
    load = float(m.get("loadavg_at_start", ["0"])[0])
    if load > m["nproc"] / 2:
        console.print(
            f"[yellow]warning[/]: the load average was {load:g} on {m['nproc']} CPUs when the run started: other "
            "work shared the machine, and every figure here (per-CPU ones too) is noisier for it."
        )
    for key, case in cases.items():
        if case["errors"]:
            console.print(f"[red]errors in {key}[/]: {case['errors']}, e.g. {case['error_samples']}")


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    parser.add_argument("--quick", action="store_true", help="fewer sentences and requests: a smoke run")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--client-procs", type=int, default=1, help="split the load over N client processes")
    parser.add_argument("--cases", default="abcd", help="which cases to run (a always runs: it is the denominator)")
    parser.add_argument("--sentences", type=int, help="override the sentence count")
    parser.add_argument(
        "--raw-engine",
        choices=("box", "torch"),
        default="box",
        help="(a)'s engine: the one the box's profile picks (default), or fp32 torch",
    )
    parser.add_argument("--seed", type=int, default=2)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 140)
    plan = PLANS[("quick" if args.quick else "full") + ("-cuda" if args.device.startswith("cuda") else "")]
    count = args.sentences or plan.sentences
    sentences = make_sentences(count, args.seed)
    warmup = make_sentences(plan.warmup_sentences, args.seed + 1000)
    threads = int(os.environ["FBX_THREADS"]) if os.environ.get("FBX_THREADS") else None
    box_env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("FBX_") and k != "FBX_DEVICE"}
    started = time.monotonic()
    figures: dict[str, Any] = {
        "issue": 2,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": args.device,
        "quick": args.quick,
        "sentences": count,
        "seed": args.seed,
        "client_procs": args.client_procs,
        "box_env": box_env,
        "targets": TARGETS,
        "machine": machine(),
        "git": git_describe(),
        "cases": {},
    }
    cases: dict[str, Any] = figures["cases"]

    sweep = min(count, plan.sweep_sentences)
    console.print(f"[bold](a)[/] raw limit on {args.device}: batch sizes {list(BATCH_SIZES)} on {sweep} sentences")
    model = RawModel(args.device, threads, args.raw_engine, Path(tempfile.gettempdir()) / "fbx-bench-onnx")
    figures["raw_engine"] = model.engine
    console.print(f"    engine: {model.engine}")
    raw = raw_limit(model, sentences, sweep)
    console.print(f"    best {raw.reference.sentences_per_s:,.0f} sentences/s at batch {raw.best_batch_size}")

    def recheck() -> None:
        """Noisy neighbours come and go: read the limit again between cases, and keep the best reading."""
        raw.readings.append(model.trial(sentences, raw.best_batch_size))
        console.print(f"    (a) again: {raw.readings[-1].sentences_per_s:,.0f} sentences/s")

    load = LoadGenerator(args.client_procs)
    workdir = Path(tempfile.mkdtemp(prefix="fbx-bench-"))
    try:
        if "b" in args.cases or "c" in args.cases:
            console.print("[bold](b, c)[/] starting fleetbox serve with the default model")
            with served_box(args.device, workdir, "embed") as box:
                figures["box_settings"] = _settings(console, box)
                for key, per_request, concurrency in (("b", 1, 64), ("c", 32, 8)):
                    if key in args.cases:
                        measured = bodies_for(sentences, per_request, EMBED_MODEL)
                        warm = bodies_for(warmup, per_request, EMBED_MODEL)
                        cases[key] = asdict(load.phase(box, measured, concurrency, warm))
                        _progress(console, key, cases[key])
            recheck()
        if "d" in args.cases:
            console.print("[bold](d)[/] starting fleetbox serve with only the no-op runtime")
            with served_box(args.device, workdir, "noop", NOOP_CONFIG) as box:
                figures["noop_box_settings"] = _settings(console, box)
                pool, _ = bodies_for(sentences, 1, NOOP_MODEL)
                bodies = [pool[i % len(pool)] for i in range(plan.noop_requests)]
                warm = [pool[i % len(pool)] for i in range(plan.noop_warmup)]
                cases["d"] = asdict(load.phase(box, (bodies, [1] * len(bodies)), 64, (warm, [1] * len(warm))))
                _progress(console, "d", cases["d"])
                lone = bodies[: plan.lone_requests]
                cases["d_lone"] = asdict(load.phase(box, (lone, [1] * len(lone)), 1, (warm[:100], [1] * 100)))
                _progress(console, "d_lone", cases["d_lone"])
            recheck()
    finally:
        load.close()
        shutil.rmtree(workdir, ignore_errors=True)

    model.close()
    figures["raw"] = raw.figures()
    for case in cases.values():
        case["inputs_per_s"] = case["inputs"] / case["seconds"]
        case["requests_per_s"] = case["requests"] / case["seconds"]
    figures["wall_s"] = round(time.monotonic() - started, 1)
    with contextlib.suppress(OSError):
        figures["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    console.print()
    report(console, figures)
    console.print(f"wall time {figures['wall_s']:.0f}s")
    if args.json:
        args.json.write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
        console.print(f"figures written to {args.json}")
    return 1 if any(case["errors"] for case in cases.values()) else 0


def _settings(console: Console, box: ServedBox) -> dict[str, Any]:
    settings = box.settings()
    for model, profile in settings.items():
        if profile:
            console.print(
                f"    {model}: profile {profile.get('match')} ({profile.get('file') or 'no file'}): batches of "
                f"{profile.get('max_batch_tokens')} tokens / {profile.get('max_batch_size')} rows / "
                f"{profile.get('max_wait_ms')} ms wait, threads {profile.get('threads') or 'torch default'}"
                f" × {profile.get('concurrent_batches', 1)} batches at once"
            )
    return settings


def _progress(console: Console, key: str, case: dict[str, Any]) -> None:
    rate = case["inputs"] / case["seconds"]
    console.print(
        f"    {key}: {rate:,.0f} inputs/s over {case['requests']} requests, p50 {case['p50_ms']:.1f} ms, "
        f"p99 {case['p99_ms']:.1f} ms, errors {case['errors']}"
    )


if __name__ == "__main__":
    sys.exit(main())
