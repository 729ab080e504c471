"""The fleet commands: `fleetbox tui`, `fleetbox models ...` and `fleetbox box ...`, which reach a fleet
through its NATS alone (as the TUI does), with the same `--nats`, `--creds` and `--tls-*` options.

A refusal or an unreachable fleet is one line on stderr and exit status 1; a bad option or argument (a
credentials or TLS file that cannot be used, a `--nats` with no URL, an empty model name, a box id no box
can have) is one line and exit 2, before any box is asked (the checks: appliance/fleet_options.py).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar, get_args

import orjson
import typer

from appliance.fleet_options import (
    LOCAL_NATS,
    check_box_id,
    check_creds_option,
    check_model_argument,
    check_nats_option,
    check_new_model_name,
    nats_auth,
    one_of,
)
from appliance.settings import MAX_BATCH_SIZE, MAX_BATCH_TOKENS, MAX_WAIT_MS, Dtype
from runtimes import Task

if TYPE_CHECKING:
    from appliance.connect import NatsAuth

T = TypeVar("T")
# What a registration may say (appliance/schemas.py's ModelRegistration), checked before any box is asked.
TASKS = tuple(task.value for task in Task)
RUNTIMES = ("torch", "onnx")  # a registration's; "noop" is for [[models]] in a box's config
DTYPES = get_args(Dtype)


Model = Annotated[str, typer.Argument(help="a model's name or alias", callback=check_model_argument)]
# A deletion takes the model's own name: an alias is refused ("delete a model by its own name").
OwnName = Annotated[str, typer.Argument(help="a model's own name (not an alias)", callback=check_model_argument)]
FleetUrl = Annotated[
    str,
    typer.Option(
        "--nats", envvar="FBX_NATS", help="NATS URL(s) of the fleet, comma-separated", callback=check_nats_option
    ),
]
Creds = Annotated[
    Path | None, typer.Option(envvar="FBX_CREDS", help="NATS credentials file", callback=check_creds_option)
]
TlsCa = Annotated[Path | None, typer.Option(envvar="FBX_TLS_CA", help="CA bundle for NATS TLS")]
TlsCert = Annotated[Path | None, typer.Option(envvar="FBX_TLS_CERT", help="client certificate for NATS TLS")]
TlsKey = Annotated[Path | None, typer.Option(envvar="FBX_TLS_KEY", help="client key for NATS TLS")]
models_app = typer.Typer(no_args_is_help=True, help="List and steer the fleet's models through NATS (as the TUI does).")
box_app = typer.Typer(no_args_is_help=True, help="Steer one box through NATS.")


@dataclass(slots=True, frozen=True)
class FleetAccess:
    """Where a fleet command finds the fleet's NATS, and how it authenticates there."""

    nats: str
    auth: NatsAuth


def _fleet_options(
    nats: FleetUrl = LOCAL_NATS,
    creds: Creds = None,
    tls_ca: TlsCa = None,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
) -> FleetAccess:
    """The options every fleet command takes, declared once."""
    return FleetAccess(nats, nats_auth(creds, tls_ca, tls_cert, tls_key))


def _reaches_the_fleet(command: Callable[..., None]) -> Callable[..., None]:
    """`command(…, fleet: FleetAccess)` as a typer command: its own options, then `_fleet_options`'s,
    which it receives as the one `fleet` value."""
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.name != "fleet"]
    shared = inspect.signature(_fleet_options, eval_str=True).parameters
    parameters = [*own, *shared.values()]  # typer reads each option's Annotated metadata off these

    @functools.wraps(command)
    def with_fleet_options(**given: Any) -> None:
        fleet = _fleet_options(**{name: given.pop(name) for name in shared})
        command(**given, fleet=fleet)

    with_fleet_options.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    with_fleet_options.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    return with_fleet_options


@_reaches_the_fleet
def tui_command(
    fleet: FleetAccess,
    refresh: Annotated[float, typer.Option(min=0.2, help="seconds between screen refreshes (at least 0.2)")] = 1.0,
) -> None:
    """Watch and steer a fleet from the terminal, attached through NATS alone."""
    from tui.commands import run_tui

    stream = not_a_terminal()
    if stream is not None:  # as `serve --tui`
        table = "use `fleetbox models list` for a table"
        typer.echo(f"fleetbox: tui needs a terminal: its {stream} is not one ({table})", err=True)
        raise typer.Exit(2)

    code = _fleet_command(run_tui(fleet.nats, fleet.auth, refresh))
    raise typer.Exit(code)  # non-zero when the app failed (it has printed the traceback)


