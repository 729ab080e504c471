"""Faults (issue 6): what a fleet promises when things break, measured end to end with real processes.

One command runs six faults, each against real nats-server processes on loopback ports and real
boxes, and prints a summary table:

  1. box dies     two boxes under steady load; one (a `fleetbox serve --role worker` subprocess) is
                  frozen while it holds requests, then SIGKILLed. Every accepted request must get its
                  correct answer (no-op vectors, and real all-MiniLM-L6-v2 vectors for every 5th
                  request, compared with the model run directly), exactly once, none lost; the
                  longest delay is how long the dead box's requests waited for redelivery.
  2. NATS dies    a 3-server NATS cluster (JetStream, replicas 3, file storage); the leader of the
                  request stream is SIGKILLed under load: 0 lost.
  3. NATS restart the only nats-server (file storage) is stopped and started again on the same port
                  and store while requests are queued: they are served after the restart, and the
                  boxes reconnect (and restore their heartbeats) by themselves.
  4. poison       a request whose input makes the runtime raise: after `max_deliver` tries the client
                  gets 422 `dead_lettered`, the message is kept in FBX_DLQ with the reason, and
                  requests sent at the same time are answered.
  5. overload     5x a box's capacity for `--overload-seconds` (a box subprocess, so its memory is its
                  own): the excess gets 429 with Retry-After, accepted requests keep a bounded p99,
                  memory stays bounded, and a request after the load stops is accepted at once.
  6. disconnect   clients that go away while their requests wait: those requests are never computed
                  (the box's `fbx_cancelled_requests` and `fbx_rows_computed` say so).

The client is open-loop (a steady rate, whatever the fleet does) and retries only what the gateway
refused (429, or 503 while NATS fails over), as a well-behaved client does; "lost" is an accepted
request that never got a 200. `tests/test_nats_faults.py` runs 1-4 in small.

    python benchmarks/faults.py [--quick] [--overload-seconds S] [--only 1,2,...] [--json PATH] [--markdown PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import os
import platform
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from appliance import bus  # noqa: E402
from appliance.app import Box  # noqa: E402
from appliance.catalog import DEFAULT_MODEL_ALIAS, DEFAULT_MODEL_NAME, default_model_path  # noqa: E402
from appliance.natsd import EmbeddedNats, free_port  # noqa: E402
from appliance.settings import ModelEntry, Settings  # noqa: E402
from benchmarks._faultkit import (  # noqa: E402
    NOOP_VECTOR,
    BoxProcess,
    NatsCluster,
    Outcome,
    SteadyLoad,
    Tally,
    metric_value,
    noop_expected,
    percentile,
    tally,
    wait_until,
)
from runtimes.tasks.embed import finish_vectors  # noqa: E402

NOOP = "noop"


@dataclass(slots=True)
class FaultResult:
    """One fault run: the tally of its requests (when it has a load) and the facts that prove the rest."""

    fault: str
    passed: bool
    tally: Tally | None = None
    facts: dict[str, Any] = field(default_factory=dict)


def noop_entry(**options: Any) -> ModelEntry:
    return ModelEntry(name=NOOP, runtime="noop", pinned=True, options=options)


def settings(nats_urls: str, **values: Any) -> Settings:
    return Settings(**{"nats": nats_urls, "port": 0, "host": "127.0.0.1", "device": "cpu", **values})


async def start_boxes(*all_settings: Settings) -> list[Box]:
    boxes = []
    for one in all_settings:
        box = Box(one)
        await box.start()
        boxes.append(box)
    return boxes


async def stop_boxes(boxes: list[Box]) -> None:
    for box in reversed(boxes):
        await box.stop()


def gateway_url(box: Box) -> str:
    return f"http://127.0.0.1:{box.http_port}"


def counter(box: Box, name: str, model: str | None = NOOP) -> float:
    labels = {"model": model} if model is not None else {}
    return box.metrics.registry.get_sample_value(f"{name}_total", labels) or 0.0


async def ack_pending(box: Box, *models: str) -> int:
    """Requests delivered to some box and not yet acked, over the models' interactive consumers."""
    assert box.js is not None
    total = 0
    for model in models:
        info = await box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name(bus.model_slug(model)))
        total += int(info.num_ack_pending or 0)
    return total


async def queued(box: Box, model: str = NOOP) -> int:
    """Requests in the queue that no box has pulled yet."""
    assert box.js is not None
    info = await box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name(bus.model_slug(model)))
    return int(info.num_pending or 0)


