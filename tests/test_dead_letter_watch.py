"""The fleet's last word on a request no box finished: JetStream's max-deliveries advisory, settled by one box."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import nats
import orjson
import pytest
from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import ObjectNotFoundError, ServiceUnavailableError

from appliance import bus
from appliance.blobs import Blobs
from appliance.deadletter import DeadLetters, DeadLetterWatch, keep_dead_letter
from appliance.envelope import BLOB, ReplyMeta, RequestMeta
from appliance.metrics import Metrics
from appliance.natsd import EmbeddedNats
from tests.conftest import free_port, wait_for

_SLUG = bus.model_slug("noop")


@dataclass
class Queue:
    """FBX_REQ and FBX_DLQ on the test's nats-server, and a gateway that confirms every reply it is sent."""

    nc: NATS
    js: JetStreamContext
    blobs: Blobs
    replies: asyncio.Queue

    async def publish(self, request_id: str, body: bytes, blob: str | None = None) -> int:
        now = int(time.time() * 1000)
        meta = RequestMeta(id=request_id, task="embed", model="noop", reply="test.replies", deadline_ms=now + 30_000,
                           sent_ms=now, blob=blob)  # fmt: skip
        return (await self.js.publish(bus.request_subject(_SLUG), body, headers=meta.headers())).seq

    async def publish_large(self, request_id: str) -> tuple[bytes, str, int]:
        """A request whose body went to the object store: its body, its blob's key and its sequence in FBX_REQ."""
        body = orjson.dumps({"input": ["a long input"] * 20_000, "model": "noop"})
        key = await self.blobs.put(bus.request_blob_key(request_id), body)
        return body, key, await self.publish(request_id, b"", blob=key)

    async def advise(self, seq: int) -> None:
        """JetStream's max-deliveries advisory for the request at `seq`."""
        advisory = {"stream": bus.REQUEST_STREAM, "stream_seq": seq, "deliveries": 3}
        await self.nc.publish(bus.max_deliveries_advisories().replace("*", f"fbx-{_SLUG}"), orjson.dumps(advisory))

    async def settled(self) -> None:
        async def empty() -> bool:
            return (await self.js.stream_info(bus.REQUEST_STREAM)).state.messages == 0

        await wait_for(empty, what="the request removed from FBX_REQ")


@pytest.fixture
async def queue(nats_server) -> AsyncIterator[Queue]:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await bus.ensure_request_stream(js, max_msgs=1000, max_bytes=1 << 20, max_age_s=600)
    await bus.ensure_dead_letter_stream(js)
    replies: asyncio.Queue = asyncio.Queue()

    async def gateway(msg) -> None:
        await msg.respond(b"")  # confirmed, as a gateway confirms a reply
        await replies.put(msg)

    await nc.subscribe("test.replies", cb=gateway)
    yield Queue(nc, js, Blobs(js, 1 << 16, nc.max_payload, ttl_s=600, file_storage=False, replicas=1), replies)
    await nc.close()


StartWatch = Callable[..., Awaitable[None]]


@pytest.fixture
async def start_watch(queue: Queue) -> AsyncIterator[StartWatch]:
    """Starts a box's `DeadLetterWatch` on the test's queue, with the JetStream context, blob store and counter given
    (the queue's own, and a fresh counter, by default), and stops it at the end."""
    started: list[DeadLetterWatch] = []

    async def start(*, js: Any = None, blobs: Any = None, dead_lettered: Any = None) -> None:
        watch = DeadLetterWatch(
            "settler", queue.nc, js or queue.js, blobs or queue.blobs, dead_lettered or Metrics().dead_lettered
        )
        started.append(watch)
        await watch.start()

    yield start
    for watch in started:
        await watch.stop()


class FailsOnce:
    """The box's JetStream context (or its blob store), but its first call of `method` fails, by default as a
    timeout: before it reaches the server (a server busy or failing over), or, `reached`, after (its answer lost).
    `error`: another NATS error in its place (a 503 while a server fails over, say)."""

    def __init__(
        self,
        js: JetStreamContext | Blobs,
        method: str,
        *,
        reached: bool = False,
        error: type[Exception] = NatsTimeout,
    ) -> None:
        self._js = js
        self._method = method
        self._reached = reached
        self._error = error
        self.failed = 0

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._js, name)
        if name != self._method:
            return real

        async def first_fails(*args: Any, **kwargs: Any) -> Any:
            if self.failed:
                return await real(*args, **kwargs)
            self.failed += 1
            if self._reached:
                await real(*args, **kwargs)
            raise self._error

        return first_fails


