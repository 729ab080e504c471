"""The Queue screen: the request stream against its limits, the dead letters, one row per consumer."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Static

from tui import format as fmt
from tui.model import FleetView
from tui.screens.base import DataScreen, make_table, sync_rows


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
