"""The TUI and the `fleetbox models`/`box` commands against a real NATS and a real serving box.

Keys are pressed through Textual's pilot; every effect is checked through the box's own HTTP API
(or its control state), not only on the screen.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Static
from typer.testing import CliRunner

from appliance import bus, cli, fleet_cli
from appliance.app import Box
from appliance.connect import NatsAuth
from appliance.errors import ServiceUnavailable
from appliance.natsd import EmbeddedNats, free_port
from tests.conftest import box_settings, freeze, noop_model, url, wait_for
from tui import commands, ops
from tui.app import FleetboxApp
from tui.dial import connect, connect_problem
from tui.dialogs import Choose, Confirm, RegisterForm
from tui.model import model_rows
from tui.source import NatsSource

FLEETBOX = str(Path(sys.executable).with_name("fleetbox"))


@pytest.fixture
async def tui(nats_server) -> AsyncIterator[tuple[FleetboxApp, Pilot]]:
    """The app attached to the test's NATS, refreshing five times a second, at 80×24."""
    nc = await connect(nats_server.url)
    source = NatsSource(nc, address=nats_server.url, own_connection=True, period_s=0.2)
    await source.start()
    app = FleetboxApp(source, refresh_s=0.2)
    async with app.run_test(size=(80, 24)) as pilot:
        yield app, pilot
    await source.stop()


def rows(app: FleetboxApp) -> list[str]:
    table = app.screen.query_one(DataTable)
    return [row.key.value for row in table.ordered_rows]


async def model(http, box, name: str) -> dict[str, Any]:
    async with http.get(url(box, f"/v1/models/{name}")) as response:
        return await response.json()


async def on_screen(app: FleetboxApp, kind: type) -> None:
    async def shown() -> bool:
        return isinstance(app.screen, kind)

    await wait_for(shown, 5.0, f"the {kind.__name__} screen")


async def test_fleet_screen_lists_the_serving_box(start_box, tui) -> None:
    app, _ = tui
    box = await start_box(default_model=False, models=[noop_model("alpha")], box_id="tui-box-1")

    async def listed() -> bool:
        return rows(app) == [box.box_id]

    await wait_for(listed, 10.0, "the box on the Fleet screen")
    cells = app.screen.query_one(DataTable).get_row(box.box_id)
    assert "tui-box-1" in str(cells[0]) and str(cells[1]) == "all" and str(cells[2]) == "cpu"
    assert "1 alpha" in str(cells[4])  # one resident model, the pinned one


async def test_keys_load_pin_evict_and_drain_change_the_box(start_box, tui, http) -> None:
    app, pilot = tui
    box = await start_box(default_model=False, models=[noop_model("alpha", pinned=False)], box_id="tui-box-2")

    await pilot.press("2")

    async def alpha_listed() -> bool:
        return "alpha" in rows(app)

    await wait_for(alpha_listed, 10.0, "alpha on the Models screen")

    await pilot.press("l")  # load: the first choice is "the box with the most free memory"
    await on_screen(app, Choose)
    await pilot.press("enter")

    async def resident() -> bool:
        return (await model(http, box, "alpha"))["state"] == "resident"

    await wait_for(resident, 10.0, "alpha resident after l")
    assert box.residency.is_resident("alpha")

    await pilot.press("p")

    async def pinned() -> bool:
        return (await model(http, box, "alpha"))["pinned"] is True

    await wait_for(pinned, 10.0, "alpha pinned after p")

    async def shown_pinned() -> bool:  # p toggles from what the screen shows, so wait until it shows it
        spec = app.view.spec("alpha")
        return spec is not None and spec.pinned

    await wait_for(shown_pinned, 5.0, "the screen showing alpha pinned")
    await pilot.press("p")

    async def unpinned() -> bool:
        return (await model(http, box, "alpha"))["pinned"] is False

    await wait_for(unpinned, 10.0, "alpha unpinned after the second p")

    async def resident_shown() -> bool:
        return app.source.ops.holders("alpha") == [box.box_id]

    await wait_for(resident_shown, 5.0, "the screen showing alpha resident")
    await pilot.press("e")  # one holder: straight to the confirmation
    await on_screen(app, Confirm)
    await pilot.press("y")

    async def evicted() -> bool:
        return (await model(http, box, "alpha"))["state"] == "cold"

    await wait_for(evicted, 10.0, "alpha evicted after e, y")
    assert not box.residency.is_resident("alpha")

    await pilot.press("1", "d")
    await on_screen(app, Confirm)
    await pilot.press("n")  # a refusal does nothing
    await pilot.pause()
    assert not box.draining
    await pilot.press("d")
    await on_screen(app, Confirm)
    await pilot.press("y")

    async def draining() -> bool:
        async with http.get(url(box, "/readyz")) as response:
            return response.status == 503 and (await response.json())["reason"] == "draining"

    await wait_for(draining, 10.0, "the box draining after d, y")
    assert box.stop_requested.is_set()


