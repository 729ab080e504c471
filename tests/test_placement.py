"""Which box loads a cold model: the first load is claimed fleet-wide, and the claim must not outlive the
load it was for (a reload after an eviction, or after a delete and a new registration, waited it out)."""

from __future__ import annotations

import asyncio
import shutil

from nats.js.errors import KeyNotFoundError

from appliance import app, bus
from appliance.bus import model_slug
from appliance.envelope import ReplyMeta, RequestMeta
from appliance.errors import ServiceUnavailable, UnloadedWhileStarting
from appliance.puller import stop_pullers
from appliance.settings import ModelEntry
from tests.conftest import hold, noop_model, url, wait_for
from tests.test_worker import publish_raw


async def _embed(http, box, model: str, timeout_s: float) -> int:
    body = {"model": model, "input": "wake up", "timeout": timeout_s}
    async with http.post(url(box, "/v1/embeddings"), json=body) as response:
        return response.status


async def test_a_model_evicted_here_loads_again_without_waiting_out_its_first_load_claim(start_box, http) -> None:
    """The claim lives as long as a heartbeat (here 60 s, as a slow fleet might set it): the box that held it
    reloaded only once it lapsed, so a request with a 20 s deadline after an eviction was a 504."""
    box = await start_box(default_model=False, models=[noop_model("cold", pinned=False)], heartbeat_ttl_s=60.0)
    assert await _embed(http, box, "cold", 20.0) == 200
    boxes = await box.js.key_value(bus.BOXES_BUCKET)
    claim = f"claim.load.{model_slug('cold')}"

    async def claim_given_back() -> bool:
        # Not `boxes.keys()`: it raises NoKeysError on a bucket left empty, and its watcher may end early.
        try:
            await boxes.get(claim)
        except KeyNotFoundError:  # deleted (KeyDeletedError) or never there
            return True
        return False

    await wait_for(claim_given_back, what="the first-load claim given back once the model is resident")
    async with http.post(url(box, "/v1/models/cold/evict")) as response:
        assert response.status == 200
    assert await _embed(http, box, "cold", 20.0) == 200


async def test_a_claim_this_box_holds_is_its_own_and_another_boxs_is_not(start_box) -> None:
    first = await start_box(default_model=False, models=[noop_model("kept")])
    second = await start_box(default_model=False, models=[noop_model("kept")])
    assert first.fleet is not None and second.fleet is not None
    assert await first.fleet.claim("load.x")
    assert await first.fleet.claim("load.x")  # its own still
    assert not await second.fleet.claim("load.x")
    await second.fleet.release("load.x")  # not its to give back
    assert not await second.fleet.claim("load.x")
    await first.fleet.release("load.x")
    assert await second.fleet.claim("load.x")


async def test_a_box_that_could_never_hold_a_model_leaves_its_load_to_a_larger_box(
    start_box, http, encoder_dir
) -> None:
    """A small box claimed the cold load of a model its budget could never hold, failed at once, and the fleet
    answered the model's requests 503 for the 30 s back-off while a larger box had room."""
    roots = [encoder_dir.parent.parent]
    large = await start_box(box_id="large", default_model=False, model_roots=roots)
    small = await start_box(box_id="small", default_model=False, model_roots=roots, memory_budget="1KB")
    async with http.post(url(large, "/v1/models"), json={"name": "enc", "path": str(encoder_dir)}) as response:
        assert response.status == 201
    await wait_for(lambda: small.catalog.get("enc") is not None, what="the small box to see the model")
    await wait_for(lambda: "large" in [r["box"] for r in small.fleet.live_boxes()], what="the large box's heartbeat")
    spec = small.catalog.get("enc")
    assert small.placement is not None and large.placement is not None
    assert not await small.placement._could_fit(spec)
    assert await large.placement._could_fit(spec)
    large.draining = True  # going away: the small box is left alone, tries, and its failure says why
    await large.fleet.beat()
    await wait_for(lambda: any(r.get("draining") for r in small.fleet.live_boxes()), what="the large box draining")
    assert await small.placement._could_fit(spec)
    large.draining = False


