"""The four screens: Fleet (boxes), Models (catalog), Queue (stream and consumers), Events.

A screen renders the app's latest `FleetView` and nothing else; `show(view)` is called on every
refresh and re-renders only cells that changed, keeping the cursor on the same box or model. An
action key opens a dialog when it needs an answer or a confirmation, then hands the call to
`app.act`, which runs it off the screen's path and reports the result in a notification.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.coordinate import Coordinate
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Sparkline, Static

from tui import format as fmt
from tui.dialogs import Choose, Confirm, RegisterForm
from tui.model import BoxState, FleetView, ModelRow, model_rows

if TYPE_CHECKING:
    from tui.app import FleetboxApp

Cells = tuple[str | Text, ...]

_STATUS_STYLE = {"live": "green", "late": "yellow", "draining": "yellow", "dead": "red", "left": "dim"}
_STATUS_MARK = {"live": "●", "late": "◐", "draining": "↓", "dead": "✗", "left": "○"}
_KIND_STYLE = {
    "error": "red",
    "dead": "red",
    "late": "yellow",
    "drain": "yellow",
    "leave": "dim",
    "evict": "magenta",
    "load": "green",
    "join": "green",
    "action": "cyan",
}


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
    table: DataTable = DataTable(cursor_type="row", zebra_stripes=True, id=table_id)
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
        line.append(f" {live} boxes · {len(view.catalog)} models · backlog {backlog} ")
    line.append(f" {view.address}", style="dim")
    return line


class DataScreen(Screen[None]):
    """What the four screens share: the status line on top, the keys in the footer."""

    TITLE: ClassVar[str] = ""
    DEFAULT_CSS = """
    DataScreen #status { height: 1; }
    DataScreen DataTable { height: 1fr; }
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