# -- 1. a box dies -------------------------------------------------------------------------------


async def box_dies(
    work: Path,
    *,
    load_s: float,  # the kill comes after a third of it
    rate: float,
    ack_wait_s: float | None = None,
    noop_cost_ms: float = 100.0,  # a slow model: each box holds a few requests at any moment
    real_every: int = 5,
) -> FaultResult:
    """Two boxes share the load; one is frozen while it holds requests, then SIGKILLed."""
    server = EmbeddedNats(store_dir=work / "nats", port=free_port())
    await server.start()
    waits = {"ack_wait_s": ack_wait_s} if ack_wait_s is not None else {}
    # The default model as the catalog has it, but without a tuned profile: torch fp32 on both boxes,
    # no ONNX export at each box's first load, and the survivor's runtime is the reference.
    real = ModelEntry(
        name=DEFAULT_MODEL_NAME, path=default_model_path(), task="embed", aliases=[DEFAULT_MODEL_ALIAS],
        pinned=True, profile="off",
    )  # fmt: skip
    models = [real, noop_entry(cost_ms=noop_cost_ms)]
    survivor = Box(settings(server.url, box_id="survivor", state_dir=work / "survivor", models=models, **waits))
    doomed: BoxProcess | None = None
    try:
        await survivor.start()
        ack_wait = f"ack_wait_s = {ack_wait_s}\n" if ack_wait_s is not None else ""
        # The catalog (the default model and noop, both pinned) comes from the fleet's KV bucket.
        doomed = await BoxProcess.start(
            work / "doomed", "doomed", f'default_model = false\ndevice = "cpu"\n{ack_wait}',
            nats_urls=server.url, role="worker",
        )  # fmt: skip

        def model(index: int) -> str:
            return DEFAULT_MODEL_ALIAS if real_every and index % real_every == 0 else NOOP

        load = SteadyLoad(gateway_url(survivor), rate, model=model)
        running = asyncio.create_task(load.run(load_s))
        await asyncio.sleep(load_s / 3)  # steady state first: the fault lands mid-run
        await wait_until(
            lambda: sum(o.box == "doomed" for o in load.outcomes) >= 3, load_s, "the doomed box to answer some"
        )

        def held_here() -> int:
            return sum(w.held for w in survivor.workers.values())

        async def held_by_doomed() -> int:
            """Unacked requests the survivor does not hold; its count read on both sides of the server's,
            the larger taken, so that answers it sends meanwhile make this an under-estimate."""
            before = held_here()
            pending = await ack_pending(survivor, NOOP, DEFAULT_MODEL_NAME)
            return pending - max(before, held_here())

        held_at_kill = await freeze_holding(doomed, held_by_doomed, within_s=15.0)
        killed_at = asyncio.get_running_loop().time()
        doomed.kill()
        outcomes = await running
        runtime = survivor.residency.get(DEFAULT_MODEL_NAME).runtime
        expected = await reference_vectors(runtime, [o for o in outcomes if o.model != NOOP])
        result = tally(outcomes, lambda o: expected[o.text] if o.model != NOOP else NOOP_VECTOR)
        before = sorted(o.latency_s for o in outcomes if o.sent_at < killed_at - 1.0 and o.status == 200)
        redelivered = sum(counter(survivor, "fbx_redelivered_requests", m) for m in (NOOP, DEFAULT_MODEL_NAME))
        facts = {
            "held by the dead box": max(0, held_at_kill),
            "redelivered": int(redelivered),
            "duplicate replies dropped": int(counter(survivor, "fbx_ignored_replies", None)),
            "real-model answers checked": sum(1 for o in outcomes if o.model != NOOP and o.status == 200),
            "p50 before the kill": f"{percentile(before, 0.5) * 1000:.0f} ms",
            "longest delay": f"{result.max_s:.1f} s",
            "ack_wait_s": survivor.settings.ack_wait_s,
        }
        passed = result.lost == 0 and result.wrong == 0 and result.ok == result.requests
        return FaultResult("1. a box dies (SIGKILL) under load", passed, result, facts)
    finally:
        if doomed is not None:
            doomed.kill()
        await survivor.stop()
        await server.stop()


