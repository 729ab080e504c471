"""Keys and dialogs of the TUI, against the fake fleet (tests/tui_fake.py).

The fleet behind the app is a fake on purpose: what these tests check is how the screens and the
dialogs answer keys (a double Enter, Home and End, the help, the footer of a dialog), not the
fleet. `tests/test_tui_live.py` drives the same app against a real NATS and a real box.
"""

from __future__ import annotations

import io
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest
from rich.console import Console
from textual import events
from textual.pilot import Pilot
from textual.widgets import DataTable, Footer, Input, Sparkline, Static
from textual.widgets._footer import FooterKey
from textual.widgets.data_table import ColumnKey

from appliance.errors import Forbidden
from runtimes.base import Task
from tests.tui_fake import FakeSource, MiB, fleet_view, resident, spec
from tui.app import FleetboxApp, describe
from tui.dialogs import Choose, Confirm, KeysHelp, RegisterForm
from tui.model import FleetView, model_rows
from tui.screens import EventsScreen, FleetScreen


def drive(app: FleetboxApp, script: Callable[[Pilot], Awaitable[None]]) -> None:
    """Run `app` headless at 80×24 through `script`, with every scripted view fed first; a crash fails."""

    async def run(pilot: Pilot) -> None:
        source = app.source
        assert isinstance(source, FakeSource)
        while not source.exhausted:
            app.tick()
        app.tick()
        await script(pilot)
        await app.workers.wait_for_complete()
        if app.return_code is None:  # a crash has set it already, and exit() would set it back to 0
            app.exit()

    app.run(headless=True, size=(80, 24), auto_pilot=run)
    assert app.return_code == 0, "the app crashed"


def test_a_second_enter_in_a_choice_dialog_is_ignored() -> None:
    """Two Enters in one write reach the option list before the dialog is gone: it answers once."""
    app = FleetboxApp(FakeSource(), refresh_s=0)

    async def script(pilot: Pilot) -> None:
        await pilot.press("l")  # Fleet: load a model on the first box
        assert isinstance(app.screen, Choose)
        app.post_message(events.Key("enter", "\r"))  # as a terminal delivers "\r\r" in one read
        app.post_message(events.Key("enter", "\r"))
        await pilot.pause()
        await pilot.pause()
        assert isinstance(app.screen, FleetScreen)

    drive(app, script)
    assert app.source.ops.calls == [("load", ("distilbert-sst2", "gpu-a-7f3k2q"))]


def test_a_second_answer_to_a_confirmation_is_ignored() -> None:
    app = FleetboxApp(FakeSource(), refresh_s=0)

    async def script(pilot: Pilot) -> None:
        await pilot.press("d")
        assert isinstance(app.screen, Confirm)
        app.post_message(events.Key("y", "y"))
        app.post_message(events.Key("y", "y"))
        await pilot.pause()
        assert isinstance(app.screen, FleetScreen)

    drive(app, script)
    assert app.source.ops.calls == [("drain", "gpu-a-7f3k2q")]


@pytest.mark.parametrize("screen", ["1", "2", "4"])
def test_home_and_end_move_the_selection_to_the_first_and_last_row(screen: str) -> None:
    app = FleetboxApp(FakeSource(), refresh_s=0)

    async def script(pilot: Pilot) -> None:
        await pilot.press(screen)
        table = app.screen.query_one(DataTable)
        assert table.row_count > 2
        await pilot.press("down")
        assert table.cursor_row == 1
        await pilot.press("end")
        assert table.cursor_row == table.row_count - 1
        await pilot.press("home")
        assert table.cursor_row == 0

    drive(app, script)


def screen_text(app: FleetboxApp) -> str:
    """The text of every Static on the current screen, rich tables rendered as a terminal would."""
    console = Console(width=100, file=io.StringIO(), color_system=None)
    with console.capture() as captured:
        for static in app.screen.query(Static):
            console.print(static.content)
    return captured.get()


def test_the_keys_help_lists_every_key() -> None:
    app = FleetboxApp(FakeSource(), refresh_s=0)
    seen: list[str] = []

    async def script(pilot: Pilot) -> None:
        await pilot.press("question_mark")
        assert isinstance(app.screen, KeysHelp)
        await pilot.pause()
        seen.append(screen_text(app))

    drive(app, script)
    text = seen[0]
    for key in ("ctrl+q", "PgUp", "PgDn", "Home", "End", "y / n", "Enter", "Esc", "Tab", "ctrl+s", "d", "p", "r"):
        assert key in text, f"{key} missing from the help:\n{text}"


