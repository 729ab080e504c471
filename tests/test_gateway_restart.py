"""A gateway's box restarted under its id (`--box-id gw1`, a crash and a restart): its requests from before have
nobody awaiting them, though the id is heard again. Each start of a box is a run of its own, named in its requests
(`Fbx-Run`) and its heartbeat; workers let the last run's requests go, and compute the new run's. Real nats-server and
boxes."""

from __future__ import annotations

import asyncio

from appliance import bus
from tests.conftest import url, wait_for
from tests.test_gateway_lapse import HELD_BACK_SETTINGS, held_back_fleet, no_beat


async def test_the_requests_of_a_gateway_restarted_under_its_id_are_let_go_and_its_new_ones_answered(
    start_box, http
) -> None:
    """Before: the restarted gateway was heard, so the worker computed the dead run's requests for nobody (a
    gateway restarted under load: its whole backlog before the new run's requests). Seen failing so: the request
    computed and answered (200)."""
    worker, first, read = await held_back_fleet(start_box)
    assert worker.fleet is not None and first.fleet is not None
    noop = worker.workers["noop"]

    def cancelled() -> float:
        return worker.metrics.registry.get_sample_value("fbx_cancelled_requests_total", {"model": "noop"}) or 0.0

    body = {"model": "noop", "input": "word " * 1000, "timeout": 4}
    sent = asyncio.ensure_future(http.post(url(first, "/v1/embeddings"), json=body))
    try:
        await wait_for(lambda: len(noop._held) == 1, what="the request held, being prepared")
        (request_id,) = list(noop._held)
        first.fleet.beat = no_beat  # the first run dies (it stays in this process, deaf, as a killed one would be)
        second = await start_box(role="gateway", box_id="gw", **HELD_BACK_SETTINGS)  # waits out the first's record
        assert second.run != first.run
        await wait_for(lambda: noop._cancelled.contains(request_id), what="the first run's request let go")
        assert worker.fleet.gateway_gone(bus.reply_subject("gw"), first.run)
        assert not worker.fleet.gateway_gone(bus.reply_subject("gw"), second.run)
        read.set()
        async with await asyncio.wait_for(sent, 30) as response:
            assert response.status == 504, await response.text()  # nobody computed it: its deadline passed
        assert cancelled() == 1.0
        async with http.post(url(second, "/v1/embeddings"), json={**body, "timeout": 30}) as response:
            assert response.status == 200, await response.text()  # the new run's own are computed
    finally:
        read.set()
        vars(first.fleet).pop("beat", None)
        sent.cancel()