async def freeze_holding(box: BoxProcess, held: Callable[[], Awaitable[int]], within_s: float) -> int:
    """SIGSTOP the box at a moment it holds requests (it then keeps them, answering and acking none).

    Its pull room is small and timed, so at a random moment it may hold nothing: watch for a moment it
    does, freeze it, and check again (it may have answered in between; then let it go on and retry).
    Returns how many it holds, frozen; 0 if no such moment came (it is frozen anyway).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while loop.time() < deadline:
        if await held() >= 1:
            box.pause()
            holding = await held()
            if holding >= 1:
                return holding
            box.resume()
        await asyncio.sleep(0.01)
    box.pause()
    return max(0, await held())


async def reference_vectors(runtime: Any, outcomes: list[Outcome]) -> dict[str, np.ndarray]:
    """The model run directly on each input, one at a time: what the fleet's answers must equal."""
    texts = sorted({o.text for o in outcomes})

    def run() -> dict[str, np.ndarray]:
        def vector(text: str) -> np.ndarray:
            pooled = runtime.run(runtime.tokenize([text]))
            return finish_vectors(pooled, folder_normalizes=runtime.info.unit_vectors)[0]

        return {text: vector(text) for text in texts}

    return await asyncio.get_running_loop().run_in_executor(None, run)


# -- 2. a NATS server of three dies --------------------------------------------------------------


async def nats_server_dies(
    work: Path, *, load_s: float, kill_after_s: float, rate: float, ack_wait_s: float = 10.0
) -> FaultResult:
    """A 3-server cluster, replicas 3, file storage; SIGKILL the request stream's leader under load."""
    cluster = NatsCluster(work / "cluster", size=3)
    await cluster.start()
    common = {"replicas": 3, "durable": True, "default_model": False, "ack_wait_s": ack_wait_s}
    models = [noop_entry(cost_ms=5)]
    boxes: list[Box] = []
    try:
        boxes = await start_boxes(
            settings(cluster.urls, role="gateway", box_id="gateway", models=models, **common),
            settings(cluster.urls, role="worker", box_id="worker-1", models=models, **common),
            settings(cluster.urls, role="worker", box_id="worker-2", models=models, **common),
        )
        load = SteadyLoad(gateway_url(boxes[0]), rate)
        running = asyncio.create_task(load.run(load_s))
        await asyncio.sleep(kill_after_s)  # steady state first: the fault lands mid-run
        leader = await cluster.leader_of(bus.REQUEST_STREAM)
        await cluster.kill(leader)
        outcomes = await running
        result = tally(outcomes, noop_expected)
        facts = {
            "killed": f"{cluster.names[leader]} (leader of {bus.REQUEST_STREAM})",
            "refused and retried (503)": result.refused_attempts,
            "duplicate replies dropped": int(counter(boxes[0], "fbx_ignored_replies", None)),
            "longest delay": f"{result.max_s:.1f} s",
        }
        passed = result.lost == 0 and result.wrong == 0
        return FaultResult("2. a NATS server of 3 dies (SIGKILL)", passed, result, facts)
    finally:
        await stop_boxes(boxes)
        await cluster.stop()


# -- 3. the only NATS server restarts --------------------------------------------------------------


async def nats_restarts(work: Path, *, requests: int, rate: float, cost_ms: float = 50.0) -> FaultResult:
    """Requests queue behind a slow worker; the only nats-server stops and starts again on its files."""
    server = EmbeddedNats(store_dir=work / "nats", port=free_port())
    await server.start()
    common = {"durable": True, "default_model": False, "models": [noop_entry(cost_ms=cost_ms)]}
    boxes: list[Box] = []
    try:
        boxes = await start_boxes(
            settings(server.url, role="gateway", box_id="gateway", **common),
            settings(server.url, role="worker", box_id="worker", max_batch_size=1, worker_capacity=1, **common),
        )
        gateway = boxes[0]
        load = SteadyLoad(gateway_url(gateway), rate)
        running = asyncio.create_task(load.run(requests / rate))
        seen: list[int] = []  # the backlog as last read: read again, it may be one less (a test saw 12 after 13)

        async def queued_up() -> bool:
            seen.append(await queued(gateway))
            return seen[-1] >= requests // 3

        await wait_until(queued_up, 30, "requests to queue up")
        waiting = seen[-1]
        loop = asyncio.get_running_loop()
        stopped_at = loop.time()
        await server.stop()
        await server.start()  # same port, same store dir
        down_s = loop.time() - stopped_at
        await wait_until(lambda: all(b.nc is not None and b.nc.is_connected for b in boxes), 30, "reconnects")
        reconnect_s = loop.time() - stopped_at
        outcomes = await running
        result = tally(outcomes, noop_expected)
        await wait_until(
            lambda: {"gateway", "worker"} <= {r["box"] for r in gateway.fleet.live_boxes()}, 15, "heartbeats"
        )
        before = [o for o in outcomes if o.sent_at < stopped_at]
        facts = {
            "queued at the stop": waiting,
            "sent before the stop, answered 200": f"{sum(o.status == 200 for o in before)}/{len(before)}",
            "server down": f"{down_s:.2f} s",
            "boxes reconnected after": f"{reconnect_s:.2f} s",
            "heartbeats back": "yes",
            "longest delay": f"{result.max_s:.1f} s",
        }
        passed = result.lost == 0 and result.wrong == 0 and all(o.status == 200 for o in before)
        return FaultResult("3. the only NATS server restarts", passed, result, facts)
    finally:
        await stop_boxes(boxes)
        await server.stop()


