"""The fleet as a gateway reads it for each request it admits: holders, rounds and pace from the heartbeats in
`fbx_boxes`, kept by model and made again only when a heartbeat changes. Records are written to the bucket of a real
nats-server, as boxes write them, and read back through a `Fleet`'s watch."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import nats
import orjson
import pytest

from appliance import bus
from appliance.fleet import Fleet, open_boxes_bucket
from appliance.tasks import cancel_and_wait
from tests.conftest import awaited_on, freeze, wait_for

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

        # what a draining holder still keeps in progress: a generator's last chunks settling too (`unacked`, review
        # h229), else its `held` (a box of an older version)
        await kv.put("e", record("e", [{"name": "g", "state": "resident", "held": 1, "unacked": 3}], draining=True))
        await kv.put("f", record("f", [{"name": "g", "state": "resident", "held": 2}], draining=True))
        await wait_for(lambda: sorted(fleet.holders("g", draining=True)) == ["e", "f"])
        assert fleet.held_by_draining("g") == 5 and fleet.holders("g") == []

        # a record past its TTL is read as gone, with no heartbeat to say so
        await kv.put("c", record("c", [{"name": "m", "state": "resident"}], ts=time.time() - 60))
        await kv.put("d", record("d", [{"name": "x", "state": "resident"}]))  # seen after c: the watch keeps order
        await wait_for(lambda: fleet.holders("x") == ["d"])
        assert fleet.holders("m") == []  # c's record is too old, a drains
    finally:
        await fleet.stop(connected=False)
        await nc.close()


@contextlib.asynccontextmanager
async def _told_fleet(nats_server: Any) -> AsyncIterator[tuple[Any, Fleet, list[list[str]]]]:
    """The heartbeats' bucket, and a reader's `Fleet` that lists what it is told is held again (`on_held_again`)."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    kv = await open_boxes_bucket(js, ttl_s=30)
    told: list[list[str]] = []
    fleet = Fleet(js, "reader", None, period_s=1, ttl_s=5, on_held_again=told.append)
    await fleet.start()
    try:
        yield kv, fleet, told
    finally:
        await fleet.stop(connected=False)
        await nc.close()


async def test_a_model_resident_again_after_no_live_box_held_it_is_told(nats_server) -> None:
    """Tester h208: a gateway measures a model's rate afresh once a box holds it again after none did (its only worker
    restarted); told of each such model, not of one another live box held, nor at each beat of a box holding it."""
    async with _told_fleet(nats_server) as (kv, fleet, told):
        m = {"name": "m", "state": "resident"}
        await kv.put("a", record("a", [m, {"name": "x", "state": "loading"}], run="r1"))
        await wait_for(lambda: told == [["m"]], what="m held: none held it before")
        await kv.put("a", record("a", [m], run="r1"))
        await kv.put("b", record("b", [m], run="s1"))  # a holds m: nothing to tell
        await kv.put("c", record("c", [{"name": "y", "state": "resident"}], run="t1"))
        await wait_for(lambda: fleet.holders("y") == ["c"])
        assert told == [["m"], ["y"]]
        await kv.delete("a")
        await kv.delete("b")
        await wait_for(lambda: fleet.holders("m") == [])
        await kv.put("a", record("a", [m], run="r2"))  # a restarted: m held again
        await wait_for(lambda: told[-1] == ["m"] and len(told) == 3, what="m held again")
        await kv.put("a", record("a", [m], run="r3"))  # restarted again, its last record live: m unheld meanwhile
        await wait_for(lambda: len(told) == 4, what="m held by a new run")


async def test_a_box_whose_clock_runs_behind_is_not_held_again_at_each_beat(nats_server) -> None:
    """Review h211: `_held_again` judged the box's last record live by the `ts` its writer's clock wrote, not by its
    arrival (hearing.py's one idea). A worker whose clock runs 4.5 s behind (TTL 5 s): each beat, the last one's
    `ts` read 5.5 s old, so the model was "held again" at every beat and each gateway restarted its rate every
    second: never measured. Seen failing so ([['m']] * 4)."""
    async with _told_fleet(nats_server) as (kv, fleet, told):
        m = {"name": "m", "state": "resident"}
        for _ in range(4):
            await kv.put("a", orjson.dumps({**orjson.loads(record("a", [m], run="r1")), "ts": time.time() - 4.5}))
            await wait_for(lambda: fleet.holders("m") == ["a"])
            await asyncio.sleep(1.0)
        assert told == [["m"]], told


