"""What a fleet promises under pressure: batch work never starves interactive work, a full queue is an
immediate 429 with Retry-After, a gone client's queued request is not computed, and a request that
fails on every delivery ends in FBX_DLQ with a clear answer while the rest flow on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import aiohttp
import nats
import orjson
import pytest

from appliance import bus
from appliance.app import Box
from appliance.connect import ensure_queue
from appliance.envelope import RequestMeta
from appliance.errors import Conflict
from appliance.gateway import context
from appliance.settings import ModelEntry, Settings
from tests.conftest import box_settings, hold_on_device, noop_model, url, wait_for


def counter(box, name: str, model: str = "noop") -> float:
    return box.metrics.registry.get_sample_value(f"{name}_total", {"model": model}) or 0.0


async def test_batch_priority_work_never_starves_interactive_work(start_box, http) -> None:
    box = await start_box(default_model=False, models=[noop_model(cost_ms=20)], max_batch_size=1, max_wait_ms=0)
    bulk_headers = {"Fbx-Priority": "batch"}
    bulk = [
        asyncio.create_task(
            http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": f"bulk {i}"}, headers=bulk_headers)
        )
        for i in range(100)
    ]  # about two seconds of work at one 20 ms batch at a time

    async def bulk_backlog() -> int:
        info = await box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name("noop", "batch"))
        return int(info.num_pending or 0)

    await wait_for(lambda: _gt(bulk_backlog(), 50), what="a bulk backlog")
    started = time.monotonic()
    async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "urgent"}) as response:
        assert response.status == 200
    waited = time.monotonic() - started
    assert await bulk_backlog() > 0  # the interactive request did not wait for the bulk queue to drain
    assert waited < 1.0
    for task in bulk:
        async with await task as response:
            assert response.status == 200


async def test_interactive_work_overtakes_the_batch_work_a_box_pulled_ahead(start_box, http) -> None:
    """Docs tester: on a fresh box, a second batch-priority request pulled while the first ran counted against the
    room for interactive work, so of three interactive requests sent then, two waited in the queue while it ran."""
    box = await start_box(default_model=False, models=[noop_model(cost_ms=300)], max_batch_size=1, max_wait_ms=0)
    finished: dict[str, float] = {}

    async def send(name: str, headers: dict[str, str]) -> None:
        async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": name}, headers=headers) as r:
            assert r.status == 200
        finished[name] = time.monotonic()

    bulk = [asyncio.create_task(send(f"bulk {i}", {"Fbx-Priority": "batch"})) for i in range(3)]
    await wait_for(lambda: box.workers["noop"].held == 2, what="a bulk request pulled while another runs")
    await asyncio.gather(*(send(f"urgent {i}", {}) for i in range(3)), *bulk)
    bulk_done = sorted(finished[f"bulk {i}"] for i in range(3))
    assert max(finished[f"urgent {i}"] for i in range(3)) < bulk_done[1], finished  # after the one running only


async def test_unknown_priority_is_422(start_box, http) -> None:
    box = await start_box(default_model=False, models=[noop_model()])
    headers = {"Fbx-Priority": "urgent"}
    async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "x"}, headers=headers) as response:
        assert response.status == 422
        assert (await response.json())["error"]["code"] == "invalid_priority"


async def test_full_queue_answers_429_with_retry_after_and_recovers(start_box, http) -> None:
    box = await start_box(
        default_model=False, models=[noop_model(cost_ms=50)], max_batch_size=1, worker_capacity=1, stream_max_msgs=5
    )
    results = await asyncio.gather(
        *(http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": f"r{i}"}) for i in range(30))
    )
    statuses = [r.status for r in results]
    overloaded = [r for r in results if r.status == 429]
    assert overloaded, statuses
    assert set(statuses) <= {200, 429}
    for response in overloaded:
        assert int(response.headers["Retry-After"]) >= 1
        assert (await response.json())["error"]["code"] == "overloaded"
    for response in results:
        response.release()
    async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "after"}) as response:
        assert response.status == 200  # recovered as soon as the queue drained


async def test_a_large_request_the_full_queue_refused_leaves_no_blob_behind(start_box, http) -> None:
    """Review finding: a body put in the object store before the stream refused its message (full) stayed there for
    the bucket's 10 min TTL: the memory a client could fill by hanging up, through a full queue."""
    box = await start_box(default_model=False, models=[noop_model(cost_ms=50)], max_batch_size=1, worker_capacity=1,
                          stream_max_msgs=3, blob_threshold=2048)  # fmt: skip
    bodies = [{"model": "noop", "input": f"r{i} " + "word " * 1000} for i in range(20)]  # 5 KB each: blobs
    results = await asyncio.gather(*(http.post(url(box, "/v1/embeddings"), json=body) for body in bodies))
    assert 429 in {r.status for r in results} and {r.status for r in results} <= {200, 429}
    for response in results:
        response.release()

    async def blobs_deleted() -> bool:
        return (await box.js.stream_info("OBJ_fbx_blobs")).state.bytes < 20 * 300  # deletion markers only

    await wait_for(blobs_deleted, what="every request's blob deleted")


async def test_overload_is_refused_at_once_and_accepted_requests_wait_within_the_queue_bound(start_box, http) -> None:
    """5x a model's capacity with a queue that could hold minutes of work: the excess is a 429 with
    Retry-After right away, the accepted requests wait about max_queue_s, not their 30 s deadline."""
    box = await start_box(default_model=False, models=[noop_model(cost_ms=50)], max_batch_size=1, max_queue_s=1.0)
    outcomes: list[tuple[int, float, str | None]] = []

    async def one(i: int) -> None:
        started = time.monotonic()
        async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": f"r{i}"}) as response:
            await response.read()
            outcomes.append((response.status, time.monotonic() - started, response.headers.get("Retry-After")))

    sends = []
    for i in range(300):  # 100 requests/s for 3 s against 20/s of capacity
        sends.append(asyncio.create_task(one(i)))
        await asyncio.sleep(0.01)
    await asyncio.gather(*sends)
    accepted = [latency for status, latency, _ in outcomes if status == 200]
    refused = [(latency, retry) for status, latency, retry in outcomes if status == 429]
    assert {status for status, _, _ in outcomes} == {200, 429}
    assert len(refused) > 100  # capacity is 60 of the 300 in those 3 s, and 1 s of queue is 20 more
    assert all(retry is not None and 1 <= int(retry) <= 60 for _, retry in refused)
    assert max(latency for latency, _ in refused) < 1.0  # refused at once, not after waiting
    # Unbounded, the last accepted request would wait ~12 s (240 requests ahead at 20/s).
    assert max(accepted) < 5.0
    assert counter(box, "fbx_refused_requests") == len(refused)
    async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "after"}) as response:
        assert response.status == 200  # the load has gone: served at once


