"""Bodies and replies larger than NATS carries go through the object store; a model that cannot load
answers its waiting requests with a clear error instead of letting them time out."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import nats
import numpy as np
import torch
from nats.js.errors import NotFoundError, ObjectNotFoundError, ServiceUnavailableError

from appliance import blobs as blobs_module
from appliance import bus
from appliance.app import Box
from appliance.envelope import ReplyMeta
from appliance.model_bytes import estimate_bytes
from benchmarks._models import copy_bert_tokenizer
from tests.conftest import noop_model, url, wait_for
from tests.models import YES_NO, save_long_context_encoder, with_config
from tests.test_worker import acked_only_once_confirmed, publish_raw


async def test_a_blob_read_whose_chunks_never_come_gives_up_within_its_bound(nats_server, monkeypatch) -> None:
    """Review h141: nats.py's object read waits for a blob's chunks without end, so a read whose chunks were purged
    under it (or a server stalled) held its request forever, kept in progress by the worker's keep-alive. Bounded,
    it raises TimeoutError, which the worker, the generator's intake and the dead letter take as a try that failed."""
    monkeypatch.setattr(blobs_module, "READ_TIMEOUT_S", 0.5)
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        blobs = blobs_module.Blobs(js, 1024, nc.max_payload, ttl_s=600, file_storage=False, replicas=1)
        await blobs.put("chunks-gone", b"x" * 4096)
        info = await (await js.object_store(bus.BLOBS_BUCKET)).get_info("chunks-gone")
        await js.purge_stream(f"OBJ_{bus.BLOBS_BUCKET}", subject=f"$O.{bus.BLOBS_BUCKET}.C.{info.nuid}")
        subscribed = len(nc._subs)
        read = asyncio.create_task(blobs.get("chunks-gone"))
        done, _ = await asyncio.wait({read}, timeout=10)
        assert read in done, "the read still waits for its chunks"
        assert isinstance(read.exception(), TimeoutError)
        assert len(nc._subs) == subscribed  # its chunks' subscription not left on the connection
        await blobs.put("whole", b"y" * 4096)
        assert await blobs.get("whole") == b"y" * 4096  # a whole read unsubscribes by itself, as before
        assert len(nc._subs) == subscribed
    finally:
        await nc.close()


class _StalledStore:
    """The object store as nats.py reads it when an object's chunks never come (purged under it, a server stalled):
    the read waits without end."""

    async def get(self, key: str) -> None:
        await asyncio.Event().wait()

    async def delete(self, key: str) -> None:
        pass


async def test_a_reply_whose_body_cannot_be_read_is_a_503_and_one_that_stalls_a_504_at_its_deadline(
    start_box, http
) -> None:
    """The answer was made but its body, in the object store, could not be read: a NATS error is a 503 telling the
    client to send it again (it was a 500), and a read that stalls ends at the request's deadline with its 504
    (review h147: 30 s past a 2 s deadline)."""
    await start_box(role="worker", box_id="wk", default_model=False, models=[noop_model()], blob_threshold=2048)
    box = await start_box(role="gateway", box_id="gw", default_model=False, models=[noop_model()])

    async def unreadable(key: str, timeout_s: float | None = None) -> bytes:
        raise ServiceUnavailableError

    take, box.dispatcher._blobs.take = box.dispatcher._blobs.take, unreadable  # type: ignore[method-assign]
    # 200 x 8 float32 from another box (a local reply is handed over in-process): a reply over 2 KiB, in a blob
    body = {"model": "noop", "input": [f"text {i}" for i in range(200)], "timeout": 2}
    async with http.post(url(box, "/v1/embeddings"), json=body) as response:
        assert response.status == 503, await response.text()
        assert response.headers["Retry-After"] == "1"
        assert "could not be read from the object store" in (await response.json())["error"]["message"]
    box.dispatcher._blobs.take = take  # type: ignore[method-assign]
    box.dispatcher._blobs._store = _StalledStore()  # type: ignore[assignment]
    began = time.monotonic()
    async with http.post(url(box, "/v1/embeddings"), json=body) as response:
        assert response.status == 504, await response.text()
    assert time.monotonic() - began < 10  # its 2 s deadline, and the second an answer's body may take past it


