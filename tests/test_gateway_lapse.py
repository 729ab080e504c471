"""A gateway taken for gone while it lived, and heard again: what the workers let go is published again, and only
that (issue 6, review h202).

A request still being prepared when its gateway is taken for gone is computed once that gateway is heard again (it
found the message held, and published no copy); a look at the request stream that is not answered tells nothing, so
nothing is published again on it, and it is made again until the stream says. Real nats-server and boxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import nats
import nats.errors
import orjson

from appliance import bus
from appliance.deadletter import tell_dead_lettered
from appliance.delivery import Cancellations
from appliance.envelope import RequestMeta
from appliance.errors import ServiceUnavailable
from appliance.settings import ModelEntry
from tests.conftest import awaited_on, hold, noop_model, url, wait_for

AWAITED_BY_GW = awaited_on(bus.reply_subject("gw"))  # a request the gateway box `gw` awaits

_FAST_FLEET = {"heartbeat_s": 0.2, "heartbeat_ttl_s": 1.0, "ack_wait_s": 1.5}  # a lapse judged within ~2 s


def _meta(request_id: str, *, reply: str = "fbx.reply.gw", copy: int = 0) -> RequestMeta:
    return RequestMeta(
        id=request_id, task="embed", model="noop", reply=reply, deadline_ms=10**13, sent_ms=10**12, copy=copy
    )


def _hold_blob_reads(worker: Any) -> asyncio.Event:
    """The object store of the worker's intake (`WorkerIntake`), its reads held back until the event is set: a long
    preparation."""
    read = asyncio.Event()
    intake = worker._intake
    blobs = intake._blobs

    class HeldBackBlobs:
        def __getattr__(self, name: str) -> Any:
            return getattr(blobs, name)

        async def get(self, key: str) -> bytes:
            await read.wait()
            return await blobs.get(key)

    intake._blobs = HeldBackBlobs()
    return read


HELD_BACK_SETTINGS: dict[str, Any] = {
    **_FAST_FLEET,
    "default_model": False,
    "models": [noop_model()],
    "blob_threshold": 2048,
}


async def held_back_fleet(start_box: Any) -> tuple[Any, Any, asyncio.Event]:
    """A worker box `wk` and a gateway box `gw` (fast heartbeats, the no-op model) whose worker's body reads are
    held back until the event returned is set: a request of 5,000 bytes stays held, being prepared."""
    worker = await start_box(role="worker", box_id="wk", **HELD_BACK_SETTINGS)
    gateway = await start_box(role="gateway", box_id="gw", **HELD_BACK_SETTINGS)
    return worker, gateway, _hold_blob_reads(worker.workers["noop"])


async def no_beat() -> None:
    """A `Fleet.beat` that writes nothing: the box frozen or cut off, as the fleet sees it."""


class _Looks:
    """A gateway's looks at the request stream (`js.get_msg`), each after `delay_s`, not answered (a TimeoutError,
    as during a failover) while `answering` is false; counted."""

    def __init__(self, js: Any, delay_s: float = 0.0) -> None:
        self.count = 0
        self.answering = True
        self._js, self._get_msg, self._delay_s = js, js.get_msg, delay_s
        js.get_msg = self._look

    async def _look(self, *args: Any, **kwargs: Any) -> Any:
        self.count += 1
        await asyncio.sleep(self._delay_s)
        if not self.answering:
            raise nats.errors.TimeoutError
        return await self._get_msg(*args, **kwargs)

    def stop_answering(self) -> None:
        self.answering, self.count = False, 0

    def restore(self) -> None:
        vars(self._js).pop("get_msg", None)


class _RequestStream:
    """The request stream as the test reads it, on a connection of its own."""

    def __init__(self, nc: nats.NATS) -> None:
        self._nc, self._js = nc, nc.jetstream()

    async def holds(self, count: int) -> bool:
        return (await self._js.stream_info(bus.REQUEST_STREAM)).state.messages == count

    async def let_go_first(self) -> None:
        """Remove the first message, as a worker that took its gateway for gone acks it."""
        await self._js.delete_msg(bus.REQUEST_STREAM, (await self._js.stream_info(bus.REQUEST_STREAM)).state.first_seq)

    async def last(self) -> Any:
        return await self._js.get_msg(
            bus.REQUEST_STREAM, (await self._js.stream_info(bus.REQUEST_STREAM)).state.last_seq
        )

    async def close(self) -> None:
        await self._nc.close()


_LOOKS_SETTINGS: dict[str, Any] = {**_FAST_FLEET, "default_model": False, "models": [noop_model()]}


@contextlib.asynccontextmanager
async def _lapsed_with_a_request_queued(
    start_box: Any, http: Any, nats_server: Any, *, look_delay_s: float = 0.0
) -> AsyncIterator[tuple[Any, _Looks, _RequestStream, asyncio.Future[Any]]]:
    """A gateway-only box `gw` with one request of its client's queued (no worker), then its heartbeat lapsed while
    the stream answers none of its looks (each after `look_delay_s`): the box, the looks, the stream as the test
    reads it, and the client's answer to come."""
    gateway = await start_box(role="gateway", box_id="gw", **_LOOKS_SETTINGS)
    assert gateway.dispatcher is not None and gateway.js is not None
    looks = _Looks(gateway.js, delay_s=look_delay_s)
    stream = _RequestStream(await nats.connect(nats_server.url))
    sent = asyncio.ensure_future(
        http.post(url(gateway, "/v1/embeddings"), json={"model": "noop", "input": "x", "timeout": 20})
    )
    try:
        await wait_for(lambda: stream.holds(1), what="the request queued")
        looks.stop_answering()
        gateway.dispatcher.heartbeat_lapsed(6.0, settle_s=0.0)
        yield gateway, looks, stream, sent
    finally:
        looks.restore()
        sent.cancel()
        await stream.close()