async def test_generation_overload_is_refused_at_once_too(start_box, http, generator_dir) -> None:
    """Generation is admitted like the encoder routes, its wait reckoned to the first chunk: with one
    request decoded at a time and many arriving, the excess is a 429 with Retry-After, not a 504 later."""
    one_at_a_time = {"max_batch_size": 1}
    model = ModelEntry(name="tiny-llama", path=generator_dir, task="generate", pinned=True, options=one_at_a_time)
    box = await start_box(default_model=False, models=[model], max_queue_s=1.0)
    outcomes: list[tuple[int, float, str | None]] = []

    async def one(i: int) -> None:
        started = time.monotonic()
        body = {"model": "tiny-llama", "prompt": f"Request {i} says", "max_tokens": 96, "temperature": 0}
        async with http.post(url(box, "/v1/completions"), json=body) as response:
            await response.read()
            outcomes.append((response.status, time.monotonic() - started, response.headers.get("Retry-After")))

    sends = []
    for i in range(120):  # 40 requests/s for 3 s, each decoded alone for 96 steps (~10/s here)
        sends.append(asyncio.create_task(one(i)))
        await asyncio.sleep(0.025)
    await asyncio.gather(*sends)
    refused = [(latency, retry) for status, latency, retry in outcomes if status == 429]
    assert {status for status, _, _ in outcomes} == {200, 429}, sorted({s for s, _, _ in outcomes})
    assert all(retry is not None and 1 <= int(retry) <= 60 for _, retry in refused)
    assert max(latency for latency, _ in refused) < 1.0  # refused at once, not after waiting
    assert counter(box, "fbx_refused_requests", model="tiny-llama") == len(refused)
    # Unbounded, the last request would wait ~8 s to start (80 ahead at ~10/s); admitted ones start within ~1 s.
    assert max(latency for status, latency, _ in outcomes if status == 200) < 5.0
    body = {"model": "tiny-llama", "prompt": "after", "max_tokens": 4, "temperature": 0}
    async with http.post(url(box, "/v1/completions"), json=body) as response:
        assert response.status == 200  # the load has gone: served at once


async def test_a_gateway_in_front_of_two_generating_boxes_lets_in_what_both_boxes_decode_slots_start(
    start_box, http, generator_dir
) -> None:
    """A gateway-only box counted one box's decode slots as free, whatever the fleet held: in front of two worker
    boxes of two slots each, a burst of four long generations on the idle model was half refused (the third
    waited, as it reckoned, behind two answers of 300 tokens) though the second box's slots stood idle. It
    counts the boxes holding the model shared among the gateways: four go. A fifth would wait behind them."""
    two_slots = {"max_batch_size": 2}
    model = ModelEntry(name="tiny-llama", path=generator_dir, task="generate", pinned=True, options=two_slots)
    common = {"default_model": False, "models": [model]}
    gateway = await start_box(role="gateway", box_id="gateway", **common)
    for name in ("worker-a", "worker-b"):
        await start_box(role="worker", box_id=name, **common)
    await wait_for(lambda: len(gateway.fleet.holders("tiny-llama")) == 2, what="both workers to say they hold it")
    assert gateway.fleet.holders_per_gateway("tiny-llama") == 2.0

    async def one(i: int) -> int:
        body = {"model": "tiny-llama", "prompt": f"Request {i} says", "max_tokens": 300, "temperature": 0}
        async with http.post(url(gateway, "/v1/completions"), json={**body, "timeout": 120}) as response:
            await response.read()
            return response.status

    assert sorted(await asyncio.gather(*(one(i) for i in range(5)))) == [200] * 4 + [429]


async def test_queued_request_of_a_gone_client_is_never_computed(start_box, http) -> None:
    box = await start_box(default_model=False, models=[noop_model(cost_ms=400)], max_batch_size=1, max_wait_ms=0)
    busy = asyncio.create_task(http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "first"}))
    await wait_for(lambda: box.workers["noop"].held == 1, what="the first request to be held")
    gone = asyncio.create_task(http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "gone"}))

    async def queued_behind() -> bool:  # in the box or still in the stream: the box holds only what it has room for
        info = await box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name("noop"))
        return box.workers["noop"].held + int(info.num_pending or 0) == 2

    await wait_for(queued_behind, what="the second request to queue behind it")
    gone.cancel()  # the client disconnects while its request waits
    async with await busy as response:
        assert response.status == 200
    await wait_for(lambda: counter(box, "fbx_cancelled_requests") == 1, what="the cancellation")
    await wait_for(lambda: box.workers["noop"].held == 0, what="the box to let go of it")
    assert counter(box, "fbx_rows_computed") == 1


async def test_a_gone_clients_request_already_on_the_device_is_not_counted_cancelled(start_box, http) -> None:
    """Tester h134: `fbx_cancelled_requests` (dropped before compute) counted every request whose client went away,
    those whose batch was already on the device too: it said none of the work was wasted."""
    box = await start_box(default_model=False, models=[noop_model()], max_batch_size=1, max_wait_ms=0)
    on_device, let_go = hold_on_device(box.workers["noop"].runtime)
    gone = asyncio.create_task(http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "gone"}))
    try:
        await wait_for(on_device.is_set, what="its batch on the device")
        gone.cancel()  # the client disconnects while its request is computed
        await wait_for(lambda: box.workers["noop"].held == 0, what="the box to let go of it")
    finally:
        let_go.set()
    await wait_for(lambda: counter(box, "fbx_rows_computed") == 1, what="its row computed")
    assert counter(box, "fbx_cancelled_requests") == 0


async def test_request_no_box_finishes_is_dead_lettered_and_answered(start_box, nats_server, http) -> None:
    """A consumer that takes the request and never acks stands in for boxes that die holding it."""
    box = await start_box(role="gateway", default_model=False, models=[noop_model()], ack_wait_s=1, max_deliver=2)
    body = {"model": "noop", "input": "x", "timeout": 20}
    answer = asyncio.create_task(http.post(url(box, "/v1/embeddings"), json=body))
    nc = await nats.connect(nats_server.url)
    try:
        sub = await nc.jetstream().pull_subscribe_bind(bus.consumer_name("noop"), stream=bus.REQUEST_STREAM)
        for _ in range(2):  # two deliveries, neither acked
            (msg,) = await sub.fetch(1, timeout=10)
            assert msg.headers["Fbx-Model"] == "noop"
        # A box still pulling is what makes JetStream notice the deliveries are used up.
        with pytest.raises(nats.errors.TimeoutError):
            await sub.fetch(1, timeout=3)
        async with await answer as response:
            assert response.status == 422
            error = (await response.json())["error"]
        assert error["code"] == "dead_lettered" and "FBX_DLQ" in error["message"]
        dead = await nc.jetstream().get_last_msg(bus.DEAD_LETTER_STREAM, bus.dead_letter_subject("noop"))
        assert dead.headers["Fbx-Dead-Reason"]
        assert orjson.loads(dead.data)["input"] == "x"

        # Gone from the queue, and counted by the box that took the advisory (review r40): it removes and counts it
        # after its client was told (the 422 above), so both are waited for.
        async def gone_and_counted() -> bool:
            info = await nc.jetstream().stream_info(bus.REQUEST_STREAM)
            return info.state.messages == 0 and counter(box, "fbx_dead_lettered_requests") == 1

        await wait_for(gone_and_counted, timeout_s=5.0, what="the request gone from the queue and counted")
    finally:
        await nc.close()