@pytest.mark.parametrize(
    ("keys", "dialog", "shown"),
    [
        (("d",), Confirm, {"y", "n"}),
        (("l",), Choose, {"escape"}),
        (("2", "r"), RegisterForm, {"ctrl+s", "escape"}),
        (("question_mark",), KeysHelp, {"escape"}),
    ],
)
def test_a_dialog_footer_shows_the_dialog_keys(keys: tuple[str, ...], dialog: type, shown: set[str]) -> None:
    app = FleetboxApp(FakeSource(), refresh_s=0)

    async def script(pilot: Pilot) -> None:
        await pilot.press(*keys)
        assert isinstance(app.screen, dialog)
        footer = app.screen.query_one(Footer)
        await pilot.pause()
        keys_in_footer = {item.key for item in footer.query(FooterKey)}
        assert shown <= keys_in_footer, keys_in_footer
        assert not keys_in_footer & {"1", "d", "l", "e"}, keys_in_footer  # not the screen's below

    drive(app, script)


def test_a_refused_registration_keeps_the_form_open_with_the_reason() -> None:
    source = FakeSource()
    app = FleetboxApp(source, refresh_s=0)

    async def refuse(registration: dict[str, Any], box: str | None = None) -> dict[str, Any]:
        source.ops.calls.append(("register", registration))
        raise Forbidden(f"path {registration['path']} is outside the model roots")

    source.ops.register = refuse  # type: ignore[method-assign]

    async def script(pilot: Pilot) -> None:
        await pilot.press("2", "r")
        await pilot.press(*"mine", "tab", *"/etc", "ctrl+s")
        await app.workers.wait_for_complete()
        await pilot.pause()
        form = app.screen
        assert isinstance(form, RegisterForm)
        assert "outside the model roots" in str(form.query_one("#problem", Static).visual)
        assert form.query_one("#name").value == "mine"  # type: ignore[attr-defined]

    drive(app, script)
    assert any(e.kind == "error" and "outside the model roots" in e.text for e in app.events.newest_first())


def test_the_events_screen_shows_the_whole_text_of_the_selected_event() -> None:
    app = FleetboxApp(FakeSource(), refresh_s=0)
    long_text = "a very long event text " * 8

    async def script(pilot: Pilot) -> None:
        from tui.events import Event

        app.events.add(Event(0.0, "error", "x", long_text.strip()))
        await pilot.press("4")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, EventsScreen)
        detail = str(screen.query_one("#detail", Static).visual)
        assert long_text.strip() in " ".join(detail.split())

    drive(app, script)


def test_one_box_is_one_box_in_the_status_line_and_the_events() -> None:
    class OneBox(FakeSource):
        def view(self) -> FleetView:
            view = super().view()
            return replace(view, boxes=view.boxes[:1], catalog=view.catalog[:1])

    app = FleetboxApp(OneBox(), refresh_s=0)

    async def script(pilot: Pilot) -> None:
        await pilot.pause()
        assert "1 box ·" in str(app.screen.query_one("#status", Static).visual)
        assert any("1 box, 1 model" in e.text for e in app.events.newest_first())

    drive(app, script)
    assert fleet_view(0).boxes  # the fake has boxes to cut


def test_models_json_has_null_latencies_where_the_table_shows_none_and_float_rates() -> None:
    from tui.commands import rows_as_json
    from tui.model import model_rows

    rows = {row["name"]: row for row in rows_as_json(model_rows(fleet_view(29)))}
    cold = rows["distilbert-sst2"]
    assert cold["state"] == "cold" and cold["p50_ms"] is None and cold["p99_ms"] is None
    assert isinstance(cold["rps"], float) and cold["rps"] == 0.0
    assert all(isinstance(row["rps"], float) for row in rows.values())
    assert isinstance(rows["all-minilm-l6-v2"]["p99_ms"], float)


class Tailored(FakeSource):
    """The fake fleet's last view, changed by `change`: a fleet with what one test needs (many models, adapters)."""

    def __init__(self, change: Callable[[FleetView], FleetView], steps: int = 30) -> None:
        super().__init__(steps)
        self._change = change

    def view_now(self) -> FleetView:
        return self._change(super().view_now())