class FleetScreen(DataScreen):
    TITLE = "Fleet"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("d", "drain", "Drain", tooltip="drain the box: stop pulling, finish, exit"),
        Binding("l", "load", "Load", tooltip="load a model on this box"),
        Binding("e", "evict", "Evict", tooltip="evict a model from this box"),
    ]

    def body(self) -> ComposeResult:
        # Widths add up to 80 columns with the cells' padding; the detail below has the full figures.
        yield make_table(
            "boxes",
            [
                ("box", "box", 16),
                ("role", "role", 7),
                ("dev", "dev", 6),
                ("memory", "memory", 10),
                ("models", "models", 11),
                ("req/s", "rps", 5),
                ("p99ms", "p99", 5),
                ("beat", "beat", 4),
            ],
        )
        yield Static(id="detail", classes="detail")

    def render_view(self, view: FleetView) -> None:
        sync_rows(self.table(), [(box.box, self._cells(box, view)) for box in view.boxes])
        self._render_detail(view)

    def _cells(self, box: BoxState, view: FleetView) -> Cells:
        style = _STATUS_STYLE.get(box.status, "")
        name = Text.assemble(
            (_STATUS_MARK.get(box.status, "?") + " ", style), (box.box, style if box.usable else "dim")
        )
        name.truncate(16, overflow="ellipsis")
        devices = Text(",".join(d.device for d in box.devices) or "-")
        devices.truncate(6, overflow="ellipsis")
        resident = [m.name for m in box.models if m.state == "resident"]
        loading = sum(1 for m in box.models if m.state == "loading")
        models = Text(
            f"{len(resident)}" + (f"+{loading}↑" if loading else "") + (f" {resident[0]}" if resident else "")
        )
        models.truncate(11, overflow="ellipsis")
        beat = box.status if box.status in ("dead", "left") else fmt.age(view.taken_at - box.ts)
        return (
            name,
            box.role,
            devices,
            fmt.share(box.used_bytes, box.budget_bytes, width=5) if box.runs_models else Text("-", style="dim"),
            models,
            fmt.rate(box.rps),
            fmt.ms(box.p99_ms),
            Text(beat, style=style),
        )

    def _render_detail(self, view: FleetView) -> None:
        box = view.box(selected_key(self.table()) or "")
        detail = self.query_one("#detail", Static)
        if box is None:
            detail.update("[dim]no box has sent a heartbeat yet[/]" if not view.boxes else "")
            return
        lines = [
            Text.assemble(
                (box.box, "bold"),
                f"  {box.status} · host {box.host or '?'} · v{box.version or '?'} · up {fmt.age(box.uptime_s)}"
                f" · http :{box.http_port or '-'} · sees backlog {box.backlog}",
                no_wrap=True,
                overflow="ellipsis",
            )
        ]
        for device in box.devices:
            lines.append(Text.assemble(f"{device.name}  ", fmt.usage(device.used_bytes, device.budget_bytes, 10)))
        for model in box.models:
            size = fmt.human_bytes(model.nbytes)
            pin = " pinned" if model.pinned else ""
            lines.append(
                Text(
                    f"  {model.name}: {model.state} {size}{pin} · {fmt.rate(model.rps)} req/s"
                    f" · p50 {fmt.ms(model.p50_ms)} p99 {fmt.ms(model.p99_ms)} ms · holds {model.held}",
                    no_wrap=True,
                    overflow="ellipsis",
                )
            )
        detail.update(Text("\n").join(lines))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._render_detail(self.fleet_app.view)

    def _selected_box(self) -> BoxState | None:
        box = self.fleet_app.view.box(selected_key(self.table()) or "")
        if box is None:
            self.notify("no box selected", severity="warning")
        elif not box.usable:
            self.notify(f"{box.box} is {box.status}: it answers nothing", severity="warning")
            return None
        return box

    def action_drain(self) -> None:
        box = self._selected_box()
        if box is None:
            return
        question = f"Drain {box.box}? It stops pulling, finishes its batches and exits."

        def answered(yes: bool | None) -> None:
            if yes:
                self.fleet_app.act(f"drain {box.box}", lambda: self.fleet_app.source.ops.drain(box.box))

        self.app.push_screen(Confirm(question, yes="Drain"), answered)

    def action_load(self) -> None:
        box = self._selected_box()
        if box is None:
            return
        if not box.runs_models:
            self.notify(f"{box.box} is a {box.role}: it runs no models", severity="warning")
            return
        here = {m.name for m in box.models}
        options = [(s.name, s.name) for s in self.fleet_app.view.catalog if s.adapter_of is None and s.name not in here]
        if not options:
            self.notify(f"every model is on {box.box} already", severity="warning")
            return

        def chosen(model: str | None) -> None:
            if model:
                self.fleet_app.act(f"load {model} on {box.box}", lambda: self.fleet_app.source.ops.load(model, box.box))

        self.app.push_screen(Choose(f"Load which model on {box.box}?", options), chosen)

    def action_evict(self) -> None:
        box = self._selected_box()
        if box is None:
            return
        options = [(m.name, m.name) for m in box.models if m.state == "resident" and not m.pinned]
        if not options:
            self.notify(f"{box.box} holds no unpinned model", severity="warning")
            return

        def chosen(model: str | None) -> None:
            if model:
                confirm_evict(self, model, box.box)

        self.app.push_screen(Choose(f"Evict which model from {box.box}?", options), chosen)


def confirm_evict(screen: DataScreen, model: str, box: str | None) -> None:
    where = f"from {box}" if box else "from every box holding it"
    fleet_app = screen.fleet_app

    def answered(yes: bool | None) -> None:
        if yes:
            fleet_app.act(f"evict {model} {where}", lambda: fleet_app.source.ops.evict(model, box))

    screen.app.push_screen(Confirm(f"Evict {model} {where}? Requests for it wait for a load.", yes="Evict"), answered)