async def test_register_form_registers_a_folder_and_reports_refusals(
    start_box, tui, http, tmp_path, encoder_dir
) -> None:
    app, pilot = tui
    root = tmp_path / "models"
    folder = root / "tiny"
    shutil.copytree(encoder_dir, folder)  # a real (tiny) model folder: registration checks that it would load
    box = await start_box(default_model=False, models=[noop_model("alpha")], model_roots=[root], box_id="tui-box-3")

    async def box_seen() -> bool:
        return [b.box for b in app.source.ops.live()] == [box.box_id]

    await wait_for(box_seen, 10.0, "the box's heartbeat")

    async def register(name: str, path: str) -> None:
        await pilot.press("2", "r")
        await on_screen(app, RegisterForm)
        await pilot.press(*name, "tab", *path, "ctrl+s")

    await register("tiny", str(folder))

    async def registered() -> bool:
        return (await model(http, box, "tiny")).get("task") == "embed"

    await wait_for(registered, 10.0, "tiny registered through the form")

    await register("outside", "/etc")

    async def refusal_logged() -> bool:
        return any(e.kind == "error" and "outside the model roots" in e.text for e in app.events.newest_first())

    await wait_for(refusal_logged, 10.0, "the 403 reported")
    assert "error" in (await model(http, box, "outside"))


async def fleetbox(*args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        FLEETBOX,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "120"},
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode or 0, out.decode(), err.decode()


async def test_models_and_box_commands_steer_the_same_box(start_box, nats_server, http) -> None:
    box = await start_box(default_model=False, models=[noop_model("alpha", pinned=False)], box_id="tui-box-4")
    nats = ("--nats", nats_server.url)

    code, out, err = await fleetbox("models", "load", "alpha", "--box", box.box_id, *nats)
    assert code == 0, err
    assert json.loads(out)["state"] == "resident" and box.residency.is_resident("alpha")

    async def listed_resident() -> bool:
        code, out, _ = await fleetbox("models", "list", "--json", *nats)
        return code == 0 and [(m["name"], m["state"], m["boxes"]) for m in json.loads(out)] == [
            ("alpha", "resident", [box.box_id])
        ]

    await wait_for(listed_resident, 20.0, "models list showing alpha resident")

    # Tester h114: no command listed the boxes (their roles, draining, dead ones were the TUI's alone).
    code, out, err = await fleetbox("box", "list", "--json", *nats)
    assert code == 0, err
    (listed,) = [b for b in json.loads(out) if b["box"] == box.box_id]
    assert (listed["status"], listed["role"], listed["http_port"]) == ("live", "all", box.http_port), listed
    assert [(m["name"], m["state"]) for m in listed["models"]] == [("alpha", "resident")], listed
    code, out, err = await fleetbox("box", "list", *nats)
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if line.startswith(box.box_id)]
    assert line.split()[1:3] == ["live", "all"] and "alpha" in line, out

    code, out, err = await fleetbox("models", "evict", "ghost", *nats)
    assert code == 1 and "ghost" in err and out == ""

    code, out, err = await fleetbox("box", "drain", box.box_id, *nats)
    assert code == 0, err
    assert json.loads(out)["draining"] is True and box.stop_requested.is_set()


async def test_models_register_and_delete_commands_change_the_catalog(
    start_box, nats_server, http, tmp_path, encoder_dir
) -> None:
    """The catalog from a script, as the TUI's register form and delete key do it: there was no command for either."""
    root = tmp_path / "models"
    shutil.copytree(encoder_dir, root / "tiny")
    box = await start_box(default_model=False, models=[noop_model("alpha")], model_roots=[root], box_id="tui-box-5")
    nats = ("--nats", nats_server.url)

    code, out, err = await fleetbox("models", "register", "tiny", str(root / "tiny"), "--alias", "t1", *nats)
    assert code == 0, err
    assert (json.loads(out)["model"], json.loads(out)["task"]) == ("tiny", "embed")
    assert (await model(http, box, "t1"))["id"] == "tiny"  # the alias given

    code, out, err = await fleetbox("models", "register", "elsewhere", "/etc", *nats)
    assert code == 1 and "outside the model roots" in err and out == ""

    code, out, err = await fleetbox("models", "delete", "t1", *nats)  # by its own name only (tester h89)
    assert code == 1 and "'t1' is an alias of model 'tiny'; delete a model by its own name" in err, err
    code, out, err = await fleetbox("models", "delete", "tiny", *nats)
    assert code == 0, err
    assert json.loads(out) == {"ok": True, "box": box.box_id, "model": "tiny", "deleted": True}
    assert (await model(http, box, "tiny"))["error"]["code"] == "model_not_found"

    code, out, err = await fleetbox("models", "delete", "tiny", *nats)
    assert code == 1 and "'tiny' does not exist" in err


