"""The fleet's last word on a request no box finished: JetStream's max-deliveries advisory, settled by one box."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats
import orjson
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import ObjectNotFoundError

from appliance import bus
from appliance.blobs import Blobs
from appliance.deadletter import DeadLetterWatch
from appliance.envelope import ReplyMeta, RequestMeta
from appliance.metrics import Metrics
from tests.conftest import wait_for


class PublishTimesOutOnce:
    """The box's JetStream context, but its first publish times out (a server busy or failing over)."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self.timed_out = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def publish(self, *args: Any, **kwargs: Any) -> Any:
        if not self.timed_out:
            self.timed_out += 1
            raise NatsTimeout
        return await self._js.publish(*args, **kwargs)


async def test_an_advisory_whose_settling_a_nats_timeout_cut_short_is_settled_on_another_try(nats_server) -> None:
    """No delivery of the request is left once the advisory comes: a settling given up at its first NATS error left
    the request in FBX_REQ for good, not dead-lettered, and its client waiting out its deadline."""
    nc = await nats.connect(nats_server.url)
    watch: DeadLetterWatch | None = None
    try:
        js = nc.jetstream()
        await bus.ensure_request_stream(js, max_msgs=1000, max_bytes=1 << 20, max_age_s=600)
        await bus.ensure_dead_letter_stream(js)
        replies: asyncio.Queue = asyncio.Queue()

        async def gateway(msg) -> None:
            await msg.respond(b"")  # confirmed, as a gateway confirms a reply
            await replies.put(msg)

        await nc.subscribe("test.replies", cb=gateway)
        now = int(time.time() * 1000)
        meta = RequestMeta(id="doomed-1", task="embed", model="noop", reply="test.replies", deadline_ms=now + 30_000,
                           sent_ms=now)  # fmt: skip
        queued = await js.publish(
            bus.request_subject(bus.model_slug("noop")), b'{"input": "x"}', headers=meta.headers()
        )
        flaky = PublishTimesOutOnce(js)
        metrics = Metrics()
        blobs = Blobs(js, 1 << 16, nc.max_payload, ttl_s=600, file_storage=False, replicas=1)
        watch = DeadLetterWatch("settler", nc, flaky, blobs, metrics.dead_lettered)  # type: ignore[arg-type]
        await watch.start()
        advisory = {"stream": bus.REQUEST_STREAM, "stream_seq": queued.seq, "deliveries": 3}
        await nc.publish(bus.max_deliveries_advisories().replace("*", "fbx-noop"), orjson.dumps(advisory))

        reply = await asyncio.wait_for(replies.get(), 30)
        assert ReplyMeta.from_headers(reply.headers).status == 422
        assert orjson.loads(reply.data)["error"]["code"] == "dead_lettered"

        async def settled() -> bool:
            return (await js.stream_info(bus.REQUEST_STREAM)).state.messages == 0

        await wait_for(settled, what="the request removed from FBX_REQ")
        assert flaky.timed_out == 1
        assert (await js.stream_info(bus.DEAD_LETTER_STREAM)).state.messages == 1
        assert metrics.registry.get_sample_value("fbx_dead_lettered_requests_total", {"model": "noop"}) == 1
    finally:
        if watch is not None:
            await watch.stop()
        await nc.close()


async def test_a_large_body_is_kept_in_its_dead_letter_and_its_blob_deleted(nats_server) -> None:
    """Tester h122: the advisory's dead letter of a request whose body went to the object store kept only the
    envelope (the body lost once the blob's TTL ran out) and left the blob holding nats-server's memory till then."""
    nc = await nats.connect(nats_server.url)
    watch: DeadLetterWatch | None = None
    try:
        js = nc.jetstream()
        await bus.ensure_request_stream(js, max_msgs=1000, max_bytes=1 << 20, max_age_s=600)
        await bus.ensure_dead_letter_stream(js)

        async def gateway(msg) -> None:
            await msg.respond(b"")  # confirmed, as a gateway confirms a reply

        await nc.subscribe("test.replies", cb=gateway)
        blobs = Blobs(js, 1 << 16, nc.max_payload, ttl_s=600, file_storage=False, replicas=1)
        body = orjson.dumps({"input": ["a long input"] * 20_000, "model": "noop"})
        key = await blobs.put(bus.request_blob_key("large-1"), body)
        now = int(time.time() * 1000)
        meta = RequestMeta(id="large-1", task="embed", model="noop", reply="test.replies", deadline_ms=now + 30_000,
                           sent_ms=now, blob=key)  # fmt: skip
        queued = await js.publish(bus.request_subject(bus.model_slug("noop")), b"", headers=meta.headers())
        watch = DeadLetterWatch("settler", nc, js, blobs, Metrics().dead_lettered)
        await watch.start()
        advisory = {"stream": bus.REQUEST_STREAM, "stream_seq": queued.seq, "deliveries": 3}
        await nc.publish(bus.max_deliveries_advisories().replace("*", "fbx-noop"), orjson.dumps(advisory))

        async def settled() -> bool:
            return (await js.stream_info(bus.REQUEST_STREAM)).state.messages == 0

        await wait_for(settled, what="the request removed from FBX_REQ")
        kept = await js.get_last_msg(bus.DEAD_LETTER_STREAM, bus.dead_letter_subject(bus.model_slug("noop")))
        assert kept.data == body
        bucket = await js.object_store(bus.BLOBS_BUCKET)
        await wait_for(lambda: _gone(bucket, key), what="the blob deleted")
    finally:
        if watch is not None:
            await watch.stop()
        await nc.close()


async def _gone(bucket, key: str) -> bool:
    try:
        await bucket.get_info(key)
    except ObjectNotFoundError:
        return True
    return False