class ModelsScreen(DataScreen):
    TITLE = "Models"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("p", "pin", "Pin", tooltip="pin the model (stays loaded), or unpin it"),
        Binding("l", "load", "Load", tooltip="load the model on a box"),
        Binding("e", "evict", "Evict", tooltip="evict the model from a box, or all"),
        Binding("r", "register", "Register", tooltip="register a model folder"),
    ]
    DEFAULT_CSS = "ModelsScreen Sparkline { height: 2; margin: 0 1; }"

    def body(self) -> ComposeResult:
        # 80 columns with padding: where a model is resident is counted here and named in the detail.
        yield make_table(
            "models",
            [
                ("model", "model", 17),
                ("task", "task", 8),
                ("state", "state", 8),
                ("on", "on", 2),
                ("pin", "pin", 3),
                ("queue", "backlog", 5),
                ("req/s", "rps", 5),
                ("p50/p99ms", "latency", 9),
                ("err", "errors", 3),
            ],
        )
        yield Static(id="detail", classes="detail")
        yield Sparkline([], id="spark")

    def render_view(self, view: FleetView) -> None:
        rows = model_rows(view)
        sync_rows(self.table(), [(row.name, self._cells(row)) for row in rows])
        self._render_detail(view)

    def _cells(self, row: ModelRow) -> Cells:
        state_style = {"resident": "green", "loading": "yellow", "cold": "dim"}[row.state]
        name = fmt.short_name(row.name if row.adapter_of is None else f"↳ {row.name}", 17)
        latency = f"{fmt.ms(row.p50_ms)}/{fmt.ms(row.p99_ms)}" if row.p99_ms else "-"
        return (
            name,
            row.task,
            Text(row.state, style=state_style),
            str(len(row.boxes)) if row.boxes else "-",
            "✓" if row.pinned else "",
            str(row.backlog) if row.backlog else "-",
            fmt.rate(row.rps),
            latency,
            Text(str(row.errors), style="red") if row.errors else "-",
        )

    def _selected(self, view: FleetView) -> ModelRow | None:
        name = selected_key(self.table())
        return next((row for row in model_rows(view) if row.name == name), None)

    def _render_detail(self, view: FleetView) -> None:
        row = self._selected(view)
        detail = self.query_one("#detail", Static)
        spark = self.query_one("#spark", Sparkline)
        if row is None:
            detail.update("[dim]the catalog is empty: r registers a model[/]" if not view.catalog else "")
            spark.data = []
            return
        history = self.fleet_app.throughput.of(row.name)
        where = ", ".join(row.boxes) or "nowhere (cold)"
        base = f" · adapter of {row.adapter_of}" if row.adapter_of else ""
        detail.update(
            Text.assemble(
                (row.name, "bold"),
                f"  {row.task} · {row.runtime}{base} · {fmt.human_bytes(row.nbytes)} · on {where}\n",
                f"req/s over the last {len(history)} refreshes: now {fmt.rate(row.rps)},"
                f" peak {fmt.rate(max(history, default=0.0))}",
            )
        )
        spark.data = list(history) if any(history) else []

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._render_detail(self.fleet_app.view)

    def _selected_row(self) -> ModelRow | None:
        row = self._selected(self.fleet_app.view)
        if row is None:
            self.notify("no model selected", severity="warning")
        return row

    def action_pin(self) -> None:
        row = self._selected_row()
        if row is None:
            return
        ops = self.fleet_app.source.ops
        if row.pinned:
            self.fleet_app.act(f"unpin {row.name}", lambda: ops.unpin(row.name))
        else:
            self.fleet_app.act(f"pin {row.name}", lambda: ops.pin(row.name))

    def action_load(self) -> None:
        row = self._selected_row()
        if row is None:
            return
        if row.adapter_of:
            self.notify(f"{row.name} is an adapter: load its base {row.adapter_of}", severity="warning")
            return
        workers = [b for b in self.fleet_app.source.ops.live() if b.runs_models and b.box not in row.boxes]
        if not workers:
            self.notify(f"no live box without {row.name} runs models", severity="warning")
            return
        options = [("", "the box with the most free memory")]
        options += [(b.box, f"{b.box}  {fmt.human_bytes(b.budget_bytes - b.used_bytes)} free") for b in workers]
        ops = self.fleet_app.source.ops

        def chosen(box: str | None) -> None:
            if box is None:
                return
            where = f" on {box}" if box else ""
            self.fleet_app.act(f"load {row.name}{where}", lambda: ops.load(row.name, box or None))

        self.app.push_screen(Choose(f"Load {row.name} on which box?", options), chosen)

    def action_evict(self) -> None:
        row = self._selected_row()
        if row is None:
            return
        holders = self.fleet_app.source.ops.holders(row.name)
        if not holders:
            self.notify(f"{row.name} is not resident anywhere", severity="warning")
            return
        if len(holders) == 1:
            confirm_evict(self, row.name, holders[0])
            return
        options = [("", f"all {len(holders)} boxes"), *((box, box) for box in holders)]

        def chosen(box: str | None) -> None:
            if box is not None:
                confirm_evict(self, row.name, box or None)

        self.app.push_screen(Choose(f"Evict {row.name} from which box?", options), chosen)

    def action_register(self) -> None:
        bases = [s.name for s in self.fleet_app.view.catalog if s.adapter_of is None]
        ops = self.fleet_app.source.ops

        def submitted(registration: dict | None) -> None:
            if registration:
                self.fleet_app.act(f"register {registration['name']}", lambda: ops.register(registration))

        self.app.push_screen(RegisterForm(bases), submitted)


