"""Liveness, readiness, metrics and the OpenAPI document."""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from dataclasses import replace

import nats
import pytest

from appliance import bus
from appliance.app import Box
from appliance.catalog import DEFAULT_MODEL_NAME
from appliance.logs import FailureStreak
from appliance.settings import ModelEntry
from tests.conftest import box_settings, hold_warm_ups, noop_model, url, wait_for
from tests.test_large_and_broken import NOT_ITS_WEIGHTS, folder_that_fails_to_load


async def test_healthz_and_readyz_when_ready(default_box, http) -> None:
    async with http.get(url(default_box, "/healthz")) as response:
        assert response.status == 200
    for probe in ("/readyz", "/health"):  # the latter TEI's name for it (huggingface_hub's `health_check`)
        async with http.get(url(default_box, probe)) as response:
            assert response.status == 200
            assert (await response.json())["status"] == "ready"


async def test_metrics_expose_the_serving_figures(default_box, http) -> None:
    async with http.post(
        url(default_box, "/v1/embeddings"), json={"input": ["metrics please"], "model": "all-minilm-l6-v2"}
    ) as response:
        assert response.status == 200
    async with http.get(url(default_box, "/metrics")) as response:
        assert response.status == 200
        text = await response.text()
    for name in (
        "fbx_http_requests_total",
        "fbx_queue_ms_bucket",
        "fbx_compute_ms_bucket",
        "fbx_batch_size_bucket",
        "fbx_batch_tokens_bucket",
        "fbx_stream_backlog",
        "fbx_resident_model_bytes",
    ):
        assert name in text, name
    assert 'fbx_http_requests_total{route="/v1/embeddings",status="200"}' in text


async def test_openapi_lists_every_route(default_box, http) -> None:
    async with http.get(url(default_box, "/openapi.json")) as response:
        spec = await response.json()
    assert {"/v1/embeddings", "/v1/models", "/healthz", "/readyz", "/metrics"} <= set(spec["paths"])
    assert "EmbeddingRequest" in spec["components"]["schemas"]


async def test_readyz_is_503_with_a_reason_until_the_pinned_model_is_resident(nats_server, http) -> None:
    box = Box(box_settings(nats_server.url, default_model=False, models=[noop_model()]))
    try:
        await box.start()
        async with http.get(url(box, "/readyz")) as response:
            assert response.status == 200
        await box.residency.evict("noop")
        async with http.get(url(box, "/readyz")) as response:  # ready once: a pinned model other than the default
            assert response.status == 200  # no longer takes it out of rotation (tester h146)
        box.was_ready = False  # as before its first ready
        async with http.get(url(box, "/readyz")) as response:
            assert response.status == 503
            assert "noop" in (await response.json())["reason"]
    finally:
        await box.stop()


async def test_a_pinned_model_that_cannot_load_leaves_the_box_ready_and_says_why(start_box, http, tmp_path) -> None:
    folder_that_fails_to_load(tmp_path / "broken")
    box = await start_box(default_model=False, model_roots=[tmp_path])
    registration = {"name": "broken", "path": "broken", "pinned": True}
    async with http.post(url(box, "/v1/models"), json=registration) as response:
        assert response.status == 201

    async def load_failed() -> bool:
        return box.residency.load_error("broken") is not None

    await wait_for(load_failed, what="the pinned model's load to fail")
    async with http.get(url(box, "/readyz")) as response:
        assert response.status == 200, await response.text()
    async with http.get(url(box, "/v1/models/broken")) as response:
        assert NOT_ITS_WEIGHTS in (await response.json())["load_error"]


async def test_a_box_starts_and_is_ready_though_a_pinned_model_fails_to_load(start_box, http, tmp_path) -> None:
    """A pinned model that cannot load (in a durable catalog, every new box would meet it) must not stop a box."""
    folder_that_fails_to_load(tmp_path / "broken")
    pinned = ModelEntry(name="broken", path=tmp_path / "broken", task="embed", pinned=True)
    box = await start_box(default_model=False, models=[pinned, noop_model("alpha")])
    assert box.residency.load_error("broken") is not None
    async with http.get(url(box, "/readyz")) as response:
        assert response.status == 200, await response.text()
    async with http.post(url(box, "/v1/embeddings"), json={"model": "alpha", "input": "x"}) as response:
        assert response.status == 200


async def test_the_default_model_gates_readiness_even_when_its_load_failed(start_box, http, tmp_path) -> None:
    box = await start_box()
    spec = box.catalog.get(DEFAULT_MODEL_NAME)
    await box.residency.evict(spec.name)
    with pytest.raises(OSError):
        await box.residency.ensure_loaded(replace(spec, path=tmp_path / "gone"))
    assert box.residency.load_error(spec.name) is not None
    async with http.get(url(box, "/readyz")) as response:
        assert response.status == 503
        assert DEFAULT_MODEL_NAME in (await response.json())["reason"]


def test_a_failing_loop_is_logged_once_when_it_starts_and_once_when_it_ends(caplog) -> None:
    logger = logging.getLogger("fleetbox.test.streak")
    streak = FailureStreak(logger, "reading the thing")
    with caplog.at_level(logging.DEBUG, logger=logger.name):
        for _ in range(3):
            streak.failed(RuntimeError("down"))
        streak.succeeded()
        streak.succeeded()
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert levels == [
        ("WARNING", "reading the thing failed"),
        ("DEBUG", "reading the thing failed"),
        ("DEBUG", "reading the thing failed"),
        ("INFO", "reading the thing works again"),
    ]