async def test_multi_megabyte_request_and_reply_travel_through_the_object_store(start_box, http) -> None:
    # A 32 KiB threshold sends the 64 KB reply (2000 x 8 float32) through the store as well.
    box = await start_box(
        default_model=False, models=[noop_model()], max_body_bytes=16 * 1024 * 1024, blob_threshold=32 * 1024
    )
    texts = [f"input number {i} " + "word " * 300 for i in range(2000)]  # about 3 MB of JSON
    body = {"model": "noop", "input": texts}
    async with http.post(url(box, "/v1/embeddings"), json=body) as response:
        assert response.status == 200, await response.text()
        payload = await response.json()
    assert len(payload["data"]) == 2000
    assert np.allclose(payload["data"][1999]["embedding"], [1.0] + [0.0] * 7)

    async def blobs_deleted() -> bool:  # the request blob goes once acked, the reply blob once read
        info = await box.js.stream_info("OBJ_fbx_blobs")
        return info.state.bytes < 4096  # only the two deletion markers remain, no chunks

    await wait_for(blobs_deleted, what="the blobs to be deleted")


async def test_a_large_request_whose_client_went_away_leaves_no_blob_behind(start_box, http) -> None:
    """Black-box finding: a client that sent 7 MB bodies and hung up at once left each in the object store for its
    10 min TTL (1.1 GB of nats-server memory in 10 s): the box acked the cancelled request and kept its blob."""
    box = await start_box(
        default_model=False, models=[noop_model(cost_ms=500)], max_batch_size=1, max_wait_ms=0, blob_threshold=2048
    )

    async def stored_bytes() -> int:
        try:
            return (await box.js.stream_info("OBJ_fbx_blobs")).state.bytes
        except NotFoundError:  # made with the first blob
            return 0

    first = asyncio.create_task(http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "x"}))
    # The model is busy with it for 0.5 s, alone: a sleep of 0.1 s here let a loaded machine batch the large
    # request with it (computed, not cancelled: 2 runs of 9 with both cores busy).
    await wait_for(lambda: box.workers["noop"].held == 1, what="the first request to be held")
    large = {"model": "noop", "input": ["word " * 2000]}  # 10 KB: over the threshold
    gone = asyncio.create_task(http.post(url(box, "/v1/embeddings"), json=large))

    async def blob_stored() -> bool:
        return await stored_bytes() > 8192

    await wait_for(blob_stored, what="the large body in the object store")
    gone.cancel()  # the client hangs up while its request waits
    async with await first as response:
        assert response.status == 200

    async def blobs_deleted() -> bool:
        return await stored_bytes() < 4096  # deletion markers only

    await wait_for(blobs_deleted, what="the cancelled request's blob to be deleted")
    assert box.metrics.cancelled.labels("noop")._value.get() == 1  # it was cancelled, not computed


