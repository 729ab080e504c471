"""A generation the model fails on: retried before any of its answer has left the box, dead-lettered
after `max_deliver` deliveries, and ended with an error chunk once part of it was streamed.

The queue, the boxes and the tiny random-weight generator are real; only the model's failure is
faked, by wrapping the loaded runtime's own `_prefill` or `_decode` in the box's process (a real
model fails this way on, say, an out-of-memory on one long prompt). A threading.Event in the wrapper
holds the device thread at one step until the test has put the other requests in place, so which
requests share that step is fixed, not left to timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import aiohttp
import nats
import orjson
import pytest
import torch
from nats.aio.msg import Msg

from appliance import bus
from appliance.envelope import ReplyMeta, RequestMeta
from appliance.generation_held import HeldGenerations
from appliance.generation_replies import GenerationReplies
from appliance.settings import ModelEntry
from runtimes.generate import GenerateRuntime
from tests.conftest import url, wait_for
from tests.test_generation_failover import MAX_TOKENS, PROMPT, greedy_text

MODEL = "tiny-llama"
POISON = "Alice"
OTHER = "Paris is the capital of France, and Berlin is"
_BOUND_S = 20.0  # the most the device thread is held at a step waiting for the test


async def generating_box(start_box, generator_dir, **settings):
    model = ModelEntry(name=MODEL, path=generator_dir, task="generate", pinned=True)
    box = await start_box(default_model=False, models=[model], **settings)
    return box, box.workers[MODEL]


def fail_prefill_of(runtime: GenerateRuntime, prompt: str, times: int | None = None) -> list[int]:
    """The runtime's prefill raises for any batch holding `prompt` (its first `times` times, or always).

    Returns the list each failure is recorded in (the size of the batch it struck), for the test to read.
    """
    poison = torch.as_tensor(runtime.tokenize([prompt])[0].ids)
    prefill, failures = runtime._prefill, []

    def failing_prefill(prompts, adapters, **kwargs):
        holds = any(len(p) == len(poison) and torch.equal(p.cpu(), poison) for p in prompts)
        if holds and (times is None or len(failures) < times):
            failures.append(len(prompts))
            raise RuntimeError("out of memory (injected)")
        return prefill(prompts, adapters, **kwargs)

    runtime._prefill = failing_prefill
    return failures


def completion(prompt: str, **fields) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}


async def answer_text(http, box, prompt: str) -> tuple[int, dict]:
    async with http.post(url(box, "/v1/completions"), json=completion(prompt)) as response:
        return response.status, await response.json()


async def settled(box, worker) -> None:
    """Nothing left held by the worker, unacked in the consumer or waiting in the queue."""

    async def empty() -> bool:
        info = await box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name(MODEL))
        return worker.held == 0 and info.num_ack_pending == 0 and info.num_pending == 0

    await wait_for(empty, what="every request settled")


def dead_lettered(box) -> float:
    return box.metrics.registry.get_sample_value("fbx_dead_lettered_requests_total", {"model": MODEL}) or 0.0


async def test_a_poison_prompt_is_dead_lettered_while_its_decode_batch_is_answered(
    start_box, http, generator_dir
) -> None:
    """Healthy decodes while the poison's prefill fails beside a healthy request joining with it: the split
    isolates the poison, which is retried, then kept in FBX_DLQ and answered 422 on its third delivery."""
    box, worker = await generating_box(start_box, generator_dir, max_deliver=3)
    failures = fail_prefill_of(worker.runtime, POISON)
    first_prefill, rest_queued = threading.Event(), threading.Event()
    prefill = worker.runtime._prefill

    def held_prefill(prompts, adapters, **kwargs):
        first_prefill.set()
        assert rest_queued.wait(_BOUND_S), "the test did not queue the other requests"
        return prefill(prompts, adapters, **kwargs)

    worker.runtime._prefill = held_prefill
    decoding = asyncio.create_task(answer_text(http, box, PROMPT))
    await wait_for(first_prefill.is_set, what="the first request's prefill")
    joining = asyncio.create_task(answer_text(http, box, OTHER))
    poison = asyncio.create_task(answer_text(http, box, POISON))
    await wait_for(lambda: len(worker._held.streams) == 3, what="the other two requests to wait for the next step")
    rest_queued.set()  # next step: the first decodes, the other two are prefilled together and split

    async with asyncio.timeout(30):
        (status_a, body_a), (status_b, body_b), (status_p, body_p) = await asyncio.gather(decoding, joining, poison)
    assert (status_a, status_b) == (200, 200), (body_a, body_b)
    assert body_a["choices"][0]["text"] == greedy_text(generator_dir)
    assert body_b["choices"][0]["text"] == greedy_text(generator_dir, OTHER)
    assert status_p == 422
    error = body_p["error"]
    assert error["code"] == "dead_lettered"
    assert "3 deliveries" in error["message"] and "FBX_DLQ" in error["message"] and "injected" in error["message"]
    assert failures == [2, 1, 1, 1]  # beside the joining request, then split down to the poison alone; 3 deliveries

    dead = await box.js.get_last_msg(bus.DEAD_LETTER_STREAM, bus.dead_letter_subject(bus.model_slug(MODEL)))
    assert "out of memory (injected)" in dead.headers["Fbx-Dead-Reason"]
    assert dead.headers["Fbx-Deliveries"] == "3"
    assert orjson.loads(dead.data)["prompt"] == POISON
    await settled(box, worker)
    assert dead_lettered(box) == 1


async def test_a_prefill_that_fails_once_is_retried_and_answered(start_box, http, generator_dir) -> None:
    box, worker = await generating_box(start_box, generator_dir, max_deliver=3)
    failures = fail_prefill_of(worker.runtime, OTHER, times=1)
    async with asyncio.timeout(30):
        status, body = await answer_text(http, box, OTHER)
    assert status == 200, body
    assert body["choices"][0]["text"] == greedy_text(generator_dir, OTHER)
    assert failures == [1]
    await settled(box, worker)
    assert dead_lettered(box) == 0
    assert (await box.js.stream_info(bus.DEAD_LETTER_STREAM)).state.messages == 0


async def test_a_failed_decode_step_ends_a_streamed_answer_with_an_error_and_answers_the_one_waiting(
    start_box, http, generator_dir
) -> None:
    """The decode step fails once, while one request has streamed chunks and another waits to join.

    The streamed one cannot start over (its client has part of the text): an error event, then [DONE],
    not a hang. The one waiting to join never ran: it joins at the next step and is answered whole,
    without spending a delivery.
    """
    box, worker = await generating_box(start_box, generator_dir, max_deliver=3)
    runtime = worker.runtime
    decode, streamed, second_queued, failed = runtime._decode, threading.Event(), threading.Event(), []

    def failing_decode():
        if not failed and any(stream.seq > 0 for stream in list(worker._held.streams.values())):
            streamed.set()
            assert second_queued.wait(_BOUND_S), "the test did not queue the second request"
            failed.append(1)
            raise RuntimeError("decode step failed (injected)")
        return decode()

    runtime._decode = failing_decode

    async def stream_events() -> list:
        body = completion(PROMPT, stream=True)
        async with http.post(url(box, "/v1/completions"), json=body) as response:
            assert response.status == 200
            raw = await response.text()
        return [line[len("data: ") :] for line in raw.split("\n\n") if line.startswith("data: ")]

    first = asyncio.create_task(stream_events())
    await wait_for(streamed.is_set, what="a chunk streamed, and the next decode step held")
    second = asyncio.create_task(answer_text(http, box, OTHER))
    await wait_for(lambda: len(worker._held.streams) == 2, what="the second request to wait for the next step")
    sample = box.metrics.registry.get_sample_value
    assert sample("fbx_generations", {"model": MODEL, "state": "running"}) == 1
    assert sample("fbx_generations", {"model": MODEL, "state": "waiting"}) == 1
    second_queued.set()

    async with asyncio.timeout(30):
        events, (status, body) = await asyncio.gather(first, second)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(event) for event in events[:-1]]
    assert chunks[0]["choices"][0]["text"]  # part of the answer had reached the client
    assert chunks[-1]["error"]["code"] == "internal_error" and "injected" in chunks[-1]["error"]["message"]
    assert status == 200, body
    assert body["choices"][0]["text"] == greedy_text(generator_dir, OTHER)
    assert failed == [1]
    await settled(box, worker)
    # The error event, after a 200 and the first chunks: counted and logged (tester h85: neither said it).
    assert sample("fbx_stream_errors_total", {"model": MODEL, "code": "internal_error"}) == 1
    assert sample("fbx_generations", {"model": MODEL, "state": "running"}) == 0
    assert not box.metrics.registry.get_sample_value("fbx_redelivered_requests_total", {"model": MODEL})


async def test_a_generation_whose_body_is_gone_is_dead_lettered_with_why(start_box, nats_server, generator_dir) -> None:
    """Its offloaded body cannot be read on any delivery: the worker itself dead-letters it and says why
    (JetStream's advisory would say only that no box finished it)."""
    box, worker = await generating_box(start_box, generator_dir, max_deliver=2)
    nc = await nats.connect(nats_server.url)
    try:
        replies: asyncio.Queue = asyncio.Queue()
        await nc.subscribe("test.replies", cb=replies.put)
        now = int(time.time() * 1000)
        meta = RequestMeta(id="gone-1", task="generate", model=MODEL, reply="test.replies", deadline_ms=now + 30_000,
                           sent_ms=now, blob="gone-1.never-put")  # fmt: skip
        await nc.jetstream().publish(bus.request_subject(bus.model_slug(MODEL)), b"", headers=meta.headers())
        reply = await asyncio.wait_for(replies.get(), 20)
        assert ReplyMeta.from_headers(reply.headers).status == 422
        assert orjson.loads(reply.data)["error"]["code"] == "dead_lettered"
        await reply.respond(b"")  # confirmed, as a gateway does: only then is the request settled
        dead = await box.js.get_last_msg(bus.DEAD_LETTER_STREAM, bus.dead_letter_subject(bus.model_slug(MODEL)))
        assert "gone-1.never-put" in dead.headers["Fbx-Dead-Reason"]
        await settled(box, worker)
        assert dead_lettered(box) == 1
    finally:
        await nc.close()


async def test_a_finished_generation_waiting_for_its_gateway_is_kept_not_generated_again(
    start_box, nats_server, generator_dir
) -> None:
    """Review h122: its last chunk awaiting the gateway's confirmation (a gateway reconnecting), a generation was no
    longer kept in progress, so JetStream delivered it again after `ack_wait`, and again, each time generated anew,
    until it was dead-lettered and its client told 422 for an answered request. Held past three `ack_wait`s, the
    final chunk is confirmed at last: the request was generated once, and is settled."""
    ack_wait_s = 2.0  # not 1: in-progress acks every 2/3 s, so only a stall of over 1.3 s (not 0.5 s) lets it lapse
    box, worker = await generating_box(start_box, generator_dir, ack_wait_s=ack_wait_s, max_deliver=3)
    nc = await nats.connect(nats_server.url)
    try:
        starts, finals, again, confirming = [], asyncio.Queue(), asyncio.Event(), asyncio.Event()

        async def gateway(msg) -> None:  # takes every chunk; a final one it leaves unconfirmed until told
            meta = ReplyMeta.from_headers(msg.headers)
            if meta.seq == 0:
                starts.append(meta.box)
                if len(starts) > 1:
                    again.set()
            if meta.final and confirming.is_set():
                await msg.respond(b"")
            elif meta.final:
                finals.put_nowait(msg)

        await nc.subscribe("test.replies", cb=gateway)
        now = int(time.time() * 1000)
        meta = RequestMeta(id="slow-gw-1", task="generate", model=MODEL, reply="test.replies",
                           deadline_ms=now + 60_000, sent_ms=now, tokens=5)  # fmt: skip
        body = orjson.dumps(completion(PROMPT))
        await nc.jetstream().publish(bus.request_subject(bus.model_slug(MODEL)), body, headers=meta.headers())
        await asyncio.wait_for(finals.get(), 20)
        with contextlib.suppress(TimeoutError):  # what the old code did within the first `ack_wait` or two
            await asyncio.wait_for(again.wait(), 3 * ack_wait_s)
        assert starts == [box.box_id], "generated again while its answer awaited its gateway"
        confirming.set()  # the next time the box sends it (it does until it is confirmed)
        await settled(box, worker)
        assert starts == [box.box_id] and dead_lettered(box) == 0
    finally:
        await nc.close()


async def test_a_dead_letter_whose_gateway_is_slow_to_take_the_error_is_kept_and_counted_once(
    start_box, nats_server, generator_dir
) -> None:
    """Review h132: a generation dead-lettered on its last delivery was kept in progress by nothing while its client
    was told (its gateway reconnecting): past the ack wait, JetStream's max-deliveries advisory had the fleet keep,
    tell and count it a second time. Its error here is left unconfirmed for three ack waits."""
    ack_wait_s = 2.0  # not 1: in-progress acks every 2/3 s, so only a stall of over 1.3 s (not 0.5 s) lets it lapse
    box, worker = await generating_box(start_box, generator_dir, ack_wait_s=ack_wait_s, max_deliver=1)
    fail_prefill_of(worker.runtime, POISON)
    nc = await nats.connect(nats_server.url)
    try:
        errors, confirming = asyncio.Queue(), asyncio.Event()

        async def gateway(msg) -> None:  # a final chunk (the error) left unconfirmed until told
            if confirming.is_set():
                await msg.respond(b"")
            errors.put_nowait(msg)

        advisories: list[object] = []

        async def advised(msg) -> None:
            advisories.append(msg)

        await nc.subscribe("test.replies", cb=gateway)
        await nc.subscribe(bus.max_deliveries_advisories(), cb=advised)
        now = int(time.time() * 1000)
        meta = RequestMeta(id="poison-slow-gw", task="generate", model=MODEL, reply="test.replies",
                           deadline_ms=now + 60_000, sent_ms=now, tokens=5)  # fmt: skip
        body = orjson.dumps(completion(POISON))
        await nc.jetstream().publish(bus.request_subject(bus.model_slug(MODEL)), body, headers=meta.headers())
        first = await asyncio.wait_for(errors.get(), 20)
        assert ReplyMeta.from_headers(first.headers).status == 422
        with contextlib.suppress(AssertionError):  # the advisory came after one ack wait in the old code
            await wait_for(lambda: bool(advisories), timeout_s=3 * ack_wait_s, what="an advisory")
        confirming.set()
        await settled(box, worker)
        assert advisories == [] and dead_lettered(box) == 1
        assert (await box.js.stream_info(bus.DEAD_LETTER_STREAM)).state.messages == 1
    finally:
        await nc.close()


@pytest.mark.parametrize("failing", ["prefill", "admission"])
async def test_a_drain_does_not_queue_afresh_a_generation_being_dead_lettered(
    start_box, nats_server, generator_dir, failing: str
) -> None:
    """Review h133: kept in progress while its client was told, a generation being dead-lettered was also among what
    a drain hands back: on its last delivery that queued a copy afresh, for `max_deliver` more tries of a request
    already in FBX_DLQ. Cut off by the drain, it is left to JetStream's max-deliveries advisory instead. Review h141:
    one whose admission failed (its body's blob gone) was dead-lettered while still among those being admitted,
    which a drain hands back too."""
    box, worker = await generating_box(start_box, generator_dir, ack_wait_s=60, max_deliver=1, shutdown_grace_s=0.2)
    fail_prefill_of(worker.runtime, POISON)
    nc = await nats.connect(nats_server.url)
    try:
        errors: asyncio.Queue = asyncio.Queue()
        await nc.subscribe("test.replies", cb=errors.put)  # a gateway that never confirms the error
        now = int(time.time() * 1000)
        meta = RequestMeta(id="poison-drained", task="generate", model=MODEL, reply="test.replies",
                           deadline_ms=now + 60_000, sent_ms=now, tokens=5,
                           blob="never-put" if failing == "admission" else None)  # fmt: skip
        body = orjson.dumps(completion(POISON)) if failing == "prefill" else b""
        await nc.jetstream().publish(bus.request_subject(bus.model_slug(MODEL)), body, headers=meta.headers())
        await asyncio.wait_for(errors.get(), 20)  # being told: its dead letter kept
        assert "poison-drained" in worker._held.retrying
        await worker.drain()
        info = await box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name(MODEL))
        assert (info.num_pending, info.num_ack_pending) == (0, 1)  # no copy queued; the original left unsettled
        assert (await box.js.stream_info(bus.DEAD_LETTER_STREAM)).state.messages == 1
    finally:
        await nc.close()