class QueueScreen(DataScreen):
    TITLE = "Queue"
    DEFAULT_CSS = "QueueScreen .stream { height: auto; padding: 0 1; border-bottom: solid $primary; }"

    def body(self) -> ComposeResult:
        yield Static(id="stream", classes="stream")
        yield make_table(
            "consumers",
            [
                ("consumer", "name", 30),
                ("pending", "pending", 8),
                ("in flight", "ack", 9),
                ("redeliv.", "redelivered", 8),
                ("pulls", "waiting", 5),
            ],
        )

    def render_view(self, view: FleetView) -> None:
        queue = view.queue
        panel = self.query_one("#stream", Static)
        if queue is None or queue.stream is None:
            panel.update(Text(queue.error if queue and queue.error else "reading the queue…", style="yellow"))
            sync_rows(self.table(), [])
            return
        stream = queue.stream
        lines = [
            Text.assemble(
                (f"{stream.name}  ", "bold"),
                "messages ",
                fmt.bar(stream.messages, stream.max_msgs, 10),
                f" {fmt.limit(stream.messages, stream.max_msgs)}",
            ),
            Text.assemble(
                " " * (len(stream.name) + 2),
                "bytes    ",
                fmt.bar(stream.nbytes, stream.max_bytes, 10),
                f" {fmt.limit(stream.nbytes, stream.max_bytes, fmt.human_bytes)}",
            ),
        ]
        dead = queue.dead_letters
        if dead is None:
            lines.append(Text("no dead-letter stream in this fleet", style="dim"))
        else:
            per_model = ", ".join(f"{s.rsplit('.', 1)[-1]} {n}" for s, n in sorted(dead.subjects.items()))
            style = "red" if dead.messages else ""
            lines.append(
                Text(f"{dead.name}  {dead.messages} dead letters" + (f": {per_model}" if per_model else ""), style)
            )
        if queue.error:
            lines.append(Text(queue.error, style="red"))
        panel.update(Text("\n").join(lines))
        rows = [
            (
                c.name,
                (
                    fmt.short_name(c.name, 30),
                    str(c.pending),
                    str(c.ack_pending),
                    Text(str(c.redelivered), style="yellow") if c.redelivered else "0",
                    str(c.waiting),
                ),
            )
            for c in queue.consumers
        ]
        sync_rows(self.table(), rows)


class EventsScreen(DataScreen):
    TITLE = "Events"
    _shown_version = -1

    def body(self) -> ComposeResult:
        yield make_table(
            "events",
            [
                ("time", "time", 8),
                ("what", "kind", 8),
                ("", "text", None),
            ],
        )

    def render_view(self, view: FleetView) -> None:
        log = self.fleet_app.events
        if self._shown_version == log.version:
            return
        self._shown_version = log.version
        # Keys count every event ever logged, so an event keeps its key as newer ones arrive.
        rows = [
            (
                str(log.version - age),
                (fmt.clock(event.at), Text(event.kind, style=_KIND_STYLE.get(event.kind, "")), event.text),
            )
            for age, event in enumerate(log.newest_first())
        ]
        sync_rows(self.table(), rows)