async def test_the_delete_key_deletes_the_selected_model_after_asking(
    start_box, tui, http, tmp_path, encoder_dir
) -> None:
    app, pilot = tui
    root = tmp_path / "models"
    shutil.copytree(encoder_dir, root / "tiny")
    box = await start_box(default_model=False, model_roots=[root], box_id="tui-box-6")
    async with http.post(url(box, "/v1/models"), json={"name": "tiny", "path": str(root / "tiny")}) as response:
        assert response.status == 201, await response.text()
    await pilot.press("2")

    async def listed() -> bool:
        return rows(app) == ["tiny"]

    await wait_for(listed, 10.0, "tiny on the Models screen")
    await pilot.press("x")
    await on_screen(app, Confirm)
    await pilot.press("n")  # asked first: no deletes nothing
    await pilot.pause()
    assert box.catalog.get("tiny") is not None
    await pilot.press("x")
    await on_screen(app, Confirm)
    await pilot.press("y")

    async def deleted() -> bool:
        return box.catalog.get("tiny") is None and rows(app) == []

    await wait_for(deleted, 10.0, "tiny deleted, on the box and on the screen")


async def test_boxes_joining_leaving_and_dying_are_marked_and_logged(start_box, tui, nats_server) -> None:
    """One box is real; the dying one is a heartbeat written by hand and then never renewed (a box
    killed without a clean stop looks exactly like that in `fbx_boxes`)."""
    app, _ = tui
    stays = await start_box(default_model=False, box_id="tui-stays", heartbeat_s=0.3, heartbeat_ttl_s=2.0)
    leaves = Box(box_settings(nats_server.url, default_model=False, box_id="tui-leaves", heartbeat_s=0.3))
    await leaves.start()  # not through start_box: this test stops it itself
    assert stays.js is not None
    kv = await stays.js.key_value(bus.BOXES_BUCKET)
    await kv.put("tui-dies", orjson.dumps({"box": "tui-dies", "role": "worker", "ts": time.time()}))

    def status() -> dict[str, str]:
        return {b.box: b.status for b in app.view.boxes}

    async def all_live() -> bool:
        return status() == {"tui-dies": "live", "tui-leaves": "live", "tui-stays": "live"}

    try:
        await wait_for(all_live, 10.0, "three live boxes")
    finally:
        await leaves.stop()  # a clean stop deletes its heartbeat at once

    async def left_and_dead() -> bool:
        return status() == {"tui-dies": "dead", "tui-leaves": "left", "tui-stays": "live"}

    await wait_for(left_and_dead, 10.0, "one box left and one dead")
    kinds = {(e.kind, e.subject) for e in app.events.newest_first()}
    assert {("leave", "tui-leaves"), ("dead", "tui-dies")} <= kinds
    marks = [str(row[0]) for row in map(app.screen.query_one(DataTable).get_row, ["tui-dies", "tui-leaves"])]
    assert marks == ["✗ tui-dies", "○ tui-leaves"]


def test_one_shot_commands_name_an_unreachable_nats_and_exit_1() -> None:
    """Nothing listens on the port: a one-line reason and exit status 1, not a silent wait for ever, and not
    a wait to the bound (ATTACH_TIMEOUT_S, 10 s) either: every server refused twice is an answer."""
    address = f"nats://127.0.0.1:{free_port()},nats://127.0.0.1:{free_port()}"
    for args in (["models", "list"], ["models", "pin", "alpha"], ["box", "drain", "some-box"]):
        started = time.monotonic()
        result = CliRunner().invoke(cli.app, [*args, "--nats", address])
        assert result.exit_code == 1, result.output
        assert result.output == f"fleetbox: cannot reach NATS at {address}: connection refused\n"
        assert time.monotonic() - started < commands.ATTACH_TIMEOUT_S / 2


def test_connect_problems_are_named_in_words() -> None:
    assert connect_problem(ConnectionRefusedError(111, "Connect call failed")) == "connection refused"
    # A host of several addresses, each refusing (review r60: a 10 s wait, and no "connection refused").
    both = OSError(
        "Multiple exceptions: [Errno 111] Connect call failed ('::1', 1, 0, 0), [Errno 111] Connect call ..."
    )
    assert connect_problem(both) == "connection refused"
    assert connect_problem(OSError("Multiple exceptions: [Errno 111] Connect call ..., [Errno 113] No route")) != (
        "connection refused"
    )
    assert connect_problem(socket.gaierror(-2, "Name or service not known")).startswith("host not found")
    assert connect_problem(TimeoutError()) == "no answer"


async def test_a_dialing_source_stopped_before_its_dial_began_stops_cleanly() -> None:
    """The TUI quitting at once stops its source before the dial ran: nats-py's `close()` of a client never
    connected raised an AssertionError (helper h216)."""
    never_started = NatsSource.dialing(f"nats://127.0.0.1:{free_port()}", period_s=0.2)
    await never_started.stop()
    started = NatsSource.dialing(f"nats://127.0.0.1:{free_port()}", period_s=0.2)
    await started.start()  # its dial is a task not yet run
    await started.stop()


async def test_a_dialing_source_whose_dial_gave_up_before_connecting_stops_cleanly(nats_server) -> None:
    """`fleetbox tui --tls-ca ...` against a server without TLS gives up before nats-py's connect (review h219):
    quitting then exited 1 with nats-py's AssertionError from closing a client never connected."""
    source = NatsSource.dialing(nats_server.url, NatsAuth(tls=ssl.create_default_context()), period_s=0.2)
    await source.start()
    await wait_for(lambda: "not retrying" in (source.view().problem or ""), 10.0, "the dial to give up")
    await source.stop()