async def test_a_poison_request_larger_than_a_message_is_dead_lettered_with_its_body_left_in_the_store(
    start_box, http
) -> None:
    """Review finding: the dead letter inlined a body fetched from the object store, and one over NATS's 1 MiB
    payload could not be published: the request was settled only by the max-deliveries advisory, an ack wait
    later. It is dead-lettered at once; the dead letter names the blob, kept until the bucket's TTL."""
    box = await start_box(default_model=False, models=[noop_model(fail_on="POISON")], max_deliver=2,
                          blob_threshold=64 * 1024)  # fmt: skip
    body = {"model": "noop", "input": ["POISON " + "word " * 300_000], "timeout": 20}  # 1.5 MB
    async with http.post(url(box, "/v1/embeddings"), json=body) as response:
        assert response.status == 422, await response.text()
        assert (await response.json())["error"]["code"] == "dead_lettered"
    dead = await box.js.get_last_msg(bus.DEAD_LETTER_STREAM, bus.dead_letter_subject("noop"))
    reason = dead.headers["Fbx-Dead-Reason"]
    assert not dead.data and reason.startswith("RuntimeError('a poison input") and "stays in the object store" in reason
    kept = await (await box.js.object_store(bus.BLOBS_BUCKET)).get(dead.headers["Fbx-Blob"])
    assert kept.data is not None and b"POISON" in kept.data
    body["input"] = ["POISON " + "word " * 40_000]  # 200 KB: through the store, and small enough for a message
    async with http.post(url(box, "/v1/embeddings"), json=body) as response:
        assert (await response.json())["error"]["code"] == "dead_lettered"
    dead = await box.js.get_last_msg(bus.DEAD_LETTER_STREAM, bus.dead_letter_subject("noop"))
    assert dead.data and b"POISON" in dead.data and "object store" not in dead.headers["Fbx-Dead-Reason"]


async def _gt(value, than: int) -> bool:
    return (await value) > than


async def test_no_request_stream_is_a_503_with_retry_after(start_box, http) -> None:
    """What a client sees while the stream has no leader (a NATS failover): retry shortly, not a 500."""
    box = await start_box(default_model=False, models=[noop_model()])
    await box.js.delete_stream(bus.REQUEST_STREAM)
    async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "x"}) as response:
        assert response.status == 503
        assert int(response.headers["Retry-After"]) >= 1
        assert (await response.json())["error"]["code"] == "unavailable"


async def test_a_request_taken_by_a_dead_box_is_answered_though_no_live_box_held_its_model(
    start_box, nats_server, http
) -> None:
    """The only box holding a model dies holding a request: nothing is left in the queue proper (the request
    is pending acknowledgement), yet another box must load the model and answer it once it comes back."""
    box = await start_box(default_model=False, models=[noop_model("cold", pinned=False)], ack_wait_s=1.0)
    nc = await nats.connect(nats_server.url)
    try:
        dying = await nc.jetstream().pull_subscribe_bind(bus.consumer_name("cold"), stream=bus.REQUEST_STREAM)
        taken = asyncio.create_task(dying.fetch(1, timeout=10))  # a box's pull, open before the request comes

        async def pull_open() -> bool:  # at the server: the request sent next is delivered to it
            info = await box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name("cold"))
            return (info.num_waiting or 0) >= 1

        await wait_for(pull_open, timeout_s=5.0, what="the dying box's pull open at the server")
        answer = asyncio.create_task(http.post(url(box, "/v1/embeddings"), json={"model": "cold", "input": "x"}))
        (msg,) = await taken  # held, never acked: the dying box
        assert RequestMeta.from_headers(msg.headers).model == "cold"
        async with await asyncio.wait_for(answer, 20) as response:
            assert response.status == 200, await response.text()
        assert box.residency.is_resident("cold")
    finally:
        await nc.close()


async def test_a_stopping_gateway_still_answers_its_clients_with_the_other_boxes_work(
    start_box, nats_server, http
) -> None:
    """A box that drains is also a gateway: the requests its clients wait for are computed by the other
    box (its own worker hands them back) and answered here before it goes; nothing is dropped."""
    slow = [noop_model(cost_ms=150)]
    await start_box(box_id="stays", default_model=False, models=slow, max_batch_size=1)
    leaving = Box(box_settings(nats_server.url, box_id="leaves", default_model=False, models=slow, max_batch_size=1))
    await leaving.start()
    try:

        async def one(i: int) -> int:
            body = {"model": "noop", "input": f"r{i}", "timeout": 30}
            async with http.post(url(leaving, "/v1/embeddings"), json=body) as response:
                await response.read()
                return response.status

        calls = [asyncio.create_task(one(i)) for i in range(12)]  # ~1 s of work for two boxes
        await wait_for(lambda: leaving.dispatcher.waiting == 12, what="all twelve to be awaited")
        await leaving.stop()
        assert await asyncio.gather(*calls) == [200] * 12
    finally:
        if leaving.nc is not None and leaving.nc.is_connected:
            await leaving.stop()


async def test_a_stopping_box_that_alone_held_a_model_has_its_clients_answered_by_a_box_that_loads_it(
    start_box, nats_server, http
) -> None:
    """Tester h114: the only box holding a model drained while another box ran models. Counted as holding it while it
    drained, it kept the other box from loading the model for the requests it handed back: its clients waited out its
    grace, then had a 503."""
    async with sole_holder_leaving(start_box, nats_server, cost_ms=150) as (stays, leaving):
        assert not stays.residency.is_resident("slow")

        async def one(i: int) -> int:
            body = {"model": "slow", "input": f"r{i}", "timeout": 30}
            async with http.post(url(leaving, "/v1/embeddings"), json=body) as response:
                await response.read()
                return response.status

        calls = [asyncio.create_task(one(i)) for i in range(6)]
        await wait_for(lambda: leaving.dispatcher.waiting == 6, what="all six to be awaited")
        await leaving.stop()
        assert await asyncio.gather(*calls) == [200] * 6
        assert stays.residency.is_resident("slow")


