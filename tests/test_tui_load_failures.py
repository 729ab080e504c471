"""A model whose load failed on a box, as the TUI and `fleetbox models list` show it: from the box's heartbeat
record (its `load_failed`), not from catching the model `loading` in one beat and gone from the next.

The views are built by hand from heartbeat records on purpose: what is checked is how the rows, the events and the
Models screen read a record; `tests/test_load_failures.py` checks that a real box writes it.
"""

from __future__ import annotations

import io
from dataclasses import replace
from typing import Any

from rich.console import Console
from textual.pilot import Pilot
from textual.widgets import DataTable, Static

from runtimes.base import Task
from tests.test_tui_keys import Tailored, drive
from tests.tui_fake import T0, spec
from tui.app import FleetboxApp
from tui.commands import print_rows, rows_as_json
from tui.events import EventLog
from tui.model import BoxState, FleetView, model_rows

WHY = "SafetensorError('Error while deserializing header: invalid JSON in header')"


def beat(
    box: str, at: float, models: tuple[dict[str, Any], ...] = (), failed: tuple[dict[str, Any], ...] = ()
) -> BoxState:
    """A box as its heartbeat record says: `failed` is the record's `load_failed`."""
    record = {"box": box, "role": "all", "ts": at, "models": list(models), "load_failed": list(failed)}
    return BoxState.from_heartbeat(record)


def view(at: float, *boxes: BoxState) -> FleetView:
    return FleetView(address="nats://test", taken_at=at, boxes=boxes, catalog=(spec("brk2", Task.CLASSIFY),))


def test_a_model_whose_load_failed_between_two_beats_reads_failed_with_why_and_is_one_event() -> None:
    """Tester h212: a load that failed in 9 ms, between two heartbeats, left the row `cold` with `err 0` and no
    event; a pinned model's load tried again every 30 s and failing kept it `cold`."""
    log = EventLog()
    failed = ({"name": "brk2", "error": WHY, "at": T0 + 1.5},)
    log.observe(view(T0, beat("boxa", T0), beat("boxb", T0)))
    log.observe(view(T0 + 2, beat("boxa", T0 + 2), beat("boxb", T0 + 2, failed=failed)))

    (row,) = model_rows(view(T0 + 2, beat("boxa", T0 + 2), beat("boxb", T0 + 2, failed=failed)))
    assert row.state == "failed" and row.load_failed_on == {"boxb": WHY} and row.boxes == ()
    (listed,) = rows_as_json([row])
    assert listed["state"] == "failed" and listed["load_failed_on"] == {"boxb": WHY}
    out = io.StringIO()
    print_rows([row], Console(file=out))
    assert "failed" in out.getvalue().splitlines()[1]

    # The box tries it again (caught `loading` by one beat), and it fails again for the same reason: no new event.
    loading = ({"name": "brk2", "state": "loading", "bytes": None, "pinned": False},)
    retried = view(T0 + 4, beat("boxa", T0 + 4), beat("boxb", T0 + 4, models=loading, failed=failed))
    log.observe(retried)
    assert model_rows(retried)[0].state == "failed"  # still: that box's last load failed
    again = ({"name": "brk2", "error": WHY, "at": T0 + 31},)
    log.observe(view(T0 + 32, beat("boxa", T0 + 32), beat("boxb", T0 + 32, failed=again)))
    # Another box's load fails too: one more event, naming it.
    log.observe(view(T0 + 34, beat("boxa", T0 + 34, failed=again), beat("boxb", T0 + 34, failed=again)))

    failures = [e.text for e in reversed(log.newest_first()) if e.kind == "error"]
    assert failures == [f"brk2 failed to load on boxb: {WHY}", f"brk2 failed to load on boxa: {WHY}"]

    # Loaded at last on one box: resident there, the other box's failure still named beside it.
    resident = ({"name": "brk2", "state": "resident", "bytes": 1000, "pinned": False},)
    (row,) = model_rows(view(T0 + 36, beat("boxa", T0 + 36, models=resident), beat("boxb", T0 + 36, failed=again)))
    assert row.state == "resident" and row.boxes == ("boxa",) and row.load_failed_on == {"boxb": WHY}
    # A failure on a box no longer live is not the fleet's.
    dead = replace(beat("boxb", T0 + 36, failed=again), status="dead")
    assert model_rows(view(T0 + 200, dead))[0].state == "cold"