async def test_a_large_request_cancelled_while_its_body_is_fetched_is_counted_cancelled(start_box, http) -> None:
    """Auditor h93: a cancel that came while a box fetched a request's body from the object store dropped it
    unstarted (right), but counted it nowhere: `fbx_cancelled_requests` said 0 where the other ways a box drops a
    gone client's request count it. Here the fetch waits until the cancel has reached the box."""
    box = await start_box(default_model=False, models=[noop_model()], blob_threshold=2048)
    worker = box.workers["noop"]
    fetching, go_on = asyncio.Event(), asyncio.Event()
    fetch = worker._blobs.get

    async def fetch_held_back(name: str) -> bytes:
        fetching.set()
        await go_on.wait()
        return await fetch(name)

    worker._blobs.get = fetch_held_back  # type: ignore[method-assign]
    gone = asyncio.create_task(http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": ["word " * 2000]}))
    await asyncio.wait_for(fetching.wait(), 10)
    (request_id,) = list(worker._held)
    gone.cancel()  # the client hangs up while the box fetches its body
    await wait_for(lambda: worker._cancelled.contains(request_id), what="the cancel to reach the box")
    go_on.set()
    await wait_for(lambda: request_id not in worker._held, what="the box to drop it")
    assert box.metrics.cancelled.labels("noop")._value.get() == 1
    assert box.metrics.rows_computed.labels("noop")._value.get() == 0


async def test_a_large_reply_no_gateway_took_before_its_deadline_leaves_no_blob(start_box, nats_server) -> None:
    """Tester h131: a gateway killed with large requests queued; the worker that answered them sent each reply (its
    body in a blob) until the deadline, then let it go, and the blob stayed in the bucket until its TTL. Here no
    gateway listens on the request's reply subject at all."""
    box = await start_box(default_model=False, models=[noop_model()], blob_threshold=2048)
    now = int(time.time() * 1000)
    body = json.dumps({"model": "noop", "input": [f"input {i}" for i in range(200)]}).encode()  # a 6,400-byte reply
    nc, _ = await publish_raw(nats_server.url, body, id="gone-gateway", reply="nobody.listens", deadline_ms=now + 1500)
    try:

        async def settled() -> bool:
            info = await box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name(bus.model_slug("noop")))
            return info.num_ack_pending == 0 and info.num_pending == 0

        await wait_for(settled, what="the request settled past its deadline")
        assert box.metrics.rows_computed.labels("noop")._value.get() == 200  # answered, its reply put in a blob
        bucket = await box.js.object_store(bus.BLOBS_BUCKET)  # made by the reply's put
        try:
            await bucket.get_info(bus.reply_blob_key("gone-gateway", box.box_id))
        except ObjectNotFoundError:
            return
        raise AssertionError("the reply's blob was left in the bucket")
    finally:
        await nc.close()


# What a load says of the folder below; its weights are whole, only they are not this model's.
NOT_ITS_WEIGHTS = "do not cover the model its config.json describes"


def folder_that_fails_to_load(folder: Path) -> Path:
    """A model folder whose files pass registration's checks (whole safetensors, a config transformers reads); only
    loading finds that its weights are none of the model's."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    config = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "intermediate_size": 64}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"unrelated.weight": torch.zeros(4)}, folder / "model.safetensors")
    return copy_bert_tokenizer(folder)


async def test_model_that_fails_to_load_answers_503_not_a_timeout(start_box, http, tmp_path) -> None:
    folder_that_fails_to_load(tmp_path / "models" / "broken")
    box = await start_box(default_model=False, model_roots=[tmp_path / "models"])
    async with http.post(url(box, "/v1/models"), json={"name": "broken", "path": "broken"}) as response:
        assert response.status == 201  # its files look right; only loading finds them not its own
    for headers in ({}, {"Fbx-Priority": "batch"}):  # batch-priority work waits in its own queue: refused too
        body = {"model": "broken", "input": "x", "timeout": 60}
        async with http.post(url(box, "/v1/embeddings"), json=body, headers=headers) as response:
            assert response.status == 503, headers
            error = (await response.json())["error"]
            # Until the box tries the load again (its 30 s back-off): it had no Retry-After (stock-client tester).
            assert 1 <= int(response.headers["Retry-After"]) <= 30, response.headers
        assert "broken" in error["message"] and "could not be loaded" in error["message"]


async def test_a_config_file_model_with_another_models_tokenizer_fails_its_load_not_every_batch(
    start_box, http, tmp_path
) -> None:
    """Tester h192: a model of a box's config file is not judged as a registration is, so a reranker given another
    model's tokenizer (ids past its vocab_size) was served and dead-lettered every request ("index out of range in
    self"), after 5 tries each. Its load refuses it now, and a request is told why at once."""
    from appliance.settings import ModelEntry
    from tests.models import save_cross_encoder

    folder = save_cross_encoder(tmp_path / "smallvocab", vocab_size=1000)
    box = await start_box(default_model=False, models=[ModelEntry(name="sv", path=folder)])
    body = {"model": "sv", "query": "q", "documents": ["a", "b"], "timeout": 60}
    async with http.post(url(box, "/v1/rerank"), json=body) as response:
        assert response.status == 503, await response.text()
        error = (await response.json())["error"]
    assert "could not be loaded" in error["message"], error
    assert "tokens which the model does not have" in error["message"], error