async def test_a_stopping_sole_holder_that_had_pulled_every_request_has_them_answered_by_a_box_that_loads_it(
    start_box, nats_server, http
) -> None:
    """Tester h226: the sole holder had pulled all its own clients' requests when it drained (steady load on it); it
    handed them back with a nak, which the queue's pending count never shows, so the other box saw nothing waiting,
    did not load the model, and the clients waited out the grace for a 503. Of a model's unacked requests, all but
    those its draining holders still compute (their heartbeats' `held`) wait."""
    # It pulls what it expects to answer within 5 s: all six at once, the first batch held while they are.
    async with sole_holder_leaving(start_box, nats_server, cost_ms=10, hold_ms=5000) as (stays, leaving):
        worker = leaving.workers["slow"]
        timing = (embed_slow(http, leaving, i) for i in range(40))
        assert await asyncio.gather(*timing) == [200] * 40  # timed: it pulls by its pace
        run, computing, release = worker.runtime.run, threading.Event(), threading.Event()

        def held_run(batch, adapter=None):  # the first batch is computed only once the box is stopping
            computing.set()
            release.wait(20)
            return run(batch, adapter)

        worker.runtime.run = held_run
        calls = [asyncio.create_task(embed_slow(http, leaving, i)) for i in range(6)]
        await wait_for(lambda: computing.is_set() and worker.held == 6, what="all six pulled by the box that leaves")
        stopping = asyncio.create_task(leaving.stop())
        await wait_for(lambda: leaving.draining, what="the box to drain")
        release.set()
        await stopping
        assert await asyncio.gather(*calls) == [200] * 6
        assert stays.residency.is_resident("slow")


async def test_a_stopping_box_that_alone_held_a_model_and_hands_nothing_back_has_no_box_load_it(
    start_box, nats_server, http
) -> None:
    """Review h115: the request a draining sole holder still computes (taken, not acked) was counted as waiting for
    the model, as a dead box's would be, and another box loaded the model for nothing."""
    async with sole_holder_leaving(start_box, nats_server, cost_ms=1500) as (stays, leaving):
        body = {"model": "slow", "input": "one", "timeout": 30}
        answer = asyncio.create_task(http.post(url(leaving, "/v1/embeddings"), json=body))
        await wait_for(lambda: "slow" in leaving.workers and leaving.workers["slow"].held == 1, what="it taken")
        await leaving.stop()
        async with await answer as response:
            assert response.status == 200
        assert not stays.residency.is_resident("slow") and "slow" not in stays.placement.loading


async def test_a_stopping_box_hands_back_a_request_on_its_last_delivery_without_it_being_dead_lettered(
    start_box, nats_server, http
) -> None:
    """Review h122: a drain handed what it held but had not started back with a nak, whatever its delivery count; on
    its last delivery (every delivery, with `max_deliver` 1) that had it dead-lettered and its client told 422
    `dead_lettered`, though nothing failed. Now such a request is queued again as a copy, and another box answers it."""
    from appliance.control import call_box

    slow = [noop_model("slow", pinned=False, cost_ms=1000)]
    knobs = {"default_model": False, "models": slow, "max_batch_size": 1, "max_deliver": 1, "hold_ms": 10_000}
    stays = await start_box(box_id="stays", **knobs)
    leaving = Box(box_settings(nats_server.url, box_id="leaves", **knobs))
    await leaving.start()
    try:
        assert leaving.nc is not None
        await call_box(leaving.nc, "leaves", "load", {"model": "slow"}, timeout_s=20)
        await wait_for(lambda: stays.fleet.holders("slow") == ["leaves"], what="the other box to see who holds it")

        async def one(i: int) -> int:
            async with http.post(url(stays, "/v1/embeddings"), json={"model": "slow", "input": f"r{i}"}) as response:
                await response.read()
                return response.status

        calls = [asyncio.create_task(one(i)) for i in range(4)]
        await wait_for(lambda: leaving.workers["slow"].held >= 2, what="the one box holding it to take two or more")
        await leaving.stop()  # one on its device, answered; the rest waiting, handed back
        assert await asyncio.gather(*calls) == [200] * 4
        assert counter(stays, "fbx_dead_lettered_requests", "slow") == 0
    finally:
        if leaving.nc is not None and leaving.nc.is_connected:
            await leaving.stop()


async def test_the_box_hosting_the_fleets_nats_stays_up_till_the_others_requests_are_answered(
    tmp_path, http, caplog
) -> None:
    """Tester h226: the box running the embedded nats-server (box 1 of `fleet.md`) stopped while it alone held a model
    the other box's clients used; its nats-server went with it at once, before the other box had loaded the model
    for what it handed back, and those clients had a 504. Now its stop keeps the server up till the request stream
    is empty, then says whom it cuts off."""
    from appliance.control import call_box

    slow = [noop_model("slow", pinned=False, cost_ms=400)]
    knobs = {"default_model": False, "models": slow, "max_batch_size": 1, "hold_ms": 10_000}
    async with box_1_and_another(tmp_path, "other", knobs) as (host, other):
        assert host.nc is not None and other.fleet is not None
        await call_box(host.nc, "hosts", "load", {"model": "slow"}, timeout_s=20)
        await wait_for(lambda: other.fleet.holders("slow") == ["hosts"], what="the other box to see who holds it")

        calls = [asyncio.create_task(embed_slow(http, other, i, timeout_s=20)) for i in range(3)]
        await wait_for(lambda: host.workers["slow"].held >= 2, what="the one box holding it to take two or more")
        with caplog.at_level(logging.WARNING, logger="appliance.app"):
            await host.stop()  # one on its device, answered; the rest handed back, for the other box to load it
        assert await asyncio.gather(*calls) == [200] * 3
        assert other.residency.is_resident("slow")
        assert cut_off(caplog) == [["other"]]


async def test_the_box_hosting_the_fleets_nats_waits_for_no_request_that_no_other_box_would_compute(
    tmp_path, caplog
) -> None:
    """Review h229: with only a gateway-only box beside it (or the whole fleet stopping), one request no box would take
    kept box 1 and its nats-server up for its whole budget, as did a stream a busy fleet keeps filling. It waits only
    while another box computes, and only for what was in the stream when it began."""
    knobs = {"default_model": False, "models": [noop_model("slow", pinned=False, cost_ms=10)]}
    async with box_1_and_another(tmp_path, "door", knobs, role="gateway") as (host, _):
        assert host.js is not None and host.fleet is not None
        await wait_for(lambda: "door" in {r.get("box") for r in host.fleet.live_boxes()}, what="box 1 to see the door")
        await host.js.publish(bus.request_subject("nosuch"), b"x", stream=bus.REQUEST_STREAM)  # no box takes it
        with caplog.at_level(logging.WARNING, logger="appliance.app"):
            await host.stop()
        assert not [r for r in caplog.records if "the others' requests" in r.getMessage()]  # not timed out: not waited
        assert cut_off(caplog) == [["door"]]