async def test_a_model_loaded_for_waiting_requests_is_not_an_idle_victim_until_it_pulls(start_box, monkeypatch) -> None:
    """Residency tester h65: a model just loaded for waiting requests counted as idle until its worker pulled, so the
    next model's load evicted it in its warm-up, round after round, and its requests starved; that eviction was then
    taken for a failed load, its requests refused 503 for the 30 s back-off."""
    models = [noop_model("a", pinned=False), noop_model("b", pinned=False)]
    box = await start_box(default_model=False, models=models)
    await box.workers.serve(box.catalog.get("a"))
    monkeypatch.setattr(app, "FIRST_PULL_S", 0.0)  # its first pulls had their time
    assert not box._in_use("a")  # pulling, nothing in hand: the first to go
    await box.residency.ensure_loaded(box.catalog.get("b"))  # loaded, its worker not started yet
    assert box._in_use("b")

    async def evicted_in_its_warm_up(spec):
        raise UnloadedWhileStarting(f"model {spec.name} was unloaded while it warmed up")

    box.workers.serve = evicted_in_its_warm_up
    assert box.placement is not None
    await box.placement._load(box.catalog.get("b"), claimed=False)
    assert "b" not in box.placement._failed and "b" not in box.placement.refusing  # no back-off, no refusal


async def test_a_generator_just_started_is_not_an_idle_victim_before_its_first_pulls(
    start_box, generator_dir, monkeypatch
) -> None:
    """Tester h97: a generator's worker is marked pulling before its pullers start, so it counted as idle (nothing in
    hand) from its load until its first requests came, and under thrashing each next load evicted it first: three
    504s of its requests. A worker counts as starting until its pullers have had `FIRST_PULL_S`."""
    model = ModelEntry(name="gen", path=generator_dir, task="generate", pinned=False)
    box = await start_box(default_model=False, models=[model])
    monkeypatch.setattr(app, "FIRST_PULL_S", 60.0)
    worker = await box.workers.serve(box.catalog.get("gen"))
    assert worker.held == 0 and box._in_use("gen")  # just started: its first pulls are coming
    monkeypatch.setattr(app, "FIRST_PULL_S", 0.0)
    assert not box._in_use("gen")  # had its time, nothing in hand: idle


async def test_a_load_refused_for_pinned_memory_is_tried_again_once_a_pin_is_let_go(start_box, http) -> None:
    """Residency tester h65: the refusal (`... with 600 B pinned`) went on for the 30 s back-off after the pin was
    gone, and the requests were answered with it."""
    models = [noop_model("pinned", pinned=True, bytes=600), noop_model("m", pinned=False, bytes=600)]
    box = await start_box(default_model=False, models=models, memory_budget="1000B")
    assert await _embed(http, box, "m", 10.0) == 503
    async with http.post(url(box, "/v1/models/pinned/unpin")) as response:
        assert response.status == 200

    async def answered() -> bool:
        return await _embed(http, box, "m", 5.0) == 200

    await wait_for(answered, timeout_s=10.0, what="the model loaded once the pin was let go, before the 30 s back-off")


async def test_a_pinned_model_whose_load_failed_is_tried_again_without_a_request(
    start_box, encoder_dir, tmp_path, monkeypatch
) -> None:
    """Tester h73: a pinned model whose folder was broken at start stayed cold after the folder was mended, until a
    request came for it. Pinned means held on every box that runs models: it is tried again after the back-off."""
    from appliance import placement

    monkeypatch.setattr(placement, "_RETRY_AFTER_FAILURE_S", 0.5)
    folder = tmp_path / "enc"
    shutil.copytree(encoder_dir, folder)
    weights = folder / "model.safetensors"
    kept = weights.rename(tmp_path / "model.safetensors")  # a folder whose weights are gone: its load fails
    model = ModelEntry(name="enc", path=folder, pinned=True)
    box = await start_box(default_model=False, models=[model], model_roots=[tmp_path])
    assert "enc" not in box.workers and box.residency.load_error("enc") is not None
    kept.rename(weights)
    await wait_for(lambda: "enc" in box.workers, 20.0, "the pinned model loaded once its folder was mended")
    assert box.residency.load_error("enc") is None