async def test_a_pin_of_a_model_whose_load_failed_says_where_and_why(start_box, http, tmp_path) -> None:
    """Review h197: pinning a registered model whose last load raised answered 200 and its record, as any pin, with
    no word of the failure from the box where it failed (a gateway has no `load_error` of its own to show). The pin is
    made (it has every box try the load again, for a folder mended meanwhile) and names each box whose last load
    failed, with why: the box that took the pin, and through the `fits` verb the others."""
    folder_that_fails_to_load(tmp_path / "models" / "broken")
    box = await start_box(box_id="work", default_model=False, model_roots=[tmp_path / "models"])
    door = await start_box(box_id="door", role="gateway", default_model=False, model_roots=[tmp_path / "models"])
    async with http.post(url(door, "/v1/models"), json={"name": "broken", "path": "broken"}) as response:
        assert response.status == 201
    async with http.post(url(box, "/v1/models/broken/load")) as response:
        assert response.status == 503
    await wait_for(lambda: "work" in {record["box"] for record in door.fleet.live_boxes()}, what="door to see work")
    for through in (door, box):
        # The pin has the box try the load again: judged once that try, if any, has failed too.
        await wait_for(
            lambda: box.residency.load_error("broken") is not None and not box.residency.is_loading("broken"),
            what="the model's last load on work to have failed",
        )
        async with http.post(url(through, "/v1/models/broken/pin")) as response:
            assert response.status == 200, await response.text()
            pinned = await response.json()
        assert pinned["pinned"] is True and list(pinned.get("load_failed_on", {})) == ["work"], (through, pinned)
        assert NOT_ITS_WEIGHTS in pinned["load_failed_on"]["work"], pinned
        # As a record says it, on one line, cut (review h225: the whole error, its lines and all).
        assert "\n" not in pinned["load_failed_on"]["work"] and len(pinned["load_failed_on"]["work"]) <= 200
        assert pinned["state"] == "failed", pinned
        async with http.post(url(through, "/v1/models/broken/unpin")) as response:
            assert response.status == 200, await response.text()
            # A record's own `load_failed_on`, from the heartbeats (up to a beat old): no box but work's.
            assert set((await response.json())["load_failed_on"]) <= {"work"}


async def test_a_refusal_of_a_model_that_failed_to_load_is_acked_only_once_its_gateway_confirms_it(
    start_box, nats_server, http, tmp_path
) -> None:
    """Review r40: placement's 503 for a model whose load failed was a plain publish, acked at once; sent while its
    gateway was reconnecting it reached nobody, and the client waited out its deadline for a 504."""
    folder_that_fails_to_load(tmp_path / "models" / "broken")
    box = await start_box(default_model=False, model_roots=[tmp_path / "models"])
    async with http.post(url(box, "/v1/models"), json={"name": "broken", "path": "broken"}) as response:
        assert response.status == 201
    nc, replies = await publish_raw(
        nats_server.url, b'{"input": "x", "model": "broken"}', id="refused-1", model="broken"
    )
    try:
        reply = await acked_only_once_confirmed(box, replies, "broken")
        assert ReplyMeta.from_headers(reply.headers).status == 503 and b"could not be loaded" in reply.data
    finally:
        await nc.close()


async def box_with_a_broken_model(start_box, http, tmp_path: Path, encoder_dir: Path) -> Box:
    """A box whose model roots hold `broken` (a folder that fails to load) and `good` (a copy of the test encoder),
    with `mine` registered on `broken`."""
    folder_that_fails_to_load(tmp_path / "models" / "broken")
    shutil.copytree(encoder_dir, tmp_path / "models" / "good")
    box = await start_box(default_model=False, model_roots=[tmp_path / "models"])
    async with http.post(url(box, "/v1/models"), json={"name": "mine", "path": "broken"}) as response:
        assert response.status == 201
    return box