def test_an_adapter_is_listed_under_its_base_on_the_screen_and_in_models_list() -> None:
    """Rows were sorted by name: an adapter of `cls` named `tui-lora` showed under whatever model preceded it."""
    catalog = (
        spec("cls", Task.CLASSIFY),
        spec("enc", Task.EMBED),
        spec("enc-lora", Task.EMBED, adapter_of="enc"),
        spec("sentence-transformers/all-minilm", Task.EMBED),
        spec("tui-lora", Task.CLASSIFY, adapter_of="cls"),
        spec("a-lora", Task.CLASSIFY, adapter_of="cls"),
        spec("orphan-lora", Task.EMBED, adapter_of="gone"),
    )
    expected = ["cls", "a-lora", "tui-lora", "enc", "enc-lora", "orphan-lora", "sentence-transformers/all-minilm"]
    assert [row.name for row in model_rows(replace(fleet_view(29), catalog=catalog))] == expected
    app = FleetboxApp(Tailored(lambda view: replace(view, catalog=catalog)), refresh_s=0)
    shown: list[list[str]] = []

    async def script(pilot: Pilot) -> None:
        await pilot.press("2")
        shown.append([row.key.value or "" for row in app.screen.query_one(DataTable).ordered_rows])

    drive(app, script)
    assert shown == [expected]


def test_the_events_screen_stays_on_the_newest_event_as_events_arrive() -> None:
    """The selection followed the event it was on, so the newest events arrived above the view, hidden; on the
    newest it now stays on the newest (watching, or coming back to the screen), and on an older one it stays there."""
    from tui.events import Event

    app = FleetboxApp(FakeSource(), refresh_s=0)

    def add(count: int, what: str) -> None:
        for n in range(count):
            app.events.add(Event(float(n), "register", f"{what}{n}", f"{what}{n} registered (embed)"))
        app.tick()

    async def script(pilot: Pilot) -> None:
        await pilot.press("4")
        table = app.screen.query_one(DataTable)
        assert table.cursor_row == 0
        add(30, "w")  # watched
        await pilot.pause()
        assert (table.cursor_row, table.scroll_y) == (0, 0)
        assert "w29 registered" in str(app.screen.query_one("#detail", Static).visual)
        await pilot.press("1")
        add(30, "x")  # while another screen is shown
        await pilot.press("4")
        await pilot.pause()
        table = app.screen.query_one(DataTable)
        assert (table.cursor_row, table.scroll_y) == (0, 0)
        assert "x29 registered" in str(app.screen.query_one("#detail", Static).visual)
        await pilot.press("down", "down")  # on an older event, it stays on that one
        add(3, "y")
        await pilot.pause()
        assert "x27 registered" in str(app.screen.query_one("#detail", Static).visual)

    drive(app, script)


def test_the_box_detail_shows_every_model_or_says_how_many_more() -> None:
    """The detail showed four models and cut the rest in silence; now what does not fit is counted and named."""
    many = tuple(resident(f"model-{n:02d}", 10 * MiB, float(n)) for n in range(20))

    def loaded(view: FleetView) -> FleetView:
        return replace(view, boxes=(replace(view.boxes[0], models=many), *view.boxes[1:]))

    app = FleetboxApp(Tailored(loaded), refresh_s=0)

    async def script(pilot: Pilot) -> None:
        await pilot.pause()
        detail = app.screen.query_one("#detail", Static)
        lines = str(detail.visual).splitlines()
        assert len(lines) <= detail.content_region.height, "lines cut by the panel's height"
        shown = [n for n in range(20) if any(f"model-{n:02d}:" in line for line in lines)]
        more = [line for line in lines if "more:" in line]
        assert len(more) == 1 and f"… {20 - len(shown)} more: model-{len(shown):02d}," in more[0], lines
        assert shown == list(range(len(shown))) and len(shown) >= 4

    drive(app, script)


def test_models_list_shows_every_column_at_80_columns() -> None:
    """At 80 columns p99 and errors were gone and task and state cut (`classi…`); the names fold instead."""
    from tui.commands import print_rows
    from tui.model import ModelRow

    rows = [
        ModelRow("sentence-transformers/all-MiniLM-L6-v2", "embed", "torch", None, True, "resident",
                 ("box-a", "box-b"), 1, 12, 3.0, 12.5, 130.2, 3),
        ModelRow("cls", "classify", "torch", None, False, "resident", ("box-a",), 1, 0, 103.4, 2.5, 1234.0, 1234),
        ModelRow("tui-lora", "classify", "torch", "cls", False, "cold", (), 1, 0, 0.0, 0.0, 0.0, 0),
    ]  # fmt: skip
    out = io.StringIO()
    print_rows(rows, Console(file=out, width=80, force_terminal=True, color_system=None))
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert lines[0].split() == ["model", "task", "state", "on", "pin", "queue", "req/s", "p50ms", "p99ms", "err"]
    assert lines[-2].split()[1:] == ["classify", "resident", "box-a", "0", "103", "2.5", "1234", "1234"], lines
    assert lines[-1].split() == ["↳", "tui-lora", "classify", "cold", "-", "0", "-", "-", "-", "0"], lines


