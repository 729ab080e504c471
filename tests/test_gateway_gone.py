"""A request whose gateway's box is gone is not computed for nobody (issue 6, review h195).

Workers judge a gateway gone by when its heartbeat records reached them, by their own clock, never by the clock
inside the records; a gateway whose heartbeat lapsed while it lived publishes again what it awaits, as copies that no
worker drops as it takes them in. Real nats-server and boxes; the gateways are plain subscribers with heartbeats
written here (`_BareGateway`), or boxes of role gateway.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import nats
import orjson
import pytest

from appliance import bus
from appliance.app import Box
from appliance.envelope import ReplyMeta, RequestMeta
from appliance.settings import ModelEntry
from appliance.tasks import cancel_and_wait
from tests.conftest import awaited_on, noop_model, url, wait_for

AWAITED_BY_GW = awaited_on(bus.reply_subject("gw"))  # a request the gateway box `gw` awaits


async def _publish_generation(nc: nats.NATS, request_id: str, reply: str, *, max_tokens: int) -> None:
    """Queue a streamed generation for model "gen" as a gateway would, its replies to `reply`."""
    now = int(time.time() * 1000)
    meta = RequestMeta(id=request_id, task="generate", model="gen", reply=reply, deadline_ms=now + 30_000, sent_ms=now)
    body = orjson.dumps({"model": "gen", "prompt": "The quick brown fox", "max_tokens": max_tokens, "stream": True})
    await nc.jetstream().publish(bus.request_subject("gen"), body, headers=meta.headers())


_FAST_FLEET = {"heartbeat_s": 0.2, "heartbeat_ttl_s": 1.0, "ack_wait_s": 1.5}  # a dead gateway known within ~2 s


class _BareGateway:
    """A gateway box as the fleet sees it: a plain subscriber to `bus.reply_subject(box_id)` that takes replies as a
    gateway does (`_gateway_of`: a final one only with `confirms_final`), and a heartbeat in `fbx_boxes` written every
    0.2 s, stamped by a clock `clock_s` off (this box's wall clock plus it). `kill` ends both at once, as a SIGKILL
    does: its record is left to age out."""

    def __init__(self, box_id: str, *, clock_s: float = 0.0) -> None:
        self.box_id = box_id
        self.clock_s = clock_s
        self.replies: asyncio.Queue = asyncio.Queue()
        self._nc: nats.NATS | None = None
        self._beats: asyncio.Task[None] | None = None

    async def start(self, nats_url: str, *, confirms_final: bool = True, listens: bool = True) -> _BareGateway:
        """`listens` false: no subscriber (a gateway reconnecting), the heartbeat alone."""
        self._nc = nc = await nats.connect(nats_url)

        async def gateway(msg) -> None:
            reply = ReplyMeta.from_headers(msg.headers)
            if msg.reply and (confirms_final or not reply.final):
                await msg.respond(b"")
            await self.replies.put((reply, msg.data))

        if listens:
            await nc.subscribe(bus.reply_subject(self.box_id), cb=gateway)
        boxes = await nc.jetstream().key_value(bus.BOXES_BUCKET)

        async def beat() -> None:
            while True:
                record = {"box": self.box_id, "role": "gateway", "ts": time.time() + self.clock_s, "started": 1.0}
                await boxes.put(self.box_id, orjson.dumps(record))
                await asyncio.sleep(0.2)

        self._beats = asyncio.create_task(beat())
        return self

    async def publish(self, request_id: str, *, max_tokens: int) -> None:
        assert self._nc is not None
        await _publish_generation(self._nc, request_id, bus.reply_subject(self.box_id), max_tokens=max_tokens)

    async def kill(self) -> None:
        if self._beats is not None:
            await cancel_and_wait([self._beats])  # a loop of NATS requests: a lone cancel can be lost
        if self._nc is not None:
            await self._nc.close()


async def test_a_generation_whose_gateway_box_died_is_cancelled_and_not_given_again(
    start_box, nats_server, generator_dir
) -> None:
    """Tester h190: a gateway box SIGKILLed, a box generated its requests for nobody until their deadline (300 s),
    those it got again by redelivery in full, from the start. A box that hears the fleet cancels a generation whose
    gateway's box has no live heartbeat any more, acks it (not given again) and counts it as cancelled, and drops one
    of that gateway pulled later as it comes; one whose gateway is live is answered. The gateways are plain
    subscribers with heartbeats written here (`_BareGateway`); the device thread is held until the gateway died, so
    both generations are admitted and unfinished then, whatever the machine's pace."""

    model = ModelEntry(name="gen", path=generator_dir, task="generate", pinned=True)
    box = await start_box(box_id="a", default_model=False, models=[model], **_FAST_FLEET)
    live = await _BareGateway("gw-live").start(nats_server.url)
    dying = await _BareGateway("gw-dying").start(nats_server.url)
    worker, held = box.workers["gen"], threading.Event()
    worker._device.submit(held.wait, 60)  # no step: what is admitted stays unfinished
    consumer = bus.consumer_name(bus.model_slug("gen"), "interactive")

    def cancelled() -> float | None:
        return box.metrics.registry.get_sample_value("fbx_cancelled_requests_total", {"model": "gen"})

    async def held_by_the_box(messages: int) -> bool:  # acked: neither waiting nor held (an ack is a plain publish)
        info = await box.js.consumer_info(bus.REQUEST_STREAM, consumer)
        return (info.num_ack_pending, info.num_pending) == (messages, 0)

    try:
        await live.publish("awaited", max_tokens=8)
        await dying.publish("forsaken", max_tokens=8)
        await wait_for(lambda: {"awaited", "forsaken"} <= set(worker._held.streams), what="both admitted")
        assert cancelled() in (None, 0.0)
        await dying.kill()
        await wait_for(lambda: cancelled() == 1.0, what="the generation of the dead gateway cancelled")
        assert set(worker._held.streams) == {"awaited"}
        await wait_for(lambda: held_by_the_box(1), what="the cancelled request acked, not given again")
        await _publish_generation(box.nc, "late", bus.reply_subject("gw-dying"), max_tokens=8)
        await wait_for(lambda: cancelled() == 2.0, what="a request of the dead gateway dropped as it comes")
        assert worker._held.copy_of("late") is None
        await wait_for(lambda: held_by_the_box(1), what="the dropped request acked")
        held.set()
        while not (reply := (await asyncio.wait_for(live.replies.get(), 30))[0]).final:
            pass
        assert (reply.id, reply.status) == ("awaited", 200)
        await _comes_to_nothing_held(box, consumer)
        assert cancelled() == 2.0
    finally:
        held.set()
        await live.kill()
        await dying.kill()


async def test_a_last_chunk_no_gateway_takes_is_given_up_once_its_gateway_box_died(
    start_box, nats_server, generator_dir, caplog
) -> None:
    """Tester h190: the last chunk of an answer whose gateway box was SIGKILLed was sent again every 0.25 s, the
    request unacked in the backlog, until its deadline, then dropped without a word. Once the gateway's box is gone
    from the fleet's heartbeats the box stops, acks the request and says so once. Here the gateway takes every chunk
    but the last (`_BareGateway`), then dies."""
    caplog.set_level(logging.INFO, logger="appliance.delivery")
    model = ModelEntry(name="gen", path=generator_dir, task="generate", pinned=True)
    box = await start_box(box_id="a", default_model=False, models=[model], **_FAST_FLEET)
    dying = await _BareGateway("gw-dying").start(nats_server.url, confirms_final=False)
    worker = box.workers["gen"]
    consumer = bus.consumer_name(bus.model_slug("gen"), "interactive")
    try:
        await dying.publish("unconfirmed", max_tokens=4)
        await wait_for(lambda: "unconfirmed" in worker._held.settling, what="the last chunk awaiting its gateway")
        await dying.kill()
        await _comes_to_nothing_held(box, consumer)
        assert "unconfirmed" not in worker._held.settling
        given_up = [r for r in caplog.records if "its gateway's box is gone from the fleet; given up" in r.getMessage()]
        assert len(given_up) == 1, caplog.text
    finally:
        await dying.kill()


async def test_an_embedding_whose_gateway_box_died_is_given_up_then_its_next_one_dropped_unread(
    start_box, nats_server, caplog
) -> None:
    """Tester h190, for an encoder: its reply, sent again while no gateway took it, is given up once the gateway's
    box is gone from the heartbeats (acked, said once); a request of that gateway pulled after is dropped before it
    is computed, counted as cancelled. The gateway here beats but never listens (`_BareGateway`), then dies."""
    caplog.set_level(logging.INFO, logger="appliance.delivery")
    box = await start_box(box_id="a", default_model=False, models=[noop_model()], **_FAST_FLEET)
    dying = await _BareGateway("gw-dying").start(nats_server.url, listens=False)
    consumer = bus.consumer_name("noop")

    async def publish(request_id: str) -> None:
        now = int(time.time() * 1000)
        meta = RequestMeta(
            id=request_id, task="embed", model="noop", reply=bus.reply_subject("gw-dying"), deadline_ms=now + 30_000,
            sent_ms=now,
        )  # fmt: skip
        await box.js.publish(bus.request_subject("noop"), b'{"input": "x", "model": "noop"}', headers=meta.headers())

    def sample(name: str) -> float:
        return box.metrics.registry.get_sample_value(name, {"model": "noop"}) or 0.0

    def said(message: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if message in r.getMessage()]

    try:
        await publish("computed")
        await wait_for(lambda: said("reply not taken by a gateway; sending it again"), what="the reply sent again")
        await dying.kill()
        await _comes_to_nothing_held(box, consumer)
        assert len(said("its gateway's box is gone from the fleet; given up")) == 1, caplog.text
        await publish("dropped")
        await wait_for(lambda: sample("fbx_cancelled_requests_total") == 1, what="the next request dropped")
        await _comes_to_nothing_held(box, consumer)
        assert sample("fbx_rows_computed_total") == 1  # the first alone
    finally:
        await dying.kill()


async def _comes_to_nothing_held(box: Box, consumer: str) -> None:
    async def nothing_held() -> bool:
        info = await box.js.consumer_info(bus.REQUEST_STREAM, consumer)
        stream = await box.js.stream_info(bus.REQUEST_STREAM)
        return (info.num_ack_pending, info.num_pending, stream.state.messages) == (0, 0, 0)

    await wait_for(nothing_held, timeout_s=30, what="every request acked and gone from the stream")


async def test_a_live_gateway_whose_clock_runs_minutes_behind_is_answered_not_taken_for_gone(
    start_box, nats_server
) -> None:
    """Review h195: a gateway whose wall clock ran 5 s behind a worker's had its requests cancelled, its heartbeat
    records judged by the time written in them. A worker judges by when the records reach it: a gateway whose
    clock is five minutes behind, beating, has its request answered, none cancelled."""
    started = time.monotonic()
    box = await start_box(box_id="a", default_model=False, models=[noop_model()], **_FAST_FLEET)
    behind = await _BareGateway("gw-behind", clock_s=-300.0).start(nats_server.url)
    fleet = box.fleet
    assert fleet is not None

    def view_old_enough() -> bool:  # a worker judges nobody gone before its view is twice the TTL old
        return time.monotonic() - started > 3 * _FAST_FLEET["heartbeat_ttl_s"]

    try:
        await wait_for(view_old_enough, what="the worker's view of the fleet old enough to judge")
        assert not fleet.gateway_gone(awaited_on(bus.reply_subject("gw-behind")))
        now = int(time.time() * 1000)
        meta = RequestMeta(
            id="behind", task="embed", model="noop", reply=bus.reply_subject("gw-behind"), deadline_ms=now + 30_000,
            sent_ms=now,
        )  # fmt: skip
        await box.js.publish(bus.request_subject("noop"), b'{"input": "x", "model": "noop"}', headers=meta.headers())
        reply, _ = await asyncio.wait_for(behind.replies.get(), 20)
        assert (reply.id, reply.status) == ("behind", 200)
        cancelled = box.metrics.registry.get_sample_value("fbx_cancelled_requests_total", {"model": "noop"})
        assert cancelled in (None, 0.0)
    finally:
        await behind.kill()


@pytest.mark.parametrize("body", ["small", "blob"])
async def test_a_gateway_whose_heartbeat_lapsed_while_it_lived_has_its_request_answered_once(
    start_box, http, body: str
) -> None:
    """Review h195: a gateway frozen, stalled or behind a half-open link (no NATS disconnect) was taken for dead, its
    requests let go, and never published them again: its clients waited to their deadline for nothing. Here its
    heartbeat is held back while it lives, until the worker takes it for gone and drops its request as it comes
    (counted as cancelled); once its heartbeat is written again, over a TTL after the last, it publishes again what
    it awaits, as a copy the worker takes in. Its client gets one answer, computed once. A body over the blob
    threshold rides in the object store: the copy has a key of its own, where the first's was deleted with it."""
    settings: dict[str, Any] = {**_FAST_FLEET, "default_model": False, "models": [noop_model()], "blob_threshold": 2048}
    worker = await start_box(role="worker", box_id="wk", **settings)
    gateway = await start_box(role="gateway", box_id="gw", **settings)
    assert worker.fleet is not None and gateway.fleet is not None
    text = "word " * (1000 if body == "blob" else 2)

    async def held_back() -> None:  # the heartbeat of a box frozen or cut off: not written
        return None

    def sample(name: str) -> float:
        return worker.metrics.registry.get_sample_value(name, {"model": "noop"}) or 0.0

    gateway.fleet.beat = held_back  # type: ignore[method-assign]
    try:
        await wait_for(lambda: worker.fleet.gateway_gone(AWAITED_BY_GW), what="the gateway taken for gone")
        sent = asyncio.ensure_future(http.post(url(gateway, "/v1/embeddings"), json={"model": "noop", "input": text}))
        await wait_for(lambda: sample("fbx_cancelled_requests_total") == 1, what="its request dropped as it came")
        del gateway.fleet.beat  # written again: over a TTL after the last
        async with await asyncio.wait_for(sent, 20) as response:
            assert response.status == 200, await response.text()
            assert len((await response.json())["data"]) == 1
        assert sample("fbx_rows_computed_total") == 1  # the copy alone
        assert sample("fbx_cancelled_requests_total") == 1
    finally:
        if "beat" in vars(gateway.fleet):
            del gateway.fleet.beat


async def test_a_lapse_publishes_nothing_again_that_is_still_queued_and_a_copy_has_a_body_of_its_own(
    start_box, http, caplog
) -> None:
    """Review h195: copies published again doubled the backlog, and a large request's copy shared its first's
    object-store key, whose ack (a worker that took it, or let it go) deleted the copy's body. A gateway whose
    heartbeat lapsed publishes again only what was let go: a large request still queued (no worker yet) is left be.
    Published again as after a lost queue, its copy names a key of its own, whose body outlives the first's, and the
    request is answered once a worker comes."""
    caplog.set_level(logging.INFO, logger="appliance.gateway.resend")
    settings: dict[str, Any] = {**_FAST_FLEET, "default_model": False, "models": [noop_model()], "blob_threshold": 2048}
    gateway = await start_box(role="gateway", box_id="gw", **settings)
    assert gateway.dispatcher is not None and gateway.blobs is not None
    text = "word " * 1000

    async def queued(messages: int) -> bool:
        return (await gateway.js.stream_info(bus.REQUEST_STREAM)).state.messages == messages

    sent = asyncio.ensure_future(http.post(url(gateway, "/v1/embeddings"), json={"model": "noop", "input": text}))
    try:
        await wait_for(lambda: queued(1), what="the request queued")
        gateway.dispatcher.heartbeat_lapsed(3.0, settle_s=0.0)  # as its next beat, 3 s after the last, says
        await wait_for(lambda: "heartbeat lapsed" in caplog.text, what="the lapse judged")
        assert await queued(1)  # still queued: not published again
        gateway.dispatcher.nats_interrupted()
        gateway.dispatcher.queue_lost()  # as after a NATS restart without --durable
        await wait_for(lambda: queued(2), what="its copy queued")
        state = (await gateway.js.stream_info(bus.REQUEST_STREAM)).state
        first, copy = [await gateway.js.get_msg(bus.REQUEST_STREAM, seq) for seq in (state.first_seq, state.last_seq)]
        keys = [RequestMeta.from_headers(m.headers).blob for m in (first, copy)]
        assert keys[0] and keys[1] and keys[0] != keys[1], keys
        assert RequestMeta.from_headers(copy.headers).copy == 1
        await gateway.blobs.delete(keys[0])  # as the first's ack does
        assert orjson.loads(await gateway.blobs.get(keys[1]))["input"] == text
        await start_box(role="worker", box_id="wk", **settings)
        async with await asyncio.wait_for(sent, 20) as response:
            assert response.status == 200, await response.text()
    finally:
        sent.cancel()


class _Relay:
    """A TCP relay between one box and the nats-server, that can be cut: that box cut off from NATS while the rest of
    the fleet is not (a network partition, a long pause), as no signal to the shared server can make it."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._open: set[asyncio.StreamWriter] = set()
        self._cut = False
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        self._open |= {writer, up_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        self._cut = True
        for writer in self._open:
            writer.close()
        self._open.clear()

    def mend(self) -> None:
        self._cut = False

    def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()


async def test_a_gateway_cut_off_long_enough_to_be_taken_for_gone_publishes_again_what_was_let_go(
    start_box, nats_server, http
) -> None:
    """Review of h194's change: a gateway cut off from NATS (here, it alone: the rest of the fleet is not) for longer
    than the workers wait to take it for gone has its request's reply given up and acked; back on NATS, its client
    waited to its deadline for nothing. Its first heartbeat written after the cut, over a TTL after the last, has it
    publish again what was let go meanwhile: answered."""
    relay = _Relay(int(nats_server.url.rsplit(":", 1)[1]))
    gateway = await start_box(role="gateway", box_id="cut-off", nats=await relay.start(), default_model=False,
                              models=[noop_model(cost_ms=4_000)], **_FAST_FLEET)  # fmt: skip
    worker = await start_box(role="worker", box_id="w", default_model=False, models=[noop_model(cost_ms=4_000)],
                             **_FAST_FLEET)  # fmt: skip
    try:
        body = {"model": "noop", "input": "x", "timeout": 25}
        answer = asyncio.create_task(http.post(url(gateway, "/v1/embeddings"), json=body))
        await wait_for(lambda: bool(worker.workers["noop"].batcher._in_flight), what="the request on the device")
        relay.cut()
        await _comes_to_nothing_held(worker, bus.consumer_name("noop"))  # let go: the gateway taken for gone
        relay.mend()
        async with await answer as response:
            assert response.status == 200, await response.text()
        computed = worker.metrics.registry.get_sample_value("fbx_rows_computed_total", {"model": "noop"})
        assert computed == 2  # the first, whose reply was given up, then its copy
    finally:
        relay.close()