async def test_a_chunk_that_cannot_be_sent_fails_its_request_alone_and_stepping_goes_on(
    start_box, http, generator_dir
) -> None:
    """The first chunk's send raises (nats-py's outbound buffer full during a reconnect, say; faked by
    wrapping the worker's own `_replies.reply`): nothing of that answer left the box, so it is retried and
    answered whole, instead of held for ever with the stepping stopped; the next request is answered."""
    from nats.errors import OutboundBufferLimitError

    box, worker = await generating_box(start_box, generator_dir)
    reply, calls = worker._replies.reply, []

    async def flaky(meta, reply_meta, body, *, confirmed=False):
        calls.append(reply_meta.seq)
        if len(calls) == 1:
            raise OutboundBufferLimitError()
        return await reply(meta, reply_meta, body, confirmed=confirmed)

    worker._replies.reply = flaky
    async with asyncio.timeout(30):
        status, body = await answer_text(http, box, PROMPT)
        assert status == 200 and body["choices"][0]["text"] == greedy_text(generator_dir, PROMPT), body
        assert not worker._stepper.done()
        status, body = await answer_text(http, box, OTHER)
    assert status == 200 and body["choices"][0]["text"] == greedy_text(generator_dir, OTHER)
    assert calls[:2] == [0, 0]  # the first chunk, then the retry's first chunk
    await settled(box, worker)