async def register_again_on_a_good_folder(http, box: Box) -> None:
    """What a user with a broken folder does: delete `mine` and register it again on `good`."""
    async with http.delete(url(box, "/v1/models/mine")) as response:
        assert response.status == 200
    async with http.post(url(box, "/v1/models"), json={"name": "mine", "path": "good"}) as response:
        assert response.status == 201


async def test_a_model_loaded_here_after_its_load_failed_is_served_at_once(
    start_box, http, tmp_path, encoder_dir
) -> None:
    """Regression tester: a user repaired the broken folder in place and loaded the model (`POST .../load`, 200,
    resident); every request still got the old load error for the rest of the 30 s back-off (the refusal stopped
    only when another box held the model). Then the next request right after the load still did (black-box tester
    h50, 3 of 3): the refusal's pull, still open, took it before the new worker's."""
    box = await box_with_a_broken_model(start_box, http, tmp_path, encoder_dir)
    async with http.post(url(box, "/v1/embeddings"), json={"model": "mine", "input": "x"}) as response:
        assert response.status == 503
    shutil.copytree(tmp_path / "models" / "good", tmp_path / "models" / "broken", dirs_exist_ok=True)  # repaired
    async with http.post(url(box, "/v1/models/mine/load")) as response:
        assert response.status == 200, await response.text()
    for _ in range(3):
        async with http.post(url(box, "/v1/embeddings"), json={"model": "mine", "input": "x"}) as response:
            assert response.status == 200, await response.text()
    await wait_for(lambda: "mine" not in box.placement.refusing, timeout_s=2.0, what="the refusal to end")


async def test_a_model_whose_load_just_failed_reads_failed_with_its_error_not_loading(
    start_box, http, tmp_path, encoder_dir
) -> None:
    """Stock-client tester: right after the 503, GET /v1/models/{name} said "loading" beside the load error (the
    box's own heartbeat, a beat old) for up to ten seconds."""
    box = await box_with_a_broken_model(start_box, http, tmp_path, encoder_dir)
    async with http.post(url(box, "/v1/embeddings"), json={"model": "mine", "input": "x"}) as response:
        assert response.status == 503
    async with http.get(url(box, "/v1/models/mine")) as response:
        record = await response.json()
    assert record["state"] == "failed" and NOT_ITS_WEIGHTS in record["load_error"], record


async def test_a_model_that_failed_to_load_then_was_registered_again_on_a_good_folder_is_served_at_once(
    start_box, http, tmp_path, encoder_dir
) -> None:
    """A user whose folder was broken deletes the model and registers it again on a good one: the box tried the
    new registration only after its 30 s back-off, answered every request meanwhile with the old folder's load
    error, and its model record showed that error (black-box finding)."""
    box = await box_with_a_broken_model(start_box, http, tmp_path, encoder_dir)
    async with http.post(url(box, "/v1/embeddings"), json={"model": "mine", "input": "x"}) as response:
        assert response.status == 503 and NOT_ITS_WEIGHTS in await response.text()
    assert box.placement.refusing == {"mine"}
    async with http.patch(url(box, "/v1/models/mine"), json={"aliases": ["still-broken"]}) as response:
        assert response.status == 200, await response.text()
    await asyncio.sleep(0.5)  # a change a load does not depend on: the same failing model, still refused
    assert box.placement.refusing == {"mine"} and box.residency.load_error("mine") is not None
    await register_again_on_a_good_folder(http, box)
    started = time.monotonic()
    async with http.post(url(box, "/v1/embeddings"), json={"model": "mine", "input": "x"}) as response:
        assert response.status == 200, await response.text()
    assert time.monotonic() - started < 10  # loaded now, not after the back-off
    async with http.get(url(box, "/v1/models/mine")) as response:
        assert (await response.json()).get("load_error") is None


