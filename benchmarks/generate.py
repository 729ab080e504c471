"""Generation (issue 3): tokens/s through fleetbox at 1, 8 and 32 concurrent streams vs sequential generate.

The model is a random-weight Llama built here with `save_pretrained` (seeded; by default 4 layers
of width 256, 2.6 M parameters, a 400-token byte-level BPE): the test suite's tiny generator,
made larger so a decode step does some arithmetic. Its end-of-turn logit is pinned at zero, so
greedy decoding runs every request to `max_tokens`; tokens are still counted from each answer's
`usage.completion_tokens`, never assumed.

  sequential  in this process, `model.generate(do_sample=False)` one prompt after another: the
              plain transformers loop a user would write. It runs with 1 torch thread before and
              after the box cases and with 2 threads once before, and the best of those readings
              is the denominator of every ratio (the conservative choice).
  fleetbox    a real `Box` in this process (JetStream on a real nats-server, gateway, worker), the
              model registered as a pinned generate model; N clients each send `POST
              /v1/completions` (temperature 0, fixed `max_tokens`) back to back, whole answers (and,
              in one row, streamed as server-sent events). Requests for one model decode together:
              they join the batch at step boundaries (`appliance/generation_decode.py`).

The same seeded prompts feed both; fleetbox's greedy answers are checked against the sequential
ones (text equal), so the speed is not bought with different outputs.

    python benchmarks/generate.py [--quick] [--max-tokens N] [--hidden H] [--layers L] [--threads T]
                                  [--seed S] [--json PATH]
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere: `appliance` is importable
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from appliance.app import Box  # noqa: E402
from appliance.natsd import EmbeddedNats, free_port  # noqa: E402
from appliance.settings import ModelEntry, Settings  # noqa: E402
from benchmarks._models import GENERATOR_CORPUS, build_generator, machine, run_benchmark  # noqa: E402
from runtimes.tokenizer import TextTokenizer  # noqa: E402

MODEL = "bench-generator"
LEVELS = (1, 8, 32)
TARGET_AT_32 = 4.0
PROMPT_WORDS = (6, 20)
WORDS = sorted({w.strip(".,?!") for line in GENERATOR_CORPUS for w in line.split()})


@dataclass(slots=True, frozen=True)
class Plan:
    max_tokens: int
    rounds: int  # requests per client at each level
    min_requests: int  # at every level, so one stream's reading is long enough to mean something
    sequential_prompts: int


PLANS = {
    "full": Plan(max_tokens=64, rounds=3, min_requests=24, sequential_prompts=24),
    "quick": Plan(max_tokens=32, rounds=1, min_requests=8, sequential_prompts=8),
}


@dataclass(slots=True)
class Reading:
    name: str
    streams: int
    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    texts: dict[int, str] = field(default_factory=dict)  # prompt index -> completion
    steps: int = 0  # decode steps the box ran (its fbx_compute_ms histogram), 0 for sequential
    step_s: float = 0.0  # their time on the device thread
    rows: int = 0  # requests advanced, summed over steps

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def figures(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "streams": self.streams,
            "requests": self.requests,
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
            "p50_request_s": float(np.percentile(self.latencies_s, 50)) if self.latencies_s else None,
            "steps": self.steps,
            "mean_step_ms": 1000 * self.step_s / self.steps if self.steps else None,
            "mean_rows_per_step": self.rows / self.steps if self.steps else None,
            "device_busy": self.step_s / self.seconds if self.steps and self.seconds else None,
        }


def make_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*PROMPT_WORDS))) for _ in range(count)]


# ---------------------------------------------------------------------------------------------
# sequential model.generate


def sequential(folder: Path, prompts: list[str], max_tokens: int, threads: int) -> Reading:
    """`model.generate` greedy, one prompt at a time, ids from the box's own tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    tokenizer = TextTokenizer(folder, keep="end")
    reading = Reading(f"sequential generate, {threads} thread{'s' if threads > 1 else ''}", 1)
    with torch.inference_mode():
        _generate(model, tokenizer, prompts[0], max_tokens)  # warm-up, not counted
        started = time.perf_counter()
        for index, prompt in enumerate(prompts):
            began = time.perf_counter()
            ids = _generate(model, tokenizer, prompt, max_tokens)
            reading.latencies_s.append(time.perf_counter() - began)
            reading.tokens += len(ids)
            reading.requests += 1
            reading.texts[index] = tokenizer.decode(ids)
        reading.seconds = time.perf_counter() - started
    return reading