async def test_the_tui_says_why_it_cannot_reach_nats_and_attaches_once_it_can(tmp_path) -> None:
    """The screen is drawn at once; its status line names the problem, and the TUI keeps trying."""
    port = free_port()
    source = NatsSource.dialing(f"nats://127.0.0.1:{port}", period_s=0.2)
    await source.start()
    app = FleetboxApp(source, refresh_s=0.2)
    server = EmbeddedNats(store_dir=tmp_path / "nats", port=port)
    try:
        async with app.run_test(size=(100, 24)):

            def status() -> str:
                return str(app.screen.query_one("#status", Static).visual)

            async def says(text: str) -> bool:
                return text in status()

            await wait_for(lambda: says("cannot reach NATS: connection refused; retrying"), 10.0, "the problem shown")
            await server.start()
            await wait_for(lambda: says("no fleet at"), 15.0, "the TUI connected once NATS listens")
    finally:
        await source.stop()
        await server.stop()


async def test_a_credentials_file_is_read_with_nkeys(nats_server, tmp_path) -> None:
    """A well-formed credentials file connects (the server here asks for no signature; nats-py still
    needs the nkeys package to take the file at all), and the CLI refuses a broken one in one line."""
    import nkeys

    seed = nkeys.encode_seed(bytes(32), nkeys.PREFIX_BYTE_USER).decode()
    creds = tmp_path / "user.creds"
    creds.write_text(
        f"-----BEGIN NATS USER JWT-----\neyJ0eXAiOiJKV1QifQ.e30.c2ln\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
    )
    nc = await connect(nats_server.url, NatsAuth(creds=creds))
    assert nc.is_connected
    await nc.close()

    junk = tmp_path / "junk.creds"
    junk.write_text("junk\n")
    for bad, why in ((junk, "is not a NATS credentials file"), (tmp_path / "absent.creds", "does not exist")):
        result = CliRunner().invoke(cli.app, ["models", "list", "--nats", nats_server.url, "--creds", str(bad)])
        assert result.exit_code == 2 and why in result.output, result.output
        assert len(result.output.splitlines()) == 1


def test_models_list_never_cuts_a_name() -> None:
    """Piped, every row is one line with the whole name (`| grep` finds it); on a narrow terminal a
    long name folds onto more lines instead of ending in an ellipsis (the figures give way)."""
    import io

    from rich.console import Console

    from tui.model import ModelRow

    name = "sentence-transformers/all-MiniLM-L6-v2-with-a-very-long-organisation-suffix"
    rows = [ModelRow(name, "embed", "torch", None, True, "resident", ("box-1",), 1, 0, 0.0, 0.0, 0.0, 0)]
    piped = io.StringIO()
    commands.print_rows(rows, Console(file=piped, width=80))
    assert any(line.split()[:3] == [name, "embed", "resident"] for line in piped.getvalue().splitlines())
    terminal = io.StringIO()
    commands.print_rows(rows, Console(file=terminal, width=60, force_terminal=True, color_system=None))
    firsts = [line.split()[0] for line in terminal.getvalue().splitlines() if line.strip()]
    assert "".join(firsts[firsts.index("model") + 1 :]) == name


async def test_a_nats_outage_keeps_the_fleet_as_last_seen_and_an_action_fails_in_bounded_time(
    start_box, nats_server, http, monkeypatch
) -> None:
    """While NATS is down nothing new is known: the box stays as last seen (marked unknown, not
    dead), its model stays resident, an action fails within the bound and is never sent later,
    and the outage and the reconnection are events."""
    monkeypatch.setattr(ops, "REACH_TIMEOUT_S", 1.0)
    box = await start_box(default_model=False, models=[noop_model("alpha")], heartbeat_s=0.3, heartbeat_ttl_s=2.0)
    nc = await connect(nats_server.url)
    source = NatsSource(nc, address=nats_server.url, own_connection=True, period_s=0.2)
    await source.start()
    app = FleetboxApp(source, refresh_s=0.2)
    try:
        async with app.run_test(size=(80, 24)) as pilot:

            async def attached() -> bool:
                return [b.box for b in app.view.boxes] == [box.box_id] and app.view.spec("alpha") is not None

            await wait_for(attached, 10.0, "the box and alpha on screen")
            await nats_server.stop()

            async def down() -> bool:
                return not app.view.connected

            await wait_for(down, 10.0, "the TUI seeing NATS gone")
            await asyncio.sleep(2.5)  # the heartbeats' TTL passes: a box judged now would be dead
            view = app.view
            assert [(b.box, b.status) for b in view.boxes] == [(box.box_id, "live")]
            assert [(r.name, r.state) for r in model_rows(view)] == [("alpha", "resident")]
            assert view.stale_since is not None
            status = str(app.screen.query_one("#status", Static).visual)
            assert "NATS" in status and "fleet as of" in status
            assert str(app.screen.query_one(DataTable).get_row(box.box_id)[0]).startswith("?")

            await pilot.press("2", "p")  # unpin alpha, while NATS is down (refused after REACH_TIMEOUT_S: 1 s)

            async def refused() -> bool:
                return any(
                    e.kind == "error" and f"cannot reach NATS at {nats_server.url}" in e.text
                    for e in app.events.newest_first()
                )

            await wait_for(refused, 8.0, "the unpin refused in bounded time")

            await nats_server.start()

            async def fresh() -> bool:
                return app.view.stale_since is None and [b.status for b in app.view.boxes] == ["live"]

            await wait_for(fresh, 30.0, "the fleet read again after NATS returned")
            kinds = [e.kind for e in app.events.newest_first()]
            assert "outage" in kinds and "reconnect" in kinds
            assert (await model(http, box, "alpha"))["pinned"] is True  # the unpin never ran
    finally:
        await source.stop()