async def test_a_load_that_fails_after_its_model_was_registered_again_does_not_hold_up_the_new_registration(
    start_box, http, tmp_path, encoder_dir
) -> None:
    """The broken folder's load is still running when the user deletes the model and registers it again on a good
    one; it fails after that: its failure (the 30 s back-off, the refusal of the model's requests with its error)
    belonged to the old registration, not the new one (found by review)."""
    box = await box_with_a_broken_model(start_box, http, tmp_path, encoder_dir)
    gate, serve = asyncio.Event(), box.workers.serve

    async def slow_serve(spec):
        await gate.wait()  # a slow load: a large folder, say
        return await serve(spec)

    box.workers.serve = slow_serve
    first = asyncio.create_task(http.post(url(box, "/v1/embeddings"), json={"model": "mine", "input": "x"}))
    await wait_for(lambda: "mine" in box.placement.loading, what="the broken folder's load to start")
    await register_again_on_a_good_folder(http, box)
    gate.set()  # the old load fails now
    async with await first as response:
        assert response.status == 404  # deleted while it waited
    await wait_for(lambda: "mine" not in box.placement.loading, what="the old load to end")
    async with http.post(url(box, "/v1/embeddings"), json={"model": "mine", "input": "x"}) as response:
        assert response.status == 200, await response.text()


async def test_a_load_the_admin_verb_tried_is_not_shown_against_the_model_registered_again(
    start_box, http, tmp_path, encoder_dir
) -> None:
    """A failed load through the admin `load` verb (or a pinned model's at start) is not placement's: deleting the
    model and registering it again on a good folder left the old folder's `load_error` in its record until
    something loaded it (review finding)."""
    box = await box_with_a_broken_model(start_box, http, tmp_path, encoder_dir)
    async with http.post(url(box, "/v1/models/mine/load")) as response:
        assert response.status == 503
    async with http.get(url(box, "/v1/models/mine")) as response:
        assert NOT_ITS_WEIGHTS in (await response.json())["load_error"]
    async with http.patch(url(box, "/v1/models/mine"), json={"aliases": ["still-broken"]}) as response:
        assert response.status == 200  # the same folder: still its error
    async with http.get(url(box, "/v1/models/mine")) as response:
        assert NOT_ITS_WEIGHTS in (await response.json())["load_error"]
    await register_again_on_a_good_folder(http, box)
    async with http.get(url(box, "/v1/models/mine")) as response:
        assert (await response.json()).get("load_error") is None


async def test_a_box_that_failed_to_load_a_model_stops_refusing_it_once_another_box_holds_it(
    start_box, http, encoder_dir
) -> None:
    """The small box's budget cannot hold the model, nor can any other: its load fails and it answers the waiting
    requests 507. Once a bigger box has loaded it, those requests are the bigger box's to answer, not the small
    box's to refuse for the rest of its 30 s back-off."""
    gateway = await start_box(role="gateway", box_id="gateway", default_model=False, model_roots=[encoder_dir.parent])
    # Registered before any box that runs models is up: one up would refuse it (507), as no box could hold it.
    async with http.post(url(gateway, "/v1/models"), json={"name": "enc", "path": str(encoder_dir)}) as response:
        assert response.status == 201
    small = await start_box(role="worker", box_id="small", default_model=False, memory_budget="1000B")
    await wait_for(lambda: "small" in [r["box"] for r in gateway.fleet.live_boxes()], what="the small box's heartbeat")
    body = {"model": "enc", "input": "x"}
    async with http.post(url(gateway, "/v1/embeddings"), json=body) as response:
        assert response.status == 507 and "the largest memory budget is 1000 bytes (box small)" in await response.text()
    assert small.placement.refusing == {"enc"}
    await start_box(role="worker", box_id="big", default_model=False)
    async with http.post(url(gateway, "/v1/models/enc/load"), json={"box": "big"}) as response:
        assert response.status == 200
    await wait_for(lambda: not small.placement.refusing, timeout_s=5, what="the small box to stop refusing")
    for _ in range(10):
        async with http.post(url(gateway, "/v1/embeddings"), json=body) as response:
            assert response.status == 200


