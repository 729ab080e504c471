"""The fleet's last word on a request no box finished: JetStream's max-deliveries advisory, settled by one box."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats
import orjson
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext

from appliance import bus
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
        watch = DeadLetterWatch("settler", nc, flaky, metrics.dead_lettered)  # type: ignore[arg-type]
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