async def test_an_action_before_nats_was_ever_reached_waits_for_it_then_goes_to_the_fleet_read(
    start_box, nats_server, http, monkeypatch
) -> None:
    """Tester h212: before the TUI had ever reached NATS an action failed at once (`no live box in the fleet to
    ask`), the box chosen from none known before waiting for NATS. Now it waits for NATS within the bound and fails
    with the CLI's words; and NATS and a box coming up meanwhile take the action, sent to the box once read."""
    await nats_server.stop()
    monkeypatch.setattr(ops, "REACH_TIMEOUT_S", 1.0)
    unreached = NatsSource.dialing(nats_server.url, period_s=0.2)
    await unreached.start()
    try:
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable) as refused:
            await unreached.ops.unpin("alpha")
        assert refused.value.message == f"cannot reach NATS at {nats_server.url}: connection refused"
        assert time.monotonic() - started >= 0.9
    finally:
        await unreached.stop()

    await unpin_pressed_before_nats_then_a_box_comes(start_box, nats_server, http, monkeypatch, fleet_read_first=False)


async def test_an_action_pressed_before_the_first_box_beats_waits_for_it(
    start_box, nats_server, http, monkeypatch
) -> None:
    """Review h219: a TUI that reaches NATS before any box made its buckets (`fleetbox tui` started before `fleetbox
    serve`) reads the fleet as none, and an action then failed at once with `no live box in the fleet to ask`. Now
    the box is looked for again within the bound, and the first box to beat takes the action."""
    await nats_server.stop()
    await unpin_pressed_before_nats_then_a_box_comes(start_box, nats_server, http, monkeypatch, fleet_read_first=True)


async def unpin_pressed_before_nats_then_a_box_comes(
    start_box, nats_server, http, monkeypatch, *, fleet_read_first: bool
) -> None:
    """An unpin pressed while NATS (stopped) refuses the TUI is taken by the box that starts once NATS is back; with
    `fleet_read_first`, only after the TUI has read the fleet as none (no box there yet)."""
    monkeypatch.setattr(ops, "REACH_TIMEOUT_S", 60.0)
    source = NatsSource.dialing(nats_server.url, period_s=0.2)
    await source.start()
    try:
        unpin = asyncio.create_task(source.ops.unpin("alpha"))
        await wait_for(lambda: source.view().problem is not None, 10.0, "the source refused by NATS")
        assert not unpin.done()
        await nats_server.start()
        if fleet_read_first:
            await wait_for(lambda: "no fleet" in (source.view().waiting_for or ""), 10.0, "no fleet read yet")
            assert not unpin.done()
        box = await start_box(default_model=False, models=[noop_model("alpha")], heartbeat_s=0.3)
        answer = await asyncio.wait_for(unpin, 30.0)
        assert answer["ok"] is True
        assert (await model(http, box, "alpha"))["pinned"] is False
    finally:
        await source.stop()


async def test_a_nats_server_that_stops_answering_is_out_of_reach_and_an_action_then_is_never_sent(
    start_box, nats_server, http, monkeypatch
) -> None:
    """A hung server (SIGSTOP) keeps the connection up: the TUI called every box dead and every model cold, and an
    unpin pressed then ran when the server woke. Now the view is the fleet as last seen, the status line says
    `no answer`, and the action fails within the bound, unsent."""
    monkeypatch.setattr(ops, "REACH_TIMEOUT_S", 1.0)
    box = await start_box(default_model=False, models=[noop_model("alpha")], box_id="tui-hung")
    nc = await connect(nats_server.url)
    source = NatsSource(nc, address=nats_server.url, own_connection=True, period_s=0.2)
    await source.start()
    app = FleetboxApp(source, refresh_s=0.2)
    assert nats_server.process is not None
    try:
        async with app.run_test(size=(80, 24)) as pilot:

            async def attached() -> bool:
                return app.view.stale_since is None and [b.box for b in app.view.boxes] == [box.box_id]

            await wait_for(attached, 10.0, "the box on screen")
            try:
                await freeze(nats_server)  # inside the try: a freeze that times out is still SIGCONTed

                async def out_of_reach() -> bool:
                    return not app.view.connected

                await wait_for(out_of_reach, 10.0, "the TUI seeing NATS not answering")
                view = app.view
                assert view.stale_since is not None and view.problem == "no answer"
                assert [b.box for b in view.boxes] == [box.box_id] and view.boxes[0].status != "dead"
                assert [(r.name, r.state) for r in model_rows(view)] == [("alpha", "resident")]
                await pilot.pause()
                status = str(app.screen.query_one("#status", Static).visual)
                assert "cannot reach NATS: no answer" in status and "fleet as of" in status, status
                assert str(app.screen.query_one(DataTable).get_row(box.box_id)[0]).startswith("?")

                await pilot.press("2", "p")  # unpin alpha, while NATS does not answer

                async def refused() -> bool:
                    return any(
                        e.kind == "error" and f"cannot reach NATS at {nats_server.url}: no answer" in e.text
                        for e in app.events.newest_first()
                    )

                await wait_for(refused, 8.0, "the unpin refused in bounded time")
            finally:
                os.kill(nats_server.process.pid, signal.SIGCONT)

            async def fresh() -> bool:
                return app.view.connected and app.view.stale_since is None and app.view.boxes[0].status == "live"

            await wait_for(fresh, 30.0, "the fleet read again once NATS answers")
            assert (await model(http, box, "alpha"))["pinned"] is True  # the unpin never ran
            assert not any("TimeoutError" in e.text for e in app.events.newest_first())
            assert any(e.kind == "outage" and "(no answer)" in e.text for e in app.events.newest_first())
    finally:
        await source.stop()