async def test_a_worker_whose_stepping_dies_lets_its_requests_go_to_another_box(start_box, http, generator_dir) -> None:
    """A bug ends the stepping task (faked: `_drop_expired` raises once a request is held). The worker
    must stop keeping that request in progress and stop pulling, so JetStream hands it to a box that
    can answer after `ack_wait`, instead of the box holding it until its deadline."""
    first, worker = await generating_box(start_box, generator_dir, ack_wait_s=1.0)

    def broken() -> None:
        if worker._held.streams:
            raise RuntimeError("stepping bug (injected)")

    worker._decoding._drop_expired = broken
    asking = asyncio.create_task(answer_text(http, first, OTHER))
    await wait_for(lambda: worker._stepper.done(), what="the stepping task to die")
    await generating_box(start_box, generator_dir, ack_wait_s=1.0)  # a second box that can answer
    async with asyncio.timeout(30):
        status, body = await asking
    assert status == 200 and body["choices"][0]["text"] == greedy_text(generator_dir, OTHER)


def hold_decoding_once_a_chunk_is_sent(worker) -> tuple[threading.Event, threading.Event]:
    """The worker's next decode step after a chunk was sent waits (on the device thread) until the test sets the
    second event; the first is set when it starts waiting: the generation is held mid-answer."""
    runtime = worker.runtime
    decode, streamed, asked = runtime._decode, threading.Event(), threading.Event()

    def held_decode():
        if not asked.is_set() and any(stream.seq > 0 for stream in list(worker._held.streams.values())):
            streamed.set()
            assert asked.wait(_BOUND_S), "the test did not ask for the hand-back"
        return decode()

    runtime._decode = held_decode
    return streamed, asked


