"""The bodies of `fleetbox tui`, `fleetbox models …` and `fleetbox box drain`: attach, act, print.

The script commands attach to the fleet the way the TUI does (a `NatsSource`) and act through the
same `FleetOps`, so a pin from a script and a pin from the TUI are the same control verb with the
same errors. Output is JSON (for scripts) or a rich table (for people).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.table import Table

from tui import format as fmt
from tui.app import FleetboxApp
from tui.model import ModelRow, model_rows
from tui.source import NatsSource, connect


@asynccontextmanager
async def attached(servers: str, creds: Path | None, timeout_s: float = 10.0) -> AsyncIterator[NatsSource]:
    """A source that has read the heartbeats, the catalog and the queue once; raises TimeoutError."""
    nc = await connect(servers, creds)
    source = NatsSource(nc, address=servers, own_connection=True)
    await source.start()
    try:
        try:
            await source.attached(timeout_s)
        except TimeoutError:
            raise TimeoutError(source.waiting_for or f"no fleet answered at {servers}") from None
        yield source
    finally:
        await source.stop()


async def run_tui(servers: str, creds: Path | None, refresh_s: float) -> None:
    nc = await connect(servers, creds)
    source = NatsSource(nc, address=servers, own_connection=True, period_s=refresh_s)
    await source.start()
    try:
        await FleetboxApp(source, refresh_s=refresh_s).run_async()
    finally:
        await source.stop()


async def act(servers: str, creds: Path | None, verb: str, **args: Any) -> dict[str, Any]:
    """One action (`pin`, `unpin`, `load`, `evict`, `drain`, `register`) with `FleetOps`, its reply."""
    async with attached(servers, creds) as source:
        return await getattr(source.ops, verb)(**args)


async def list_models(servers: str, creds: Path | None) -> list[ModelRow]:
    async with attached(servers, creds) as source:
        return model_rows(source.view())


def rows_as_json(rows: list[ModelRow]) -> list[dict[str, Any]]:
    return [asdict(row) for row in rows]


def rows_as_table(rows: list[ModelRow]) -> Table:
    table = Table(box=None, header_style="bold")
    for column in ("model", "task", "state", "on", "pinned", "queue", "req/s", "p50 ms", "p99 ms", "errors"):
        table.add_column(column, justify="right" if column in ("queue", "req/s", "p50 ms", "p99 ms") else "left")
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
