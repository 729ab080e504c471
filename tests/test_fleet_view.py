"""The fleet as a gateway reads it for each request it admits: holders, rounds and pace from the heartbeats in
`fbx_boxes`, kept by model and made again only when a heartbeat changes. Records are written to the bucket of a real
nats-server, as boxes write them, and read back through a `Fleet`'s watch."""

from __future__ import annotations

import time
from typing import Any

import nats
import orjson
import pytest

from appliance.fleet import Fleet, open_boxes_bucket
from tests.conftest import wait_for

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
