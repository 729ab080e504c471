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
from textual.widgets import DataTable, Footer, Static
from textual.widgets._footer import FooterKey

from appliance.errors import Forbidden
from tests.tui_fake import FakeSource, fleet_view
from tui.app import FleetboxApp
from tui.dialogs import Choose, Confirm, KeysHelp, RegisterForm
from tui.model import FleetView
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