# -- 4. a poison request ------------------------------------------------------------------------------


POISON = "POISON"


async def poison_request(work: Path, *, max_deliver: int, load_s: float, rate: float) -> FaultResult:
    """A request that makes the runtime raise, sent in the middle of steady traffic."""
    server = EmbeddedNats(store_dir=work / "nats", port=free_port())
    await server.start()
    box = Box(
        settings(
            server.url, box_id="box", default_model=False, max_deliver=max_deliver,
            models=[noop_entry(cost_ms=2, fail_on=POISON)],
        )
    )  # fmt: skip
    try:
        await box.start()
        load = SteadyLoad(gateway_url(box), rate)
        running = asyncio.create_task(load.run(load_s))
        started = time.monotonic()
        async with aiohttp.ClientSession() as http:
            body = {"model": NOOP, "input": ["a fine input", f"a {POISON} input"], "timeout": 60}
            async with http.post(f"{gateway_url(box)}/v1/embeddings", json=body) as response:
                status, error = response.status, (await response.json())["error"]
        answered_s = time.monotonic() - started
        outcomes = await running
        assert box.js is not None
        kept = await box.js.get_last_msg(bus.DEAD_LETTER_STREAM, bus.dead_letter_subject(NOOP))
        reason = (kept.headers or {}).get("Fbx-Dead-Reason", "")
        result = tally(outcomes, noop_expected)
        facts = {
            "poison answered": f"{status} {error.get('code')} after {answered_s:.1f} s",
            "deliveries": (kept.headers or {}).get("Fbx-Deliveries", "?"),
            "kept in FBX_DLQ with reason": reason[:60],
            "others answered 200": f"{result.ok}/{result.requests}",
        }
        passed = (
            status == 422
            and error.get("code") == "dead_lettered"
            and "poison" in reason.lower()
            and orjson.loads(kept.data)["input"] == body["input"]
            and result.ok == result.requests
        )
        return FaultResult("4. a poison request", passed, result, facts)
    finally:
        await box.stop()
        await server.stop()


# -- 5. overload ----------------------------------------------------------------------------------


async def overload(
    work: Path, *, seconds: float, factor: float = 5.0, cost_ms: float = 25.0, queue_s: float = 2.0
) -> FaultResult:
    """Offer `factor` times a box's capacity; the box serves one request per `cost_ms` (one row a batch).

    The gateway's admission bound `max_queue_s` is `queue_s`; the stream keeps its default size
    (100,000 requests), so what refuses the excess is the wait estimate, not a full queue.
    """
    capacity = 1000.0 / cost_ms
    config = (
        f"default_model = false\nmax_batch_size = 1\nmax_queue_s = {queue_s}\n\n"
        f'[[models]]\nname = "{NOOP}"\nruntime = "noop"\npinned = true\noptions = {{ cost_ms = {cost_ms} }}\n'
    )
    box = await BoxProcess.start(work / "overload", "overloaded", config)
    try:
        rss_start = box.rss_bytes()
        samples = [rss_start]
        load = SteadyLoad(box.url, capacity * factor, retry_refused=False)
        running = asyncio.create_task(load.run(seconds))
        while not load.sent_all.is_set():
            samples.append(box.rss_bytes())
            await asyncio.wait([running], timeout=0.5)
        # The load has stopped (its accepted requests still drain): how soon is a new one taken, and answered?
        refused_after, first_ok_s = await _recovery(box.url)
        outcomes = await running
        rss_end = box.rss_bytes()
        accepted = [o for o in outcomes if o.status != 429]
        result = tally(accepted, noop_expected)
        retry_after = sorted(v for o in outcomes for v in o.retry_after)
        refusals = sorted(o.latency_s for o in outcomes if o.status == 429)
        rejected = len(outcomes) - len(accepted)
        facts = {
            "offered": f"{capacity * factor:.0f}/s ({factor:g}x {capacity:.0f}/s) for {seconds:g} s",
            "served": f"{result.ok / seconds:.1f}/s",
            "429": f"{rejected} ({rejected / len(outcomes):.0%}), Retry-After {retry_after[0]}-{retry_after[-1]} s"
            if retry_after
            else "0",
            "accepted p50 / p99": _ms(result.p50_s, result.p99_s),
            "429 answered in p50 / p99": _ms(percentile(refusals, 0.5), percentile(refusals, 0.99)),
            "RSS start / peak / end": " / ".join(f"{b / 2**20:.0f}" for b in (rss_start, max(samples), rss_end))
            + " MiB",
            "first request after the load": f"refused {refused_after}x, answered 200 in {first_ok_s:.2f} s",
            "queue bound (max_queue_s)": f"{queue_s:g} s",
        }
        passed = (
            result.lost == 0
            and rejected > 0
            and result.p99_s < 2 * queue_s + 1.0
            and max(samples) < rss_start * 1.5 + 64 * 2**20
            and refused_after == 0
            and first_ok_s < queue_s + 1.0
        )
        return FaultResult(f"5. overload {factor:g}x for {seconds:g} s", passed, result, facts)
    finally:
        await box.stop()