@contextlib.asynccontextmanager
async def box_1_and_another(
    tmp_path, other_id: str, knobs: dict[str, Any], **other_knobs: Any
) -> AsyncIterator[tuple[Box, Box]]:
    """Box "hosts", running the embedded nats-server (box 1 of `fleet.md`), and box `other_id` joined to it (with
    `other_knobs` besides `knobs`); each stopped at the end if the test did not."""
    from appliance.natsd import free_port

    host = Box(Settings(host="127.0.0.1", port=0, device="cpu", nats_port=free_port(), state_dir=tmp_path / "a",
                        box_id="hosts", **knobs))  # fmt: skip
    await host.start()
    other: Box | None = None
    try:
        assert host.natsd is not None
        other = Box(box_settings(host.natsd.url, box_id=other_id, **knobs, **other_knobs))
        await other.start()
        yield host, other
    finally:
        if other is not None:
            await other.stop()
        if host.nc is not None and host.nc.is_connected:
            await host.stop()


def cut_off(caplog: pytest.LogCaptureFixture) -> list[list[str]]:
    """The boxes each stop of an embedded nats-server said it cut off."""
    return [r.boxes for r in caplog.records if r.message.startswith("stopping the embedded nats-server")]


async def embed_slow(http: aiohttp.ClientSession, box: Box, i: int, *, timeout_s: float = 30) -> int:
    """One request for model `slow` at `box`'s gateway: its status."""
    body = {"model": "slow", "input": f"r{i}", "timeout": timeout_s}
    async with http.post(url(box, "/v1/embeddings"), json=body) as response:
        await response.read()
        return response.status


@contextlib.asynccontextmanager
async def sole_holder_leaving(start_box, nats_server, *, cost_ms: int, **knobs: Any) -> AsyncIterator[tuple[Box, Box]]:
    """Two boxes of no-op model `slow` (`cost_ms` a row, one row a batch): "stays", which does not hold it, and
    "leaves", the one box that does (with settings `knobs`), for the test to stop (stopped at the end if it did
    not)."""
    from appliance.control import call_box

    slow = [noop_model("slow", pinned=False, cost_ms=cost_ms)]
    stays = await start_box(box_id="stays", default_model=False, models=slow, max_batch_size=1)
    leaving = Box(
        box_settings(nats_server.url, box_id="leaves", default_model=False, models=slow, max_batch_size=1, **knobs)
    )
    await leaving.start()
    try:
        assert leaving.nc is not None
        await call_box(leaving.nc, "leaves", "load", {"model": "slow"}, timeout_s=20)
        await wait_for(lambda: stays.fleet.holders("slow") == ["leaves"], what="the other box to see who holds it")
        yield stays, leaving
    finally:
        if leaving.nc is not None and leaving.nc.is_connected:
            await leaving.stop()


async def test_a_stopping_box_takes_no_new_request_on_a_kept_alive_connection(start_box, nats_server, http) -> None:
    """A stopping box went on taking new requests on connections its clients kept alive (about 1,300 in 8 s in
    the black-box tester's run), stopped only at the end of its grace, and answered the last ones 503 or
    dropped them, though another box answered in 20 ms; its probe never saw `draining` (the port was closed at
    once). Now: what it had taken is answered, anything new is a 503 at once with its connection closed, and
    `/readyz` says draining until the listener closes. Found by the black-box tester."""
    slow = [noop_model(cost_ms=800)]  # the box stays in its drain while the checks run
    await start_box(box_id="stays", default_model=False, models=slow, max_batch_size=1)
    leaving = Box(box_settings(nats_server.url, box_id="leaves", default_model=False, models=slow, max_batch_size=1))
    await leaving.start()
    try:
        taken = asyncio.create_task(http.post(url(leaving, "/v1/embeddings"), json={"model": "noop", "input": "x"}))
        await wait_for(lambda: leaving.dispatcher.waiting == 1 or taken.done(), what="the request to be awaited")
        assert not taken.done(), taken.result()
        stopping = asyncio.create_task(leaving.stop())
        await wait_for(lambda: leaving.draining, what="the box to start draining")
        for probe in ("/readyz", "/health"):  # the latter TEI's, as huggingface_hub's health_check calls it
            async with http.get(url(leaving, probe)) as response:
                assert (response.status, (await response.json())["reason"]) == (503, "draining"), probe
                assert response.headers.get("Connection", "").lower() == "close"
        async with http.post(url(leaving, "/v1/embeddings"), json={"model": "noop", "input": "y"}) as response:
            body = await response.json()
            assert (response.status, body["error"]["code"]) == (503, "unavailable"), body
            assert "is stopping; send the request to another box" in body["error"]["message"]
            assert response.headers["Retry-After"] == "1"
        async with await taken as response:
            assert response.status == 200, await response.text()
        await stopping
    finally:
        if leaving.nc is not None and leaving.nc.is_connected:
            await leaving.stop()


