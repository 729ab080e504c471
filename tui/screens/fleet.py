"""The Fleet screen: one row per box, the selected box in detail; drain, load and evict from it."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import DataTable, Static

from tui import format as fmt
from tui.dialogs import Choose, Confirm
from tui.model import BoxState, FleetView
from tui.screens.base import Cells, DataScreen, confirm_evict, make_table, not_read_why, selected_key, sync_rows

_STATUS_STYLE = {"live": "green", "late": "yellow", "draining": "yellow", "dead": "red", "left": "dim"}
_STATUS_MARK = {"live": "●", "late": "◐", "draining": "↓", "dead": "✗", "left": "○"}
_UNKNOWN_MARK = "?"  # NATS is out of reach: the box's state now is not known
_GONE = ("dead", "left")  # kept on screen a while, with no rate or latency: what it last reported is past


class FleetScreen(DataScreen):
    TITLE = "Fleet"
    DEFAULT_CSS = "FleetScreen #detail { max-height: 50%; }"  # `_detail_lines` decides, this only bounds it
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("d", "drain", "Drain", tooltip="drain the box: stop pulling, finish, exit"),
        Binding("l", "load", "Load", tooltip="load a model on this box"),
        Binding("e", "evict", "Evict", tooltip="evict a model from this box"),
    ]

    def body(self) -> ComposeResult:
        # Widths add up to 78 columns with the cells' padding (80 less a scrollbar); the detail has the full figures.
        yield make_table(
            "boxes",
            [
                ("box", "box", 15),
                ("role", "role", 7),
                ("dev", "dev", 6),
                ("memory", "memory", 10),
                ("models", "models", 10),
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
        mark = _STATUS_MARK.get(box.status, _UNKNOWN_MARK)
        if view.stale_since is not None:  # the last state known, not judged now: no colour claims it
            style, mark = "dim", _UNKNOWN_MARK
        name = Text.assemble((mark + " ", style), (box.box, style if box.usable else "dim"))
        name.truncate(15, overflow="ellipsis")
        devices = Text(",".join(d.device for d in box.devices) or "-")
        devices.truncate(6, overflow="ellipsis")
        resident = [m.name for m in box.models if m.state == "resident"]
        loading = sum(1 for m in box.models if m.state == "loading")
        models = Text(
            f"{len(resident)}" + (f"+{loading}↑" if loading else "") + (f" {resident[0]}" if resident else "")
        )
        models.truncate(10, overflow="ellipsis")
        beat = box.status if box.status in ("dead", "left") else fmt.age(view.taken_at - box.ts)
        return (
            name,
            box.role,
            devices,
            fmt.share(box.used_bytes, box.budget_bytes, width=5) if box.runs_models else Text("-", style="dim"),
            models,
            "-" if box.status in _GONE else fmt.rate(box.rps),
            "-" if box.status in _GONE else fmt.ms(box.p99_ms),
            Text(beat, style=style),
        )

    def _render_detail(self, view: FleetView) -> None:
        box = view.box(selected_key(self.table()) or "")
        detail = self.query_one("#detail", Static)
        if box is None:
            why = not_read_why(view)
            if view.boxes:
                detail.update("")
            elif why:
                detail.update(Text(f"the fleet is not known: {why}", style="dim"))
            else:
                detail.update(Text("no box has sent a heartbeat yet", style="dim"))
            return
        status = f"{box.status} when last seen" if view.stale_since is not None else box.status
        lines = [
            Text.assemble(
                (box.box, "bold"),
                f"  {status} · host {box.host or '?'} · v{box.version or '?'}{f' ({box.build})' if box.build else ''}"
                f" · up {fmt.age(box.uptime_s)}"
                f" · http :{box.http_port or '-'} · sees backlog {box.backlog}",
                no_wrap=True,
                overflow="ellipsis",
            )
        ]
        for device in box.devices:
            lines.append(Text.assemble(f"{device.name}  ", fmt.usage(device.used_bytes, device.budget_bytes, 10)))
        # What does not fit is counted and named on the last line, never cut in silence.
        shown, more = list(box.models), []
        room = self._detail_lines() - len(lines)
        if len(shown) > room:
            fits = max(room - 1, 0)
            shown, more = shown[:fits], shown[fits:]
        gone = box.status in _GONE
        for model in shown:
            size = fmt.human_bytes(model.nbytes)
            pin = " pinned" if model.pinned else ""
            rps, p50, p99 = ("-",) * 3 if gone else (fmt.rate(model.rps), fmt.ms(model.p50_ms), fmt.ms(model.p99_ms))
            lines.append(
                Text(
                    f"  {model.name}: {model.state} {size}{pin} · {rps} req/s"
                    f" · p50 {p50} p99 {p99} ms · holds {'-' if gone else model.held}",
                    no_wrap=True,
                    overflow="ellipsis",
                )
            )
        if more:
            names = ", ".join(m.name for m in more)
            lines.append(Text(f"  … {len(more)} more: {names}", style="dim", no_wrap=True, overflow="ellipsis"))
        detail.update(Text("\n").join(lines))

    def _detail_lines(self) -> int:
        """How many lines the detail shows: two fifths of the screen, less its rule (8 at 24 rows)."""
        return max(1, self.size.height * 2 // 5 - 1)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._render_detail(self.fleet_app.view)

    def _selected_box(self) -> BoxState | None:
        box = self.fleet_app.view.box(selected_key(self.table()) or "")
        why = not_read_why(self.fleet_app.view)
        if box is None and why and not self.fleet_app.view.boxes:  # no box, for none is known: say why, not "selected"
            self.notify(f"no box known: {why}", severity="warning")
        elif box is None:
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