def _ms(*seconds: float) -> str:
    return " / ".join(f"{s * 1000:.0f}" for s in seconds) + " ms"


async def _recovery(base_url: str) -> tuple[int, float]:
    """Requests refused (429) before one was accepted once the load stopped, and seconds until it was answered."""
    refused = 0
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.post(f"{base_url}/v1/embeddings", json={"model": NOOP, "input": "after"}) as response:
                if response.status == 200:
                    return refused, time.monotonic() - started
                refused += 1
            await asyncio.sleep(0.01)


# -- 6. clients that disconnect -------------------------------------------------------------------------


async def client_disconnects(work: Path, *, gone: int = 6, cost_ms: float = 300.0) -> FaultResult:
    """One request on the device, `gone` more queued behind it (in the box and in the stream); their clients leave."""
    server = EmbeddedNats(store_dir=work / "nats", port=free_port())
    await server.start()
    box = Box(
        settings(
            server.url, box_id="box", default_model=False, max_batch_size=1, max_wait_ms=0, worker_capacity=3,
            models=[noop_entry(cost_ms=cost_ms)],
        )
    )  # fmt: skip
    try:
        await box.start()
        worker = box.workers[NOOP]
        url = f"{gateway_url(box)}/v1/embeddings"
        async with aiohttp.ClientSession() as http:
            busy = asyncio.create_task(http.post(url, json={"model": NOOP, "input": "stays"}))
            await wait_until(lambda: worker.held == 1, 10, "the first request on the device")
            leaving = [
                asyncio.create_task(http.post(url, json={"model": NOOP, "input": f"gone {i}"})) for i in range(gone)
            ]

            async def all_queued() -> bool:
                return worker.held - 1 + await queued(box) == gone

            await wait_until(all_queued, 10, "the others to queue")
            in_box = worker.held - 1
            for task in leaving:
                task.cancel()  # the client closes its connection
            async with await busy as response:
                assert response.status == 200
        await wait_until(lambda: worker.held == 0, 10 + gone * cost_ms / 1000, "the box to let go of them")

        async def settled() -> bool:
            return await queued(box) == 0 and await ack_pending(box, NOOP) == 0

        await wait_until(settled, 10, "the queue to empty")
        async with aiohttp.ClientSession() as http, http.get(f"{gateway_url(box)}/metrics") as response:
            metrics = await response.text()
        cancelled = metric_value(metrics, "fbx_cancelled_requests_total", {"model": NOOP})
        computed = metric_value(metrics, "fbx_rows_computed_total", {"model": NOOP})
        facts = {
            "clients gone": f"{gone} ({in_box} held by the box, {gone - in_box} still in the stream)",
            "fbx_cancelled_requests": int(cancelled),
            "fbx_rows_computed": f"{int(computed)} (the one whose client stayed)",
        }
        return FaultResult("6. clients disconnect", cancelled == gone and computed == 1, None, facts)
    finally:
        await box.stop()
        await server.stop()


# -- the run ----------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Plan:
    box_load_s: float
    box_rate: float
    cluster_load_s: float
    cluster_rate: float
    restart_requests: int
    poison_load_s: float
    overload_s: float