async def test_an_advisory_whose_settling_a_nats_timeout_cut_short_is_settled_on_another_try(
    queue, start_watch
) -> None:
    """No delivery of the request is left once the advisory comes: a settling given up at its first NATS error left
    the request in FBX_REQ for good, not dead-lettered, and its client waiting out its deadline."""
    seq = await queue.publish("doomed-1", b'{"input": "x"}')
    flaky, metrics = FailsOnce(queue.js, "publish"), Metrics()
    await start_watch(js=flaky, dead_lettered=metrics.dead_lettered)
    await queue.advise(seq)

    reply = await asyncio.wait_for(queue.replies.get(), 30)
    assert ReplyMeta.from_headers(reply.headers).status == 422
    assert orjson.loads(reply.data)["error"]["code"] == "dead_lettered"
    await queue.settled()
    assert flaky.failed == 1
    assert (await queue.js.stream_info(bus.DEAD_LETTER_STREAM)).state.messages == 1

    def counted() -> bool:  # once the watch has its delete's answer: FBX_REQ may be read empty a moment before
        return metrics.registry.get_sample_value("fbx_dead_lettered_requests_total", {"model": "noop"}) == 1

    await wait_for(counted, timeout_s=5.0, what="the dead letter counted")


async def test_a_large_body_is_kept_in_its_dead_letter_and_its_blob_deleted(queue, start_watch) -> None:
    """Tester h122: the advisory's dead letter of a request whose body went to the object store kept only the
    envelope (the body lost once the blob's TTL ran out) and left the blob holding nats-server's memory till then."""
    body, key, seq = await queue.publish_large("large-1")
    await start_watch()
    await queue.advise(seq)

    await queue.settled()
    kept = await queue.js.get_last_msg(bus.DEAD_LETTER_STREAM, bus.dead_letter_subject(_SLUG))
    assert kept.data == body and BLOB not in (kept.headers or {})  # the body itself, not a blob gone by now
    bucket = await queue.js.object_store(bus.BLOBS_BUCKET)

    async def blob_gone() -> bool:
        try:
            await bucket.get_info(key)
        except ObjectNotFoundError:
            return True
        return False

    await wait_for(blob_gone, what="the blob deleted")


async def test_a_delete_whose_answer_was_lost_still_has_the_blob_deleted_and_the_dead_letter_counted(
    queue, start_watch
) -> None:
    """Review h132: the settling tried again after the lost answer found the request gone, took it for an advisory
    not to act on, and so left the blob to its TTL and the dead letter uncounted."""
    _body, key, seq = await queue.publish_large("large-2")
    flaky, metrics = FailsOnce(queue.js, "delete_msg", reached=True), Metrics()
    await start_watch(js=flaky, dead_lettered=metrics.dead_lettered)
    await queue.advise(seq)

    def counted() -> bool:
        return metrics.registry.get_sample_value("fbx_dead_lettered_requests_total", {"model": "noop"}) == 1

    await wait_for(counted, what="the dead letter counted")
    assert flaky.failed == 1
    bucket = await queue.js.object_store(bus.BLOBS_BUCKET)
    with pytest.raises(ObjectNotFoundError):
        await bucket.get_info(key)


async def test_a_blob_read_that_times_out_is_tried_again_not_taken_for_a_body_gone(queue, start_watch) -> None:
    """Review h133: any error reading the body's blob was taken for the body gone, a timeout too: the dead letter kept
    only the envelope and the blob was left to its TTL."""
    body, _key, seq = await queue.publish_large("large-3")
    slow_store = FailsOnce(queue.blobs, "get")
    await start_watch(blobs=slow_store)
    await queue.advise(seq)

    await queue.settled()
    kept = await queue.js.get_last_msg(bus.DEAD_LETTER_STREAM, bus.dead_letter_subject(_SLUG))
    assert slow_store.failed == 1 and kept.data == body


async def test_a_blob_read_the_store_refuses_just_now_is_tried_again_and_the_body_kept(queue, start_watch) -> None:
    """Review h141: a NATS error other than a timeout was taken for the body gone, so the dead letter kept only the
    envelope; a later step cut short had the settling tried again, FBX_DLQ dropped the body read then as a duplicate,
    and the blob was deleted: the body in neither the dead letter nor the store."""
    body, _key, seq = await queue.publish_large("large-5")
    store = FailsOnce(queue.blobs, "get", error=ServiceUnavailableError)
    js = FailsOnce(queue.js, "delete_msg")  # the first delete does not reach the server: the settling tried again
    await start_watch(js=js, blobs=store)
    await queue.advise(seq)

    await queue.settled()
    kept = await queue.js.get_last_msg(bus.DEAD_LETTER_STREAM, bus.dead_letter_subject(_SLUG))
    assert store.failed == 1 and kept.data == body