def test_a_cancel_only_for_a_gone_gateway_is_lifted_once_that_gateway_is_heard_again() -> None:
    cancelled = Cancellations()
    cancelled.add("r1", why="gateway_gone")
    assert cancelled.still_cancelled(_meta("r1"), lambda reply: True)  # still gone: dropped
    assert not cancelled.still_cancelled(_meta("r1"), lambda reply: False)  # heard again: computed
    assert not cancelled.contains("r1")
    cancelled.add("r1", why="gateway_gone")
    cancelled.add("r1", why="gone")  # then its gateway, back, says its client went away meanwhile (review h204)
    assert cancelled.still_cancelled(_meta("r1"), lambda reply: False)
    cancelled.add("r2", why="gone")  # its client went away: whatever its gateway is
    assert cancelled.still_cancelled(_meta("r2"), lambda reply: False)
    assert not cancelled.still_cancelled(_meta("r3"), lambda reply: True)  # never cancelled


async def test_a_request_being_prepared_when_its_gateway_was_taken_for_gone_is_answered_once_it_is_heard_again(
    start_box, http, caplog
) -> None:
    """Review h202: a held request still being prepared (here its body read from the object store, held back) when
    the worker takes its gateway for gone was dropped once prepared, whenever that was. Prepared after the gateway
    came back and looked (it found the message held, so published no copy), its client had a 504 at its deadline.
    Seen failing so: 504 after 12 s."""
    caplog.set_level(logging.INFO, logger="appliance.gateway.resend")
    worker, gateway, read = await held_back_fleet(start_box)
    assert gateway.fleet is not None and worker.fleet is not None
    noop = worker.workers["noop"]

    sent = asyncio.ensure_future(
        http.post(url(gateway, "/v1/embeddings"), json={"model": "noop", "input": "word " * 1000, "timeout": 12})
    )
    try:
        await wait_for(lambda: len(noop._held) == 1, what="the request held, being prepared")
        (request_id,) = list(noop._held)
        gateway.fleet.beat = no_beat  # the gateway's box frozen or cut off: no heartbeat written
        await wait_for(lambda: noop._cancelled.contains(request_id), what="let go as its gateway's")
        del gateway.fleet.beat  # back: its lapse judged, a TTL waited, the stream looked at
        await wait_for(lambda: "heartbeat lapsed" in caplog.text, timeout_s=10, what="the lapse judged")
        await wait_for(lambda: not worker.fleet.gateway_gone(AWAITED_BY_GW), what="the gateway heard again")
        read.set()  # prepared after the gateway looked
        async with await asyncio.wait_for(sent, 30) as response:
            assert response.status == 200, await response.text()
    finally:
        read.set()
        vars(gateway.fleet).pop("beat", None)
        sent.cancel()