@models_app.command("list")
@_reaches_the_fleet
def models_list(
    fleet: FleetAccess,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
) -> None:
    """Every catalog model: task, state, where resident, pinned, backlog, throughput, latency."""
    from tui.commands import list_models, print_rows, rows_as_json

    rows = _fleet_command(list_models(fleet.nats, fleet.auth))
    if json_out:
        typer.echo(orjson.dumps(rows_as_json(rows), option=orjson.OPT_INDENT_2).decode())
    else:
        print_rows(rows)


@models_app.command("pin")
@_reaches_the_fleet
def models_pin(model: Model, fleet: FleetAccess) -> None:
    """Pin a model: every box that runs models and has room keeps it loaded (refused if none has)."""
    _print_action(fleet, "pin", model=model)


@models_app.command("unpin")
@_reaches_the_fleet
def models_unpin(model: Model, fleet: FleetAccess) -> None:
    """Unpin a model: it may be evicted when memory is needed."""
    _print_action(fleet, "unpin", model=model)


@models_app.command("update")
@_reaches_the_fleet
def models_update(
    model: Model,
    fleet: FleetAccess,
    alias: Annotated[
        list[str] | None, typer.Option("--alias", help="an alias; repeat it: the list replaces the model's aliases")
    ] = None,
    no_aliases: Annotated[bool, typer.Option("--no-aliases", help="drop every alias")] = False,
    pin: Annotated[bool | None, typer.Option("--pin/--unpin", help="pin the model, or unpin it")] = None,
    max_batch_tokens: Annotated[
        int | None, typer.Option(min=1, max=MAX_BATCH_TOKENS, help="rows x longest row in one batch")
    ] = None,
    max_batch_size: Annotated[int | None, typer.Option(min=1, max=MAX_BATCH_SIZE, help="rows in one batch")] = None,
    max_wait_ms: Annotated[
        float | None, typer.Option(min=0, max=MAX_WAIT_MS, help="how long a partial batch waits for company")
    ] = None,
) -> None:
    """Change a model in place, as PATCH /v1/models/NAME: its aliases, pin or batching knobs (no reload)."""
    if alias and no_aliases:
        typer.echo("fleetbox: give --alias or --no-aliases, not both", err=True)
        raise typer.Exit(2)
    change: dict[str, Any] = {"aliases": [] if no_aliases else alias, "pinned": pin}
    change |= {"max_batch_tokens": max_batch_tokens, "max_batch_size": max_batch_size, "max_wait_ms": max_wait_ms}
    change = {field: value for field, value in change.items() if value is not None}
    if not change:
        typer.echo("fleetbox: nothing to change; give --alias, --no-aliases, --pin, --unpin or --max-*", err=True)
        raise typer.Exit(2)
    _print_action(fleet, "update", model=model, change=change)


@models_app.command("register")
@_reaches_the_fleet
def models_register(
    name: Annotated[str, typer.Argument(help="the new model's name", callback=check_new_model_name)],
    path: Annotated[str, typer.Argument(help="its folder, on the box: under one of the box's model roots")],
    fleet: FleetAccess,
    task: Annotated[
        str | None,
        typer.Option(help=f"{', '.join(TASKS)}; default: read from the files", callback=one_of("--task", TASKS)),
    ] = None,
    adapter_of: Annotated[str | None, typer.Option(help="the base model, for a LoRA adapter")] = None,
    alias: Annotated[list[str] | None, typer.Option("--alias", help="another name for it; repeat it")] = None,
    pin: Annotated[bool, typer.Option("--pin", help="pin it: kept loaded on every box with room")] = False,
    runtime: Annotated[
        str | None, typer.Option(help="torch (default) or onnx", callback=one_of("--runtime", RUNTIMES))
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help=f"{', '.join(DTYPES)}; default: float32", callback=one_of("--dtype", DTYPES))
    ] = None,
    box: Annotated[
        str | None,
        typer.Option(help="the box that judges the folder; default: a live box on this host", callback=check_box_id),
    ] = None,
) -> None:
    """Register a model folder (or a LoRA adapter of a model), as POST /v1/models; it loads when first asked."""
    registration: dict[str, Any] = {"name": name, "path": path, "task": task, "adapter_of": adapter_of}
    registration |= {"aliases": alias, "pinned": pin or None, "runtime": runtime, "dtype": dtype}
    _print_action(
        fleet, "register", registration={field: value for field, value in registration.items() if value}, box=box
    )