def _generate(model: Any, tokenizer: TextTokenizer, prompt: str, max_tokens: int) -> list[int]:
    ids = torch.as_tensor(tokenizer.tokenize([prompt])[0].ids).unsqueeze(0)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=model.config.pad_token_id,
    )
    return out[0, ids.shape[1] :].tolist()


# ---------------------------------------------------------------------------------------------
# through fleetbox


async def through_box(
    port: int, prompts: list[str], streams: int, requests: int, max_tokens: int, *, stream: bool
) -> Reading:
    """`streams` clients sending `requests` completions in all, each back to back; tokens from `usage`."""
    reading = Reading(f"fleetbox, {streams} stream{'s' if streams > 1 else ''}{', SSE' if stream else ''}", streams)
    jobs = iter(range(requests))
    url = f"http://127.0.0.1:{port}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client() -> None:
            for job in jobs:
                index = job % len(prompts)
                began = time.perf_counter()
                text, tokens = await _complete(session, url, prompts[index], max_tokens, stream=stream)
                reading.latencies_s.append(time.perf_counter() - began)
                reading.tokens += tokens
                reading.requests += 1
                reading.texts[index] = text

        await _complete(session, url, prompts[0], 4, stream=stream)  # warm-up, not counted
        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(streams)))
        reading.seconds = time.perf_counter() - started
    return reading


async def _complete(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, *, stream: bool
) -> tuple[str, int]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as response:
        if response.status != 200:
            raise RuntimeError(f"completion failed: {response.status} {await response.text()}")
        if not stream:
            answer = await response.json(loads=orjson.loads)
            return answer["choices"][0]["text"], int(answer["usage"]["completion_tokens"])
        parts: list[str] = []
        tokens = 0
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = orjson.loads(line[6:])
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
            parts.extend(choice.get("text", "") for choice in event.get("choices", []))
        return "".join(parts), tokens


async def box_readings(folder: Path, state: Path, prompts: list[str], plan: Plan, threads: int) -> list[Reading]:
    natsd = EmbeddedNats(store_dir=state / "nats", port=free_port())
    await natsd.start()
    settings = Settings(
        nats=natsd.url,
        host="127.0.0.1",
        port=0,
        device="cpu",
        threads=threads,
        state_dir=state,
        default_model=False,
        model_roots=[folder.parent],
        models=[ModelEntry(name=MODEL, path=folder, task="generate", pinned=True)],
        log_level="WARNING",
    )
    box = Box(settings)
    await box.start()
    try:
        assert box.http_port is not None
        cases = [(streams, False) for streams in LEVELS] + [(LEVELS[-1], True)]
        readings = []
        for streams, stream in cases:
            requests = max(streams * plan.rounds, plan.min_requests)
            before = _step_totals(box)
            reading = await through_box(box.http_port, prompts, streams, requests, plan.max_tokens, stream=stream)
            after = _step_totals(box)
            reading.steps = int(after[0] - before[0])
            reading.step_s = (after[1] - before[1]) / 1000
            reading.rows = int(after[2] - before[2])
            readings.append(reading)
        return readings
    finally:
        await box.stop()
        await natsd.stop()


def _step_totals(box: Box) -> tuple[float, float, float]:
    """(steps, their milliseconds, rows advanced) so far: the worker's own histograms."""
    totals = {"compute_count": 0.0, "compute_sum": 0.0, "batch_sum": 0.0}
    for metric, prefix in ((box.metrics.compute_ms, "compute"), (box.metrics.batch_size, "batch")):
        for family in metric.collect():
            for sample in family.samples:
                for suffix in ("_count", "_sum"):
                    if sample.name.endswith(suffix) and sample.labels.get("model") == MODEL:
                        key = prefix + suffix
                        if key in totals:
                            totals[key] += sample.value
    return totals["compute_count"], totals["compute_sum"], totals["batch_sum"]


# ---------------------------------------------------------------------------------------------
# the report