async def _alone_with_six_awaited(nats_server, http) -> tuple[Box, list[asyncio.Task]]:
    """A box alone with six requests its gateway awaits, about 2 s of work at one 300 ms batch at a time."""
    box = Box(box_settings(nats_server.url, default_model=False, models=[noop_model(cost_ms=300)], max_batch_size=1))
    await box.start()
    calls = [
        asyncio.create_task(http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": f"r{i}"}))
        for i in range(6)
    ]
    await wait_for(lambda: box.dispatcher.waiting == 6, what="all six to be awaited")
    return box, calls


async def test_a_stopping_gateway_that_no_box_can_answer_for_says_so(nats_server, http) -> None:
    """Alone, a stopping box's unstarted requests have no one to compute them: a 503 to retry, not a dropped line."""
    box, calls = await _alone_with_six_awaited(nats_server, http)
    await box.stop()
    statuses = []
    for call in calls:
        async with await call as response:
            statuses.append(response.status)
            if response.status == 503:
                assert "is stopping" in (await response.json())["error"]["message"]
                assert response.headers["Retry-After"] == "1"
    assert set(statuses) <= {200, 503} and 503 in statuses, statuses


async def test_queued_generation_of_a_gone_client_is_never_generated(start_box, http, generator_dir) -> None:
    """As for the encoder routes: with generations queued behind a busy decode batch, one whose client goes
    away before a box pulls it is dropped unstarted by the box that pulls it later."""
    model = ModelEntry(
        name="tiny-llama", path=generator_dir, task="generate", pinned=True, options={"max_batch_size": 1}
    )
    # Room for all nine to wait: a loaded machine's slow warm-up made the gateway's pace low enough to refuse the
    # ninth, and two of the eight, 429 (auditor h93, 2 runs of 10 under load).
    box = await start_box(default_model=False, models=[model], max_queue_s=120)

    def body(prompt: str) -> dict:
        return {"model": "tiny-llama", "prompt": prompt, "max_tokens": 200, "temperature": 0}

    # One answer first: until a generation is made whole, admission takes a slot to make 20 tokens a second and
    # lets one generation of 200 wait behind the first, not the eight (0.4 s each on this model) queued here.
    async with http.post(url(box, "/v1/completions"), json=body("warm")) as warm:
        assert warm.status == 200, await warm.text()
        tokens = (await warm.json())["usage"]["completion_tokens"]
    # The decode steps are held until the gone client's cancel has reached the box: holding all it may (two: one on
    # the device, one waiting to join), the box pulls nothing more meanwhile. Left to timing (CI, once), what was
    # queued ahead of the gone one (three or more generations) could be pulled before its cancel came.
    let_step = threading.Event()
    runtime = box.workers["tiny-llama"].runtime
    step = runtime.step

    def held_step():
        assert let_step.wait(30), "the decode steps were held past 30 s"
        return step()

    runtime.step = held_step
    try:
        busy = [asyncio.create_task(http.post(url(box, "/v1/completions"), json=body(f"busy {i}"))) for i in range(8)]

        async def pending() -> int:
            info = await box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name("tiny-llama"))
            return int(info.num_pending or 0)

        await wait_for(lambda: _at_least(pending(), 3), what="generations waiting in the queue")
        await wait_for(lambda: box.dispatcher.waiting == 8, what="the eight to be awaited")
        awaited = set(box.dispatcher._waiters._streams)
        gone = asyncio.create_task(http.post(url(box, "/v1/completions"), json=body("gone")))
        await wait_for(lambda: box.dispatcher.waiting == 9, what="the last one to be queued")
        (gone_id,) = set(box.dispatcher._waiters._streams) - awaited
        gone.cancel()  # its client disconnects while it waits behind the others
        await wait_for(lambda: box.workers._cancelled.contains(gone_id), what="its cancel to reach the box")
    finally:
        let_step.set()
    for task in busy:
        async with await task as response:
            tokens += (await response.json())["usage"]["completion_tokens"]
    await wait_for(lambda: counter(box, "fbx_cancelled_requests", model="tiny-llama") == 1, what="the cancellation")
    assert counter(box, "fbx_rows_computed", model="tiny-llama") == tokens  # not one token for the gone client
    decoders = [queue.decoder for queue in box.dispatcher._admission._queues.values()]
    assert decoders and not any(decoder.running for decoder in decoders)  # every generation let go of its slot
    made = [tokens for decoder in decoders for _, _, tokens, _ in decoder.made]  # each timed with the tokens it made
    assert len(made) >= 8 and all(0 < tokens <= 200 for tokens in made), made


async def _at_least(count: Awaitable[int], least: int) -> bool:
    return await count >= least


async def test_a_stopping_gateway_answers_every_client_before_it_sends_a_cancel(nats_server, http) -> None:
    """It answered one client, waited for that request's cancel to be published, then answered the next: on a
    NATS that hangs (a full write buffer) the clients after the first were never answered. Found by the review
    of the stop path; here the first cancel is held as such a publish would be."""
    from tests.conftest import hold

    box, calls = await _alone_with_six_awaited(nats_server, http)
    cancelling, go_on = hold(box.dispatcher._publisher, "cancel")
    stopping = asyncio.create_task(box.stop())
    try:
        await asyncio.wait_for(cancelling.wait(), 20)
        statuses = []
        for call in calls:
            async with await asyncio.wait_for(call, 10) as response:
                statuses.append(response.status)
        assert set(statuses) <= {200, 503} and 503 in statuses, statuses
    finally:
        go_on.set()
        await stopping


async def test_a_request_that_reaches_the_queue_after_a_stopping_box_gave_up_is_answered_at_once(
    start_box, http
) -> None:
    """A handler that passed the draining check before SIGTERM but reached the queue only after the box answered
    what it awaited was left waiting, then dropped by the listener's close 3 s later, unanswered (4 runs in 10
    of the black-box tester's). Now it gets the stopping box's 503 at once."""
    from appliance.errors import ServiceUnavailable

    box = await start_box(default_model=False, models=[noop_model()])
    await box.dispatcher.abandon(ServiceUnavailable("box b is stopping; send the request again", retry_after_s=1))
    async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "x", "timeout": 30}) as response:
        body = await response.json()
        assert (response.status, body["error"]["code"]) == (503, "unavailable"), body
        assert "is stopping" in body["error"]["message"]


async def test_a_gateway_with_no_worker_for_a_while_answers_503_at_once(start_box, http, monkeypatch) -> None:
    """Operator tester h60: a gateway-only fleet (or one whose last worker died) queued each request, which waited out
    its deadline (a 504 after 30 s) while `/v1/models` showed no box to run it. Past a heartbeat's TTL and a grace
    (here 0, and a TTL of 1 s) with no worker, a 503 at once; once a worker joins, requests are answered."""
    monkeypatch.setattr(context, "NO_WORKER_GRACE_S", 0.0)
    models = [noop_model("a", pinned=False)]
    gateway = await start_box(
        role="gateway", box_id="door", default_model=False, models=models, heartbeat_s=0.3, heartbeat_ttl_s=1.0
    )
    body = {"model": "a", "input": "x", "timeout": 2}  # queued within the grace: a 504 after 2 s

    async def refused_at_once() -> bool:
        started = time.monotonic()
        async with http.post(url(gateway, "/v1/embeddings"), json=body) as response:
            if response.status != 503:
                return False
            assert response.headers["Retry-After"] == "2"
            assert "no box in the fleet runs models" in (await response.json())["error"]["message"]
        return time.monotonic() - started < 1

    await wait_for(refused_at_once, what="a 503 at once with no worker past the TTL")
    await start_box(role="worker", box_id="runner", default_model=False, models=models)

    async def answered() -> bool:
        async with http.post(url(gateway, "/v1/embeddings"), json=body) as response:
            return response.status == 200

    await wait_for(answered, what="a request answered once a worker joined")


async def test_a_gateway_that_cannot_see_the_heartbeats_does_not_say_no_box_runs_models(
    start_box, http, monkeypatch
) -> None:
    """Tester h87: through a NATS quorum loss or a whole cluster's restart, gateway-only boxes answered 503 "no box in
    the fleet runs models" with three workers up, for seconds after the cluster was back: their own view of the
    heartbeats had gone stale with everyone's. A box that does not see its own heartbeat knows nothing of the
    workers: it says nothing of them. Here the gateway's watch of the heartbeats is cut (TTL 1 s, no grace)."""
    monkeypatch.setattr(context, "NO_WORKER_GRACE_S", 0.0)
    models = [noop_model("a")]
    common = {"default_model": False, "models": models, "heartbeat_ttl_s": 1.0, "heartbeat_s": 0.2}
    gateway = await start_box(role="gateway", box_id="door", **common)
    await start_box(role="worker", box_id="runner", **common)
    await wait_for(lambda: gateway.fleet.holders("a"), what="the worker seen")
    (watch,) = [task for task in gateway.fleet._tasks if task.get_name() == "fleet-watch"]
    watch.cancel()
    loop = asyncio.get_running_loop()
    until = loop.time() + 3.0  # past the TTL: every record the gateway holds, its own too, is stale
    while loop.time() < until:
        async with http.post(url(gateway, "/v1/embeddings"), json={"model": "a", "input": "x"}) as response:
            assert response.status == 200, await response.text()
        await asyncio.sleep(0.1)
    assert not gateway.fleet.holders("a") and gateway.fleet.without_workers_s() == 0.0


