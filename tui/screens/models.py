"""The Models screen: one row per catalog model across the fleet; pin, load, evict, register, delete."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import DataTable, Sparkline, Static

from tui import format as fmt
from tui.dialogs import Choose, Confirm, RegisterForm
from tui.model import FleetView, ModelRow, model_rows
from tui.screens.base import Cells, DataScreen, confirm_evict, make_table, not_read_why, selected_key, sync_rows

_STATE_STYLES = {"resident": "green", "loading": "yellow", "failed": "red", "cold": "dim"}


def _failed_on(box: str, why: str) -> tuple[tuple[str, str], str]:
    """A line of the detail: a box where the model's last load failed, and why (as the box's heartbeat says)."""
    return ("failed", "red"), f" on {box}: {why}\n"


class ModelsScreen(DataScreen):
    TITLE = "Models"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("p", "pin", "Pin", tooltip="pin the model (stays loaded), or unpin it"),
        Binding("l", "load", "Load", tooltip="load the model on a box"),
        Binding("e", "evict", "Evict", tooltip="evict the model from a box, or all"),
        Binding("r", "register", "Register", tooltip="register a model folder"),
        # Off the footer, which 80 columns fill; `?` lists it.
        Binding("x", "delete", "Delete", tooltip="delete the model from the fleet", show=False),
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
        stale = view.stale_since is not None
        sync_rows(self.table(), [(row.name, self._cells(row, stale)) for row in rows])
        self._render_detail(view)

    def _cells(self, row: ModelRow, stale: bool) -> Cells:
        # While NATS is out of reach the state is the last known one: shown, but not in colour.
        state_style = "dim" if stale else _STATE_STYLES[row.state]
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
            why = not_read_why(view)
            if view.catalog:
                detail.update("")
            elif why:  # NATS never reached, or no fleet there yet: the catalog is unknown, not empty
                detail.update(Text(f"the catalog is not known: {why}", style="dim"))
            else:
                detail.update(Text("the catalog is empty: r registers a model", style="dim"))
            spark.data = []
            return
        history = self.fleet_app.throughput.of(row.name)
        where = ", ".join(row.boxes) or f"nowhere ({row.state})"
        base = f" · adapter of {row.adapter_of}" if row.adapter_of else ""
        detail.update(
            Text.assemble(
                (row.name, "bold"),
                f"  {row.task} · {row.runtime}{base} · {fmt.human_bytes(row.nbytes)} · on {where}\n",
                *(part for box, why in row.load_failed_on.items() for part in _failed_on(box, why)),
                f"req/s over the last {len(history)} refreshes: now {fmt.rate(row.rps)},"
                f" peak {fmt.rate(max(history, default=0.0))}",
            )
        )
        # Textual's Sparkline scales its data's min..max (no floor to set): a 0 first puts the floor at zero, so
        # a steady 20.1 → 19.9 req/s draws as steady, not as full-height drops (tester h212).
        spark.data = [0.0, *history] if any(history) else []

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

        async def register(registration: dict[str, Any]) -> str | None:
            # The form waits for the answer: a refusal is shown in it, so nothing has to be typed again.
            what = f"register {fmt.short_name(registration['name'], 40)}"  # a notification, not a wall of name
            return await self.fleet_app.attempt(what, lambda: ops.register(registration))

        self.app.push_screen(RegisterForm(bases, register))

    def action_delete(self) -> None:
        row = self._selected_row()
        if row is None:
            return
        adapters = [s.name for s in self.fleet_app.view.catalog if s.adapter_of == row.name]
        if adapters:  # as the box would answer, before asking
            self.notify(f"{row.name} has adapters ({', '.join(adapters)}): delete them first", severity="warning")
            return
        ops = self.fleet_app.source.ops

        def answered(yes: bool | None) -> None:
            if yes:
                self.fleet_app.act(f"delete {row.name}", lambda: ops.delete(row.name))

        kind = "adapter" if row.adapter_of else "model"
        question = f"Delete the {kind} {row.name} from the fleet? Requests for it get a 404; it is unloaded everywhere."
        self.app.push_screen(Confirm(question, yes="Delete"), answered)
