"""The Events screen: what happened in the fleet since the TUI attached, newest first.

With the selection on the newest event it stays there as events arrive (the view stays at the top); on
an older one it stays on that one. A row is cut at the screen's edge; the panel below it holds the
selected event's whole text, wrapped.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable, Static

from tui import format as fmt
from tui.events import Event
from tui.model import FleetView
from tui.screens.base import DataScreen, make_table, selected_key, sync_rows

_KIND_STYLE = {
    "error": "red",
    "dead": "red",
    "outage": "red",
    "late": "yellow",
    "drain": "yellow",
    "leave": "dim",
    "evict": "magenta",
    "load": "green",
    "join": "green",
    "reconnect": "green",
    "action": "cyan",
}


class EventsScreen(DataScreen):
    TITLE = "Events"
    DEFAULT_CSS = "EventsScreen #detail { text-wrap: wrap; max-height: 6; }"
    _shown_version = -1

    def __init__(self) -> None:
        super().__init__()
        self._shown: dict[str, Event] = {}  # row key -> the event on that row

    def body(self) -> ComposeResult:
        yield make_table(
            "events",
            [
                ("time", "time", 8),
                ("what", "kind", 9),  # "reconnect"
                ("", "text", None),
            ],
        )
        yield Static(id="detail", classes="detail")

    def render_view(self, view: FleetView) -> None:
        log = self.fleet_app.events
        if self._shown_version == log.version:
            return
        self._shown_version = log.version
        # Keys count every event ever logged, so an event keeps its key as newer ones arrive.
        self._shown = {str(log.version - age): event for age, event in enumerate(log.newest_first())}
        rows = [
            (key, (fmt.clock(event.at), Text(event.kind, style=_KIND_STYLE.get(event.kind, "")), event.text))
            for key, event in self._shown.items()
        ]
        table = self.table()
        on_the_newest = table.cursor_row <= 0  # then it stays on the newest, as a log being watched does
        sync_rows(table, rows)
        if on_the_newest and table.row_count:
            table.move_cursor(row=0, animate=False)
        self._render_detail()

    def _render_detail(self) -> None:
        event = self._shown.get(selected_key(self.table()) or "")
        detail = self.query_one("#detail", Static)
        if event is None:
            detail.update("[dim]no event yet[/]")
            return
        style = _KIND_STYLE.get(event.kind, "")
        detail.update(Text.assemble((f"{fmt.clock(event.at)} {event.kind}", style or "bold"), f"  {event.text}"))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._render_detail()