async def embed_at_once(
    http: aiohttp.ClientSession, box: Box, count: int, *, timeout_s: float
) -> list[tuple[int, dict[str, str], dict]]:
    """`count` embeddings of model "a" sent to `box` at once: each one's status, headers and body."""

    async def embed(i: int) -> tuple[int, dict[str, str], dict]:
        body = {"model": "a", "input": f"x{i}", "timeout": timeout_s}
        async with http.post(url(box, "/v1/embeddings"), json=body) as response:
            return response.status, dict(response.headers), await response.json()

    return await asyncio.gather(*(embed(i) for i in range(count)))


async def test_a_gateway_queueing_for_a_worker_to_come_back_refuses_what_it_cannot_queue_with_a_503(
    start_box, http
) -> None:
    """Fleet tester h82: with every worker dead, requests past what the gateway queues for the grace got a 429 "this
    gateway already awaits 60 requests", `Retry-After: 1`: nothing was overloaded, no box held the model. They get
    a 503 that says so; what was queued waits for a worker (here none comes: a 504 at the deadline)."""
    models = [ModelEntry(name="a", runtime="noop", max_batch_size=2)]  # rounds of 2 rows: a handful is queued
    gateway = await start_box(
        role="gateway", box_id="door", default_model=False, models=models, heartbeat_s=0.3, heartbeat_ttl_s=1.0
    )
    outcomes = await embed_at_once(http, gateway, 20, timeout_s=2)
    statuses = sorted(status for status, _, _ in outcomes)
    assert set(statuses) == {503, 504}, statuses
    for status, headers, body in outcomes:
        if status == 503:
            assert "held by no live box now" in body["error"]["message"], body
            assert headers["Retry-After"] == "2"


async def test_a_full_queue_for_a_model_a_live_box_has_not_loaded_is_a_429_not_a_503(start_box, http) -> None:
    """Tester h214: under churn on a tight memory budget, a model the box had evicted (and would load again in its
    turn) had its full queue refused with a 503 "held by no live box now (its boxes restarting, or one loading it)".
    A live box that runs models loads it: that is overload, a 429. Here the model is cold on a live box (not pinned:
    loaded once requests wait); seen failing so (503s)."""
    models = [ModelEntry(name="a", runtime="noop", max_batch_size=2)]  # rounds of 2 rows: a handful is let wait
    box = await start_box(default_model=False, models=models, heartbeat_s=0.3, heartbeat_ttl_s=1.0)
    await wait_for(box.fleet.hears_itself, what="its own heartbeat")
    assert not box.fleet.holders("a") and box.fleet.can_load("a")
    outcomes = await embed_at_once(http, box, 20, timeout_s=10)
    statuses = sorted(status for status, _, _ in outcomes)
    assert set(statuses) == {200, 429}, outcomes
    for status, headers, body in outcomes:
        if status == 429:
            assert body["error"]["message"].startswith("model a is overloaded: "), body
            assert int(headers["Retry-After"]) >= 1


async def test_a_box_started_under_the_id_of_a_live_box_is_refused_and_leaves_its_record(
    start_box, nats_server, caplog
) -> None:
    """Operator tester h60: two boxes under one `--box-id` shared a heartbeat and control subjects, and one `fleetbox
    box drain` stopped both. The second is refused at start, never writes under the id, and its stop does not
    delete the live box's record (watched for: the live box would write it again within a beat)."""
    first = await start_box(box_id="twin", default_model=False, models=[noop_model()])
    twin = Box(box_settings(nats_server.url, box_id="twin", default_model=False, models=[noop_model()]))
    kv = await first.js.key_value(bus.BOXES_BUCKET)
    watcher = await kv.watch("twin", include_history=False)
    try:
        with pytest.raises(Conflict, match="box id twin is taken: another live box of the fleet beats under it"):
            await twin.start()
        with caplog.at_level(logging.INFO, logger="appliance.app"):
            await twin.stop()
        stops = [(r.message, r.box, r.ready) for r in caplog.records if r.message.startswith("box stop")]
        assert stops == [("box stopping", "twin", False), ("box stopped", "twin", False)]  # not the live box's stop
        assert first.ready
        written = []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                async for entry in watcher:
                    if entry is not None:
                        written.append((entry.operation, orjson.loads(entry.value)["started"] if entry.value else None))
        assert written and all(written_by == (None, first.started_at) for written_by in written), written
    finally:
        await watcher.stop()


async def test_a_box_whose_id_another_box_took_while_it_was_frozen_stops_when_it_wakes(start_box, nats_server) -> None:
    """Tester h82: a worker SIGSTOPped past its heartbeat TTL, a new worker started under its id, and the old one
    woke (SIGCONT) with its NATS connection intact: it wrote over the new box's record and both beat on, every
    request computed twice, `models list` showing one box. Here the new box's record is written as its start
    writes it (the old box's aged out); the old box's next beat finds it and stops the old box, leaving it be."""
    frozen = await start_box(box_id="sleeper", default_model=False, models=[noop_model()])
    nc = await nats.connect(nats_server.url)
    kv = await nc.jetstream().key_value(bus.BOXES_BUCKET)
    await frozen.fleet._stop_tasks()  # frozen: it beats no more (and watches no more)
    await kv.delete("sleeper")  # its record aged out
    newcomer = {"box": "sleeper", "started": frozen.started_at + 30, "ts": time.time(), "role": "all", "models": []}
    await kv.create("sleeper", orjson.dumps(newcomer))
    await frozen.fleet.beat()  # it wakes: its timer's beat comes first
    assert frozen.stop_requested.is_set() and "box id sleeper is taken" in (frozen.failure or "")
    assert orjson.loads((await kv.get("sleeper")).value)["started"] == newcomer["started"]  # not written over
    await frozen.stop()
    assert orjson.loads((await kv.get("sleeper")).value)["started"] == newcomer["started"]  # nor deleted by its stop
    await nc.close()