async def test_a_dead_letter_kept_before_without_the_body_leaves_the_blob_to_its_ttl(queue, start_watch) -> None:
    """Review h141: the dead letter was kept already (by a worker whose blob read failed, say) with only the envelope;
    the advisory's copy, body and all, is dropped by FBX_DLQ as a duplicate, so the blob is not deleted."""
    body, key, seq = await queue.publish_large("large-6")
    stored = await queue.js.get_msg(bus.REQUEST_STREAM, seq)
    meta = RequestMeta.from_headers(dict(stored.headers or {}))
    await keep_dead_letter(queue.js, meta, dict(stored.headers or {}), b"", deliveries=1, reason="kept by a worker")
    metrics = Metrics()
    await start_watch(dead_lettered=metrics.dead_lettered)
    await queue.advise(seq)

    def counted() -> bool:  # once its blob was deleted or left
        return metrics.registry.get_sample_value("fbx_dead_lettered_requests_total", {"model": "noop"}) == 1

    await wait_for(counted, what="the dead letter counted")
    kept = await queue.js.get_last_msg(bus.DEAD_LETTER_STREAM, bus.dead_letter_subject(_SLUG))
    assert not kept.data and kept.headers[BLOB] == key
    assert await queue.blobs.get(key) == body


class BlobReadsTimeOut:
    """A blob store whose reads all time out (a store slow throughout)."""

    def __init__(self, blobs: Blobs) -> None:
        self._blobs = blobs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._blobs, name)

    async def get(self, key: str) -> bytes:
        raise NatsTimeout


async def test_a_worker_whose_blob_read_times_out_still_dead_letters_with_the_models_error(queue) -> None:
    """Review h135: a worker has no settling to try again, and the raised timeout left the request neither acked nor
    naked; after the ack wait the advisory dead-lettered it as "no box finished it", the model's error lost."""
    _body, key, _ = await queue.publish_large("large-4")
    await bus.ensure_request_consumers(queue.js, _SLUG, ack_wait_s=30, max_deliver=1, max_ack_pending=10)
    puller = await queue.js.pull_subscribe_bind(bus.consumer_name(_SLUG), bus.REQUEST_STREAM)
    [msg] = await puller.fetch(1, timeout=5)
    metrics = Metrics()
    dead_letters = DeadLetters("worker", queue.nc, queue.js, BlobReadsTimeOut(queue.blobs), 1,  # type: ignore[arg-type]
                               metrics.dead_lettered.labels("noop"))  # fmt: skip
    meta = RequestMeta.from_headers(msg.headers)
    await dead_letters.retry_or_dead_letter(meta, msg, RuntimeError("model failed"), stopping=lambda: False)

    reply = await asyncio.wait_for(queue.replies.get(), 30)
    assert "model failed" in orjson.loads(reply.data)["error"]["message"]
    kept = await queue.js.get_last_msg(bus.DEAD_LETTER_STREAM, bus.dead_letter_subject(_SLUG))
    assert "model failed" in kept.headers["Fbx-Dead-Reason"] and key in kept.headers["Fbx-Dead-Reason"]
    await queue.settled()  # acked


async def test_the_dead_letter_stream_is_bounded_in_bytes_as_in_count(queue: Queue) -> None:
    """Tester h185: each dead letter keeps its request's body, and FBX_DLQ had no byte bound (10,000 of them, 7
    days): a client's megabyte poison requests could hold 10 GB of the server's memory. The oldest go past 256 MiB."""
    config = (await queue.js.stream_info(bus.DEAD_LETTER_STREAM)).config
    assert (config.max_msgs, config.max_bytes) == (10_000, bus.DEAD_LETTER_MAX_BYTES) == (10_000, 256 << 20)
    assert config.discard in (None, "old")


async def test_a_jetstream_without_room_for_its_byte_bound_still_gets_a_dead_letter_stream(tmp_path) -> None:
    """Review h186: nats-server reserves a stream's max_bytes as it makes it; where JetStream's limit had no room for
    256 MiB, FBX_DLQ was refused (insufficient resources) and the box could not start. Made unbounded in bytes."""
    conf = tmp_path / "nats.conf"
    conf.write_text("jetstream { max_memory_store: 128MB }\n")
    server = EmbeddedNats(store_dir=tmp_path / "nats", port=free_port(), extra_args=("-c", str(conf)))
    await server.start()
    nc = await nats.connect(server.url)
    try:
        await bus.ensure_dead_letter_stream(nc.jetstream())
        config = (await nc.jetstream().stream_info(bus.DEAD_LETTER_STREAM)).config
        assert (config.max_msgs, config.max_bytes in (None, -1)) == (10_000, True)
    finally:
        await nc.close()
        await server.stop()