async def test_stopping_the_source_after_nats_went_away_raises_nothing(nats_server) -> None:
    """Quitting `fleetbox tui` once NATS was gone printed `fleetbox: Connection lost` and exited 1: closing the
    connection raised it, from a reconnect that had failed."""
    source = NatsSource.dialing(nats_server.url, period_s=0.2)
    problems: list[str] = []
    said = source._connect_failed
    source._connect_failed = lambda problem: (problems.append(problem), said(problem))  # type: ignore[method-assign]
    await source.start()
    try:

        async def waiting_for_a_fleet() -> bool:
            return "no fleet at" in (source.view().waiting_for or "")

        await wait_for(waiting_for_a_fleet, 10.0, "the source connected")
        await nats_server.stop()

        async def refused() -> bool:
            return problems.count("connection refused") >= 3

        await wait_for(refused, 10.0, "reconnects refused")
    finally:
        await source.stop()


def test_evict_from_a_named_box_says_when_it_is_a_gateway_or_does_not_hold_the_model() -> None:
    """The heartbeats are built by hand and the box's answer is stubbed: this checks FleetOps's rule."""
    from appliance.errors import Conflict, NotFound
    from tui.model import BoxState

    boxes = [
        BoxState.from_heartbeat({"box": "gw", "role": "gateway", "ts": time.time()}),
        BoxState.from_heartbeat({"box": "w", "role": "all", "ts": time.time()}),
    ]
    fleet_ops = ops.FleetOps(None, lambda: boxes)  # type: ignore[arg-type]
    sent: list[str] = []

    async def call(box: str, verb: str, payload: dict[str, Any]) -> dict[str, Any]:
        sent.append(box)
        return {"model": payload["model"], "evicted": False}

    fleet_ops._call = call  # type: ignore[method-assign]

    async def run() -> None:
        with pytest.raises(Conflict, match="box gw is a gateway; it runs no models"):
            await fleet_ops.evict("alpha", "gw")
        with pytest.raises(NotFound, match="model alpha is not resident on box w"):
            await fleet_ops.evict("alpha", "w")

    asyncio.run(run())
    assert sent == ["w"]  # the gateway is never asked


def test_evict_by_an_alias_evicts_from_every_box_that_holds_the_model() -> None:
    """Tester h226: `fleetbox models evict ALIAS` matched the heartbeats (which name a model by its own name) against
    the alias, found no holder, asked one box, and said `evicted_from: []` (or the one box asked) with the model still
    resident on the others, exit 0. The box's answer names the model: its holders by that name are asked too."""
    from tui.model import BoxState

    def beat(box: str, held: list[str]) -> BoxState:
        models = [{"name": name, "state": "resident"} for name in held]
        return BoxState.from_heartbeat({"box": box, "role": "all", "ts": time.time(), "models": models})

    holding = {"a": ["other"], "b": ["mini"], "c": ["mini"]}
    fleet_ops = ops.FleetOps(None, lambda: [beat(box, held) for box, held in holding.items()])  # type: ignore[arg-type]
    sent: list[str] = []

    async def call(box: str, verb: str, payload: dict[str, Any]) -> dict[str, Any]:
        sent.append(box)
        evicted = "mini" in holding[box]
        return {"model": "mini", "evicted": evicted}

    async def answering() -> float:
        return 0.0

    fleet_ops._call = call  # type: ignore[method-assign]
    fleet_ops._answering = answering  # type: ignore[method-assign]
    assert asyncio.run(fleet_ops.evict("m")) == {"ok": True, "model": "mini", "evicted_from": ["b", "c"]}
    assert sent == ["a", "b", "c"]  # one box to learn the name, then its holders, each once
    sent.clear()
    assert asyncio.run(fleet_ops.evict("mini")) == {"ok": True, "model": "mini", "evicted_from": ["b", "c"]}
    assert sent == ["b", "c"]


