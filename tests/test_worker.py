"""The pull path: deadlines, sharing one consumer, redelivery after a dead box, duplicate replies.

These use the no-op runtime with a set cost, so "slow" and "busy" are exact rather than timed
guesses; the queue, the consumers and the boxes are all real.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any

import nats
import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from appliance import bus
from appliance.app import Box
from appliance.catalog import Catalog
from appliance.configured import configured_specs
from appliance.delivery import Cancellations
from appliance.envelope import ReplyMeta, RequestMeta
from tests.conftest import deliveries, hold_on_device, hold_warm_ups, in_progress_acks, noop_model, url, wait_for

NOOP_BODY = {"input": ["one two three"], "model": "noop"}
NOOP_RAW = b'{"input": "x", "model": "noop"}'


def counter(box, name: str, model: str = "noop") -> float:
    value = box.metrics.registry.get_sample_value(f"{name}_total", {"model": model})
    return value or 0.0


async def publish_raw(nats_url: str, body: bytes, **fields: Any) -> tuple[NATS, asyncio.Queue]:
    """Queue a request (for model "noop" unless `fields` say) as a gateway would, with no gateway: its replies come
    to the queue, none confirmed (a worker sends a reply again until its gateway confirms it)."""
    nc = await nats.connect(nats_url)
    replies: asyncio.Queue = asyncio.Queue()
    await nc.subscribe("test.replies", cb=replies.put)
    now = int(time.time() * 1000)
    envelope = {"task": "embed", "model": "noop", "reply": "test.replies", "deadline_ms": now + 30_000, "sent_ms": now}
    meta = RequestMeta(**(envelope | fields))
    await nc.jetstream().publish(bus.request_subject(bus.model_slug(meta.model)), body, headers=meta.headers())
    return nc, replies


async def acked_only_once_confirmed(box, replies: asyncio.Queue, model: str) -> Msg:
    """A box's error reply its gateway does not confirm (its confirmation lost, as in a NATS failover) is sent
    again, and the request is held, not acked, until a send of it is confirmed: the first send, then the one
    confirmed."""
    first = await asyncio.wait_for(replies.get(), 30)
    info = await box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name(bus.model_slug(model)))
    assert info.num_ack_pending == 1  # not acked while no gateway has confirmed the reply
    again = await asyncio.wait_for(replies.get(), 30)  # sent again, once the confirmation has not come in time
    assert again.data == first.data and again.headers == first.headers
    await again.respond(b"")  # what a gateway does with each reply it takes

    async def acked() -> bool:
        info = await box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name(bus.model_slug(model)))
        return info.num_ack_pending == 0 and (await box.js.stream_info(bus.REQUEST_STREAM)).state.messages == 0

    await wait_for(acked, what="the request acked once its reply was confirmed")
    return first


async def test_request_past_its_deadline_is_never_computed(start_box, http, nats_server) -> None:
    """A request whose deadline passes while it waits behind a batch is dropped, never computed. Queued with no
    gateway: a gateway refuses (429) a request that cannot start within its deadline behind a batch of one row."""
    box = await start_box(default_model=False, models=[noop_model(cost_ms=300)], max_batch_size=1)
    slow = asyncio.create_task(http.post(url(box, "/v1/embeddings"), json={**NOOP_BODY, "timeout": 10}))
    await wait_for(
        lambda: (
            box.workers["noop"].batcher.pending_interactive == 0
            and counter(box, "fbx_rows_computed") == 0
            and box.workers["noop"].held == 1
        ),
        what="the slow request on the device",
    )
    now = int(time.time() * 1000)
    nc, replies = await publish_raw(nats_server.url, NOOP_RAW, id="short-1", deadline_ms=now + 100, sent_ms=now)
    try:
        assert ReplyMeta.from_headers((await asyncio.wait_for(replies.get(), 10)).headers).status == 504
    finally:
        await nc.close()
    async with await slow as response:
        assert response.status == 200
    await wait_for(lambda: counter(box, "fbx_expired_requests") == 1, what="the expired request dropped")
    assert counter(box, "fbx_rows_computed") == 1  # only the slow one ran


async def test_a_request_its_gateway_cancels_at_its_deadline_is_counted_expired_not_cancelled(
    start_box, http, nats_server
) -> None:
    """Tester h142: a generation whose deadline passed at its gateway (which cancels it fleet-wide then) was counted
    in `fbx_cancelled_requests` as if its client had gone away. A cancel that says `expired` counts as expired."""
    box = await start_box(default_model=False, models=[noop_model()], max_batch_size=1)
    worker = box.workers["noop"]
    on_device, let_go = hold_on_device(worker.runtime)
    first = asyncio.create_task(http.post(url(box, "/v1/embeddings"), json={**NOOP_BODY, "timeout": 10}))
    await asyncio.to_thread(on_device.wait, 10)
    nc, _ = await publish_raw(nats_server.url, NOOP_RAW, id="at-deadline")
    try:
        await wait_for(lambda: "at-deadline" in worker._held, what="the second request held behind the first")
        await nc.publish(bus.cancel_subject(), orjson.dumps({"id": "at-deadline", "why": "expired"}))
        await wait_for(lambda: "at-deadline" not in worker._held, what="the box to drop it")
    finally:
        let_go.set()
        await nc.close()
    async with await first as response:
        assert response.status == 200
    assert (counter(box, "fbx_expired_requests"), counter(box, "fbx_cancelled_requests")) == (1, 0)
    assert counter(box, "fbx_rows_computed") == 1


async def test_message_already_expired_on_arrival_is_answered_504_and_not_computed(start_box, nats_server) -> None:
    box = await start_box(default_model=False, models=[noop_model()])
    now = int(time.time() * 1000)
    nc, replies = await publish_raw(nats_server.url, NOOP_RAW, id="late-1", deadline_ms=now - 1, sent_ms=now - 5)
    reply = await asyncio.wait_for(replies.get(), 10)
    assert ReplyMeta.from_headers(reply.headers).status == 504
    assert counter(box, "fbx_expired_requests") == 1
    assert counter(box, "fbx_rows_computed") == 0
    await nc.close()


async def test_a_message_whose_headers_cannot_be_read_is_terminated_and_the_next_is_served(
    start_box, nats_server
) -> None:
    """A message on a model's subject that no gateway made (no envelope headers) is terminated, not redelivered until
    `max_deliver` dead-letters it, and the worker serves the request queued after it."""
    box = await start_box(default_model=False, models=[noop_model()])
    nc = await nats.connect(nats_server.url)
    try:
        await nc.jetstream().publish(bus.request_subject(bus.model_slug("noop")), NOOP_RAW)
        consumer = bus.consumer_name(bus.model_slug("noop"))

        async def settled() -> bool:
            info = await box.js.consumer_info(bus.REQUEST_STREAM, consumer)
            return info.delivered.stream_seq >= 1 and info.num_ack_pending == 0 and info.num_redelivered == 0

        await wait_for(settled, what="the headerless message taken and terminated at once")
        assert (await box.js.stream_info(bus.REQUEST_STREAM)).state.messages == 0
    finally:
        await nc.close()
    nc, replies = await publish_raw(nats_server.url, NOOP_RAW, id="after-1")
    reply = await asyncio.wait_for(replies.get(), 10)
    assert ReplyMeta.from_headers(reply.headers).status == 200
    await nc.close()
    info = await box.js.consumer_info(bus.REQUEST_STREAM, consumer)
    assert info.delivered.consumer_seq == 2  # each message delivered once: the headerless one was not tried again


async def test_a_request_whose_blob_is_gone_is_retried_then_dead_lettered_not_held_for_ever(
    start_box, nats_server
) -> None:
    """Its offloaded body expired or was deleted: the fetch fails, and the request must still be settled.

    A held request is kept in progress (never redelivered), so one that failed to be prepared and was
    left held would never be answered and would hold a slot of the box's room for good.
    """
    box = await start_box(default_model=False, models=[noop_model()])
    nc, replies = await publish_raw(nats_server.url, b"", id="no-blob-1", blob="no-blob-1.never-put")
    reply = await asyncio.wait_for(replies.get(), 20)
    assert ReplyMeta.from_headers(reply.headers).status == 422
    assert b"dead_lettered" in reply.data
    await reply.respond(b"")  # confirmed, as a gateway does: only then is the request settled
    await wait_for(lambda: box.workers["noop"].held == 0, what="the request let go")
    assert counter(box, "fbx_dead_lettered_requests") == 1
    await nc.close()


async def test_a_dead_letter_reply_is_acked_only_once_its_gateway_confirms_it(start_box, nats_server) -> None:
    """Review r40: a dead-lettered request's 422 was a plain publish, acked at once; sent while its gateway was
    reconnecting it reached nobody, and the client waited out its deadline for a 504."""
    box = await start_box(default_model=False, models=[noop_model(fail_on="POISON")], max_deliver=1)
    nc, replies = await publish_raw(nats_server.url, b'{"input": "POISON", "model": "noop"}', id="poison-1")
    try:
        reply = await acked_only_once_confirmed(box, replies, "noop")
        assert ReplyMeta.from_headers(reply.headers).status == 422 and b"dead_lettered" in reply.data
        assert ReplyMeta.from_headers(reply.headers).box == box.box_id
        assert counter(box, "fbx_dead_lettered_requests") == 1
    finally:
        await nc.close()


async def test_a_dead_letter_its_stopping_box_could_not_tell_is_kept_and_counted_once(start_box, nats_server) -> None:
    """Review r41: a worker that dead-lettered a request and stopped before its gateway confirmed the 422 kept it in
    FBX_DLQ and counted it, then handed it back; JetStream's max-deliveries advisory had another box keep and count it
    again. Now the box that tells the client keeps and counts it: once."""
    first = await start_box(box_id="first", default_model=False, models=[noop_model(fail_on="POISON")], max_deliver=1)
    nc, replies = await publish_raw(nats_server.url, b'{"input": "POISON", "model": "noop"}', id="poison-2")
    try:
        told = await asyncio.wait_for(replies.get(), 30)  # the 422, not confirmed: sent again until it is
        assert ReplyMeta.from_headers(told.headers).box == "first"
        second = await start_box(box_id="second", default_model=False, max_deliver=1)
        await first.stop()  # its client never confirmed: handed back, past its last delivery
        assert counter(first, "fbx_dead_lettered_requests") == 0
        while (reply := await asyncio.wait_for(replies.get(), 30)).headers.get("Fbx-Box") != "second":
            pass  # the first box's last sends
        await reply.respond(b"")  # the advisory's box told the client: confirmed

        async def settled() -> bool:
            return (await second.js.stream_info(bus.REQUEST_STREAM)).state.messages == 0

        await wait_for(settled, what="the request settled by the advisory's box")
        assert (await second.js.stream_info(bus.DEAD_LETTER_STREAM)).state.messages == 1
        # Counted once it has its delete's answer: FBX_REQ may be read empty a moment before.
        await wait_for(lambda: counter(second, "fbx_dead_lettered_requests") == 1, 5.0, "the dead letter counted")
    finally:
        await nc.close()


async def test_two_workers_on_one_consumer_share_the_work(start_box, http) -> None:
    models = [noop_model(cost_ms=40)]
    first = await start_box(role="worker", box_id="worker-a", default_model=False, models=models, worker_capacity=2)
    second = await start_box(role="worker", box_id="worker-b", default_model=False, models=models, worker_capacity=2)
    gateway = await start_box(role="gateway", box_id="gw", default_model=False, models=models)

    async def one(i: int) -> str:
        async with http.post(url(gateway, "/v1/embeddings"), json={**NOOP_BODY, "input": [f"r {i}"]}) as response:
            assert response.status == 200
            return response.headers["Fbx-Box"]

    boxes = await asyncio.gather(*(one(i) for i in range(24)))
    assert set(boxes) == {"worker-a", "worker-b"}
    assert counter(first, "fbx_rows_computed") + counter(second, "fbx_rows_computed") == 24


async def test_killed_worker_request_is_redelivered_and_answered_once(start_box, nats_server, http, tmp_path) -> None:
    # The fleet-wide catalog says "noop" takes ten minutes a batch: the doomed box will hold the request.
    gateway = await start_box(role="gateway", default_model=False, models=[noop_model(cost_ms=600_000)], ack_wait_s=2)
    config = tmp_path / "doomed.toml"
    config.write_text("default_model = false\nack_wait_s = 2\n")
    doomed = subprocess.Popen(
        [sys.executable, "-m", "appliance.cli", "serve", "--role", "worker", "--nats", nats_server.url,
         "--box-id", "doomed", "--config", str(config)],
        env={**os.environ, "FBX_LOG_LEVEL": "WARNING"},
    )  # fmt: skip
    try:
        answer = asyncio.create_task(http.post(url(gateway, "/v1/embeddings"), json={**NOOP_BODY, "timeout": 60}))

        async def doomed_holds_it() -> bool:
            info = await gateway.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name("noop"))
            return info.num_ack_pending == 1

        await wait_for(doomed_holds_it, timeout_s=60, what="the doomed worker to pull the request")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
        # The operator makes the model fast again; a new box picks up what the dead one held.
        spec = gateway.catalog.get("noop")
        await gateway.store.put(replace(spec, options={}))
        rescuer = await start_box(role="worker", box_id="rescuer", default_model=False, ack_wait_s=2)
        async with await answer as response:
            assert response.status == 200, await response.text()
            assert response.headers["Fbx-Box"] == "rescuer"
        assert counter(rescuer, "fbx_redelivered_requests") == 1
        assert gateway.metrics.registry.get_sample_value("fbx_ignored_replies_total") == 0
    finally:
        if doomed.poll() is None:
            doomed.kill()
            doomed.wait(10)


async def test_a_draining_worker_keeps_its_batch_in_flight_in_progress_until_it_is_answered(
    start_box, nats_server, http
) -> None:
    """The batch on the device is held there (a threading.Event in a wrapper of the no-op runtime's `run`: the
    device thread busy with another model's batch, say) while the worker drains, past two `ack_wait_s` periods.
    The drain waits for it, and keeps its request in progress meanwhile: JetStream never hands it to the second
    box, which would compute it again; the first box answers it once."""
    models = [noop_model()]
    # 2 s, not 1: the keep-alive's in-progress acks come every 2/3 s, so only an event-loop stall of over 1.3 s (not
    # 0.5 s, as on a loaded 2-core CI machine) lets the ack wait lapse between two of them.
    ack_wait_s = 2.0
    first = await start_box(box_id="first", default_model=False, models=models, ack_wait_s=ack_wait_s)
    on_device, let_go = hold_on_device(first.workers["noop"].runtime)
    watcher, kept = await in_progress_acks(nats_server.url)
    try:
        answer = asyncio.create_task(http.post(url(first, "/v1/embeddings"), json=NOOP_BODY))
        await wait_for(on_device.is_set, what="the batch on the device")
        second = await start_box(
            role="worker", box_id="second", default_model=False, models=models, ack_wait_s=ack_wait_s
        )
        draining = asyncio.create_task(first.workers["noop"].drain())
        await wait_for(lambda: first.workers["noop"]._draining, what="the drain to begin")
        kept.clear()

        async def redelivered_or_kept() -> bool:
            return await deliveries(first, "noop") > 1 or len(kept) >= 7  # one every 2/3 s: past two ack_wait

        await wait_for(redelivered_or_kept, what="a redelivery, or the request kept in progress past two ack_wait")
        let_go.set()
        async with await answer as response:
            assert response.status == 200, await response.text()
            assert response.headers["Fbx-Box"] == "first"
        await asyncio.wait_for(draining, 20)
        assert await deliveries(first, "noop") == 1
        assert counter(second, "fbx_redelivered_requests") == 0
        assert counter(second, "fbx_rows_computed") == 0
    finally:
        let_go.set()
        await watcher.close()


async def test_a_batch_the_runtime_answers_with_too_few_rows_is_answered_500_at_once_not_at_its_deadline(
    start_box, http
) -> None:
    """The no-op runtime's `run` wrapped to return one row too few (a runtime bug): the batch fails after the
    device call, where no per-input retry applies. Its request is answered at once with a clear 500 and acked,
    rather than kept in progress until its gateway gives up with a 504 at its deadline."""
    box = await start_box(default_model=False, models=[noop_model()])
    runtime = box.workers["noop"].runtime
    run = runtime.run
    runtime.run = lambda batch, adapter=None: run(batch, adapter=adapter)[:-1]
    body = {**NOOP_BODY, "input": ["one two three", "four five"], "timeout": 20}
    async with http.post(url(box, "/v1/embeddings"), json=body) as response:
        assert response.status == 500, await response.text()
        error = (await response.json())["error"]
    assert error["code"] == "internal_error"
    assert "returned 1 rows for 2 inputs" in error["message"]

    async def settled() -> bool:
        info = await box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name("noop"))
        return box.workers["noop"].held == 0 and info.num_ack_pending == 0 and info.num_pending == 0

    await wait_for(settled, what="the request acked and let go")
    assert await deliveries(box, "noop") == 1  # answered, not retried


async def test_gateway_answers_once_when_two_replies_arrive(start_box, nats_server) -> None:
    gateway = await start_box(role="gateway", default_model=False, models=[noop_model()])
    spec = Catalog(configured_specs(gateway.settings)).resolve("noop").spec
    call = asyncio.create_task(
        gateway.dispatcher.call(
            spec=spec, task="embed", body=b'{"input": "x", "model": "noop"}', timeout_s=10, tokens=1
        )
    )
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    sub = await js.pull_subscribe_bind(bus.consumer_name("noop"), stream=bus.REQUEST_STREAM)
    (msg,) = await sub.fetch(1, timeout=10)
    meta = RequestMeta.from_headers(msg.headers)
    for box in ("first", "second"):
        reply = ReplyMeta(id=meta.id, status=200, box=box, rows=1, dims=1)
        await nc.publish(meta.reply, b"\x00\x00\x80?", headers=reply.headers())
    await msg.ack()
    result = await asyncio.wait_for(call, 10)
    assert result.meta.box == "first"
    await wait_for(lambda: gateway.metrics.registry.get_sample_value("fbx_ignored_replies_total") == 1,
                   what="the second reply to be dropped")  # fmt: skip
    await nc.close()


async def test_a_second_box_answering_a_request_leaves_the_reply_blob_the_gateway_is_reading_whole(
    start_box, nats_server
) -> None:
    """Review r40: every box put a large reply's body under `<id>.reply`. A redelivered request answered by two boxes
    had the second's put overwrite the object, purging the chunks the gateway was reading for the first answer: its
    read never finished (or failed, a 500). Here the gateway's read is held once it has found the first answer's
    object; the redelivery is the request queued again under a new message id, answered by a second box."""
    from tests.conftest import box_settings, hold

    models = [noop_model()]
    gateway = await start_box(role="gateway", box_id="gw", default_model=False, models=models)
    first = Box(box_settings(nats_server.url, role="worker", box_id="first", default_model=False, models=models,
                             blob_threshold=1024))  # fmt: skip
    await first.start()
    try:
        assert gateway.blobs is not None and gateway.dispatcher is not None
        store = await gateway.blobs._bucket()
        found, read_on = hold(store, "get_info", after=True)  # the gateway knows where the chunks are, not read yet
        body = orjson.dumps({"input": [f"word {i}" for i in range(200)], "model": "noop"})  # 200 rows: 6.4 KB back
        spec = gateway.catalog.resolve("noop").spec
        call = asyncio.create_task(gateway.dispatcher.call(
            spec=spec, task="embed", body=body, timeout_s=30, tokens=200, request_id="twice-1"
        ))  # fmt: skip
        await asyncio.wait_for(found.wait(), 20)
    finally:
        await first.stop()
    second = await start_box(role="worker", box_id="second", default_model=False, models=models, blob_threshold=1024)
    now = int(time.time() * 1000)
    meta = RequestMeta(id="twice-1", task="embed", model="noop", reply=gateway.dispatcher.reply_subject,
                       deadline_ms=now + 30_000, sent_ms=now)  # fmt: skip
    await second.js.publish(bus.request_subject("noop"), body, headers={**meta.headers(), "Nats-Msg-Id": "again"})
    await wait_for(lambda: gateway.metrics.registry.get_sample_value("fbx_ignored_replies_total") == 1,
                   what="the second box's answer dropped")  # fmt: skip
    read_on.set()
    reply = await asyncio.wait_for(call, 10)
    assert reply.meta.status == 200 and reply.meta.box == "first" and reply.meta.rows == 200
    assert len(reply.body) == 200 * reply.meta.dims * 4  # whole: float32 rows

    async def no_blobs_left() -> bool:
        try:
            return all(info.deleted for info in await store.list())
        except NotFoundError:  # nats-py's word for a bucket that never held an object
            return True

    await wait_for(no_blobs_left, what="both answers' blobs deleted, the one read and the one dropped")
    assert second.workers["noop"].held == 0


def test_cancelled_ids_are_forgotten_in_the_order_they_came_and_kept_bounded() -> None:
    remembered = Cancellations(memory_s=600, most=3)
    for request_id in ("a", "b", "c", "d"):
        remembered.add(request_id)
    assert [remembered.contains(i) for i in "abcd"] == [False, True, True, True]  # the oldest made room
    expired = Cancellations(memory_s=0)
    expired.add("gone")
    assert not expired.contains("gone")


async def test_a_model_unloaded_while_its_worker_warms_up_leaves_no_worker_pulling(
    start_box, http, monkeypatch
) -> None:
    """Review r51: evicted while its worker timed its warm-up batches, the worker went on to start pulling on a closed
    runtime, out of the box's table: requests it took were kept in progress for ever (one of three was a 504). Now
    its start is refused, the load that asked for it says so, and the model is served by a worker of its own."""
    box = await start_box(default_model=False, models=[noop_model(pinned=False)])
    release = hold_warm_ups(monkeypatch)
    loading = asyncio.create_task(http.post(url(box, "/v1/models/noop/load")))
    await wait_for(lambda: box.workers.get("noop") is not None, what="the worker to be warming up")
    orphan = box.workers.get("noop")
    evicting = asyncio.create_task(box.residency.evict("noop"))  # its drain waits for the warm-up to end
    await wait_for(lambda: orphan._draining, what="the worker to be drained")
    release.set()
    assert await evicting
    async with await loading as response:
        assert response.status == 503, await response.text()
    assert orphan.batcher._task is None and box.workers.get("noop") is not orphan  # it never started pulling
    monkeypatch.undo()  # warm-ups as they are again
    for i in range(3):
        async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": f"x{i}"}) as response:
            assert response.status == 200
    assert orphan.held == 0


async def test_a_model_evicted_while_its_pullers_subscribe_leaves_no_worker_pulling(
    start_box, http, monkeypatch
) -> None:
    """Tester h95: an eviction whose drain came while the new worker's pullers subscribed stopped them before they
    had started; the start then started them, pulling for good on the runtime the eviction closed. Every request of
    the model failed (`'TorchBackend' object has no attribute 'model'`, dead-lettered) until the box restarted."""
    box = await start_box(default_model=False, models=[noop_model(pinned=False)])
    subscribing, release = asyncio.Event(), asyncio.Event()
    subscribe = box.nc.subscribe

    async def held_subscribe(subject: str, *args, **kwargs):
        if subject.startswith("_FBX.pull.") and not release.is_set():
            subscribing.set()
            await release.wait()
        return await subscribe(subject, *args, **kwargs)

    monkeypatch.setattr(box.nc, "subscribe", held_subscribe)
    loading = asyncio.create_task(http.post(url(box, "/v1/models/noop/load")))
    await asyncio.wait_for(subscribing.wait(), 30)
    orphan = box.workers.get("noop")
    evicting = asyncio.create_task(box.residency.evict("noop"))
    await wait_for(lambda: orphan._draining, what="the worker to be drained")
    release.set()
    assert await evicting
    async with await loading as response:
        assert response.status == 503, await response.text()  # not "loaded": nothing is
    for puller in (orphan.puller, orphan.bulk_puller):  # neither pulls: no task asking, no inbox
        assert (puller._task is None or puller._task.done()) and puller._sub is None
    assert box.workers.get("noop") is not orphan
    for i in range(3):  # served by a worker of its own
        async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": f"x{i}"}) as response:
            assert response.status == 200, await response.text()
    assert orphan.held == 0