async def test_two_boxes_started_under_one_id_at_the_same_moment_are_not_both_let_in(nats_server) -> None:
    """Both saw no record under the id and both beat on (a planning item since tester h64): the first record is
    written only over what was judged, so one of them is refused."""
    boxes = [Box(box_settings(nats_server.url, box_id="gemini", default_model=False, models=[])) for _ in range(2)]
    try:
        results = await asyncio.gather(*(box.start() for box in boxes), return_exceptions=True)
        refused = [r for r in results if isinstance(r, Conflict)]
        assert len(refused) == 1 and results.count(None) == 1, results
        assert "box id gemini is taken" in refused[0].message
        live = boxes[results.index(None)]
        await wait_for(lambda: [b["started"] for b in live.fleet.live_boxes()] == [live.started_at], 5.0)
    finally:
        for box in boxes:
            await box.stop()


async def test_a_box_whose_twin_wrote_its_record_after_the_watch_was_read_is_refused(nats_server, monkeypatch) -> None:
    """CI (stop 23): two boxes started under one id at the same moment were both let in, 1 run of many. The twin
    check read the watch, which showed no record yet, and the first write then read the bucket, found the other
    box's fresh record and wrote over it. Here the other box's record lands just after this box's watch was read
    (its first look in the bucket), and that box beats on: this box is refused and the record stays the other's."""
    from nats.js.kv import KeyValue

    nc = await nats.connect(nats_server.url)
    box = Box(box_settings(nats_server.url, box_id="gemini", default_model=False, models=[]))
    other = {"box": "gemini", "started": 1.0, "role": "all", "models": []}
    looks: list[str] = []
    plain_get = KeyValue.get

    async def get_after_the_other_box_wrote(self: KeyValue, key: str, *args: object, **kwargs: object):
        if key == "gemini" and not looks:
            looks.append(key)
            await self.create(key, orjson.dumps({**other, "ts": time.time()}))
        return await plain_get(self, key, *args, **kwargs)

    async def the_other_box_beats() -> None:
        while True:
            await asyncio.sleep(box.settings.heartbeat_s / 4)
            if looks:
                kv = await nc.jetstream().key_value(bus.BOXES_BUCKET)
                await kv.put("gemini", orjson.dumps({**other, "ts": time.time()}))

    monkeypatch.setattr(KeyValue, "get", get_after_the_other_box_wrote)
    beating = asyncio.create_task(the_other_box_beats())
    try:
        with pytest.raises(Conflict, match="box id gemini is taken"):
            await box.start()
        assert looks
        kv = await nc.jetstream().key_value(bus.BOXES_BUCKET)
        assert orjson.loads((await plain_get(kv, "gemini")).value)["started"] == 1.0
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
        await box.stop()
        await nc.close()


async def test_a_box_restarted_under_the_id_of_one_that_died_moments_ago_starts(start_box, nats_server) -> None:
    """The record a SIGKILLed box left lives a TTL: a restart under its id (a container's fixed id) is not a twin."""
    dead = Box(box_settings(nats_server.url, box_id="phoenix", default_model=False, models=[noop_model()]))
    await dead.start()
    await dead.fleet._stop_tasks()  # it beats no more, its record left to the TTL, as after a SIGKILL
    try:
        again = await start_box(box_id="phoenix", default_model=False, models=[noop_model()])
        assert again.fleet.live_boxes()[0]["started"] == again.started_at
    finally:
        await dead.stop()


async def test_a_box_back_on_nats_whose_id_another_box_took_stops(start_box) -> None:
    """Review r61: cut off past its heartbeat's TTL while another box started under its id, a box's restore on its
    return was refused 30 times, then it went on pulling and answering control verbs, out of the fleet's sight."""
    box = await start_box(box_id="taken", default_model=False, models=[noop_model()])
    kv = await box.js.key_value(bus.BOXES_BUCKET)

    async def another_box_beats() -> None:
        while True:
            record = {"box": "taken", "role": "all", "started": 1.0, "ts": time.time()}
            await kv.put("taken", orjson.dumps(record))
            await asyncio.sleep(box.settings.heartbeat_s / 4)

    beating = asyncio.create_task(another_box_beats())
    try:
        await asyncio.sleep(box.settings.heartbeat_s / 2)
        async with asyncio.timeout(10):
            await box.queue._restore()
        assert box.stop_requested.is_set() and "box id taken is taken" in (box.failure or ""), box.failure
    finally:
        beating.cancel()


async def test_a_worker_counts_deliveries_by_its_queues_max_deliver_not_its_own_setting(
    start_box, nats_server, http, caplog
) -> None:
    """Tester h73: max_deliver raised between restarts leaves the consumer at its old value (configuration.md), and
    the worker, counting by its own setting, answered a request its model failed on with 'no box finished it: each
    box holding it stopped answering' instead of the model's error."""
    nc = await nats.connect(nats_server.url)
    try:
        await ensure_queue(nc.jetstream(), Settings())
        await bus.ensure_request_consumers(nc.jetstream(), "noop", ack_wait_s=10, max_deliver=2, max_ack_pending=100)
    finally:
        await nc.close()
    with caplog.at_level(logging.WARNING, logger="appliance.workers"):
        box = await start_box(default_model=False, models=[noop_model(fail_on="POISON")], max_deliver=4)
    (warning,) = [r for r in caplog.records if r.message.startswith("the model's queue was made with other values")]
    assert warning.queue_max_deliver == 2
    async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "POISON", "timeout": 20}) as r:
        assert r.status == 422, await r.text()
    dead = await box.js.get_last_msg(bus.DEAD_LETTER_STREAM, bus.dead_letter_subject("noop"))
    assert dead.headers["Fbx-Dead-Reason"].startswith("RuntimeError('a poison input"), dead.headers
    # Said once a model: a load racing the start's (a clean-clone run under load logged it twice) reads it again.
    with caplog.at_level(logging.WARNING, logger="appliance.workers"):
        terms = await box.workers._queue_terms(box.catalog.get("noop"))
    assert terms.max_deliver == 2
    assert [r.message for r in caplog.records].count(warning.message) == 1


async def test_a_request_stream_kept_with_other_storage_or_replicas_is_said(nats_server, caplog) -> None:
    """Tester h73: a state dir switched from --durable to memory, or --replicas raised on a running fleet, kept the
    stream as it was made, unsaid."""
    nc = await nats.connect(nats_server.url)
    try:
        await ensure_queue(nc.jetstream(), Settings())
        with caplog.at_level(logging.WARNING, logger="appliance.bus"):
            await ensure_queue(nc.jetstream(), Settings())  # the same settings: nothing to say
            assert not caplog.records
            await ensure_queue(nc.jetstream(), Settings(durable=True))
        (warning,) = caplog.records
        assert warning.message.startswith("the request stream keeps the storage and replicas it was made with")
        assert (warning.kept, warning.settings) == (
            {"storage": "memory", "replicas": 1},
            {"storage": "file", "replicas": 1},
        )
    finally:
        await nc.close()