def test_a_verb_for_any_box_goes_to_one_beating_on_time_before_a_late_one() -> None:
    """Planning note: `models delete` asked the first live box by name, a frozen one (only late until its heartbeat
    expires) included, and waited the verb's 120 s for it."""
    from dataclasses import replace

    from tui.model import BoxState

    beating = {"role": "all", "ts": time.time()}
    boxes = [
        replace(BoxState.from_heartbeat({"box": "a-frozen", **beating}), status="late"),
        BoxState.from_heartbeat({"box": "b-fine", **beating}),
    ]
    fleet_ops = ops.FleetOps(None, lambda: boxes)  # type: ignore[arg-type]
    assert [box.box for box in fleet_ops.live()] == ["b-fine", "a-frozen"]
    assert fleet_ops._any_box() == "b-fine" and fleet_ops.holders("x") == []


def test_an_empty_nats_url_list_is_a_usage_error(monkeypatch) -> None:
    """`--nats ""` (or blanks, or bare commas) used to spin for ever; `FBX_NATS=` still means the default."""
    for value in ("", " ", ","):
        for args in (["models", "list"], ["tui"], ["box", "drain", "b"]):
            result = CliRunner().invoke(cli.app, [*args, "--nats", value])
            assert result.exit_code == 2, (args, value, result.output)
            assert result.output.startswith("fleetbox: --nats: no NATS URL") and len(result.output.splitlines()) == 1
    bad = {
        "nats://127.0.0.1:99999": "has a port outside 1 to 65535",  # was a 60-line traceback (AssertionError)
        "nats://127.0.0.1:-1": "has a port outside 1 to 65535",
        "http://127.0.0.1:4222": "is not a NATS URL",  # was "host not found"
    }
    for value, said in bad.items():
        result = CliRunner().invoke(cli.app, ["models", "list", "--nats", value])
        assert result.exit_code == 2 and said in result.output and len(result.output.splitlines()) == 1, result.output
    monkeypatch.setattr(commands, "ATTACH_TIMEOUT_S", 1.0)
    monkeypatch.setenv("FBX_NATS", "")
    result = CliRunner().invoke(cli.app, ["models", "list"])
    assert result.exit_code == 1 and "nats://127.0.0.1:4222" in result.output, result.output


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["models", "load", ""], "fleetbox: MODEL '' names no model; give a model's name or alias"),
        (["models", "load", "  "], "fleetbox: MODEL '  ' names no model"),
        (["models", "pin", ""], "fleetbox: MODEL '' names no model"),
        (["models", "unpin", "\t"], "fleetbox: MODEL '\\t' names no model"),
        (["models", "evict", " "], "fleetbox: MODEL ' ' names no model"),
        (["models", "load", "a\x01b"], "has a control character"),
        (["models", "load", "m" * 201], "is longer than 200 characters"),
        (["models", "load", "m", "--box", ""], "fleetbox: box id '' is not 1 to 64 letters"),
        (["models", "evict", "m", "--box", "a.b"], "fleetbox: box id 'a.b' is not 1 to 64 letters"),
        (["box", "drain", " "], "fleetbox: box id ' ' is not 1 to 64 letters"),
        (["models", "delete", ""], "fleetbox: MODEL '' names no model"),
        (["models", "register", "", "/m"], "fleetbox: NAME '' is empty; give the name the new model"),
        # A box was asked, and answered with its schema's regular expression (exit 1).
        (["models", "register", "abc ", "/m"], "fleetbox: NAME 'abc ' starts or ends with a space"),
        (["models", "register", "a\u200bb", "/m"], "has a control or invisible character (U+200B)"),
        (["models", "register", "a\tb", "/m"], "has a control character"),
        (["models", "register", "m", "/m", "--task", "embedding"], "--task: 'embedding' is not one of embed, score"),
        (["models", "register", "m", "/m", "--dtype", "fp8"], "--dtype: 'fp8' is not one of float32, float16"),
        (["models", "register", "m", "/m", "--runtime", "noop"], "--runtime: 'noop' is not one of torch, onnx"),
        (["models", "register", "m", "/m", "--box", "a b"], "fleetbox: box id 'a b' is not 1 to 64 letters"),
    ],
)
def test_an_empty_model_name_or_bad_box_id_is_a_usage_error_before_any_box_is_asked(
    args: list[str], said: str, monkeypatch
) -> None:
    """`models load ""` was sent to the fleet (exit 1 with a box's answer, or a NATS error when none was up);
    `--box ""` was taken as no box given. Nothing is attached: a NATS that would be dialled fails the test."""

    def no_dialling(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("a usage error dialled NATS")

    monkeypatch.setattr(commands, "act", no_dialling)
    result = CliRunner().invoke(cli.app, [*args, "--nats", "nats://127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert said in result.output and len(result.output.splitlines()) == 1, result.output


def test_the_tui_command_exits_non_zero_when_the_app_fails(monkeypatch) -> None:
    """A source whose view raises stands for any bug in the app: the traceback is printed, the exit is 1."""
    from tests.tui_fake import FakeSource

    class Broken(FakeSource):
        def view(self):  # type: ignore[override]
            raise RuntimeError("a bug in the TUI")

    monkeypatch.setattr(NatsSource, "dialing", classmethod(lambda cls, *a, **k: Broken()))
    monkeypatch.setattr(FleetboxApp, "run_async", functools.partialmethod(FleetboxApp.run_async, headless=True))
    monkeypatch.setattr(fleet_cli, "not_a_terminal", lambda: None)
    result = CliRunner().invoke(cli.app, ["tui", "--nats", "nats://127.0.0.1:1"])
    assert result.exit_code == 1, result.output


def test_the_tui_without_a_terminal_says_so() -> None:
    """Tester h114: `fleetbox tui` with its output in a pipe ran for ever, writing a screen's escapes into it, where
    `serve --tui` refuses."""
    result = CliRunner().invoke(cli.app, ["tui", "--nats", "nats://127.0.0.1:1"])
    assert result.exit_code == 2 and result.output.startswith("fleetbox: tui needs a terminal"), result.output


@pytest.mark.parametrize("verb", ["tui", "serve"])
def test_the_tui_with_its_stderr_not_a_terminal_says_so(verb: str, tmp_path) -> None:
    """Tester h212: `fleetbox tui 2>err.log` drew the whole screen into the file (Textual draws on stderr) and left
    the terminal blank, where a piped stdout is refused. Its stdout and stdin a terminal here, its stderr a file."""
    import pty

    ports = ["--port", str(free_port()), "--nats-port", str(free_port())]  # were it to start, on ports of its own
    command = ["tui", "--nats", "nats://127.0.0.1:1"] if verb == "tui" else ["serve", "--tui", *ports]
    controller, terminal = pty.openpty()
    errors = tmp_path / "err.log"
    try:
        with errors.open("wb") as err:
            result = subprocess.run(
                [sys.executable, "-m", "appliance.cli", *command],
                stdin=terminal,
                stdout=terminal,
                stderr=err,
                timeout=30,
                env={**os.environ, "FBX_STATE_DIR": str(tmp_path / "state")},
            )
    finally:
        os.close(terminal)
        os.close(controller)
    said = errors.read_text()
    assert result.returncode == 2 and said.startswith("fleetbox: ") and "needs a terminal" in said, said
    assert "its stderr is not one" in said and "\x1b[" not in said, said


@pytest.mark.parametrize("verb", ["tui", "serve"])
def test_the_tui_with_its_stdin_not_a_terminal_says_so(verb: str, tmp_path) -> None:
    """Review h219: `fleetbox tui </dev/null` drew and ran for ever, deaf to `q` and Ctrl-C (Textual reads its keys
    from stdin). Its stdout and stderr a terminal here, its stdin /dev/null."""
    import pty

    ports = ["--port", str(free_port()), "--nats-port", str(free_port())]  # were it to start, on ports of its own
    command = ["tui", "--nats", "nats://127.0.0.1:1"] if verb == "tui" else ["serve", "--tui", *ports]
    controller, terminal = pty.openpty()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "appliance.cli", *command],
            stdin=subprocess.DEVNULL,
            stdout=terminal,
            stderr=terminal,
            timeout=30,
            env={**os.environ, "FBX_STATE_DIR": str(tmp_path / "state")},
        )
        said = os.read(controller, 65536).decode(errors="replace")
    finally:
        os.close(terminal)
        os.close(controller)
    assert result.returncode == 2 and "needs a terminal: its stdin is not one" in said, said


def test_version_is_printed_by_the_option_and_the_command() -> None:
    """Operator tester: `fleetbox --version` was a usage error; `fleetbox version` the only way."""
    from appliance import __version__
    from appliance.build import build_id

    said = f"{__version__} (build {build_id()})" if build_id() else __version__
    for args in (["--version"], ["version"]):
        result = CliRunner().invoke(cli.app, args)
        assert (result.exit_code, result.output) == (0, f"{said}\n"), (args, result.output)


async def test_an_option_of_one_value_given_twice_is_a_usage_error() -> None:
    """Tester h146: `fleetbox models load M --box a --box b` loaded on b, click keeping the last `--box` silently;
    `--pin --unpin` unpinned. Refused before anything is asked (no NATS here), exit 2; list options repeat."""
    cases = [
        (["models", "load", "m", "--box", "a", "--box=b"], "fleetbox: --box given 2 times; give it once"),
        (["models", "update", "m", "--pin", "--unpin"], "fleetbox: --pin and --unpin given together; give one of them"),
        (["serve", "--port", "1", "--port", "2"], "fleetbox: --port given 2 times; give it once"),
    ]
    for args, said in cases:
        code, out, err = await fleetbox(*args)
        assert (code, out, err.strip()) == (2, "", said), (args, err)
    code, _, err = await fleetbox(
        "models", "update", "m", "--alias", "a", "--alias", "b", "--nats", "nats://127.0.0.1:1"
    )
    assert code == 1 and "cannot reach NATS" in err, err  # past the check: a list option may repeat