def render(
    baseline: Reading,
    sequential_readings: list[Reading],
    readings: list[Reading],
    info: dict[str, Any],
    console: Console,
) -> None:
    table = Table(
        title=f"Generation: {info['parameters'] / 1e6:.1f} M-parameter Llama, max_tokens {info['max_tokens']}, greedy"
    )
    columns = (
        "case",
        "streams",
        "requests",
        "tokens",
        "seconds",
        "tokens/s",
        "p50 request s",
        "rows/step",
        "ms/step",
        "device busy",
        "vs sequential",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == "case" else "right")
    for reading in sequential_readings:
        table.add_row(*_cells(reading, baseline), end_section=reading is sequential_readings[-1])
    for reading in readings:
        table.add_row(*_cells(reading, baseline))
    console.print(table)
    top = next(r for r in readings if r.streams == LEVELS[-1])
    ratio = top.tokens_per_s / baseline.tokens_per_s
    verdict = "met" if ratio >= TARGET_AT_32 else "MISSED"
    console.print(
        f"target: >= {TARGET_AT_32:.0f}x the sequential rate at {LEVELS[-1]} streams: {ratio:.2f}x ({verdict})"
    )
    console.print(f"greedy answers equal to sequential generate's: {info['matching']}")


def _cells(reading: Reading, baseline: Reading) -> list[str]:
    f = reading.figures()
    p50 = f["p50_request_s"]
    return [
        reading.name + (" (reference)" if reading is baseline else ""),
        str(reading.streams),
        str(reading.requests),
        str(reading.tokens),
        f"{reading.seconds:.1f}",
        f"{reading.tokens_per_s:.0f}",
        "-" if p50 is None else f"{p50:.2f}",
        "-" if f["mean_rows_per_step"] is None else f"{f['mean_rows_per_step']:.1f}",
        "-" if f["mean_step_ms"] is None else f"{f['mean_step_ms']:.1f}",
        "-" if f["device_busy"] is None else f"{f['device_busy']:.0%}",
        f"{reading.tokens_per_s / baseline.tokens_per_s:.2f}x",
    ]


def matching(reference: dict[int, str], readings: list[Reading]) -> str:
    compared = equal = 0
    for reading in readings:
        for index, text in reading.texts.items():
            if index in reference:
                compared += 1
                equal += text == reference[index]
    return f"{equal}/{compared}"


# ---------------------------------------------------------------------------------------------


async def main_async(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    plan = PLANS["quick" if args.quick else "full"]
    if args.max_tokens:
        plan = replace(plan, max_tokens=args.max_tokens)
    prompts = make_prompts(max(LEVELS[-1] * plan.rounds, plan.min_requests), args.seed)
    with tempfile.TemporaryDirectory(prefix="fbx-generate-") as tmp:
        folder = build_generator(
            Path(tmp) / "models" / "generator", hidden=args.hidden, layers=args.layers, seed=args.seed
        )
        parameters = sum(p.numel() for p in _load(folder).parameters())
        loop = asyncio.get_running_loop()
        few = prompts[: plan.sequential_prompts]
        # Two threads only once: on a shared 2-core machine their spin-waits can make it very slow.
        sequential_readings = []
        for threads in (1, 2):
            console.print(f"sequential generate, {threads} thread(s) ...")
            sequential_readings.append(
                await loop.run_in_executor(None, sequential, folder, few, plan.max_tokens, threads)
            )
        console.print("through fleetbox ...")
        readings = await box_readings(folder, Path(tmp) / "state", prompts, plan, args.threads)
        console.print("sequential generate again, 1 thread ...")
        sequential_readings.append(await loop.run_in_executor(None, sequential, folder, few, plan.max_tokens, 1))
    baseline = max(sequential_readings, key=lambda r: r.tokens_per_s)
    info = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "parameters": parameters,
        "hidden": args.hidden,
        "layers": args.layers,
        "max_tokens": plan.max_tokens,
        "rounds": plan.rounds,
        "min_requests": plan.min_requests,
        "box_threads": args.threads,
        "seed": args.seed,
        "matching": matching(baseline.texts, readings),
    }
    render(baseline, sequential_readings, readings, info, console)
    return {
        **info,
        "sequential": [r.figures() for r in sequential_readings],
        "baseline_tokens_per_s": baseline.tokens_per_s,
        "fleetbox": [r.figures() | {"ratio": r.tokens_per_s / baseline.tokens_per_s} for r in readings],
    }


def _load(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests (a smoke run)")
    parser.add_argument("--max-tokens", type=int, help="tokens per completion (default 64; 32 with --quick)")
    parser.add_argument("--hidden", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the box's model (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    run_benchmark(parser, main_async)


if __name__ == "__main__":
    main()
