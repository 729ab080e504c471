"""The bodies of `fleetbox tui`, `fleetbox models …` and `fleetbox box …`: attach, act, print.

The script commands attach to the fleet the way the TUI does (a `NatsSource`) and act through the
same `FleetOps`, so a pin from a script and a pin from the TUI are the same control verb with the
same errors. Output is JSON (for scripts) or a rich table (for people).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from appliance.connect import NatsAuth
from tui import format as fmt
from tui.app import FleetboxApp
from tui.dial import connect
from tui.model import BoxState, ModelRow, model_rows
from tui.ops import REACH_TIMEOUT_S
from tui.source import NatsSource

ATTACH_TIMEOUT_S = REACH_TIMEOUT_S  # how long a one-shot command waits for NATS, then for the fleet's state
NO_FLEET_S = 2.0  # how long it waits for a fleet's first box where none ever started (one may be starting)


@asynccontextmanager
async def attached(servers: str, auth: NatsAuth, timeout_s: float | None = None) -> AsyncIterator[NatsSource]:
    """A source that has read the heartbeats, the catalog and the queue once; raises TimeoutError,
    or `tui.dial.NatsUnreachable` when NATS itself does not answer within `timeout_s`."""
    timeout_s = timeout_s or ATTACH_TIMEOUT_S
    nc = await connect(servers, auth, give_up_after_s=timeout_s)
    source = NatsSource(nc, address=servers, own_connection=True)
    await source.start()
    try:
        try:
            await source.attached(timeout_s, no_fleet_s=min(NO_FLEET_S, timeout_s))
        except TimeoutError:
            # Not the view's "…; retrying…": the TUI retries, a command stops here (tester h87 read on, for it).
            why = (source.waiting_for or "").removesuffix("; retrying…")
            raise TimeoutError(why or f"no fleet answered at {servers}") from None
        yield source
    finally:
        await source.stop()


async def run_tui(servers: str, auth: NatsAuth, refresh_s: float) -> int:
    """The TUI draws at once; while NATS cannot be reached its status line says why, and it retries.
    Returns the exit status: 1 when the app failed (Textual has printed why), else 0."""
    source = NatsSource.dialing(servers, auth, period_s=refresh_s)
    await source.start()
    app = FleetboxApp(source, refresh_s=refresh_s)
    try:
        await app.run_async()
    finally:
        await source.stop()
    return app.return_code or 0


async def act(servers: str, auth: NatsAuth, verb: str, **args: Any) -> dict[str, Any]:
    """One action (`pin`, `unpin`, `update`, `load`, `evict`, `drain`, `register`, `delete`) with `FleetOps`."""
    async with attached(servers, auth) as source:
        return await getattr(source.ops, verb)(**args)


async def list_models(servers: str, auth: NatsAuth) -> list[ModelRow]:
    async with attached(servers, auth) as source:
        return model_rows(source.view())


async def list_boxes(servers: str, auth: NatsAuth) -> tuple[list[BoxState], float]:
    """The fleet's boxes as the TUI's Fleet screen sees them, and when they were read: one reading, so a box whose
    heartbeat record is gone is not among them (the TUI, watching, keeps a dead one on screen for a while)."""
    async with attached(servers, auth) as source:
        view = source.view()
        return list(view.boxes), view.taken_at


def boxes_as_json(boxes: list[BoxState], taken_at: float) -> list[dict[str, Any]]:
    return [
        {
            "box": box.box,
            "status": box.status,
            "role": box.role,
            "host": box.host,
            "http_port": box.http_port,
            "version": box.version,
            "uptime_s": round(box.uptime_s, 1),
            "beat_age_s": round(max(0.0, taken_at - box.ts), 1),  # since its last heartbeat, by this machine's clock
            "devices": [asdict(device) for device in box.devices],
            "models": [asdict(model) for model in box.models],
        }
        for box in boxes
    ]


def print_boxes(boxes: list[BoxState], taken_at: float, console: Console | None = None) -> None:
    """The boxes as a table, the models each holds whole (piped, as wide as the rows need, as `print_rows`)."""
    console = console or Console()
    if not console.is_terminal:
        console = Console(file=console.file, width=_UNBOUNDED, no_color=True, highlight=False)
    table = Table(box=None, header_style="bold", pad_edge=False)
    for header, justify in _BOX_COLUMNS:
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for box in boxes:
        loading = [model.name for model in box.models if model.state == "loading"]
        models = [model.name for model in box.models if model.state == "resident"] + [f"{n} (loading)" for n in loading]
        table.add_row(
            box.box,
            box.status,
            box.role,
            f"{box.host}:{box.http_port}" if box.http_port else box.host or "-",
            ",".join(device.device for device in box.devices) or "-",
            f"{fmt.human_bytes(box.used_bytes)} / {fmt.human_bytes(box.budget_bytes)}" if box.runs_models else "-",
            ", ".join(models) or "-",
            fmt.rate(box.rps),
            box.status if box.status in ("dead", "left") else fmt.age(taken_at - box.ts),
        )
    console.print(table)


_BOX_COLUMNS = (
    ("box", "left"),
    ("status", "left"),
    ("role", "left"),
    ("http", "left"),
    ("dev", "left"),
    ("memory", "right"),
    ("models", "left"),
    ("req/s", "right"),
    ("beat", "right"),
)


def rows_as_json(rows: list[ModelRow]) -> list[dict[str, Any]]:
    """One object per model; a latency nothing measured (the table's `-`) is null, a rate always a float."""
    return [
        {
            **asdict(row),
            "rps": float(row.rps),
            "p50_ms": row.p50_ms if row.p50_ms > 0 else None,
            "p99_ms": row.p99_ms if row.p99_ms > 0 else None,
        }
        for row in rows
    ]


def print_rows(rows: list[ModelRow], console: Console | None = None) -> None:
    """The table, never cutting a name: on a terminal long names fold onto a second line; piped,
    the table is as wide as it needs, so `| grep` sees every name whole on one line."""
    console = console or Console()
    if not console.is_terminal:
        console = Console(file=console.file, width=_UNBOUNDED, no_color=True, highlight=False)
        console.print(rows_as_table(rows))
        return
    console.print(rows_as_table(rows, console.width))


_UNBOUNDED = 10_000  # columns: wider than any row


# (header, justify) per column; the headers are short so that every column fits 80 columns.
_COLUMNS = (
    ("model", "left"),
    ("task", "left"),
    ("state", "left"),
    ("on", "left"),
    ("pin", "left"),
    ("queue", "right"),
    ("req/s", "right"),
    ("p50ms", "right"),
    ("p99ms", "right"),
    ("err", "right"),
)
_MODEL, _ON = 0, 3  # the named columns: they fold onto more lines on a narrow terminal; the others keep their width
_LEAST_NAMED = 8  # columns a named column keeps however narrow the terminal (then the figures give way)


def rows_as_table(rows: list[ModelRow], width: int | None = None) -> Table:
    """The models as a table `width` columns wide at most (None: as wide as the rows need)."""
    cells = [
        (
            row.name if row.adapter_of is None else f"↳ {row.name}",
            row.task,
            row.state,
            ", ".join(row.boxes) or "-",
            "yes" if row.pinned else "",
            str(row.backlog),
            fmt.rate(row.rps),
            fmt.ms(row.p50_ms),
            fmt.ms(row.p99_ms),
            str(row.errors),
        )
        for row in rows
    ]
    widths = [max([len(header), *(len(cell[index]) for cell in cells)]) for index, (header, _) in enumerate(_COLUMNS)]
    if width is not None:
        widths[_MODEL], widths[_ON] = _share(
            width - sum(widths) + widths[_MODEL] + widths[_ON] - 2 * (len(_COLUMNS) - 1), widths[_MODEL], widths[_ON]
        )
    table = Table(box=None, header_style="bold", pad_edge=False)
    for index, (header, justify) in enumerate(_COLUMNS):
        named = index in (_MODEL, _ON)
        table.add_column(
            header,
            justify=justify,  # type: ignore[arg-type]
            overflow="fold" if named else "ellipsis",
            no_wrap=not named,
            width=widths[index],
        )
    for row_cells in cells:
        table.add_row(*row_cells)
    return table


def _share(room: int, model: int, on: int) -> tuple[int, int]:
    """The widths of the model and box columns in `room` columns: each as wide as its widest cell where both fit,
    else the boxes a third of the room and the names the rest (folding)."""
    if model + on <= room:
        return model, on
    on = max(min(on, room // 3), _LEAST_NAMED)
    return max(min(model, room - on), _LEAST_NAMED), on