@models_app.command("delete")
@_reaches_the_fleet
def models_delete(model: OwnName, fleet: FleetAccess) -> None:
    """Delete a model or adapter from the fleet, as DELETE /v1/models/NAME: requests waiting for it get a 404."""
    _print_action(fleet, "delete", model=model)


@models_app.command("load")
@_reaches_the_fleet
def models_load(
    model: Model,
    fleet: FleetAccess,
    box: Annotated[
        str | None,
        typer.Option(help="the box; default: the live worker with most free memory", callback=check_box_id),
    ] = None,
) -> None:
    """Load a model on a box."""
    _print_action(fleet, "load", model=model, box=box)


@models_app.command("evict")
@_reaches_the_fleet
def models_evict(
    model: Model,
    fleet: FleetAccess,
    box: Annotated[
        str | None, typer.Option(help="the box; default: every box holding it", callback=check_box_id)
    ] = None,
) -> None:
    """Evict a model from a box, or from every box."""
    _print_action(fleet, "evict", model=model, box=box)


@box_app.command("list")
@_reaches_the_fleet
def box_list(
    fleet: FleetAccess,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
) -> None:
    """Every live box of the fleet: status (live, late, draining), role, devices, memory, models, req/s, last beat.
    A box whose heartbeat record expired (stopped or dead) is not listed: the TUI shows it `dead` or `left`."""
    from tui.commands import boxes_as_json, list_boxes, print_boxes

    boxes, taken_at = _fleet_command(list_boxes(fleet.nats, fleet.auth))
    if json_out:
        typer.echo(orjson.dumps(boxes_as_json(boxes, taken_at), option=orjson.OPT_INDENT_2).decode())
    else:
        print_boxes(boxes, taken_at)


@box_app.command("drain")
@_reaches_the_fleet
def box_drain(
    box: Annotated[str, typer.Argument(help="the box's id", callback=check_box_id)], fleet: FleetAccess
) -> None:
    """Drain a box: it stops pulling, finishes its batches, then exits."""
    _print_action(fleet, "drain", box=box)


def not_a_terminal() -> str | None:
    """Which stream the TUI needs as a terminal is not one (`stdout`, `stderr`, `stdin`), or None when all are.

    Textual's Linux driver draws on `sys.__stderr__`: with stderr in a file the whole screen went into it and
    the terminal stayed blank (tester h212); with stdout in a pipe the screen's escapes went there (h114); it reads
    keys from stdin: with stdin not a terminal (`</dev/null`) it drew and ran for ever, deaf to `q` and Ctrl-C
    (review h219)."""
    if not sys.stdout.isatty():
        return "stdout"
    if sys.__stderr__ is None or not sys.__stderr__.isatty():
        return "stderr"
    if sys.__stdin__ is None or not sys.__stdin__.isatty():
        return "stdin"
    return None


def _print_action(fleet: FleetAccess, verb: str, **args: Any) -> None:
    from tui.commands import act

    reply = _fleet_command(act(fleet.nats, fleet.auth, verb, **args))
    typer.echo(orjson.dumps(reply, option=orjson.OPT_INDENT_2).decode())


def _fleet_command(coro: Coroutine[Any, Any, T]) -> T:
    """Run one NATS-side command; a refusal or an unreachable fleet is a message and exit status 1."""
    from nats.errors import Error as NatsError

    from appliance.errors import FleetboxError

    logging.getLogger("asyncio").addFilter(_not_ssl_eof_noise)  # once: the same filter is not added twice
    try:
        return asyncio.run(coro)
    except FleetboxError as exc:
        typer.echo(f"fleetbox: {exc.message}", err=True)
    except (NatsError, TimeoutError, OSError) as exc:
        typer.echo(f"fleetbox: {exc or type(exc).__name__}", err=True)
    raise typer.Exit(1)


def _not_ssl_eof_noise(record: logging.LogRecord) -> bool:
    """Drop asyncio's warning on every close of a TLS connection to NATS: nats-py reads through asyncio
    streams, whose protocol answers an EOF in a way the ssl transport ignores (harmless). The fleet
    commands configure no logging, so it would reach the terminal as a stray line on stderr."""
    return "eof_received() has no effect when using ssl" not in record.getMessage()