async def test_a_generation_being_admitted_when_its_gateway_was_taken_for_gone_is_answered_once_it_is_heard_again(
    start_box, http, generator_dir, caplog
) -> None:
    """The same for a generation (review h202): one being admitted (its body read, its adapter held, its prompt
    rendered: here held before its admission runs) when its gateway is taken for gone is generated once that
    gateway is heard again, not cancelled once admitted. Seen failing with the check as it was: a 504 after 12 s."""
    caplog.set_level(logging.INFO, logger="appliance.gateway.resend")
    model = ModelEntry(name="gen", path=generator_dir, task="generate", pinned=True)
    settings: dict[str, Any] = {**_FAST_FLEET, "default_model": False, "models": [model]}
    worker = await start_box(role="worker", box_id="wk", **settings)
    gateway = await start_box(role="gateway", box_id="gw", **settings)
    assert gateway.fleet is not None and worker.fleet is not None
    gen = worker.workers["gen"]
    admitting, go_on = hold(gen._intake, "_admit")

    body = {"model": "gen", "prompt": "The quick brown fox", "max_tokens": 4, "timeout": 12}
    sent = asyncio.ensure_future(http.post(url(gateway, "/v1/completions"), json=body))
    try:
        await asyncio.wait_for(admitting.wait(), 20)
        (request_id,) = list(gen._held.preparing)
        gateway.fleet.beat = no_beat
        await wait_for(lambda: gen._cancelled.contains(request_id), what="let go as its gateway's")
        del gateway.fleet.beat
        await wait_for(lambda: "heartbeat lapsed" in caplog.text, timeout_s=10, what="the lapse judged")
        await wait_for(lambda: not worker.fleet.gateway_gone(AWAITED_BY_GW), what="the gateway heard again")
        go_on.set()
        async with await asyncio.wait_for(sent, 30) as response:
            assert response.status == 200, await response.text()
            assert (await response.json())["usage"]["completion_tokens"] >= 1
    finally:
        go_on.set()
        vars(gateway.fleet).pop("beat", None)
        sent.cancel()


async def test_a_copy_whose_gateway_died_after_it_came_back_is_let_go_after_a_grace(start_box, http) -> None:
    """Review h202: a copy its gateway published again once its heartbeat came back was never let go, so the copies
    of a gateway that lapsed, came back and then died for good were computed in full. A copy is let go once its
    gateway has stayed gone for twice the TTL while it was held (not at once: the gateway's fresh heartbeat may not
    have reached the box when the copy did). Here: a request dropped at intake while its gateway is taken for gone,
    its copy published when it beats again, held in its body's read, then the gateway silent for good. Seen failing
    before: the copy not let go."""
    worker, gateway, read = await held_back_fleet(start_box)
    assert gateway.fleet is not None and worker.fleet is not None
    noop = worker.workers["noop"]

    def cancelled() -> float:
        return worker.metrics.registry.get_sample_value("fbx_cancelled_requests_total", {"model": "noop"}) or 0.0

    gateway.fleet.beat = no_beat
    sent = None
    try:
        await wait_for(lambda: worker.fleet.gateway_gone(AWAITED_BY_GW), what="the gateway taken for gone")
        body = {"model": "noop", "input": "word " * 1000, "timeout": 30}
        sent = asyncio.ensure_future(http.post(url(gateway, "/v1/embeddings"), json=body))
        await wait_for(lambda: cancelled() == 1.0, what="the first dropped at intake")
        del gateway.fleet.beat  # back: its lapse judged, the first found let go, its copy published
        await wait_for(lambda: len(noop._held) == 1, timeout_s=15, what="its copy held, being prepared")
        (request_id,) = list(noop._held)
        assert RequestMeta.from_headers(noop._held[request_id].headers).copy == 1
        gateway.fleet.beat = no_beat  # gone for good, as the fleet sees it
        await wait_for(lambda: noop._cancelled.contains(request_id), timeout_s=15, what="the copy let go")
        read.set()
        await wait_for(lambda: not noop._held, what="the copy dropped once prepared")
        assert cancelled() == 2.0
        assert worker.metrics.registry.get_sample_value("fbx_rows_computed_total", {"model": "noop"}) in (None, 0.0)
    finally:
        read.set()
        vars(gateway.fleet).pop("beat", None)
        if sent is not None:
            sent.cancel()