async def test_a_box_asked_to_hand_a_generation_back_stops_and_it_is_generated_again(
    start_box, nats_server, http, generator_dir
) -> None:
    """A gateway that lost a chunk of a streamed answer asks the box generating it to hand it back (a request on the
    cancel subject naming the box, `again`): the box stops it, says so, and naks its message; it is generated again
    from the start (here by the same box, the only one) and the client's stream carries on from the text it had. A
    box asked for a generation it does not hold says so."""
    box, worker = await generating_box(start_box, generator_dir)
    streamed, asked = hold_decoding_once_a_chunk_is_sent(worker)

    async def stream_events() -> list:
        async with http.post(url(box, "/v1/completions"), json=completion(PROMPT, stream=True)) as response:
            assert response.status == 200
            raw = await response.text()
        return [orjson.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")]

    events = asyncio.create_task(stream_events())
    await wait_for(streamed.is_set, what="a chunk streamed, and the next decode step held")
    (request_id,) = worker._held.streams
    nc = await nats.connect(nats_server.url)
    try:
        ask = {"id": request_id, "box": box.box_id, "again": True}
        answer = await nc.request(bus.cancel_subject(), orjson.dumps(ask), timeout=5)
        assert orjson.loads(answer.data) == {"handed_back": True, "publish_again": False}
        assert request_id not in worker._held.streams
        asked.set()
        elsewhere = await nc.request(bus.cancel_subject(), orjson.dumps({**ask, "id": "not-held"}), timeout=5)
        assert orjson.loads(elsewhere.data) == {"handed_back": False, "publish_again": False}
    finally:
        await nc.close()
    async with asyncio.timeout(30):
        chunks = await events
    assert not any("error" in chunk for chunk in chunks), chunks
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == greedy_text(generator_dir)
    await settled(box, worker)
    assert box.metrics.registry.get_sample_value("fbx_redelivered_requests_total", {"model": MODEL}) == 1


async def test_a_generation_on_its_last_delivery_is_not_handed_back(
    start_box, nats_server, http, generator_dir
) -> None:
    """Review r50: handed back on its `max_deliver`-th delivery, a generation was dead-lettered, its client told 422
    `dead_lettered` (blaming the request) for a lost chunk. The box says no: the gateway answers 503 `chunk_lost`."""
    box, worker = await generating_box(start_box, generator_dir, max_deliver=1)
    streamed, asked = hold_decoding_once_a_chunk_is_sent(worker)
    answer = asyncio.create_task(http.post(url(box, "/v1/completions"), json=completion(PROMPT, stream=True)))
    await wait_for(streamed.is_set, what="a chunk streamed, and the next decode step held")
    (request_id,) = worker._held.streams
    nc = await nats.connect(nats_server.url)
    try:
        ask = {"id": request_id, "box": box.box_id, "again": True}
        reply = await nc.request(bus.cancel_subject(), orjson.dumps(ask), timeout=5)
        assert orjson.loads(reply.data) == {"handed_back": False, "publish_again": False}
        assert request_id in worker._held.streams  # still generating it
    finally:
        asked.set()
        await nc.close()
    async with asyncio.timeout(30), await answer as response:
        assert response.status == 200
        await response.read()
    await settled(box, worker)


async def test_a_client_gone_mid_stream_is_no_server_error(start_box, generator_dir, http, monkeypatch, caplog) -> None:
    """Tester h70: a write after the client hung up (aiohttp's ClientConnectionResetError, 'Cannot write to closing
    transport', raised when it comes before the handler's cancel) was logged as an unhandled error and counted a
    500. The write that meets the closed connection is made to raise just that, at the second event."""
    from aiohttp import ClientConnectionResetError

    from appliance.gateway import generation

    box, _ = await generating_box(start_box, generator_dir)
    send, events = generation._event, []

    async def closing_event(response, payload):
        events.append(payload)
        if len(events) == 2:
            raise ClientConnectionResetError("Cannot write to closing transport")
        await send(response, payload)

    monkeypatch.setattr(generation, "_event", closing_event)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stream": True}
    with caplog.at_level(logging.WARNING):
        async with http.post(url(box, "/v1/completions"), json=body) as response:
            assert response.status == 200
            await response.read()
    route = {"route": "/v1/completions"}
    sample = box.metrics.registry.get_sample_value
    assert sample("fbx_http_requests_total", route | {"status": "499"}) == 1
    assert sample("fbx_http_requests_total", route | {"status": "500"}) is None
    assert not [r for r in caplog.records if r.message == "unhandled error"]
    await wait_for(lambda: not box.workers[MODEL].runtime.has_work, what="the generation to stop")


async def test_a_client_gone_before_the_stream_opens_is_no_server_error(
    start_box, generator_dir, http, monkeypatch, caplog
) -> None:
    """Tester h224: a client that dropped its stream just before the first event made the headers' write raise
    ClientConnectionResetError in `_open`, logged as an unhandled error and counted a 500 (43 of 80 streams dropped
    at once). The headers' write is made to raise just that, once they are written."""
    from aiohttp import ClientConnectionResetError, web

    box, _ = await generating_box(start_box, generator_dir)
    prepare = web.StreamResponse.prepare

    async def closing_prepare(self, request):
        writer = await prepare(self, request)
        if self.content_type == "text/event-stream":
            raise ClientConnectionResetError("Cannot write to closing transport")
        return writer

    monkeypatch.setattr(web.StreamResponse, "prepare", closing_prepare)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stream": True}
    with caplog.at_level(logging.WARNING):
        async with http.post(url(box, "/v1/completions"), json=body) as response:
            with contextlib.suppress(aiohttp.ClientPayloadError):  # the stream is ended as the client is taken gone
                await response.read()
    route = {"route": "/v1/completions"}
    sample = box.metrics.registry.get_sample_value
    assert sample("fbx_http_requests_total", route | {"status": "499"}) == 1
    assert sample("fbx_http_requests_total", route | {"status": "500"}) is None
    assert not [r for r in caplog.records if r.message == "unhandled error"]
    await wait_for(lambda: not box.workers[MODEL].runtime.has_work, what="the generation to stop")


async def test_a_client_that_hangs_up_is_counted_499(start_box, generator_dir) -> None:
    """Tester h74: a client gone mid-stream cancels its handler, and the request was counted under no status at
    all (api.md says 499). The stream is cut after its first event, as an impatient client does."""
    box, worker = await generating_box(start_box, generator_dir)
    entered, release = threading.Event(), threading.Event()
    decode = worker.runtime._decode

    def held_decode():
        entered.set()
        release.wait(20)
        return decode()

    worker.runtime._decode = held_decode
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0, "stream": True}
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url(box, "/v1/completions"), json=body) as response:
                assert response.status == 200
                await wait_for(entered.is_set, what="the generation to hold its first decode step")
        sample = box.metrics.registry.get_sample_value
        route = {"route": "/v1/completions", "status": "499"}
        await wait_for(lambda: sample("fbx_http_requests_total", route) == 1, what="the hang-up counted 499")
    finally:
        release.set()