async def test_a_pinned_models_load_failure_stands_while_its_load_is_tried_again(
    start_box, http, encoder_dir, tmp_path, monkeypatch
) -> None:
    """Review h201: a load tried again cleared the last failure as it began, so a pin during it named no failure
    (`load_failed_on`), and `/readyz`, which stops counting a pinned model whose load failed, counted it as "not
    resident yet" for as long as the try ran: the box out of rotation every 30 s. The failure stands until a load
    succeeds. Seen failing before: `load_error` None during the try."""
    from appliance import placement

    monkeypatch.setattr(placement, "_RETRY_AFTER_FAILURE_S", 0.5)
    folder = tmp_path / "enc"
    shutil.copytree(encoder_dir, folder)
    weights = folder / "model.safetensors"
    kept = weights.rename(tmp_path / "model.safetensors")
    model = ModelEntry(name="enc", path=folder, pinned=True)
    box = await start_box(default_model=False, models=[model], model_roots=[tmp_path])
    failed = box.residency.load_error("enc")
    assert failed is not None
    trying, go_on = hold(box.residency, "_load_runtime")
    kept.rename(weights)
    try:
        await asyncio.wait_for(trying.wait(), 20)
        assert box.residency.load_error("enc") == failed
        async with http.get(url(box, "/readyz")) as response:
            assert response.status == 200, await response.text()
    finally:
        go_on.set()
    await wait_for(lambda: "enc" in box.workers, 20.0, "the pinned model loaded once its folder was mended")
    assert box.residency.load_error("enc") is None


async def test_a_refusals_request_on_its_last_delivery_for_a_model_loaded_here_since_goes_to_its_worker(
    start_box, nats_server
) -> None:
    """Review h132: a refusal's pull (the model's load had failed here) that took a request after the model was loaded
    here handed it back with a nak, and on its last delivery that had it dead-lettered, its client told 422. The
    refusal's pull is played here by a pull of the test's own on the model's consumer, the worker's pullers stopped."""
    box = await start_box(default_model=False, models=[noop_model("m")], max_deliver=1)
    worker = box.workers["m"]
    await stop_pullers([worker.puller, worker.bulk_puller])
    nc, replies = await publish_raw(
        nats_server.url, b'{"input": "x", "model": "m"}', id="refused-then-loaded", model="m"
    )
    try:
        refusal = await box.js.pull_subscribe_bind(bus.consumer_name(model_slug("m")), bus.REQUEST_STREAM)
        [msg] = await refusal.fetch(1, timeout=5)
        assert msg.metadata.num_delivered == 1  # its last
        await box.placement._answer(msg, ServiceUnavailable("the load of m failed"))
        reply = await asyncio.wait_for(replies.get(), 30)
        assert ReplyMeta.from_headers(reply.headers).status == 200, reply.data
    finally:
        await nc.close()


async def test_a_refusals_request_on_its_last_delivery_for_a_model_draining_here_is_queued_afresh(
    start_box, nats_server
) -> None:
    """Review h141: taken in by the model's worker as that worker drained (an eviction meanwhile), it waited in a
    stopped batcher, unanswered, until its deliveries ran out. It is queued afresh for another delivery instead."""
    box = await start_box(default_model=False, models=[noop_model("m")], max_deliver=1)
    worker = box.workers["m"]
    await stop_pullers([worker.puller, worker.bulk_puller])
    nc, _ = await publish_raw(nats_server.url, b'{"input": "x", "model": "m"}', id="refused-then-drained", model="m")
    try:
        refusal = await box.js.pull_subscribe_bind(bus.consumer_name(model_slug("m")), bus.REQUEST_STREAM)
        [msg] = await refusal.fetch(1, timeout=5)
        await worker.drain()
        await box.placement._answer(msg, ServiceUnavailable("the load of m failed"))
        [copy] = await refusal.fetch(1, timeout=5)  # not held by the drained worker: back in the queue
        assert RequestMeta.from_headers(copy.headers).id == "refused-then-drained"
        assert copy.metadata.sequence.stream > msg.metadata.sequence.stream
    finally:
        await nc.close()