async def test_a_look_at_the_stream_that_is_not_answered_publishes_nothing_and_is_made_again(
    start_box, http, nats_server, caplog
) -> None:
    """Review h202: a look at the request stream after a lapse that was not answered (a stream leader moving) was
    taken for "let go": every request still queued was published again, and a client whose copy's publish was not
    answered either was told 503 though its first was queued. Now nothing is published again on an unanswered look,
    and the look is made again: once the stream answers that the message is gone, a copy is published and answered.
    Seen failing on the code before: no second look (the first, unanswered, taken for "let go")."""
    caplog.set_level(logging.INFO, logger="appliance.gateway.resend")
    async with _lapsed_with_a_request_queued(start_box, http, nats_server) as (_, looks, stream, sent):
        await wait_for(lambda: looks.count >= 2, what="a look made again")
        assert await stream.holds(1)  # nothing published again
        assert not sent.done()
        await stream.let_go_first()
        looks.answering = True
        await wait_for(lambda: stream.holds(1), what="its copy queued")
        assert RequestMeta.from_headers((await stream.last()).headers).copy == 1
        await start_box(role="worker", box_id="wk", **_LOOKS_SETTINGS)
        async with await asyncio.wait_for(sent, 20) as response:
            assert response.status == 200, await response.text()
        assert "published again what was let go" in caplog.text


async def test_a_dead_letter_whose_gateway_is_gone_is_not_told_to_its_deadline(nats_server) -> None:
    """Review h202: a dead-lettered request's client was told again every 0.25 s to its deadline (300 s for a
    generation) when its gateway's box was gone, the message held unacked meanwhile. Known gone, it is given up at
    once, as a plain reply is (`deliver_reply`)."""
    nc = await nats.connect(nats_server.url)
    try:
        meta = _meta("r1", reply=bus.reply_subject("gw-dead"))  # nobody listens there
        told = tell_dead_lettered(
            nc, meta, deliveries=5, reason="boom", box_id="wk", give_up=lambda: False, gateway_gone=lambda reply: True
        )
        assert await asyncio.wait_for(told, 10)
    finally:
        await nc.close()


async def test_a_request_whose_client_went_away_while_its_gateway_was_taken_for_gone_is_not_computed(
    start_box, http
) -> None:
    """Review h204: a request being prepared, let go as its gateway's; its gateway, back, says on `fbx.cancel` that
    its client went away. That cancel was swallowed (the id was cancelled already), and the gateway_gone one lifted
    once the gateway was heard: computed for nobody (h204's reproduction: one row computed). Seen failing on the code
    before: the client's cancel not recorded."""
    worker, gateway, read = await held_back_fleet(start_box)
    assert gateway.fleet is not None and worker.fleet is not None and gateway.nc is not None
    noop = worker.workers["noop"]

    def sample(name: str) -> float:
        return worker.metrics.registry.get_sample_value(name, {"model": "noop"}) or 0.0

    body = {"model": "noop", "input": "word " * 1000, "timeout": 12}
    sent = asyncio.ensure_future(http.post(url(gateway, "/v1/embeddings"), json=body))
    try:
        await wait_for(lambda: len(noop._held) == 1, what="the request held, being prepared")
        (request_id,) = list(noop._held)
        gateway.fleet.beat = no_beat
        await wait_for(lambda: noop._cancelled.contains(request_id), what="let go as its gateway's")
        await gateway.nc.publish(bus.cancel_subject(), orjson.dumps({"id": request_id}))  # as its dispatcher does
        await wait_for(lambda: noop._cancelled.why(request_id) == "gone", what="its client's cancel heard")
        del gateway.fleet.beat
        await wait_for(lambda: not worker.fleet.gateway_gone(AWAITED_BY_GW), what="the gateway heard again")
        read.set()
        await wait_for(lambda: sample("fbx_cancelled_requests_total") == 1.0, what="dropped once prepared")
        assert not noop._held and sample("fbx_rows_computed_total") == 0.0
    finally:
        read.set()
        vars(gateway.fleet).pop("beat", None)
        sent.cancel()


async def test_two_lapses_whose_looks_overlap_publish_one_copy(start_box, http, nats_server) -> None:
    """Review h204: each lapse looked at each awaited request in a loop of its own, so two lapses close together
    (a flapping link) while the stream answered looks slowly both found the message gone and both published a copy.
    One look loop per request now, and one copy at a time (h204's reproduction, these steps: 2 copies)."""
    async with _lapsed_with_a_request_queued(start_box, http, nats_server, look_delay_s=0.5) as lapsed:
        gateway, looks, stream, _ = lapsed
        resender = gateway.dispatcher._resender
        await asyncio.sleep(0.3)  # the first lapse's look under way
        gateway.dispatcher.heartbeat_lapsed(3.0, settle_s=0.0)
        await stream.let_go_first()
        looks.answering = True
        await wait_for(lambda: stream.holds(1), what="a copy queued")
        await wait_for(lambda: not resender._looking and not resender._republishing, what="every look ended")
        assert await stream.holds(1)