async def test_a_queued_generation_its_gateway_cancelled_as_expired_is_counted_expired(
    start_box, nats_server, generator_dir
) -> None:
    """Review h145: the gateway cancels a generation whose deadline passed with `expired`, but a box that had not
    pulled it yet (it waited in FBX_REQ, the usual way a generation times out under load) kept only the id, and
    counted it in fbx_cancelled_requests_total as a client gone when it pulled it later."""
    box, _ = await generating_box(start_box, generator_dir)

    def count(name: str) -> float:
        return box.metrics.registry.get_sample_value(f"{name}_total", {"model": MODEL}) or 0.0

    nc = await nats.connect(nats_server.url)
    try:
        await nc.publish(bus.cancel_subject(), orjson.dumps({"id": "timed-out-in-queue", "why": "expired"}))
        await wait_for(lambda: box.workers._cancelled.contains("timed-out-in-queue"), what="the cancel heard")
        now = int(time.time() * 1000)  # then pulled, a decode slot free: its deadline passed, as at its gateway
        meta = RequestMeta(
            id="timed-out-in-queue", task="generate", model=MODEL, reply="test.replies", deadline_ms=now - 10,
            sent_ms=now - 500, tokens=5,
        )  # fmt: skip
        subject = bus.request_subject(bus.model_slug(MODEL))
        await nc.jetstream().publish(subject, orjson.dumps(completion("hi")), headers=meta.headers())
        await wait_for(lambda: count("fbx_expired_requests") + count("fbx_cancelled_requests") >= 1, what="a drop")
        assert (count("fbx_expired_requests"), count("fbx_cancelled_requests")) == (1, 0)
    finally:
        await nc.close()


