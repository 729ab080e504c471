"""A generation request from the moment a box pulls it until it joins the decode batch (its admission: the body
fetched, its LoRA adapter loaded, its prompt rendered): kept in progress however long that takes, so JetStream never
hands it to a second box meanwhile.

The queue, the boxes, the tiny random-weight generator and its adapter are real; the adapter's load is held
(`tests.conftest.hold`, the real load runs once let go) to stand for a slow one, say behind other loads of the
same base, which run one at a time.
"""

from __future__ import annotations

import asyncio

from appliance.settings import ModelEntry
from tests.conftest import deliveries, hold, in_progress_acks, url, wait_for
from tests.test_generation_failover import MAX_TOKENS, PROMPT

MODEL = "tiny-llama"
ADAPTER = f"{MODEL}:lora"
# 2 s, not 1: the in-progress acks come every 2/3 s, so only an event-loop stall of over 1.3 s (not 0.5 s, as on a
# loaded 2-core CI machine) lets the ack wait lapse between two of them.
ACK_WAIT_S = 2.0
_KEPT = 7  # in-progress acks, one every ack_wait_s / 3 (at least 0.5 s): the 7th is 6 of them on, past two ack_waits


def models(generator_dir, adapter_dir) -> list[ModelEntry]:
    base = ModelEntry(name=MODEL, path=generator_dir, task="generate", pinned=True)
    return [base, ModelEntry(name=ADAPTER, path=adapter_dir, adapter_of=MODEL)]


async def test_a_generation_whose_admission_outlasts_ack_wait_is_kept_in_progress_and_delivered_once(
    start_box, nats_server, http, generator_dir, second_generator_adapter_dir
) -> None:
    """The adapter's load is held past two `ack_wait_s` periods: the request being admitted is kept in progress
    like one generating, so it is never redelivered (which would have it generated twice, and a sampled answer
    end 503 generation_restarted at the gateway), and it is answered 200 once the load goes on."""
    served = models(generator_dir, second_generator_adapter_dir)
    box = await start_box(default_model=False, models=served, ack_wait_s=ACK_WAIT_S)
    loading, go_on = hold(box.residency, "hold_adapter")
    watcher, kept = await in_progress_acks(nats_server.url)
    try:
        body = {"model": ADAPTER, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        answer = asyncio.create_task(http.post(url(box, "/v1/completions"), json=body))
        await wait_for(loading.is_set, what="the request's adapter load to be held")
        kept.clear()

        async def redelivered_or_kept() -> bool:
            return await deliveries(box, MODEL) > 1 or len(kept) >= _KEPT

        await wait_for(redelivered_or_kept, what="a redelivery, or the request kept in progress past two ack_wait")
        go_on.set()
        async with await answer as response:
            assert response.status == 200, await response.text()
        assert await deliveries(box, MODEL) == 1
        assert not box.metrics.registry.get_sample_value("fbx_redelivered_requests_total", {"model": MODEL})
    finally:
        go_on.set()
        await watcher.close()


async def test_a_generation_still_being_admitted_when_its_worker_drains_is_handed_back_at_once(
    start_box, http, generator_dir, second_generator_adapter_dir
) -> None:
    """The first box drains (no grace) while the request's adapter load there is held: the admission is cut off and
    the request handed back (nak), so the second box takes it at once and answers it. With `ack_wait_s` at 60 s, a
    request left to time out instead would come back only long after the test's bound of 20 s."""
    common = {"default_model": False, "models": models(generator_dir, second_generator_adapter_dir), "ack_wait_s": 60.0}
    first = await start_box(box_id="first", shutdown_grace_s=0.0, **common)
    loading, go_on = hold(first.residency, "hold_adapter")
    try:
        body = {"model": ADAPTER, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        answer = asyncio.create_task(http.post(url(first, "/v1/completions"), json=body))
        await wait_for(loading.is_set, what="the request's adapter load to be held on the first box")
        second = await start_box(role="worker", box_id="second", **common)
        await first.workers[MODEL].drain()
        async with asyncio.timeout(20):
            async with await answer as response:
                assert response.status == 200, await response.text()
        assert await deliveries(first, MODEL) == 2
        assert second.metrics.registry.get_sample_value("fbx_redelivered_requests_total", {"model": MODEL}) == 1
    finally:
        go_on.set()