def test_the_register_form_says_in_one_line_why_a_name_cannot_be_a_model_name() -> None:
    """A 250-character name was sent to a box, whose answer quoted its schema (``of length <= 200 - at `$.name` ``)
    and the notification repeated the name over the form's buttons; now the form says it, and no box is asked."""
    app = FleetboxApp(FakeSource(), refresh_s=0)
    said: list[str] = []

    async def script(pilot: Pilot) -> None:
        await pilot.press("2", "r")
        form = app.screen
        assert isinstance(form, RegisterForm)
        form.query_one("#name", Input).value = "m" * 250
        form.query_one("#path", Input).value = "/srv/models/m"
        await pilot.press("ctrl+s")
        await pilot.pause()
        said.append(str(form.query_one("#problem", Static).visual))
        form.query_one("#name", Input).value = "a\u200bb"
        await pilot.press("ctrl+s")
        await pilot.pause()
        said.append(str(form.query_one("#problem", Static).visual))
        assert app.screen is form

    drive(app, script)
    assert said == [
        "refused: the name is longer than 200 characters",
        "refused: the name has a control or invisible character (U+200B), which a model's name may not have",
    ]
    assert app.source.ops.calls == []


def test_the_evict_confirmation_says_when_another_box_still_holds_the_model() -> None:
    """It always said "Requests for it wait for a load", even with the model resident on another box."""
    app = FleetboxApp(FakeSource(steps=20), refresh_s=0)  # all-minilm-l6-v2 on gpu-a and gpu-b
    asked: list[str] = []

    async def script(pilot: Pilot) -> None:
        await pilot.press("2", "home", "e")  # all-minilm-l6-v2, held by two boxes: which one?
        assert isinstance(app.screen, Choose)
        await pilot.press("down", "enter")  # gpu-a-7f3k2q
        assert isinstance(app.screen, Confirm)
        asked.append(str(app.screen.query_one(".title", Static).visual))
        await pilot.press("n", "e", "enter")  # all boxes
        assert isinstance(app.screen, Confirm)
        asked.append(str(app.screen.query_one(".title", Static).visual))
        await pilot.press("n")

    drive(app, script)
    assert asked == [
        "Evict all-minilm-l6-v2 from gpu-a-7f3k2q? gpu-b-19ab4c still holds it.",
        "Evict all-minilm-l6-v2 from every box holding it? Requests for it wait for a load.",
    ]


@pytest.mark.parametrize("screen", ["1", "2", "4"])
def test_a_full_table_fits_80_columns_beside_its_scrollbar(screen: str) -> None:
    """At 80×24 with more rows than fit, the Models table's last column was cut (`er`) under a horizontal scrollbar,
    and the Events kind `reconnect` showed as `reconnec`."""
    from tui.events import Event

    def crowded(view: FleetView) -> FleetView:
        boxes = tuple(replace(view.boxes[0], box=f"gpu-{n:02d}-7f3k2qxyz") for n in range(30))
        catalog = tuple(spec(f"a-model-with-a-long-name-{n:02d}", Task.EMBED) for n in range(30))
        return replace(view, boxes=boxes, catalog=catalog)

    app = FleetboxApp(Tailored(crowded), refresh_s=0)

    async def script(pilot: Pilot) -> None:
        for n in range(30):
            app.events.add(Event(float(n), "reconnect", "nats", "reconnected"))
        await pilot.press(screen)
        app.tick()
        await pilot.pause()
        table = app.screen.query_one(DataTable)
        assert table.show_vertical_scrollbar
        if screen == "4":  # the text column is as wide as the longest event by design; the kind is whole
            assert table.columns[ColumnKey("kind")].width >= len("reconnect")
            return
        assert table.virtual_size.width <= table.scrollable_content_region.width
        assert not table.show_horizontal_scrollbar

    drive(app, script)


def test_the_status_line_of_a_fleet_out_of_reach_fits_80_columns() -> None:
    """`…retrying…  showing the` was all 80 columns showed of an outage: the age of the view was cut."""
    from tui.screens.base import status_line

    view = replace(fleet_view(29), connected=False, problem="connection refused", stale_since=fleet_view(17).taken_at)
    for screen in ("Fleet", "Models", "Queue", "Events"):
        shown = status_line(view, screen).plain[:80]
        assert "cannot reach NATS: connection refused" in shown and "as of 12s ago" in shown, shown