def test_a_generation_being_dead_lettered_is_known_as_the_workers_own() -> None:
    """Review h145: a request being given another try or dead-lettered (`retrying`) was not known as the worker's own,
    so a copy of it published again after the queue was lost was taken in afresh and generated beside its dead
    letter. The copy takes the original's place instead (and is given another delivery once that ends)."""
    held = HeldGenerations()
    original, copy = Msg(_client=None), Msg(_client=None)  # type: ignore[arg-type]
    held.retrying["r"] = original
    assert held.copy_of("r") is original
    held.take_copy("r", copy)
    assert held.retrying["r"] is copy and held.copy_of("r") is copy


class _SettledMsg:
    """A message that records how it was settled: the copy below is judged by what the worker does with it."""

    def __init__(self) -> None:
        self.metadata = SimpleNamespace(num_delivered=5)
        self.settled: list[str] = []

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.settled.append("nak")


@pytest.mark.parametrize("dead_lettered", [True, False])
async def test_the_copy_that_took_a_dead_lettered_generations_place_is_settled_with_it(dead_lettered: bool) -> None:
    """Review h147: a copy of a request (published again after the queue was lost) that took the original's place
    while it was dead-lettered was nak'd afterwards: a request in FBX_DLQ, its client told 422, generated again for
    nobody. It is acked where the original was dead-lettered, and nak'd (the other try the original's nak, sent to
    the lost stream, could not give) where it was not. The dead-lettering is played by a stand-in: the real one,
    with a NATS restart in the middle of it, is what this bookkeeping guards against."""
    held, copy = HeldGenerations(), _SettledMsg()

    class DeadLettering:
        async def retry_or_dead_letter(
            self, meta: RequestMeta, msg: object, error: Exception, *, stopping: Callable[[], bool]
        ) -> bool:
            held.take_copy(meta.id, copy)  # what the intake does with the copy that arrives meanwhile
            return dead_lettered

    spawned: list = []
    replies = GenerationReplies(
        "box", None, None, DeadLettering(), held,  # type: ignore[arg-type]
        local_reply=None, hand_back=None, stopping=lambda: False,  # type: ignore[arg-type]
        spawn=spawned.append, poke=lambda: None,
    )  # fmt: skip
    meta = RequestMeta(id="r", task="generate", model=MODEL, reply="x", deadline_ms=0, sent_ms=0, tokens=1)
    await replies.retry_or_dead_letter(meta, _SettledMsg(), RuntimeError("the model raised"))  # type: ignore[arg-type]
    for settle in spawned:
        await settle
    assert copy.settled == (["ack"] if dead_lettered else ["nak"])
    assert "r" not in held.retrying


