"""The control subject of a real box: each request answered on its own, so a slow verb holds up no other."""

from __future__ import annotations

import asyncio

import nats
import pytest

from appliance.app import Box
from appliance.control import call_box
from appliance.errors import Conflict, NotFound, ServiceUnavailable, Unprocessable
from tests.conftest import box_settings, noop_model, wait_for


async def test_a_slow_load_does_not_hold_up_a_status_sent_to_the_same_box(start_box) -> None:
    box = await start_box(default_model=False, models=[noop_model("cold", pinned=False)])
    assert box.nc is not None
    # The load waits for room in the box's memory while the test holds the residency's room lock:
    # a load as slow as the test wants, ended when the test lets go.
    room = box.residency._room_lock
    await room.acquire()
    try:
        load = asyncio.create_task(call_box(box.nc, box.box_id, "load", {"model": "cold"}, timeout_s=30))
        await wait_for(lambda: box.residency.is_loading("cold"), 10, "the load to wait for room")
        status = await call_box(box.nc, box.box_id, "status", timeout_s=5)
        assert status["box"] == box.box_id
        assert not load.done()  # answered while the load is still in flight
    finally:
        room.release()
    loaded = await asyncio.wait_for(load, 10)
    assert loaded["state"] == "resident" and box.residency.is_resident("cold")


async def test_a_verb_naming_no_model_or_an_unknown_one_says_which_in_its_code(start_box) -> None:
    """The TUI and the CLI show the code: an unknown model was a bare `not_found`, a missing name a 404."""
    box = await start_box(default_model=False, models=[noop_model("kept")])
    assert box.nc is not None
    with pytest.raises(NotFound) as unknown:
        await call_box(box.nc, box.box_id, "load", {"model": "ghost"}, timeout_s=5)
    assert unknown.value.code == "model_not_found" and "kept" in str(unknown.value)
    with pytest.raises(Unprocessable, match="name a model"):
        await call_box(box.nc, box.box_id, "evict", {}, timeout_s=5)


async def test_a_verb_to_a_box_that_stops_beating_is_answered_503_once_its_heartbeat_is_gone(start_box) -> None:
    """Tester h82 (N3): a verb sent to a frozen box (SIGSTOP) waited out the whole 120 s control timeout, its
    subscription still on the server. Here the box's load waits for room, its heartbeat stops and its record ages
    out (deleted, as the bucket's TTL would): the caller is answered 503 then, long before the verb's 60 s."""
    from appliance import bus

    box = await start_box(default_model=False, models=[noop_model("cold", pinned=False)])
    assert box.nc is not None and box.fleet is not None
    room = box.residency._room_lock
    await room.acquire()  # the load waits for room in the box's memory for as long as the test holds it
    try:
        load = asyncio.create_task(call_box(box.nc, box.box_id, "load", {"model": "cold"}, timeout_s=60))
        await wait_for(lambda: box.residency.is_loading("cold"), 10, "the load to wait for room")
        await box.fleet._stop_tasks()  # frozen: it beats no more
        kv = await box.nc.jetstream().key_value(bus.BOXES_BUCKET)
        await kv.delete(box.box_id)  # its record aged out
        with pytest.raises(ServiceUnavailable, match="left the fleet before it answered load"):
            await asyncio.wait_for(load, 20)
    finally:
        room.release()


async def test_a_verb_cut_short_by_the_box_stopping_is_answered_503(nats_server) -> None:
    """A `load` running when its box stopped got no answer: the caller waited out the whole 120 s control timeout,
    then heard the box "did not answer", though it had exited within seconds."""
    box = Box(box_settings(nats_server.url, default_model=False, models=[noop_model("cold", pinned=False)]))
    await box.start()
    room = box.residency._room_lock
    await room.acquire()  # the load waits for room in the box's memory for as long as the test holds it
    try:
        assert box.nc is not None
        client = await nats.connect(nats_server.url)
        try:
            load = asyncio.create_task(call_box(client, box.box_id, "load", {"model": "cold"}, timeout_s=60))
            await wait_for(lambda: box.residency.is_loading("cold"), 10, "the load to wait for room")
            await box.stop()
            with pytest.raises(ServiceUnavailable, match="stopped before it finished load"):
                await asyncio.wait_for(load, 20)
        finally:
            await client.close()
    finally:
        room.release()


async def test_a_draining_box_takes_no_new_model(start_box) -> None:
    """It loaded the model and started pulling for it as it drained (architecture.md: a draining box takes no
    new loads)."""
    box = await start_box(default_model=False, models=[noop_model("cold", pinned=False)])
    assert box.nc is not None
    box.draining = True
    try:
        with pytest.raises(Conflict, match="is draining"):
            await call_box(box.nc, box.box_id, "load", {"model": "cold"}, timeout_s=5)
        assert not box.residency.is_resident("cold")
    finally:
        box.draining = False


async def test_a_load_under_way_as_the_box_stops_starts_no_worker(nats_server) -> None:
    """A `load` past its check for draining when the stop began started its worker after the box had drained the
    others: it pulled requests as the box stopped and was never drained (they came back only after ack_wait), and
    the verb answered ok. Found by the review of the stop path."""
    from tests.conftest import hold

    box = Box(box_settings(nats_server.url, default_model=False, models=[noop_model("late", pinned=False)]))
    await box.start()
    loaded, go_on = hold(box.residency, "ensure_loaded", after=True)  # loaded, its worker not started yet
    drained, close = hold(box.door, "close")  # the stop held after its drain, before it stops answering verbs
    client = await nats.connect(nats_server.url)
    try:
        load = asyncio.create_task(call_box(client, box.box_id, "load", {"model": "late"}, timeout_s=30))
        await asyncio.wait_for(loaded.wait(), 20)
        stopping = asyncio.create_task(box.stop())
        await asyncio.wait_for(drained.wait(), 20)
        go_on.set()
        with pytest.raises(ServiceUnavailable, match="this box is stopping; load late on another box"):
            await asyncio.wait_for(load, 20)
        close.set()
        await asyncio.wait_for(stopping, 30)
    finally:
        go_on.set()
        close.set()
        await client.close()


async def test_a_load_a_stopping_box_refuses_tells_the_http_caller_when_to_retry(start_box, nats_server, http) -> None:
    """Review r40: the box's 503 ("this box is stopping", Retry-After 1) reached `POST /v1/models/{name}/load`
    without its Retry-After: the control reply carried only the status, and `call_box` rebuilt the error without it."""
    from tests.conftest import hold, url

    models = [noop_model("late", pinned=False)]
    gateway = await start_box(role="gateway", box_id="gw", default_model=False, models=models)
    box = Box(box_settings(nats_server.url, role="worker", box_id="leaving", default_model=False, models=models))
    await box.start()
    loaded, go_on = hold(box.residency, "ensure_loaded", after=True)  # loaded, its worker not started yet
    drained, close = hold(box.door, "close")  # the stop held after its drain, before it stops answering verbs
    try:
        load = asyncio.create_task(http.post(url(gateway, "/v1/models/late/load"), json={"box": "leaving"}))
        await asyncio.wait_for(loaded.wait(), 20)
        stopping = asyncio.create_task(box.stop())
        await asyncio.wait_for(drained.wait(), 20)
        go_on.set()
        async with await asyncio.wait_for(load, 20) as response:
            assert response.status == 503
            assert "this box is stopping" in (await response.json())["error"]["message"]
            assert response.headers.get("Retry-After") == "1"
        close.set()
        await asyncio.wait_for(stopping, 30)
    finally:
        go_on.set()
        close.set()
