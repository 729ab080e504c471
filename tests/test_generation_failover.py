"""A box that dies mid-answer while generating: the request is redelivered, another box generates it
again from the start, and the client still gets one whole, right answer (or, where the two answers
cannot agree, a clear error instead of a hang).

The dying box is played by a bare JetStream consumer: it takes the request, sends the first chunks
the way a worker does, and never acks, exactly what a box killed mid-answer leaves behind.
"""

from __future__ import annotations

import asyncio
import logging
import shutil

import nats
import orjson
import pytest

from appliance import bus
from appliance.envelope import ReplyMeta, RequestMeta
from appliance.settings import ModelEntry
from tests.conftest import url, wait_for

PROMPT = "The quick brown fox"
MAX_TOKENS = 12


def greedy_text(folder, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS) -> str:
    """What the tiny generator answers to `prompt` with greedy decoding, straight from transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)[0, len(ids) :].tolist()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tokenizer.decode(out[: out.index(eos)] if eos in out else out)


async def a_box_dies_mid_answer(nats_url: str, chunks: list[str], seqs: list[int] | None = None) -> None:
    """Take the one queued generation request, send `chunks` of it as box "dead-box", never ack."""
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.jetstream().pull_subscribe_bind(bus.consumer_name("tiny-llama"), stream=bus.REQUEST_STREAM)
        (msg,) = await sub.fetch(1, timeout=10)
        meta = RequestMeta.from_headers(msg.headers)
        for seq, text in zip(seqs or range(len(chunks)), chunks, strict=True):
            reply = ReplyMeta(id=meta.id, status=200, box="dead-box", seq=seq, final=seq == (seqs or [-1])[-1])
            await nc.publish(meta.reply, orjson.dumps({"text": text}), headers=reply.headers())
        await nc.flush()
    finally:
        await nc.close()


async def generate_through_a_failover(start_box, nats_server, http, generator_dir, *, stream: bool, chunks: list[str]):
    """A gateway box; the request is taken by a dying box; then a worker box joins and takes it over."""
    model = ModelEntry(name="tiny-llama", path=generator_dir, task="generate", pinned=True)
    common = {"default_model": False, "models": [model], "ack_wait_s": 1.0}
    gateway = await start_box(role="gateway", box_id="gateway", **common)
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    answer = asyncio.create_task(http.post(url(gateway, "/v1/completions"), json=body))
    await a_box_dies_mid_answer(nats_server.url, chunks)
    await start_box(role="worker", box_id="survivor", **common)  # gets the request again after ack_wait_s
    async with await answer as response:
        assert response.status == 200
        if not stream:
            return (await response.json())["choices"][0]["text"]
        raw = await response.text()
    events = [line[len("data: ") :] for line in raw.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [orjson.loads(event) for event in events[:-1]]


async def test_a_whole_answer_is_taken_from_the_box_that_finished_it(start_box, nats_server, http, generator_dir):
    text = await generate_through_a_failover(start_box, nats_server, http, generator_dir, stream=False,
                                             chunks=["half an answer from a box that died"])  # fmt: skip
    assert text == greedy_text(generator_dir)


async def test_a_stream_carries_on_where_the_dead_box_stopped(start_box, nats_server, http, generator_dir):
    """Greedy decoding gives the same text on the new box: the client sees one unbroken answer."""
    expected = greedy_text(generator_dir)
    assert len(expected) >= 4
    sent = [expected[:2], expected[2:4]]
    events = await generate_through_a_failover(start_box, nats_server, http, generator_dir, stream=True, chunks=sent)
    assert not any("error" in event for event in events)
    assert "".join(event["choices"][0]["text"] for event in events) == expected
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


async def test_a_stream_that_cannot_be_carried_on_ends_with_a_clear_error(start_box, nats_server, http, generator_dir):
    """What the dead box sent is not how the new answer starts: no stitching, an error event, no hang."""
    events = await generate_through_a_failover(start_box, nats_server, http, generator_dir, stream=True,
                                               chunks=["\x00not this"])  # fmt: skip
    assert events[0]["choices"][0]["text"] == "\x00not this"
    assert events[-1]["error"]["code"] == "generation_restarted"


async def test_a_streamed_answer_with_a_lost_chunk_is_an_error_not_a_shorter_one(
    start_box, nats_server, http, generator_dir
):
    """Chunks 0 and 2 arrive, 1 never does (lost in a NATS failover), and 2 is the last: its box has finished and
    settled the request, so nothing can generate it again: no answer with a hole in it, an error event at once."""
    model = ModelEntry(name="tiny-llama", path=generator_dir, task="generate", pinned=True)
    gateway = await start_box(role="gateway", box_id="gateway", default_model=False, models=[model])
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    answer = asyncio.create_task(http.post(url(gateway, "/v1/completions"), json=body))
    await a_box_dies_mid_answer(nats_server.url, ["one ", "three"], seqs=[0, 2])
    async with await answer as response:
        events = [line[len("data: ") :] for line in (await response.text()).split("\n\n") if line.startswith("data: ")]
    assert [orjson.loads(event)["choices"][0]["text"] for event in events[:1]] == ["one "]
    assert orjson.loads(events[-2])["error"]["code"] == "chunk_lost" and events[-1] == "[DONE]"


@pytest.mark.parametrize("box_gone", [False, True], ids=["finished", "gone"])
async def test_a_whole_answer_with_a_lost_chunk_is_made_again(
    start_box, nats_server, http, generator_dir, box_gone, caplog
):
    """Tester h86: a non-streamed generation whose chunk was lost in a NATS restart, its box finished (or gone, not
    answering the ask to hand it back), was a 503 `chunk_lost`, though nothing had reached its client. The gateway
    publishes it again under a new id, and a box makes the whole answer."""
    caplog.set_level(logging.INFO, logger="appliance.gateway.generation")
    model = ModelEntry(name="tiny-llama", path=generator_dir, task="generate", pinned=True)
    common = {"default_model": False, "models": [model]}
    gateway = await start_box(role="gateway", box_id="gateway", **common)
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "timeout": 60}
    answer = asyncio.create_task(http.post(url(gateway, "/v1/completions"), json=body))
    chunks, seqs = (["one ", "three", "four"], [0, 2, 3]) if box_gone else (["one ", "three"], [0, 2])
    await a_box_dies_mid_answer(nats_server.url, chunks, seqs=seqs)
    await start_box(role="worker", box_id="worker", **common)
    async with asyncio.timeout(40), await answer as response:
        assert response.status == 200, await response.text()
        assert (await response.json())["choices"][0]["text"] == greedy_text(generator_dir)
    assert "generation published again: a chunk was lost" in caplog.text


async def test_a_draining_generator_finishes_its_answers_and_acks_them(start_box, http, generator_dir) -> None:
    """Drain waits for the active generation, then for its final chunk to be confirmed and the request acked:
    an answer cut off there would be left unacked, and another box would generate it all over again."""
    model = ModelEntry(name="tiny-llama", path=generator_dir, task="generate", pinned=True)
    common = {"default_model": False, "models": [model]}
    gateway = await start_box(role="gateway", box_id="gateway", **common)
    worker_box = await start_box(role="worker", box_id="worker", **common)
    worker = worker_box.workers["tiny-llama"]
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    taken, on_message = asyncio.Event(), worker.puller._on_message

    def seen_taken(msg) -> None:  # the moment the worker holds it: a poll could miss an answer of milliseconds
        on_message(msg)
        taken.set()

    worker.puller._on_message = seen_taken
    answer = asyncio.create_task(http.post(url(gateway, "/v1/completions"), json=body))
    await asyncio.wait_for(taken.wait(), 20)
    await worker.drain()
    async with await answer as response:
        assert response.status == 200
        assert (await response.json())["choices"][0]["text"] == greedy_text(generator_dir)

    async def acked() -> bool:  # an ack is a plain publish, applied on the consumer's own queue: read once it is
        info = await worker_box.js.consumer_info(bus.REQUEST_STREAM, bus.consumer_name("tiny-llama"))
        return info.num_ack_pending == 0 and info.num_pending == 0

    await wait_for(acked, timeout_s=5.0, what="the request acked")  # well within its 10 s ack wait


async def test_sampling_a_request_leaves_out_is_the_models_own(start_box, http, generator_dir, tmp_path) -> None:
    """A model whose generation_config.json says temperature 0 answers greedily when the request names none,
    as vLLM does."""
    folder = tmp_path / "greedy-by-default"
    shutil.copytree(generator_dir, folder)
    config = orjson.loads((folder / "generation_config.json").read_bytes())
    (folder / "generation_config.json").write_bytes(orjson.dumps(config | {"temperature": 0.0}))
    model = ModelEntry(name="tiny-llama", path=folder, task="generate", pinned=True)
    box = await start_box(default_model=False, models=[model])
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS}
    for _ in range(2):
        async with http.post(url(box, "/v1/completions"), json=body) as response:
            assert (await response.json())["choices"][0]["text"] == greedy_text(generator_dir)


async def a_chunk_lost_then_handed_back(start_box, nats_server, http, generator_dir, *, queue_lost: bool):
    """A gateway box; "lossy-box" takes the request and its chunk 1 never reaches the gateway (chunk 2 does, not its
    last); asked to hand the request back, it does (a nak), or, with `queue_lost`, says its message went with the
    request stream (deleted meanwhile, as a restart of a nats-server without --durable loses it): publish it again.
    Then a worker box joins. The events of the streamed answer, and the text expected."""
    expected = greedy_text(generator_dir)
    assert len(expected) >= 6
    model = ModelEntry(name="tiny-llama", path=generator_dir, task="generate", pinned=True)
    common = {"default_model": False, "models": [model]}
    gateway = await start_box(role="gateway", box_id="gateway", **common)
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    answer = asyncio.create_task(http.post(url(gateway, "/v1/completions"), json=body))
    nc = await nats.connect(nats_server.url)
    asked: asyncio.Queue = asyncio.Queue()
    try:
        sub = await nc.jetstream().pull_subscribe_bind(bus.consumer_name("tiny-llama"), stream=bus.REQUEST_STREAM)
        (msg,) = await sub.fetch(1, timeout=10)
        meta = RequestMeta.from_headers(msg.headers)

        async def hand_back(cancel) -> None:
            if orjson.loads(cancel.data) == {"id": meta.id, "box": "lossy-box", "again": True}:
                if not queue_lost:
                    await msg.nak()
                await cancel.respond(orjson.dumps({"handed_back": True, "publish_again": queue_lost}))
                asked.put_nowait(cancel)

        async def made_again() -> bool:
            try:
                await gateway.js.stream_info(bus.REQUEST_STREAM)
            except nats.js.errors.NotFoundError:
                return False
            return True

        await nc.subscribe(bus.cancel_subject(), cb=hand_back)
        for seq, text in ((0, expected[:2]), (2, expected[4:6])):  # chunk 1 never arrives
            reply = ReplyMeta(id=meta.id, status=200, box="lossy-box", seq=seq, final=False)
            await nc.publish(meta.reply, orjson.dumps({"text": text}), headers=reply.headers())
            if seq == 0 and queue_lost:
                await gateway.js.delete_stream(bus.REQUEST_STREAM)  # the gateway's box makes it again
                await wait_for(made_again, what="the request stream made again")
        await asyncio.wait_for(asked.get(), 10)
    finally:
        await nc.close()
    await start_box(role="worker", box_id="survivor", **common)  # pulls it at once: it was handed back
    async with asyncio.timeout(15), await answer as response:
        assert response.status == 200
        raw = await response.text()
    return [orjson.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")], expected


@pytest.mark.parametrize("queue_lost", [False, True])
async def test_a_stream_that_lost_a_chunk_while_its_box_generates_is_generated_again(
    start_box, nats_server, http, generator_dir, queue_lost: bool
):
    """Chunk 1 is lost in transit (a NATS failover) while its box still generates the answer: the gateway asks that
    box to hand the request back, and the box that pulls it next starts the answer over, replayed as after a box
    death: the client gets one unbroken answer, where it got a 503 `chunk_lost`. With `queue_lost` (tester h85): a
    restart of an embedded nats-server had taken the request's message with the old stream, so the nak brought
    nothing back, and the client had the 503 after 20 s; the box says so, and the gateway publishes it again."""
    events, expected = await a_chunk_lost_then_handed_back(
        start_box, nats_server, http, generator_dir, queue_lost=queue_lost
    )
    assert not any("error" in event for event in events), events
    assert "".join(event["choices"][0]["text"] for event in events) == expected


async def test_a_lost_chunk_whose_box_does_not_hand_it_back_is_an_error(start_box, nats_server, http, generator_dir):
    """Chunk 1 is lost while its box generates, and the box does not answer the gateway's ask to hand the request
    back (it is gone): the client is told the chunk was lost, within the ask's bound, not left to its deadline."""
    model = ModelEntry(name="tiny-llama", path=generator_dir, task="generate", pinned=True)
    gateway = await start_box(role="gateway", box_id="gateway", default_model=False, models=[model])
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "timeout": 60}
    answer = asyncio.create_task(http.post(url(gateway, "/v1/completions"), json=body | {"stream": True}))
    await a_box_dies_mid_answer(nats_server.url, ["one ", "three", "four"], seqs=[0, 2, 3])
    async with asyncio.timeout(20), await answer as response:
        assert response.status == 200  # chunk 0 was sent on: the error is the stream's last event
        assert '"code":"chunk_lost"' in (await response.text()).replace(" ", "")