async def test_a_request_the_model_gives_no_finite_logits_is_answered_an_error_and_its_batch_is_answered(
    start_box, http, generator_dir
) -> None:
    """One row of a decode step all nan (faked by wrapping the loaded runtime's `_decode`; a broken half-precision model
    makes them): answered token 0, that request was a 200 with garbage text. It ends with an error saying why, after
    the chunks it had sent (a 500, as any generation the model fails on after part of it left the box); the request
    decoding beside it is answered whole."""
    box, worker = await generating_box(start_box, generator_dir, max_deliver=1)
    runtime = worker.runtime
    poison = torch.as_tensor(runtime.tokenize([POISON])[0].ids)
    decode, prefill, poisoned = runtime._decode, runtime._prefill, []
    first_prefill, rest_queued = threading.Event(), threading.Event()

    def held_prefill(prompts, adapters, **kwargs):
        first_prefill.set()
        assert rest_queued.wait(_BOUND_S), "the test did not queue the other request"
        return prefill(prompts, adapters, **kwargs)

    def nan_decode():
        logits = decode()
        for row, request in enumerate(runtime._rows):
            is_poison = len(request.prompt) == len(poison) and torch.equal(request.prompt.cpu(), poison)
            stream = worker._held.streams.get(request.request_id)
            if is_poison and stream is not None and stream.seq > 0 and not poisoned:  # part of its text has left
                logits[row] = float("nan")
                poisoned.append(len(runtime._rows))  # the size of the batch it struck
        return logits

    runtime._prefill, runtime._decode = held_prefill, nan_decode
    decoding = asyncio.create_task(answer_text(http, box, PROMPT))
    await wait_for(first_prefill.is_set, what="the first request's prefill")
    culprit = asyncio.create_task(answer_text(http, box, POISON))
    await wait_for(lambda: len(worker._held.streams) == 2, what="the other request to wait for the next step")
    rest_queued.set()

    async with asyncio.timeout(30):
        (status, body), (status_p, body_p) = await asyncio.gather(decoding, culprit)
    assert poisoned == [2]
    assert status == 200 and body["choices"][0]["text"] == greedy_text(generator_dir), body
    assert status_p == 500, body_p
    assert body_p["error"]["code"] == "internal_error"
    assert "no finite logits" in body_p["error"]["message"] and "check the model's files" in body_p["error"]["message"]
    await settled(box, worker)


