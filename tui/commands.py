"""The bodies of `fleetbox tui`, `fleetbox models …` and `fleetbox box drain`: attach, act, print.

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
from tui.model import ModelRow, model_rows
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
            raise TimeoutError(source.waiting_for or f"no fleet answered at {servers}") from None
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


_UNBOUNDED = 10_000  # columns: wider than any row


def rows_as_table(rows: list[ModelRow]) -> Table:
    table = Table(box=None, header_style="bold")
    # A narrow terminal folds names (models, boxes) onto more lines, never cuts them; the figures give way.
    longest = max((len(row.name) + 2 for row in rows), default=5)
    for column in ("model", "task", "state", "on", "pinned", "queue", "req/s", "p50 ms", "p99 ms", "errors"):
        named = column in ("model", "on")
        table.add_column(
            column,
            justify="right" if column in ("queue", "req/s", "p50 ms", "p99 ms") else "left",
            overflow="fold" if named else "ellipsis",
            min_width=min(longest, 24) if column == "model" else 6 if column == "on" else None,
        )
    for row in rows:
        table.add_row(
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
    return table
