"""How a box keeps the requests it holds: a real nats-server, a real JetStream consumer."""

from __future__ import annotations

import asyncio
import time

import nats
from nats.js.api import AckPolicy, ConsumerConfig

from appliance.delivery import keep_alive
from appliance.natsd import EmbeddedNats


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