async def test_a_gateway_is_known_gone_by_when_its_records_arrive_and_only_from_a_sound_view(nats_server) -> None:
    """Review h195: a box judged a gateway gone by the time written in its records, its writer's wall clock, and a
    live gateway whose clock ran 5 s behind a worker's had its requests cancelled. Judged by when the records reach
    this box, by its own clock: a gateway beating with a clock five minutes behind is live; one no record of which
    arrives for twice the TTL is gone, once this box has watched that long; and a box cut off from NATS (the server
    frozen here), its own record no longer reaching it, judges nobody gone."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    kv = await open_boxes_bucket(js, ttl_s=30)
    ttl_s = 0.5
    fleet = Fleet(js, "w", lambda: {"role": "worker", "started": 1.0}, period_s=0.1, ttl_s=ttl_s)

    def gone(box: str) -> bool:
        return fleet.gateway_gone(awaited_on(bus.reply_subject(box)))

    async def beat_behind() -> None:
        while True:
            await kv.put("gw-behind", record("gw-behind", [], role="gateway", ts=time.time() - 300))
            await asyncio.sleep(0.1)

    beats = asyncio.create_task(beat_behind())
    started = time.monotonic()
    frozen = False
    try:
        await asyncio.wait_for(fleet.start(), 30)
        assert not gone("gw-never")  # its view is not twice the TTL old yet
        await wait_for(lambda: gone("gw-never"), what="a gateway never heard judged gone")
        assert time.monotonic() - started > 2 * ttl_s
        assert not gone("gw-behind")  # its records arrive: its clock says nothing
        assert not gone("w") and not fleet.gateway_gone(awaited_on("test.reply"))  # its own; not a gateway's subject
        await cancel_and_wait([beats])  # a loop of NATS requests: a lone cancel can be lost (appliance/tasks.py)
        assert not gone("gw-behind")
        await wait_for(lambda: gone("gw-behind"), what="the gateway whose records stopped judged gone")

        beats = asyncio.create_task(beat_behind())
        await wait_for(lambda: not gone("gw-behind"), what="the gateway beating again live")
        await cancel_and_wait([beats])
        frozen = True  # before: its SIGSTOP is sent at once, and a freeze that times out must be SIGCONTed too
        await freeze(nats_server)
        cut_at = time.monotonic()
        await wait_for(lambda: time.monotonic() - cut_at > 3 * ttl_s, what="three TTLs cut off")
        assert not gone("gw-behind") and not gone("gw-never")  # its own record does not reach it either
    finally:
        await cancel_and_wait([beats])
        if frozen:
            nats_server.process.send_signal(signal.SIGCONT)
        await asyncio.wait_for(fleet.stop(), 30)
        await asyncio.wait_for(nc.close(), 30)


async def test_a_heartbeat_whose_record_cannot_be_made_is_a_failed_beat_not_the_end_of_the_beats(nats_server) -> None:
    """Review h202: a record that raised while it was made ended the heartbeat task for good, the box serving on with
    no heartbeat, so the workers took its gateway for gone and dropped every request it published."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    kv = await open_boxes_bucket(js, ttl_s=2)
    broken = [True]

    def snapshot() -> dict[str, Any]:
        if broken[0]:
            raise RuntimeError("a status field not read")
        return {"role": "gateway", "started": 1.0}

    fleet = Fleet(js, "gw", lambda: {"role": "gateway", "started": 1.0}, period_s=0.1, ttl_s=2)
    await fleet.start()
    try:
        fleet._snapshot = snapshot
        await asyncio.sleep(0.3)  # beats fail meanwhile
        broken[0] = False
        written_at = time.time()

        async def written_again() -> bool:
            return orjson.loads((await kv.get("gw")).value)["ts"] > written_at

        await wait_for(written_again, timeout_s=5, what="a heartbeat written after the failed ones")
    finally:
        await fleet.stop()
        await nc.close()