async def test_a_request_given_no_finite_logits_before_any_chunk_is_retried_then_dead_lettered_with_why(
    start_box, http, generator_dir
) -> None:
    """Its prefill's logits all inf (faked by wrapping the loaded runtime's `_prefill`): nothing of it left the box,
    so it goes the way of any request the model fails on there, tried again (another box may serve the model in
    another dtype), then dead-lettered, its client told why."""
    box, worker = await generating_box(start_box, generator_dir, max_deliver=2)
    runtime = worker.runtime
    poison = torch.as_tensor(runtime.tokenize([POISON])[0].ids)
    prefill, poisoned = runtime._prefill, []

    def inf_prefill(prompts, adapters, **kwargs):
        batch, logits = prefill(prompts, adapters, **kwargs)
        for row, prompt in enumerate(prompts):
            if len(prompt) == len(poison) and torch.equal(prompt.cpu(), poison):
                logits[row] = float("inf")
                poisoned.append(row)
        return batch, logits

    runtime._prefill = inf_prefill
    async with asyncio.timeout(30):
        status, body = await answer_text(http, box, POISON)
    assert poisoned == [0, 0]  # both deliveries
    assert status == 422 and body["error"]["code"] == "dead_lettered", body
    assert "no finite logits" in body["error"]["message"] and "check the model's files" in body["error"]["message"]
    async with asyncio.timeout(30):
        status, body = await answer_text(http, box, PROMPT)
    assert status == 200 and body["choices"][0]["text"] == greedy_text(generator_dir), body
    await settled(box, worker)