PLANS = {
    "full": Plan(box_load_s=30, box_rate=40, cluster_load_s=30, cluster_rate=50, restart_requests=200,
                 poison_load_s=10, overload_s=60),
    "quick": Plan(box_load_s=15, box_rate=30, cluster_load_s=12, cluster_rate=40, restart_requests=60,
                  poison_load_s=4, overload_s=15),
}  # fmt: skip


def runs(plan: Plan) -> dict[str, Callable[[Path], Awaitable[FaultResult]]]:
    return {
        "1": lambda w: box_dies(w, load_s=plan.box_load_s, rate=plan.box_rate),
        "2": lambda w: nats_server_dies(
            w, load_s=plan.cluster_load_s, kill_after_s=plan.cluster_load_s / 3, rate=plan.cluster_rate
        ),
        "3": lambda w: nats_restarts(w, requests=plan.restart_requests, rate=plan.restart_requests),
        "4": lambda w: poison_request(w, max_deliver=5, load_s=plan.poison_load_s, rate=40),
        "5": lambda w: overload(w, seconds=plan.overload_s),
        "6": lambda w: client_disconnects(w),
    }


def _numbers(t: Tally | None) -> list[str]:
    if t is None:
        return [""] * 6
    return [str(t.requests), str(t.ok), str(t.lost), str(t.wrong), f"{t.p99_s:.2f} s", f"{t.max_s:.2f} s"]


def render(results: list[FaultResult], console: Console) -> None:
    table = Table(title="Faults (issue 6)", show_lines=True)
    for column in ("fault", "requests", "right", "lost", "wrong", "p99", "worst", "what it shows", "ok"):
        table.add_column(column, justify="left" if column in ("fault", "what it shows") else "right")
    for result in results:
        numbers = _numbers(result.tally)
        facts = "\n".join(f"{key}: {value}" for key, value in result.facts.items())
        table.add_row(result.fault, *numbers, facts, "[green]pass[/]" if result.passed else "[red]FAIL[/]")
    console.print(table)


def markdown(results: list[FaultResult]) -> str:
    """The same table, for docs/benchmarks.md."""
    lines = [
        "| fault | requests | answered right | lost | wrong | p99 | worst | what it shows | result |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for result in results:
        numbers = _numbers(result.tally)
        facts = "; ".join(f"{key}: {value}" for key, value in result.facts.items()).replace("|", "/")
        lines.append(f"| {result.fault} | {' | '.join(numbers)} | {facts} | {'pass' if result.passed else 'FAIL'} |")
    return "\n".join(lines) + "\n"


async def run_all(args: argparse.Namespace, console: Console) -> list[FaultResult]:
    plan = PLANS["quick" if args.quick else "full"]
    if args.overload_seconds is not None:
        plan = Plan(**{**asdict(plan), "overload_s": args.overload_seconds})
    chosen = runs(plan)
    results = []
    for key in args.only.split(","):
        console.print(f"[bold]fault {key}[/] …")
        with tempfile.TemporaryDirectory(prefix=f"fbx-fault{key}-") as work:
            started = time.monotonic()
            try:
                result = await chosen[key](Path(work))
            except Exception as exc:
                result = FaultResult(f"{key}. failed to run", False, None, {"error": repr(exc)[:300]})
            result.facts["run took"] = f"{time.monotonic() - started:.0f} s"
        console.print(f"  {'pass' if result.passed else 'FAIL'}: {result.tally} {result.facts}")
        results.append(result)
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (about 2 minutes in all)")
    parser.add_argument("--overload-seconds", type=float, default=None, help="overload duration (default 60, quick 15)")
    parser.add_argument("--only", default="1,2,3,4,5,6", help="which faults, comma-separated (default all)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table here, as markdown")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 200)
    log_file = Path(tempfile.gettempdir()) / "fbx-faults.log"
    # Faults make boxes complain (disconnects, retries): keep it out of the table, in a file.
    logging.basicConfig(filename=log_file, filemode="w", level=logging.WARNING, force=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import uvloop

    started = datetime.datetime.now(datetime.UTC)
    results = uvloop.run(run_all(args, console))
    console.print(
        f"{started:%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}; box logs in {log_file}"
    )
    render(results, console)
    if args.markdown is not None:
        args.markdown.write_text(markdown(results))
    if args.json is not None:
        args.json.write_text(
            orjson.dumps([asdict(r) for r in results], option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()
        )
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
