"""What the four screens share: the status line, the table that keeps its cursor, the footer.

A screen renders the app's latest `FleetView` and nothing else; `show(view)` is called on every
refresh and re-renders only cells that changed, keeping the cursor on the same row. While NATS
cannot be reached the view is the last one known (`view.stale`): the screens still draw it,
marked, and the status line says since when.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.coordinate import Coordinate
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from tui import format as fmt
from tui.dialogs import Confirm
from tui.model import FleetView

if TYPE_CHECKING:
    from tui.app import FleetboxApp

Cells = tuple[str | Text, ...]


class Table(DataTable):
    """A row-cursor table where Home and End go to the first and last row (a DataTable scrolls sideways)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("home", "scroll_top", "First row", show=False),
        Binding("end", "scroll_bottom", "Last row", show=False),
    ]


# The keys every table answers, for the help: DataTable's own, and the two above.
TABLE_KEYS = (("↑ ↓", "move the selection"), ("PgUp PgDn", "a page up, down"), ("Home End", "the first, last row"))


def sync_rows(table: DataTable, rows: Sequence[tuple[str, Cells]]) -> None:
    """Make `table` show `rows` (key, cells), touching only what changed and keeping the cursor's row."""
    keys = [key for key, _ in rows]
    current = [row.key.value for row in table.ordered_rows]
    if keys != current:
        selected = current[table.cursor_row] if 0 <= table.cursor_row < len(current) else None
        table.clear()
        for key, cells in rows:
            table.add_row(*cells, key=key)
        if selected in keys:
            table.move_cursor(row=keys.index(selected), animate=False)
        return
    columns = list(table.columns)
    for key, cells in rows:
        for column, value in zip(columns, cells, strict=False):
            if table.get_cell(key, column) != value:
                table.update_cell(key, column, value)


def make_table(table_id: str, columns: Sequence[tuple[str, str, int | None]]) -> DataTable:
    """A row-cursor table with (label, key, width) columns; a None width fits the content."""
    table = Table(cursor_type="row", zebra_stripes=True, id=table_id)
    for label, key, width in columns:
        table.add_column(label, key=key, width=width)
    return table


def selected_key(table: DataTable) -> str | None:
    if table.row_count == 0:
        return None
    return table.coordinate_to_cell_key(Coordinate(table.cursor_row, 0)).row_key.value


def status_line(view: FleetView, screen: str) -> Text:
    line = Text(no_wrap=True, overflow="ellipsis")
    line.append(" fleetbox ", style="bold reverse")
    line.append(f" {screen} ", style="bold")
    if not view.connected and view.problem:
        line.append(f" cannot reach NATS: {view.problem} ", style="bold red")
    elif not view.connected:
        line.append(" not connected to NATS, connecting… ", style="bold red")
    elif view.waiting_for:
        line.append(f" {view.waiting_for} ", style="yellow")
    else:
        live = sum(1 for b in view.boxes if b.usable)
        backlog = view.queue.stream.messages if view.queue and view.queue.stream else 0
        line.append(f" {fmt.count(live, 'box')} · {fmt.count(len(view.catalog), 'model')} · backlog {backlog} ")
    if view.stale_since is not None:  # short, so that it and the reason fit 80 columns
        line.append(f" fleet as of {fmt.age(view.taken_at - view.stale_since)} ago ", style="yellow")
    line.append(f" {view.address}", style="dim")
    return line


def not_read_why(view: FleetView) -> str | None:
    """Why the fleet is not read (yet, or again), or None when it is: an empty table then means an unknown fleet,
    not an empty one (tester h212: `the catalog is empty` before NATS was ever reached)."""
    if not view.connected:
        return f"cannot reach NATS: {view.problem}" if view.problem else "not connected to NATS"
    return view.waiting_for


class DataScreen(Screen[None]):
    """What the four screens share: the status line on top, the keys in the footer."""

    TITLE: ClassVar[str] = ""
    DEFAULT_CSS = """
    DataScreen #status { height: 1; }
    DataScreen DataTable { height: 1fr; width: 100%; }  /* not auto: its scrollbar then takes from its columns */
    DataScreen .detail {
        height: auto; max-height: 7; border-top: solid $primary; padding: 0 1;
        text-wrap: nowrap; text-overflow: ellipsis;
    }
    """

    @property
    def fleet_app(self) -> FleetboxApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        yield Static(id="status")
        yield from self.body()
        yield Footer(show_command_palette=False, compact=True)

    def body(self) -> ComposeResult:
        raise NotImplementedError

    def on_mount(self) -> None:
        self.show(self.fleet_app.view)

    def on_screen_resume(self) -> None:
        self.show(self.fleet_app.view)

    def show(self, view: FleetView) -> None:
        self.query_one("#status", Static).update(status_line(view, self.TITLE))
        self.render_view(view)

    def render_view(self, view: FleetView) -> None:
        raise NotImplementedError

    def table(self) -> DataTable:
        return self.query_one(DataTable)


def confirm_evict(screen: DataScreen, model: str, box: str | None) -> None:
    """Ask before evicting `model` from `box` (None: from every box holding it), saying what becomes of its requests."""
    where = f"from {box}" if box else "from every box holding it"
    fleet_app = screen.fleet_app
    others = [holder for holder in fleet_app.source.ops.holders(model) if box and holder != box]
    if others:
        after = f"{', '.join(others)} still {'holds' if len(others) == 1 else 'hold'} it."
    else:
        after = "Requests for it wait for a load."

    def answered(yes: bool | None) -> None:
        if yes:
            fleet_app.act(f"evict {model} {where}", lambda: fleet_app.source.ops.evict(model, box))

    screen.app.push_screen(Confirm(f"Evict {model} {where}? {after}", yes="Evict"), answered)