async def test_a_generation_begun_by_a_box_that_died_with_a_lost_queue_is_published_again(
    start_box, nats_server, http, generator_dir
) -> None:
    """Tester h190: the box of the embedded nats-server killed (memory storage: the queue lost with it) while it
    generated answers for another box's clients: no box held them, no stream kept them, and they waited their whole
    deadline (3 of 3). A begun generation is its box's to finish from the copy in hand, so the gateway publishes it
    again only once its answer has been silent for `ack_wait_s` since the queue was lost."""
    model = ModelEntry(name="tiny-llama", path=generator_dir, task="generate", pinned=True)
    common = {"default_model": False, "models": [model], "ack_wait_s": 1.0}
    gateway = await start_box(role="gateway", box_id="gateway", **common)
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "timeout": 25}
    answer = asyncio.create_task(http.post(url(gateway, "/v1/completions"), json=body))
    await a_box_dies_mid_answer(nats_server.url, ["half an answer from a box that died with the queue"])
    await wait_for(
        lambda: any(s.box == "dead-box" for s in gateway.dispatcher._waiters._streams.values()), what="chunk 0"
    )
    await nats_server.stop()
    await nats_server.start()  # memory storage: the message the dead box held is gone with the stream

    async def queued() -> bool:
        try:
            return (await gateway.js.stream_info(bus.REQUEST_STREAM)).state.messages == 1
        except Exception:  # cut off from NATS, or the stream not made again yet
            return False

    await wait_for(queued, timeout_s=20, what="the begun generation published again in the new queue")
    await start_box(role="worker", box_id="survivor", **common)
    async with await answer as response:
        assert response.status == 200, await response.text()
        assert (await response.json())["choices"][0]["text"] == greedy_text(generator_dir)
