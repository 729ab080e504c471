"""How a box keeps the requests it holds: a real nats-server, a real JetStream consumer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import nats
import pytest
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DiscardPolicy, RetentionPolicy

from appliance.delivery import HandBack, keep_alive
from appliance.natsd import EmbeddedNats
from tests.conftest import wait_for


async def _comes_to_hold(js: JetStreamContext, stream: str, messages: int) -> None:
    """An ack is a plain publish, and nats-server applies it on the consumer's own queue: a stream's count read
    just after it may not show it yet (a clean-clone CI run saw 2 for 1), so the count is waited for, bounded."""

    async def holds() -> bool:
        return (await js.stream_info(stream)).state.messages == messages

    await wait_for(holds, timeout_s=5.0, what=f"{stream} to hold {messages} message(s)")


async def test_a_request_nakd_after_the_keep_alive_listed_it_is_redelivered_after_its_back_off(
    nats_server: EmbeddedNats,
) -> None:
    """The keep-alive lists the held requests, then sends each an in-progress; one nak'd in between
    must not get it (JetStream would then hold it back a whole ack_wait, not its back-off)."""
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="KEEP", subjects=["keep.>"])
        config = ConsumerConfig(durable_name="w", ack_policy=AckPolicy.EXPLICIT, ack_wait=3.0)
        await js.add_consumer("KEEP", config)
        sub = await js.pull_subscribe("keep.>", durable="w", stream="KEEP")
        await js.publish("keep.one", b"x")
        [msg] = await sub.fetch(1, timeout=2)
        listed = [msg]  # as the keep-alive's list of held requests was taken, before the nak
        await msg.nak(delay=1.5)
        nakd_at = time.monotonic()
        ticking = asyncio.create_task(keep_alive(lambda: listed, ack_wait_s=3.0))  # ticks after 1 s
        try:
            [again] = await sub.fetch(1, timeout=6)
        finally:
            ticking.cancel()
        assert again.metadata.num_delivered == 2
        assert time.monotonic() - nakd_at < 3.5  # its 1.5 s back-off; an in-progress after the nak means 4 s or never
    finally:
        await nc.close()


@pytest.fixture
async def client(nats_server: EmbeddedNats) -> AsyncIterator[nats.NATS]:
    nc = await nats.connect(nats_server.url)
    yield nc
    await nc.close()


async def _last_delivery(js, stream: str, *, max_msgs: int = -1, max_deliver: int = 1, ack_wait: float = 30.0):
    """A work queue as the request stream is, a consumer of `max_deliver` 1, one request in it, and that request
    delivered (its last)."""
    await js.add_stream(name=stream, subjects=[f"{stream.lower()}.>"], max_msgs=max_msgs, discard=DiscardPolicy.NEW,
                        retention=RetentionPolicy.WORK_QUEUE)  # fmt: skip
    config = ConsumerConfig(durable_name="w", ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait, max_deliver=max_deliver)
    await js.add_consumer(stream, config)
    sub = await js.pull_subscribe(f"{stream.lower()}.>", durable="w", stream=stream)
    await js.publish(f"{stream.lower()}.m", b"body", headers={"Nats-Msg-Id": "r1", "Fbx-Id": "r1"})
    [msg] = await sub.fetch(1, timeout=2)
    return sub, msg


async def test_a_request_handed_back_on_its_last_delivery_is_queued_again_as_a_copy(client: nats.NATS) -> None:
    """Review h122: a nak on the last delivery had the request dead-lettered. A publish of the copy that times out
    is sent again under the same id (stored or not, the duplicate window keeps one copy: review h124)."""
    js = client.jetstream()
    sub, msg = await _last_delivery(js, "HANDBACK")
    publish, timeouts = JetStreamContext.publish, []

    async def stored_then_timed_out(self, subject, payload=b"", **kwargs):
        ack = await publish(self, subject, payload, **kwargs)
        if not timeouts:  # the first one stored, but its ack lost
            timeouts.append(ack.seq)
            raise NatsTimeout
        return ack

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(JetStreamContext, "publish", stored_then_timed_out)
        await HandBack(client, max_deliver=1)(msg)
    [copy] = await sub.fetch(1, timeout=2)
    assert (copy.data, copy.headers["Fbx-Id"], copy.metadata.num_delivered) == (b"body", "r1", 1)
    assert copy.headers["Nats-Msg-Id"] == f"r1.again.{msg.metadata.sequence.stream}"
    await _comes_to_hold(js, "HANDBACK", 1)  # the copy alone: the original acked, the copy sent twice stored once


async def test_a_slow_hand_back_keeps_the_original_from_its_max_deliveries_advisory(client: nats.NATS) -> None:
    """Review h132: three tries of JetStream's 5 s publish outlasted the ack wait, with nothing marking the original
    in progress: its max-deliveries advisory had it dead-lettered (its client told 422, its blob deleted) while its
    copy was served. Here the copy's first two publishes stall until they time out, 1.2 s each (at most), on a
    consumer of a 1.5 s ack wait."""
    js = client.jetstream()
    _, msg = await _last_delivery(js, "SLOW", ack_wait=1.5)
    advisories: list[object] = []

    async def advised(advisory) -> None:
        advisories.append(advisory)

    await client.subscribe("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.SLOW.*", cb=advised)
    publish, stalls = JetStreamContext.publish, []

    async def stalled_twice(self, subject, payload=b"", **kwargs):
        if len(stalls) < 2:
            stalls.append(kwargs.get("timeout"))
            await asyncio.sleep(min(1.2, kwargs.get("timeout") or 5.0))
            raise NatsTimeout
        return await publish(self, subject, payload, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(JetStreamContext, "publish", stalled_twice)
        await HandBack(client, max_deliver=1, ack_wait_s=1.5)(msg)
    await client.flush()
    assert len(stalls) == 2 and advisories == []
    await _comes_to_hold(js, "SLOW", 1)  # the copy alone, the original acked


async def test_a_copy_the_full_stream_refuses_leaves_the_nak(client: nats.NATS) -> None:
    js = client.jetstream()
    _, msg = await _last_delivery(js, "FULL", max_msgs=1)  # the original fills it
    await HandBack(client, max_deliver=1)(msg)
    state = (await js.stream_info("FULL")).state
    assert (state.messages, state.last_seq) == (1, msg.metadata.sequence.stream)  # no copy: the original, naked


async def test_a_request_not_on_its_last_delivery_is_naked(client: nats.NATS) -> None:
    js = client.jetstream()
    sub, msg = await _last_delivery(js, "NAKED", max_deliver=2)
    await HandBack(client, max_deliver=2)(msg)
    [again] = await sub.fetch(1, timeout=2)
    assert (again.metadata.sequence.stream, again.metadata.num_delivered) == (msg.metadata.sequence.stream, 2)
