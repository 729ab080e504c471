"""The `fleetbox` command: `serve` runs a box (uvloop), more verbs join as they land.

Flags override `FBX_*` environment variables, which override the `--config` TOML file.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import inspect
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import orjson
import typer

from appliance import __version__
from appliance.logs import configure_logging
from appliance.settings import Settings, load_settings, settings_problems
from appliance.tasks import cancel_and_wait

if TYPE_CHECKING:
    from appliance.connect import NatsAuth

app = typer.Typer(add_completion=False, no_args_is_help=True, help="fleetbox: serve a fleet of small models.")
log = logging.getLogger("appliance.cli")
T = TypeVar("T")
_LOCAL_NATS = "nats://127.0.0.1:4222"


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="HTTP bind address [FBX_HOST, default 127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port [FBX_PORT, default 8080]")] = None,
    nats: Annotated[
        str | None, typer.Option("--nats", help="NATS URL(s), comma-separated; none starts an embedded server")
    ] = None,
    nats_port: Annotated[int | None, typer.Option(help="embedded NATS port [FBX_NATS_PORT, default 4222]")] = None,
    state_dir: Annotated[Path | None, typer.Option(help="state directory [FBX_STATE_DIR, default .fleetbox]")] = None,
    config: Annotated[Path | None, typer.Option(help="TOML config file [FBX_CONFIG]")] = None,
    model_root: Annotated[
        list[Path] | None, typer.Option(help="a folder registered models may live in; repeatable [FBX_MODEL_ROOTS]")
    ] = None,
    role: Annotated[str | None, typer.Option(help="all | gateway | worker [FBX_ROLE]")] = None,
    box_id: Annotated[str | None, typer.Option(help="this box's id [FBX_BOX_ID, default host-random]")] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda | cuda:N [FBX_DEVICE]")] = None,
    log_level: Annotated[str | None, typer.Option(help="DEBUG | INFO | WARNING | ERROR [FBX_LOG_LEVEL]")] = None,
    creds: Annotated[Path | None, typer.Option(help="NATS credentials file [FBX_CREDS]")] = None,
    tls_ca: Annotated[Path | None, typer.Option(help="CA bundle for NATS TLS [FBX_TLS_CA]")] = None,
    tls_cert: Annotated[Path | None, typer.Option(help="client certificate for NATS TLS [FBX_TLS_CERT]")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="client key for NATS TLS [FBX_TLS_KEY]")] = None,
    durable: Annotated[
        bool | None, typer.Option("--durable/--memory", help="file storage for the queue and buckets [FBX_DURABLE]")
    ] = None,
    replicas: Annotated[int | None, typer.Option(help="stream and bucket replicas in a cluster [FBX_REPLICAS]")] = None,
    blob_threshold: Annotated[
        int | None, typer.Option(help="bodies above this many bytes go to the object store [FBX_BLOB_THRESHOLD]")
    ] = None,
    memory_budget: Annotated[
        str | None, typer.Option(help="model memory budget: 6GB, 512MiB or a share like 0.5 [FBX_MEMORY_BUDGET]")
    ] = None,
    tui: Annotated[bool, typer.Option("--tui", help="show the fleet TUI while serving; logs go to a file")] = False,
) -> None:
    """Run a box: gateway, worker and (without --nats) an embedded nats-server."""
    if tui and not sys.stdout.isatty():
        typer.echo("fleetbox: --tui needs a terminal", err=True)
        raise typer.Exit(2)
    from appliance.configured import configured_specs

    try:
        settings = load_settings(
            config,
            host=host,
            port=port,
            nats=nats,
            nats_port=nats_port,
            state_dir=state_dir,
            role=role,
            box_id=box_id,
            device=device,
            log_level=log_level,
            model_roots=model_root or None,
            creds=creds,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            durable=durable,
            replicas=replicas,
            blob_threshold=blob_threshold,
            memory_budget=memory_budget,
        )
        configured_specs(settings)  # every [[models]] entry's folder and task, checked before anything starts
    except Exception as exc:  # pydantic's ValidationError or a missing file: a usage error, not a crash
        _refuse_settings(settings_problems(exc))
        raise typer.Exit(2) from None
    _refuse_settings(
        [
            *([_device_problem(settings.device)] if settings.runs_models else []),
            *([_creds_problem(settings.creds)] if settings.creds else []),
            _tls_problem(settings.tls_ca, settings.tls_cert, settings.tls_key),
        ]
    )
    in_use = _port_problem(settings.host, settings.port)
    if in_use:
        typer.echo(f"fleetbox: {in_use}", err=True)
        raise typer.Exit(1)
    configure_logging(settings.log_level)
    import uvloop

    code = uvloop.run(_serve(settings, tui=tui))
    raise typer.Exit(code)


def _refuse_settings(problems: list[str | None]) -> None:
    """Exit 2 with one `fleetbox: bad settings: …` line per problem, if there is any."""
    problems_given = [problem for problem in problems if problem]
    for problem in problems_given:
        typer.echo(f"fleetbox: bad settings: {problem}", err=True)
    if problems_given:
        raise typer.Exit(2)


def _device_problem(device: str) -> str | None:
    """Why torch cannot run on `device` here (`cuda` on a machine without one), or None."""
    if not device.startswith("cuda"):
        return None
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if count == 0:
        built = "" if torch.version.cuda else f" (torch {torch.__version__} is built without CUDA)"
        return f"device: {device}: torch sees no CUDA device on this machine{built}"
    if index >= count:
        devices = f"{count} CUDA device{'s' if count > 1 else ''}"
        return f"device: {device}: torch sees {devices} on this machine (cuda:0 to cuda:{count - 1})"
    return None


def _creds_problem(path: Path) -> str | None:
    """Why `path` is not a usable NATS credentials file (a user JWT and its nkey seed), or None.

    Checked before connecting: nats-py reads the file only while it connects, and retries a
    missing or broken one with every attempt instead of saying what is wrong.
    """
    import re

    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return f"creds: {path} does not exist"
    except (OSError, UnicodeDecodeError) as exc:
        return f"creds: cannot read {path}: {getattr(exc, 'strerror', None) or exc}"
    jwt = re.search(r"-{3,}BEGIN NATS USER JWT-{3,}\s*\n\s*(\S+)", text)
    seed = re.search(r"-{3,}BEGIN USER NKEY SEED-{3,}\s*\n\s*(\S+)", text)
    if jwt is None or seed is None:
        return f"creds: {path} is not a NATS credentials file (it needs a user JWT and a user nkey seed)"
    import nkeys

    try:
        nkeys.from_seed(bytearray(seed.group(1).encode()))
    except (nkeys.NkeysError, ValueError):
        return f"creds: {path}: the user nkey seed is not valid"
    return None


def _check_creds_option(creds: Path | None) -> Path | None:
    """The `--creds` option of the fleet commands: a bad file is a one-line usage error."""
    problem = _creds_problem(creds) if creds is not None else None
    if problem:
        typer.echo(f"fleetbox: {problem}", err=True)
        raise typer.Exit(2)
    return creds


def _tls_problem(ca: Path | None, cert: Path | None, key: Path | None) -> str | None:
    """Why the TLS files cannot make a client context (missing, unreadable, a key not the certificate's), or None."""
    from appliance.connect import BadTlsFiles, client_tls

    try:
        client_tls(ca, cert, key)
    except BadTlsFiles as exc:
        return str(exc)
    return None


def _nats_auth(creds: Path | None, tls_ca: Path | None, tls_cert: Path | None, tls_key: Path | None) -> NatsAuth:
    """How the fleet commands join NATS; a bad TLS file is a one-line usage error, as a bad `--creds` is."""
    from appliance.connect import BadTlsFiles, NatsAuth, client_tls

    try:
        return NatsAuth(creds, client_tls(tls_ca, tls_cert, tls_key))
    except BadTlsFiles as exc:
        typer.echo(f"fleetbox: {exc}", err=True)
        raise typer.Exit(2) from None


def _check_nats_option(nats: str) -> str:
    """The `--nats` option of the fleet commands: a list with no URL in it is a one-line usage error
    (nats-py, given no server, would try none of them for ever)."""
    if not any(url.strip() for url in nats.split(",")):
        typer.echo(f"fleetbox: --nats: no NATS URL in {nats!r}; give one, e.g. {_LOCAL_NATS}", err=True)
        raise typer.Exit(2)
    return nats


def _port_problem(host: str, port: int) -> str | None:
    """'port P on H is in use' when another process listens there (checked before a box starts,
    which binds its HTTP port only after loading its models); None when it is free or any port."""
    from appliance.natsd import port_in_use

    if port == 0:
        return None
    try:
        return f"port {port} on {host} is in use" if port_in_use(host, port) else None
    except OSError:
        return None  # not this check's business: the box's own bind reports it


async def _serve(settings: Settings, tui: bool = False) -> int:
    from appliance.app import Box

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    box = Box(settings)
    starting = asyncio.create_task(box.start())
    signalled = asyncio.create_task(stop.wait())
    await asyncio.wait([starting, signalled], return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    if not starting.done():  # a signal while the box still starts (it may wait for NATS for ever): stop now
        await cancel_and_wait([starting])
        await box.stop()
        return 0
    try:
        starting.result()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE or f"{settings.port}" not in str(exc):
            log.error("box failed to start", extra={"error": repr(exc)})
        else:  # taken since the check before the start
            typer.echo(f"fleetbox: port {settings.port} on {settings.host} is in use", err=True)
        await box.stop()
        return 1
    except Exception as exc:
        log.error("box failed to start", extra={"error": repr(exc)})
        await box.stop()
        return 1
    # A signal, or the `drain` control verb, ends the box the same way.
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(box.stop_requested.wait())]
    embedded = None
    if tui:  # quitting the TUI ends the box too
        from tui.embedded import EmbeddedTui

        assert box.nc is not None
        embedded = EmbeddedTui(box.nc, box.box_id, box.nats_url, settings.state_dir / "fleetbox.log")
        waits.append(asyncio.create_task(embedded.run()))
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if embedded is not None:
        await embedded.close()  # give the terminal back before the shutdown logs
    for wait in waits:
        wait.cancel()
    try:
        async with asyncio.timeout(settings.shutdown_grace_s + 4.0):  # not wait_for (see appliance/tasks.py)
            await box.stop()
    except TimeoutError:
        log.error("shutdown took too long; exiting anyway")
    return 0


FleetUrl = Annotated[
    str,
    typer.Option(
        "--nats", envvar="FBX_NATS", help="NATS URL(s) of the fleet, comma-separated", callback=_check_nats_option
    ),
]
Creds = Annotated[
    Path | None, typer.Option(envvar="FBX_CREDS", help="NATS credentials file", callback=_check_creds_option)
]
TlsCa = Annotated[Path | None, typer.Option(envvar="FBX_TLS_CA", help="CA bundle for NATS TLS")]
TlsCert = Annotated[Path | None, typer.Option(envvar="FBX_TLS_CERT", help="client certificate for NATS TLS")]
TlsKey = Annotated[Path | None, typer.Option(envvar="FBX_TLS_KEY", help="client key for NATS TLS")]
models_app = typer.Typer(no_args_is_help=True, help="List and steer the fleet's models through NATS (as the TUI does).")
box_app = typer.Typer(no_args_is_help=True, help="Steer one box through NATS.")
app.add_typer(models_app, name="models")
app.add_typer(box_app, name="box")


@dataclass(slots=True, frozen=True)
class FleetAccess:
    """Where a fleet command finds the fleet's NATS, and how it authenticates there."""

    nats: str
    auth: NatsAuth


def _fleet_options(
    nats: FleetUrl = _LOCAL_NATS,
    creds: Creds = None,
    tls_ca: TlsCa = None,
    tls_cert: TlsCert = None,
    tls_key: TlsKey = None,
) -> FleetAccess:
    """The options every fleet command takes, declared once."""
    return FleetAccess(nats, _nats_auth(creds, tls_ca, tls_cert, tls_key))


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


@app.command("tui")
@_reaches_the_fleet
def tui_command(
    fleet: FleetAccess,
    refresh: Annotated[float, typer.Option(min=0.2, help="seconds between screen refreshes (at least 0.2)")] = 1.0,
) -> None:
    """Watch and steer a fleet from the terminal, attached through NATS alone."""
    from tui.commands import run_tui

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
def models_pin(model: str, fleet: FleetAccess) -> None:
    """Pin a model: every box keeps it loaded."""
    _print_action(fleet, "pin", model=model)


@models_app.command("unpin")
@_reaches_the_fleet
def models_unpin(model: str, fleet: FleetAccess) -> None:
    """Unpin a model: it may be evicted when memory is needed."""
    _print_action(fleet, "unpin", model=model)


@models_app.command("load")
@_reaches_the_fleet
def models_load(
    model: str,
    fleet: FleetAccess,
    box: Annotated[str | None, typer.Option(help="the box; default: the live worker with most free memory")] = None,
) -> None:
    """Load a model on a box."""
    _print_action(fleet, "load", model=model, box=box)


@models_app.command("evict")
@_reaches_the_fleet
def models_evict(
    model: str,
    fleet: FleetAccess,
    box: Annotated[str | None, typer.Option(help="the box; default: every box holding it")] = None,
) -> None:
    """Evict a model from a box, or from every box."""
    _print_action(fleet, "evict", model=model, box=box)


@box_app.command("drain")
@_reaches_the_fleet
def box_drain(box: str, fleet: FleetAccess) -> None:
    """Drain a box: it stops pulling, finishes its batches, then exits."""
    _print_action(fleet, "drain", box=box)


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


@app.command()
def version() -> None:
    """Print the fleetbox version."""
    typer.echo(__version__)


@app.command()
def tune(
    model: Annotated[str, typer.Argument(help="a model name or alias the box knows, or a model folder")],
    budget_minutes: Annotated[float, typer.Option(min=0.01, help="how long the whole tune may take")] = 10.0,
    slo_p99_ms: Annotated[float | None, typer.Option(help="only settings whose p99 stays within this qualify")] = None,
    objective: Annotated[str, typer.Option(help="throughput (heavy load) | latency (light load)")] = "throughput",
    write: Annotated[bool, typer.Option("--write/--dry-run", help="write the profile and report, or print it")] = True,
    device: Annotated[str | None, typer.Option(help="cpu | cuda | cuda:N [FBX_DEVICE, default auto]")] = None,
    out: Annotated[
        Path | None, typer.Option(help="profiles folder [FBX_PROFILES_DIR, default the shipped profiles/]")
    ] = None,
    concurrency: Annotated[
        int | None, typer.Option(min=1, help="closed-loop clients [8/core, 128 GPU, 4 latency]")
    ] = None,
    window_s: Annotated[
        float | None, typer.Option(min=0.01, help="seconds per measured window [1 CPU, 0.5 GPU]")
    ] = None,
    quick: Annotated[bool, typer.Option(help="a smaller space (fewer batching values)")] = False,
    name: Annotated[str | None, typer.Option(help="the name the model is served under, for a folder")] = None,
    note: Annotated[str | None, typer.Option(help="a line for the report, e.g. how busy the machine was")] = None,
    config: Annotated[Path | None, typer.Option(help="TOML config file [FBX_CONFIG]")] = None,
    inputs: Annotated[
        Path | None,
        typer.Option(help="requests of your own traffic, one a line (a request body, or a line of text)"),
    ] = None,
) -> None:
    """Find the fastest settings of MODEL on this machine that keep its answers; write its profile (docs/tuning.md)."""
    from appliance.tune_cli import run_tune

    try:
        settings = load_settings(config, device=device)
    except Exception as exc:  # pydantic's ValidationError or a missing file: a usage error, not a crash
        _refuse_settings(settings_problems(exc))
        raise typer.Exit(2) from None
    _refuse_settings([_device_problem(settings.device)])
    code = run_tune(
        model,
        settings,
        budget_minutes=budget_minutes,
        slo_p99_ms=slo_p99_ms,
        objective=objective,
        write=write,
        device=device,
        out=out,
        concurrency=concurrency,
        window_s=window_s,
        quick=quick,
        name=name,
        note=note,
        inputs=inputs,
    )
    raise typer.Exit(code)


def main() -> None:
    app(prog_name="fleetbox")


if __name__ == "__main__":
    sys.exit(main())