async def test_a_look_at_a_missing_request_stream_tells_nothing(start_box, nats_server) -> None:
    """Review h204: nats-py raises NotFoundError for a stream that does not exist as for a message that is gone, so a
    lapse while the stream was missing (being made anew) took every request for let go, and their copies failed to
    publish into nothing: a 503. A missing stream tells nothing (None): `queue_lost` publishes them again once it is
    made anew."""
    gateway = await start_box(role="gateway", box_id="gw", default_model=False, models=[noop_model()])
    assert gateway.dispatcher is not None
    publisher = gateway.dispatcher._publisher
    nc = await nats.connect(nats_server.url)
    try:
        assert await publisher.queued(1, "r1") is False  # the stream is there; no such message: gone
        await nc.jetstream().delete_stream(bus.REQUEST_STREAM)
        assert await publisher.queued(1, "r1") is None
    finally:
        await nc.close()


async def test_a_request_published_as_the_heartbeat_came_back_and_let_go_is_published_again(start_box, http) -> None:
    """Tester h205: what a lapse looks at again was taken when the gateway's first heartbeat after it was written,
    but the boxes hear that heartbeat a moment later, and let go what they pull of the gateway's meanwhile: a request
    published in that moment was let go and never published again, a 504 at its deadline (4 of 4 runs of a 6 s
    freeze). What it awaits is taken once the boxes have heard it (`settle_s`). Here the worker's view is held at
    "gone" while the gateway's lapse settles and a request is published. Seen failing before: a 504."""
    settings: dict[str, Any] = {**_FAST_FLEET, "default_model": False, "models": [noop_model()]}
    worker = await start_box(role="worker", box_id="wk", **settings)
    gateway = await start_box(role="gateway", box_id="gw", **settings)
    assert gateway.dispatcher is not None and worker.fleet is not None
    heard = asyncio.Event()

    def cancelled() -> float:
        return worker.metrics.registry.get_sample_value("fbx_cancelled_requests_total", {"model": "noop"}) or 0.0

    worker.fleet.gateway_gone = lambda meta: not heard.is_set()  # the gateway's fresh heartbeat not heard yet
    gateway.dispatcher.heartbeat_lapsed(6.0, settle_s=1.0)  # its first heartbeat after a 6 s freeze written
    body = {"model": "noop", "input": "x", "timeout": 8}
    sent = asyncio.ensure_future(http.post(url(gateway, "/v1/embeddings"), json=body))
    try:
        await wait_for(lambda: cancelled() == 1.0, what="the request let go as its gateway's")
        heard.set()
        async with await asyncio.wait_for(sent, 15) as response:
            assert response.status == 200, await response.text()
    finally:
        heard.set()
        vars(worker.fleet).pop("gateway_gone", None)
        sent.cancel()


async def test_a_lapse_restarts_the_rates_admission_measures(start_box, monkeypatch) -> None:
    """Tester h205: after a freeze, the seconds frozen counted as seconds in which nothing was answered: each model's
    rate came out near nothing, and requests were refused 429 "would take about 101s to start" for a backlog
    cleared in 5 s. A lapse restarts the rates, as a cut from NATS does. Seen failing before: not restarted."""
    gateway = await start_box(role="gateway", box_id="gw", default_model=False, models=[noop_model()])
    assert gateway.dispatcher is not None
    admission = gateway.dispatcher._admission
    restarts: list[float] = []
    restart_rates = admission.restart_rates
    monkeypatch.setattr(admission, "restart_rates", lambda models=None: (restarts.append(1), restart_rates(models))[1])
    gateway.dispatcher.heartbeat_lapsed(6.0, settle_s=0.0)
    assert restarts == [1]


async def test_a_stopping_gateway_stops_publishing_again(start_box, http, nats_server) -> None:
    """Review h204 L4: a lapse's look loops (and a generation's wait for silence) went on through a box's stop, each
    until its request was no longer awaited; the box's stop now ends them before it answers what it awaits. Seen
    failing on the code before: the look loop still running after `abandon`."""
    async with _lapsed_with_a_request_queued(start_box, http, nats_server) as (gateway, looks, _, sent):
        resender = gateway.dispatcher._resender
        await wait_for(lambda: looks.count >= 1, what="the stream looked at")
        assert len(resender._republishes) == 1
        await gateway.dispatcher.abandon(ServiceUnavailable("box gw is stopping", retry_after_s=1))
        assert len(resender._republishes) == 0 and not resender._looking
        async with await asyncio.wait_for(sent, 20) as response:
            assert response.status == 503, await response.text()