async def test_a_model_larger_than_every_live_box_is_507_naming_its_size_and_the_largest_budget(
    start_box, http, encoder_dir
) -> None:
    """It was a 503 ("could not be loaded on box small": try again soon) from the box that tried, though no box
    could ever hold it: a retry fails the same way until a larger box joins. Both priorities are told."""
    gateway = await start_box(role="gateway", box_id="gateway", default_model=False, model_roots=[encoder_dir.parent])
    # Registered before any box that runs models is up: one up would refuse it (507), as no box could hold it.
    async with http.post(url(gateway, "/v1/models"), json={"name": "enc", "path": str(encoder_dir)}) as response:
        assert response.status == 201
    tiny = await start_box(role="worker", box_id="tiny", default_model=False, memory_budget="1000B")
    small = await start_box(role="worker", box_id="small", default_model=False, memory_budget="2KiB")
    for box in (tiny, small, gateway):
        await wait_for(lambda box=box: {"tiny", "small"} <= {r["box"] for r in box.fleet.live_boxes()}, what="beats")
    need = estimate_bytes(small.catalog.get("enc"))
    for headers in ({}, {"Fbx-Priority": "batch"}):
        async with http.post(url(gateway, "/v1/embeddings"), json={"model": "enc", "input": "x"}, headers=headers) as r:
            assert r.status == 507, await r.text()
            error = (await r.json())["error"]
        assert error["code"] == "insufficient_memory"
        assert error["message"] == (
            f"model enc needs about {need / 2**20:.0f} MiB, more than any box in the fleet can hold: the largest "
            "memory budget is 2048 bytes (box small)"
        )


async def test_a_model_whose_load_measures_more_than_every_budget_is_unloaded_and_its_requests_are_507(
    start_box, http, tmp_path
) -> None:
    """Its estimate (its weight file) fits the box's 6 MB budget, so it registers; its load measures 8 MB. It was
    served anyway, resident over the budget (black-box finding: 1,085 MiB resident in a 600 MiB budget, no 507).
    Now the load is undone and the waiting requests are told it fits no box, by its measured size."""
    save_long_context_encoder(tmp_path / "models" / "long")
    box = await start_box(default_model=False, model_roots=[tmp_path / "models"], memory_budget="6MB")
    async with http.post(url(box, "/v1/models"), json={"name": "long", "path": "long"}) as response:
        assert response.status == 201, await response.text()  # the estimate fits
    for _ in range(2):  # the second is refused without a second load
        async with http.post(url(box, "/v1/embeddings"), json={"model": "long", "input": "x"}) as response:
            assert response.status == 507, await response.text()
            error = (await response.json())["error"]
        assert error["code"] == "insufficient_memory"
        assert error["message"].startswith("model long needs about 8 MiB, more than any box in the fleet can hold")
    assert not box.residency.is_resident("long") and box.residency.used_bytes == 0
    assert box.metrics.registry.get_sample_value("fbx_model_loads_total", {"model": "long"}) == 1

    async def record() -> dict:
        async with http.get(url(box, "/v1/models/long")) as response:
            return await response.json()

    async def failed() -> bool:
        return (await record())["state"] == "failed"

    assert "measured 8 MiB loaded" in (await record())["load_error"]
    await wait_for(failed, timeout_s=5, what="the heartbeat to say the load is over")