def test_a_failure_a_box_already_holds_when_it_joins_or_comes_back_is_an_event() -> None:
    """Review h219: a box first seen (joining) or back from dead with a failure in its record read `failed` on the
    Models screen while the Events screen never said so (failures were compared only between two usable beats)."""
    log = EventLog()
    failed = ({"name": "brk2", "error": WHY, "at": T0 + 1},)
    log.observe(view(T0))  # attached: no box yet
    log.observe(view(T0 + 2, beat("boxb", T0 + 2, failed=failed)))
    dead = replace(beat("boxb", T0 + 2, failed=failed), status="dead")  # as last seen, as the TUI's source keeps it
    log.observe(view(T0 + 20, dead))
    log.observe(view(T0 + 22, beat("boxb", T0 + 22, failed=failed)))  # back: the same failure, no news
    again = ({"name": "brk2", "error": "OSError: gone", "at": T0 + 21},)
    log.observe(view(T0 + 40, dead))
    log.observe(view(T0 + 42, beat("boxb", T0 + 42, failed=again)))  # back: failed anew meanwhile, for another why
    texts = [e.text for e in reversed(log.newest_first())]
    assert [t for t in texts if "failed to load" in t] == [
        f"brk2 failed to load on boxb: {WHY}",
        "brk2 failed to load on boxb: OSError: gone",
    ], texts


def test_a_load_that_ends_unnamed_as_a_failure_is_no_failure_on_a_box_that_names_failures() -> None:
    """Review h219: a model gone from a box's `models` while it loaded (deleted meanwhile, or unloaded while starting)
    read `failed to load` on the Events screen though the box's `load_failed` named no failure; a box of an older
    version, whose record has no `load_failed`, still gets that event (it names no failure any other way)."""
    loading = ({"name": "brk2", "state": "loading", "bytes": None, "pinned": False},)
    older = {"box": "boxa", "role": "all", "models": []}
    for box, said in (("boxb", []), ("boxa", ["brk2 failed to load on boxa"])):
        log = EventLog()

        def state(at: float, models: tuple[dict[str, Any], ...] = (), box: str = box) -> BoxState:
            return (
                beat(box, at, models)
                if box == "boxb"
                else BoxState.from_heartbeat(older | {"ts": at, "models": list(models)})
            )

        log.observe(view(T0, state(T0)))
        log.observe(view(T0 + 1, state(T0 + 1, loading)))
        log.observe(view(T0 + 2, state(T0 + 2)))
        assert [e.text for e in log.newest_first() if "failed" in e.text] == said


def test_the_models_screen_shows_a_failed_model_and_why_in_its_detail() -> None:
    failed = ({"name": "brk2", "error": WHY, "at": T0},)

    def with_failure(fake: FleetView) -> FleetView:
        catalog = (*fake.catalog, spec("brk2", Task.CLASSIFY))
        boxes = tuple(replace(b, load_failed=beat(b.box, b.ts, failed=failed).load_failed) for b in fake.boxes[:1])
        return replace(fake, catalog=catalog, boxes=boxes + fake.boxes[1:])

    app = FleetboxApp(Tailored(with_failure), refresh_s=0)
    seen: dict[str, str] = {}

    async def script(pilot: Pilot) -> None:
        await pilot.press("2")
        table = app.screen.query_one(DataTable)
        index = next(i for i, r in enumerate(table.ordered_rows) if r.key.value == "brk2")
        seen["state"] = str(table.get_row_at(index)[2])
        table.move_cursor(row=index)
        await pilot.pause()
        seen["detail"] = " ".join(str(app.screen.query_one("#detail", Static).visual).split())

    drive(app, script)
    assert seen["state"] == "failed"
    assert "nowhere (failed)" in seen["detail"] and "failed on " in seen["detail"]
    assert WHY in seen["detail"], seen["detail"]
