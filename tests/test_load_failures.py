"""A load that failed on a box is in that box's heartbeat record (`load_failed`), so the fleet's readers (the TUI,
`fleetbox models list`) see it: a corrupt folder fails in milliseconds, between two beats, and the record's `models`
never caught it `loading` (tester h212: the TUI showed such a model `cold`, with no error and no event)."""

from __future__ import annotations

from typing import Any

import pytest

from appliance.app import Box
from appliance.box_status import LOAD_ERROR_CHARS
from appliance.connect import NO_AUTH
from tests.conftest import url, wait_for
from tests.test_large_and_broken import NOT_ITS_WEIGHTS, box_with_a_broken_model
from tui.commands import list_models


def own_record(box: Box) -> dict[str, Any]:
    """This box's heartbeat as the fleet reads it from `fbx_boxes` (its watched copy), or {} before the first."""
    assert box.fleet is not None
    return next((r for r in box.fleet.live_boxes() if r.get("box") == box.box_id), {})


async def test_a_failed_load_is_in_the_box_record_and_models_list_until_the_model_is_deleted(
    start_box, http, tmp_path, encoder_dir, nats_server
) -> None:
    box = await box_with_a_broken_model(start_box, http, tmp_path, encoder_dir)
    async with http.post(url(box, "/v1/embeddings"), json={"model": "mine", "input": "x"}) as response:
        assert response.status == 503

    def failures() -> list[dict[str, Any]]:
        return own_record(box).get("load_failed", [])

    await wait_for(lambda: [f["name"] for f in failures()] == ["mine"], what="the failure in the box's heartbeat")
    (failure,) = failures()
    assert NOT_ITS_WEIGHTS in failure["error"] and "\n" not in failure["error"], failure
    assert len(failure["error"]) <= LOAD_ERROR_CHARS and isinstance(failure["at"], float), failure
    # Not an entry of `models`, which placement and admission read as held or on its way.
    assert all(m["name"] != "mine" for m in own_record(box)["models"]), own_record(box)
    assert box.fleet is not None and box.fleet.holders("mine", loading=True) == []

    # The same failure again keeps its first time (review h219: restamped at each try, the record's newest-16 cut
    # took turns over more failing models than that, each back as news to the TUI).
    ((_, _, first_at),) = box.residency.load_failures()
    spec = box.catalog.get("mine")
    assert spec is not None
    with pytest.raises(Exception, match=NOT_ITS_WEIGHTS):
        await box.residency.ensure_loaded(spec)  # tried again, as a pinned model's load is each 30 s
    assert box.residency.load_failures() == [("mine", box.residency.load_error("mine"), first_at)]

    # `fleetbox models list` (its body, attached over NATS as the command is)
    (row,) = [row for row in await list_models(nats_server.url, NO_AUTH) if row.name == "mine"]
    assert row.state == "failed" and list(row.load_failed_on) == [box.box_id], row
    assert NOT_ITS_WEIGHTS in row.load_failed_on[box.box_id]

    # `GET /v1/models/{name}` says so too, on this box and on a gateway-only box that reads it from the heartbeat
    # (it said `cold`, where the TUI and `fleetbox models list` said `failed`).
    gateway = await start_box(role="gateway", default_model=False, model_roots=box.settings.model_roots)
    assert gateway.fleet is not None
    await wait_for(lambda: any(r.get("load_failed") for r in gateway.fleet.live_boxes()), what="the box's record")
    for reader in (box, gateway):
        async with http.get(url(reader, "/v1/models/mine")) as response:
            record = await response.json()
        assert (record["state"], record["boxes"], list(record["load_failed_on"])) == ("failed", [], [box.box_id])
        assert NOT_ITS_WEIGHTS in record["load_failed_on"][box.box_id], record
    async with http.get(url(gateway, "/v1/models")) as response:
        listed = {m["id"]: m for m in (await response.json())["data"]}
    assert listed["mine"]["state"] == "failed" and listed["mine"]["load_error"] is None, listed  # none of its own
    # A draining box is not counted, as the TUI counts none (review h225): it takes nothing new.
    box.draining = True
    await box.fleet.beat()
    await wait_for(lambda: any(r.get("draining") for r in gateway.fleet.live_boxes()), what="the box's draining beat")
    async with http.get(url(gateway, "/v1/models/mine")) as response:
        record = await response.json()
    assert (record["state"], record["load_failed_on"]) == ("cold", {}), record
    box.draining = False
    await box.fleet.beat()

    async with http.delete(url(box, "/v1/models/mine")) as response:
        assert response.status == 200
    await wait_for(lambda: "load_failed" in own_record(box) and failures() == [], what="the failure forgotten")


async def test_a_box_whose_load_of_a_model_failed_is_not_one_that_would_load_it(
    start_box, http, tmp_path, encoder_dir
) -> None:
    """`Fleet.can_load` tells a full queue for a model held by no live box as overload (429: a live box loads it in its
    turn, tester h214) from nothing answering it (503). A box whose last load of the model failed (its heartbeat names
    it in `load_failed`) would not load it in its turn: counted as one (as since efa99bb), a refusal for a model whose
    folder fails on every box read as overload, a 429, where no box would answer it. The box would still load another
    model."""
    box = await box_with_a_broken_model(start_box, http, tmp_path, encoder_dir)
    assert box.fleet is not None
    await wait_for(lambda: box.fleet.can_load("mine"), what="the box's heartbeat")
    async with http.post(url(box, "/v1/embeddings"), json={"model": "mine", "input": "x"}) as response:
        assert response.status == 503
    await wait_for(lambda: own_record(box).get("load_failed"), what="the failed load in the box's heartbeat")
    assert not box.fleet.can_load("mine") and box.fleet.can_load("good") and box.fleet.holders("mine") == []


def a_gateway_beside(work_draining: bool) -> Any:
    """A gateway-only box (its state stubbed) whose one other live box, `work`, holds generator `gen`."""
    from types import SimpleNamespace

    record = {
        "box": "work",
        "draining": work_draining,
        "models": [{"name": "gen", "state": "resident", "bytes": 10, "max_length": 128}],
    }
    residency = SimpleNamespace(
        load_error=lambda name: None,
        get=lambda name: None,
        is_loading=lambda name: False,
        adapter_names=lambda name: [],
    )
    return SimpleNamespace(
        box_id="gw",
        draining=False,
        catalog=SimpleNamespace(get=lambda name: None),
        fleet=SimpleNamespace(live_boxes=lambda: [record]),
        residency=residency,
        placement=None,
        profiles=None,
    )


def test_a_sole_holder_that_drains_is_no_holder_but_still_says_the_model_s_context() -> None:
    """Review h228: once a draining box counted nowhere, a gateway read `max_model_len` None while the sole holder
    drained, and weighed a generation's `max_tokens` as sent (100,000 on a 128-token model), and an eviction of every
    holder skipped the draining one, which kept the model loaded. It is no holder (`boxes`, `state`), but its context
    and size stand, and an eviction (`draining=True`) asks it too."""
    from appliance.box_status import model_state

    assert model_state(a_gateway_beside(False), "gen")["boxes"] == ["work"]
    state = model_state(a_gateway_beside(True), "gen")
    assert (state["state"], state["boxes"], state["max_model_len"], state["bytes"]) == ("cold", [], 128, 10), state
    assert model_state(a_gateway_beside(True), "gen", draining=True)["boxes"] == ["work"]