async def test_a_folder_whose_weights_do_not_cover_its_config_is_refused_not_served_with_random_weights(
    start_box, http, tmp_path, encoder_dir
) -> None:
    """The packaged model's config.json edited to 150 layers over its 6 layers' weights registered, loaded, and
    answered with 144 randomly initialised layers (black-box finding). More layers than the weights hold is
    refused at registration (422); a backbone weight a classifier reads (its pooler) that the weights lack is seen
    only by the load, which refuses it (503)."""
    with_config(encoder_dir, tmp_path / "models" / "deep", num_hidden_layers=4)
    classifier = {"architectures": ["BertForSequenceClassification"], **YES_NO}
    headless = with_config(encoder_dir, tmp_path / "models" / "headless", **classifier)
    box = await start_box(default_model=False, model_roots=[tmp_path / "models"])
    async with http.post(url(box, "/v1/models"), json={"name": "deep", "path": "deep"}) as response:
        assert response.status == 422
        assert "num_hidden_layers 4, the weights hold 2 layers" in (await response.json())["error"]["message"]
    async with http.post(url(box, "/v1/models"), json={"name": "headless", "path": "headless"}) as response:
        assert response.status == 201, await response.text()
    async with http.post(url(box, "/v1/classify"), json={"model": "headless", "input": "x"}) as response:
        assert response.status == 503, await response.text()
        message = (await response.json())["error"]["message"]
    assert f"the weights in {headless} do not cover the model its config.json describes: 2 of its" in message
    assert "e.g. bert.pooler.dense.bias, bert.pooler.dense.weight;" in message


async def test_worker_only_box_serves_health_and_metrics_but_no_api(start_box, http) -> None:
    worker = await start_box(role="worker", default_model=False, models=[noop_model()])
    async with http.get(url(worker, "/readyz")) as response:
        assert response.status == 200
    async with http.get(url(worker, "/metrics")) as response:
        assert response.status == 200
    async with http.post(url(worker, "/v1/embeddings"), json={"model": "noop", "input": "x"}) as response:
        assert response.status == 404


async def test_a_folder_whose_weights_are_cut_short_is_refused_at_registration(
    start_box, http, tmp_path, encoder_dir
) -> None:
    """An interrupted copy registered (201) and then failed every load with a 503 (planning item): registration reads
    the safetensors headers and refuses it, saying which file and what to do."""
    folder = tmp_path / "models" / "cut"
    shutil.copytree(encoder_dir, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    box = await start_box(default_model=False, model_roots=[tmp_path / "models"])
    async with http.post(url(box, "/v1/models"), json={"name": "cut", "path": "cut"}) as response:
        assert response.status == 422
        error = (await response.json())["error"]
    assert error["code"] == "unsupported_model"
    assert (
        f"{weights} holds " in error["message"] and "the file is cut short; copy the weights again" in error["message"]
    )
    async with http.get(url(box, "/v1/models/cut")) as response:
        assert response.status == 404


async def test_a_blob_bucket_gone_since_the_box_looked_it_up_is_made_again(start_box, http) -> None:
    """Review: the box kept the object store it looked up once; with the bucket gone (memory storage does not
    outlive a nats-server restart, an operator may delete it) every large body after it was a 500."""
    box = await start_box(default_model=False, models=[noop_model()], blob_threshold=2048)
    large = {"model": "noop", "input": ["word " * 2000]}  # 10 KB: over the threshold
    async with http.post(url(box, "/v1/embeddings"), json=large) as response:
        assert response.status == 200
    await box.js.delete_stream("OBJ_fbx_blobs")
    async with http.post(url(box, "/v1/embeddings"), json=large) as response:
        assert response.status == 200, await response.text()
    assert (await box.js.stream_info("OBJ_fbx_blobs")).config.name == "OBJ_fbx_blobs"


async def test_a_request_body_the_object_store_cannot_take_is_a_503_with_retry_after(start_box, http) -> None:
    """Review: a put that timed out (a NATS failover) was a 500, where a publish that timed out is a 503 a client
    retries. The store's failure is faked here (a put that raises NATS's timeout): the thing under test is what the
    gateway answers for it."""
    from nats.errors import TimeoutError as NatsTimeout

    box = await start_box(default_model=False, models=[noop_model()], blob_threshold=2048)

    async def timed_out(key: str, data: bytes) -> str:
        raise NatsTimeout

    box.dispatcher._blobs.put = timed_out
    async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": ["word " * 2000]}) as response:
        assert response.status == 503
        assert response.headers["Retry-After"] == "2"
        error = (await response.json())["error"]
    assert error["message"].startswith("the request body could not be stored beside the queue")
    async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "small"}) as response:
        assert response.status == 200  # a body that rides the queue is not held up by the store