async def test_readyz_waits_for_a_pinned_models_worker_to_warm_up_at_start_only(start_box, http, monkeypatch) -> None:
    """Before it was first ready, a box waits for its pinned models' workers to time their warm-up batches (until
    then its heartbeat says no pace, and a burst sent then was bounded by rounds of its batches). A model pinned
    once the box was ready keeps it ready while it loads and warms up: every box of a fleet left rotation at once
    for a pin (tester h146), which a readiness probe would have made an outage of every model."""
    box = await start_box(default_model=False, models=[noop_model(pinned=False)])
    release = hold_warm_ups(monkeypatch)
    try:
        assert box.was_ready  # its start finished, its pinned models (none here) loaded: never probed, it counts
        box.was_ready = False  # as if it had not been ready yet: the pinned model's warm-up keeps it out

        async def readyz() -> tuple[int, str | None]:
            async with http.get(url(box, "/readyz")) as response:
                return response.status, (await response.json()).get("reason")

        async with http.post(url(box, "/v1/models/noop/pin")) as response:
            assert response.status == 200

        async def warming() -> bool:
            return await readyz() == (503, "pinned model noop is warming up")

        await wait_for(warming, what="readyz to say the model warms up")
        release.set()
        await wait_for(lambda: _is(readyz(), (200, None)), what="readyz to say ready once it pulls")
        assert box.was_ready
        release.clear()
        async with http.post(url(box, "/v1/models/noop/unpin")) as response:
            assert response.status == 200
        async with http.post(url(box, "/v1/models/noop/evict")) as response:
            assert response.status == 200
        async with http.post(url(box, "/v1/models/noop/pin")) as response:  # loads it again, its warm-up held
            assert response.status == 200
        await wait_for(lambda: box.workers.get("noop") is not None, what="its worker warming up")
        assert not box.workers["noop"].pulling.is_set()
        assert await readyz() == (200, None)  # ready all along
    finally:
        release.set()


async def _is(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


async def test_readyz_says_not_ready_while_the_request_stream_does_not_answer(start_box, http, monkeypatch) -> None:
    """Tester h87 (a 3-server cluster): through 4-6 s leader elections and 25 s of quorum loss `/readyz` said ready
    while every request got 503: the monitor's look at the stream waited out JetStream's 5 s timeout, and publishes
    failing said nothing to it. Then (h92) a quorum lost with the stream's leader alive: looks were answered and
    publishes not, and each look made it ready again; and a publish waits 5 s before it fails. Not ready: a publish
    that failed unanswered (until one is answered, or a look after a quiet while), one waiting over 2 s, or a look
    over 2 s."""
    import asyncio

    from nats.errors import TimeoutError as NatsTimeout

    from appliance.gateway import publish as publish_module

    box = await start_box(default_model=False, models=[noop_model("a")])

    async def reason() -> str | None:
        async with http.get(url(box, "/readyz")) as response:
            return (await response.json()).get("reason") if response.status == 503 else None

    async def embed() -> int:
        async with http.post(url(box, "/v1/embeddings"), json={"model": "a", "input": "x"}) as response:
            return response.status

    js = box.dispatcher._publisher._js
    publish, released = js.publish, asyncio.Event()

    async def no_leader(*args, **kwargs):
        raise NatsTimeout

    async def waiting(*args, **kwargs):
        await released.wait()
        raise NatsTimeout

    not_answering = "stream FBX_REQ is not answering publishes (a NATS failover?)"
    monkeypatch.setattr(js, "publish", no_leader)
    assert await embed() == 503
    assert await reason() == not_answering
    await asyncio.sleep(2.5)  # looks at the stream answered meanwhile (its leader alive): not enough
    assert await reason() == not_answering
    monkeypatch.setattr(js, "publish", publish)
    assert await embed() == 200 and await reason() is None  # a publish answered
    monkeypatch.setattr(js, "publish", no_leader)
    assert await embed() == 503
    monkeypatch.setattr(publish_module, "_QUIET_S", 0.5)  # no traffic since: an answered look after a quiet while
    monkeypatch.setattr(js, "publish", publish)
    await wait_for(lambda: not box.dispatcher.queue_unanswered(), what="a look after the quiet while")
    assert await reason() is None
    monkeypatch.setattr(js, "publish", waiting)
    sent = asyncio.ensure_future(embed())
    try:
        await wait_for(lambda: box.dispatcher.queue_unanswered(), timeout_s=10.0, what="a publish waiting over 2 s")
        assert await reason() == not_answering
    finally:
        released.set()
    assert await sent == 503
    monkeypatch.setattr(js, "publish", publish)

    async def hung(*args, **kwargs):
        await asyncio.sleep(30)

    monkeypatch.setattr(box.js, "stream_info", hung)
    await wait_for(lambda: not box.queue.stream_ok, timeout_s=10.0, what="a look over its bound read as no answer")
    assert await reason() == "stream FBX_REQ is not available"


async def test_a_stopped_box_leaves_no_consumers_on_the_buckets(start_box, nats_server) -> None:
    """Its watches of `fbx_boxes` and `fbx_models` stopped by unsubscribing only, and the server kept each consumer
    for nats-py's inactive threshold: 5 minutes, two a stopped box (tester's note, carried since h60)."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    streams = [f"KV_{bucket}" for bucket in (bus.BOXES_BUCKET, bus.MODELS_BUCKET)]

    async def consumers() -> list[int]:
        return [(await js.stream_info(stream)).state.consumer_count for stream in streams]

    try:
        box = await start_box(default_model=False, models=[noop_model()])
        assert await consumers() == [1, 1]  # the box's own watches
        await box.stop()
        assert await consumers() == [0, 0]
    finally:
        await nc.close()