def test_a_pin_some_boxes_cannot_hold_says_which_in_its_notification() -> None:
    """A pin made though a box cannot hold the model beside its own pinned models answers `not_held_by`: the
    notification names those boxes, where it read "pinned" alone."""
    answer = {"ok": True, "box": "door", "model": "m", "pinned": True, "not_held_by": {"small": "model m needs ..."}}
    assert describe(answer) == "pinned, not held by small (too little memory) (answered by door)"
    assert describe({"box": "door", "model": "m", "pinned": True}) == "pinned (answered by door)"
    failed = {"box": "door", "model": "m", "pinned": True, "load_failed_on": {"work": "its weights ..."}}  # h197
    assert describe(failed) == "pinned, its last load failed on work (see its load_error) (answered by door)"


def test_before_nats_is_reached_the_screens_say_the_fleet_is_unknown_not_empty() -> None:
    """Tester h212: before the TUI had ever reached NATS the Models screen said `the catalog is empty: r registers a
    model`, and `l` on the Fleet screen `no box selected`; nothing was known, and now they say why."""
    app = FleetboxApp(Tailored(lambda view: unreached), refresh_s=0)
    unreached = FleetView(
        address="nats://127.0.0.1:1",
        taken_at=0.0,
        connected=False,
        waiting_for="connecting to NATS at nats://127.0.0.1:1…",
        problem="connection refused; retrying…",
    )

    async def script(pilot: Pilot) -> None:
        await pilot.pause()
        fleet_detail = str(app.screen.query_one("#detail", Static).visual)
        assert fleet_detail == "the fleet is not known: cannot reach NATS: connection refused; retrying…"
        await pilot.press("l")
        assert [n.message for n in app._notifications] == [
            "no box known: cannot reach NATS: connection refused; retrying…"
        ]
        await pilot.press("2")
        models_detail = str(app.screen.query_one("#detail", Static).visual)
        assert models_detail == "the catalog is not known: cannot reach NATS: connection refused; retrying…"

    drive(app, script)


def test_a_fleet_read_with_no_model_says_the_catalog_is_empty() -> None:
    app = FleetboxApp(Tailored(lambda view: replace(view, catalog=())), refresh_s=0)

    async def script(pilot: Pilot) -> None:
        await pilot.press("2")
        assert str(app.screen.query_one("#detail", Static).visual) == "the catalog is empty: r registers a model"

    drive(app, script)


def test_the_models_sparkline_is_drawn_from_zero_so_a_steady_rate_looks_steady() -> None:
    """Tester h212: a steady 20.1 → 19.9 req/s drew as full-height drops, Textual's Sparkline scaling its data's
    min..max; from zero, every bar of a steady rate is near full height (the top line is all but blank-free)."""
    app = FleetboxApp(FakeSource(), refresh_s=0)

    def at(view: FleetView, rps: float) -> FleetView:
        boxes = tuple(replace(b, models=tuple(replace(m, rps=rps) for m in b.models)) for b in view.boxes)
        return replace(view, boxes=boxes)

    async def script(pilot: Pilot) -> None:
        for n in range(60):
            app.throughput.record(at(fleet_view(29), 20.1 if n % 2 else 19.9))
        await pilot.press("2")
        await pilot.pause()
        spark = app.screen.query_one("#spark", Sparkline)
        console = Console(width=spark.size.width, file=io.StringIO(), color_system=None)
        console.print(spark.render())
        top, bottom = console.file.getvalue().splitlines()[:2]
        assert len(top) >= spark.size.width and top.count(" ") <= 2, top  # a column of the zero floor at most
        assert " " not in bottom, bottom

    drive(app, script)


@pytest.mark.parametrize("status", ["dead", "left"])
def test_a_box_gone_shows_no_rates_or_latencies(status: str) -> None:
    """Tester h212: a dead box kept its last req/s and p99 on its row (`✗ boxb … 20.0 22.9 dead`) and its models'
    in the detail (`clf: resident 4.8M · 10.0 req/s`) for the two minutes it stays listed: figures it no longer has."""

    def gone(view: FleetView) -> FleetView:
        return replace(view, boxes=(replace(view.boxes[0], status=status), *view.boxes[1:]))

    app = FleetboxApp(Tailored(gone), refresh_s=0)

    async def script(pilot: Pilot) -> None:
        await pilot.pause()
        box = app.view.boxes[0]
        assert box.rps > 0 and box.p99_ms > 0 and box.status == status  # what it last reported
        row = app.screen.query_one(DataTable).get_row(box.box)
        assert [str(cell) for cell in row[5:]] == ["-", "-", status]
        lines = str(app.screen.query_one("#detail", Static).visual).splitlines()
        models = [line for line in lines if line.startswith("  ") and ": " in line]
        assert models and all("· - req/s · p50 - p99 - ms · holds -" in line for line in models), lines

    drive(app, script)
