"""The fleet as a gateway reads it for each request it admits: holders, rounds and pace from the heartbeats in
`fbx_boxes`, kept by model and made again only when a heartbeat changes. Records are written to the bucket of a real
nats-server, as boxes write them, and read back through a `Fleet`'s watch."""

from __future__ import annotations

import signal
import time
from typing import Any

import nats
import orjson
import pytest

from appliance import bus
from appliance.fleet import Fleet, open_boxes_bucket
from tests.conftest import freeze, wait_for

LINE = {"fixed_s": 0.01, "token_s": 0.0001, "rows": 8, "tokens": 1024, "slots": 1, "row_tokens": 32.0}


def record(box: str, models: list[dict[str, Any]], *, role: str = "all", **fields: Any) -> bytes:
    return orjson.dumps({"box": box, "role": role, "ts": time.time(), "models": models, **fields})


async def test_what_a_gateway_reads_of_a_model_follows_each_heartbeat(nats_server) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    kv = await open_boxes_bucket(js, ttl_s=30)
    fleet = Fleet(js, "reader", None, period_s=1, ttl_s=5)
    await kv.put("a", record("a", [{"name": "m", "state": "resident", "round_tokens": 512, "batch_cost": LINE}]))
    await kv.put("b", record("b", [{"name": "m", "state": "loading"}, {"name": "n", "state": "resident"}]))
    await fleet.start()
    try:
        assert fleet.holders("m") == ["a"] and sorted(fleet.holders("m", loading=True)) == ["a", "b"]
        assert fleet.box_round("m") == 512 and fleet.box_round("n") is None
        assert fleet.holders_per_gateway("m") == 1  # one holder, two gateways: never less than one box's
        rows_s = 8 / (0.01 + 0.0001 * 8 * 32)  # a's full batches of 32-token rows a second
        one = fleet.pace_per_gateway("m", 32.0)
        assert one is not None and one[1] == pytest.approx(rows_s / 2)  # a's pace, shared by two gateways

        # b's next beat: m resident there too, with its own round and pace; each read says so at once
        await kv.put(
            "b",
            record("b", [{"name": "m", "state": "resident", "round_tokens": 2048, "batch_cost": LINE}], role="worker"),
        )
        await wait_for(lambda: fleet.box_round("m") == 2048)
        assert sorted(fleet.holders("m")) == ["a", "b"] and fleet.holders("n") == []
        assert fleet.holders_per_gateway("m") == 2  # two holders, one gateway (b is a worker only)
        two = fleet.pace_per_gateway("m", 32.0)
        assert two is not None and two[1] == pytest.approx(2 * rows_s)

        # a draining box takes no new work: neither its round nor its pace counts; a deleted record none at all
        await kv.put(
            "a",
            record("a", [{"name": "m", "state": "resident", "round_tokens": 4096, "batch_cost": LINE}], draining=True),
        )
        await wait_for(lambda: fleet.holders_per_gateway("m") == 1)
        assert fleet.box_round("m") == 2048 and fleet.holders("m") == ["b"]  # nor is it a holder (tester h114)
        await kv.delete("b")
        await wait_for(lambda: fleet.holders("m") == [])
        assert fleet.box_round("m") is None and fleet.pace_per_gateway("m", 32.0) is None

        # a record past its TTL is read as gone, with no heartbeat to say so
        await kv.put("c", record("c", [{"name": "m", "state": "resident"}], ts=time.time() - 60))
        await kv.put("d", record("d", [{"name": "x", "state": "resident"}]))  # seen after c: the watch keeps order
        await wait_for(lambda: fleet.holders("x") == ["d"])
        assert fleet.holders("m") == []  # c's record is too old, a drains
    finally:
        await fleet.stop(connected=False)
        await nc.close()


async def test_a_gateway_is_known_gone_only_by_a_box_that_has_heard_the_fleet_for_a_ttl(nats_server) -> None:
    """Tester h190: a box cancels the requests of a gateway known gone (`Fleet.gateway_gone`). Known: no live heartbeat
    of the gateway's box, while this box has seen its own unbroken for over a TTL (never from a view still filling),
    its own last beat over a TTL newer than the gateway's: cut off from NATS (the server frozen here), every record
    stops at once, and one a moment older than this box's own is no sign its box died."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    kv = await open_boxes_bucket(js, ttl_s=30)
    fleet = Fleet(js, "w", lambda: {"role": "worker", "started": 1.0}, period_s=0.1, ttl_s=1.0)
    await kv.put("gw-old", record("gw-old", [], role="gateway", ts=time.time() - 10))
    await fleet.start()
    frozen = False
    try:
        assert not fleet.gateway_gone(bus.reply_subject("gw-never"))  # its view is not a TTL old yet
        await wait_for(lambda: fleet.gateway_gone(bus.reply_subject("gw-never")), what="a gateway never seen gone")
        assert fleet.gateway_gone(bus.reply_subject("gw-old"))
        assert not fleet.gateway_gone(bus.reply_subject("w"))  # its own
        assert not fleet.gateway_gone("test.reply")  # not a gateway's subject
        await kv.put("gw-live", record("gw-live", [], role="gateway"))
        await wait_for(lambda: "gw-live" in fleet._boxes, what="the live gateway seen")
        assert not fleet.gateway_gone(bus.reply_subject("gw-live"))

        quiet_ts = time.time() - 0.5  # its last beat: half a TTL before the server stops, this box's own just before
        await kv.put("gw-quiet", record("gw-quiet", [], role="gateway", ts=quiet_ts))
        await wait_for(lambda: "gw-quiet" in fleet._boxes, what="the quiet gateway seen")
        await freeze(nats_server)
        frozen = True
        await wait_for(lambda: time.time() - quiet_ts > 1.1, what="the quiet gateway's record a TTL old")
        assert not fleet.gateway_gone(bus.reply_subject("gw-quiet"))  # this box's own is about as old
        await wait_for(lambda: not fleet.hears_itself(), what="this box's own record a TTL old")
        assert not fleet.gateway_gone(bus.reply_subject("gw-quiet"))
        assert not fleet.gateway_gone(bus.reply_subject("gw-never"))  # cut off: nobody is known gone
    finally:
        if frozen:
            nats_server.process.send_signal(signal.SIGCONT)
        await fleet.stop()
        await nc.close()
