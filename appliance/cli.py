"""The `fleetbox` command: `serve` runs a box (uvloop), `tune` profiles a model, `version`; the fleet
commands (`tui`, `models ...`, `box ...`) are appliance/fleet_cli.py.

`serve`'s flags override `FBX_*` environment variables, which override the `--config` TOML file;
every setting is checked before anything starts (one line per bad setting, exit 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer

from appliance import __version__, fleet_cli
from appliance.build import build_id
from appliance.logs import configure_logging
from appliance.settings import Settings, load_settings, settings_problems, unknown_variables
from appliance.tasks import cancel_and_wait

if TYPE_CHECKING:
    from appliance.app import Box

app = typer.Typer(add_completion=False, no_args_is_help=True, help="fleetbox: serve a fleet of small models.")
log = logging.getLogger("appliance.cli")


def _version() -> str:
    build = build_id()
    return f"{__version__} (build {build})" if build else __version__


def _print_version(value: bool) -> None:
    if value:
        typer.echo(_version())
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the fleetbox version and exit."),
    ] = False,
) -> None:
    """fleetbox: serve a fleet of small models."""


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
        str | None,
        typer.Option(
            help="model memory budget: a size with its unit (6GB, 512MiB) or a share up to 1 (0.5) [FBX_MEMORY_BUDGET]"
        ),
    ] = None,
    tui: Annotated[bool, typer.Option("--tui", help="show the fleet TUI while serving; logs go to a file")] = False,
) -> None:
    """Run a box: gateway, worker and (without --nats) an embedded nats-server."""
    with _stop_signals_end_the_start():  # until the box's event loop takes them over
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
                _host_problem("host", settings.host),
                *(
                    []
                    if settings.nats_urls
                    else [
                        _host_problem("nats_host", settings.nats_host),
                        _replicas_problem(settings),
                        _ports_problem(settings),
                    ]
                ),
                *([_device_problem(settings.device)] if settings.runs_models else []),
                *([fleet_cli.creds_problem(settings.creds)] if settings.creds else []),
                fleet_cli.tls_problem(settings.tls_ca, settings.tls_cert, settings.tls_key),
            ]
        )
        ports = (_port_problem(settings.host, settings.port), _nats_port_problem(settings))
        in_use = [problem for problem in ports if problem]
        for problem in in_use:
            typer.echo(f"fleetbox: {problem}", err=True)
        if in_use:
            raise typer.Exit(1)
        configure_logging(settings.log_level, runs_models=settings.runs_models)
        for warning in unknown_variables(os.environ):
            log.warning(warning)
        import uvloop

        code = uvloop.run(_serve(settings, tui=tui, watchdog=True))
        _exit_now(code)


@contextlib.contextmanager
def _stop_signals_end_the_start() -> Iterator[None]:
    """SIGTERM or SIGINT while `serve` still checks its settings and imports its runtimes (seconds: torch) ends the
    process at once, with 0 and a line, as a stop of a running box does: nothing has started yet. Python's default
    ended it as killed (exit 143), without a word. The box's event loop installs its own handlers when it starts;
    a refusal before that (or a test's in-process run) gets the previous ones back."""
    previous = {sig: signal.signal(sig, _stopped_before_start) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stopped_before_start(signum: int, frame: object) -> None:
    os.write(2, f"fleetbox: stopped by {signal.Signals(signum).name} before the box started\n".encode())
    os._exit(0)


def _refuse_settings(problems: list[str | None]) -> None:
    """Exit 2 with one `fleetbox: bad settings: …` line per problem, if there is any."""
    problems_given = [problem for problem in problems if problem]
    for problem in problems_given:
        typer.echo(f"fleetbox: bad settings: {problem}", err=True)
    if problems_given:
        raise typer.Exit(2)


def _replicas_problem(settings: Settings) -> str | None:
    """The embedded server is one server: a stream of more replicas was refused (the box exited saying `ServerError()`,
    auditor h61). Judged by `serve` only: `tune` reads the same config file and runs no NATS."""
    if settings.replicas == 1:
        return None
    return (
        f"replicas: {settings.replicas} needs a NATS cluster of at least that many servers; the embedded server is "
        "one: join a cluster with --nats, or leave replicas at 1"
    )


def _ports_problem(settings: Settings) -> str | None:
    """The HTTP port and the embedded server's are two: one for both read `port P is in use` (by its own server,
    started first: tester h73)."""
    if settings.port != settings.nats_port:
        return None
    return (
        f"port: {settings.port} is also the embedded nats-server's port (nats_port); give the HTTP port and"
        " --nats-port different ports"
    )


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


def _host_problem(field: str, host: str) -> str | None:
    """Why a box cannot listen on `host` (a name that does not resolve, an address this machine lacks), or None.

    Checked before anything starts: the box binds its HTTP port only after starting NATS and loading its
    models, and failed there with a bare `gaierror` log line and exit 1."""
    try:
        addresses = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        return f"{field}: {host!r} does not resolve to an address ({getattr(exc, 'strerror', None) or exc})"
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.bind(address)  # port 0: only whether this machine has the address, not whether a port is free
            except OSError as exc:
                return f"{field}: cannot listen on {host!r}: {exc.strerror or exc}"
    return None


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


def _nats_port_problem(settings: Settings) -> str | None:
    """Why the embedded nats-server cannot listen on its port (another process does); None when it can, or when
    the box joins a server (`--nats`). Checked before the start, as the HTTP port is: the refusal was a JSON log
    line carrying an `OSError(98, ...)` repr."""
    from appliance.natsd import NatsPortInUse, check_port_free

    if settings.nats_urls:
        return None
    try:
        check_port_free(settings.nats_host, settings.nats_port)
    except NatsPortInUse as exc:
        return exc.strerror
    except OSError:
        return None  # not this check's business: the server's own start reports it
    return None


def _exit_now(code: int) -> NoReturn:
    """Exit at once, logs flushed. A model load or a batch still running on an executor thread cannot be
    interrupted, and the interpreter's exit would join those threads: a stopped box stayed up for as long as
    its last batch or load ran (28-30 s for a 30 s batch), though it had said "box stopped"."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _stop(box: Box, settings: Settings, *, watchdog: bool) -> None:
    """`box.stop()`, bounded at `shutdown_grace_s` + 4 s. The bound works by cancelling, and a step that swallows
    its cancellation (nats-py's flush of a full write buffer to a server that hangs) would outlive it; so would the
    event loop's own shutdown after it (it waits for the default executor's jobs and for every task). With
    `watchdog` (the serve command, which exits once the loop is done), a thread exits the process 2 s past the
    bound whatever still runs: it stays armed until the exit. The embedded nats-server ends with the process
    (its parent-death signal)."""
    budget_s = settings.shutdown_grace_s + 4.0
    if watchdog:
        timer = threading.Timer(budget_s + 2.0, _give_up, args=(box,))
        timer.daemon = True
        timer.start()
    try:
        async with asyncio.timeout(budget_s):  # not wait_for (see appliance/tasks.py)
            await box.stop()
    except TimeoutError:
        log.error("shutdown took too long; exiting anyway")


def _give_up(box: Box) -> None:
    """The watchdog's exit: its one line written straight to the file, past any lock a stuck stop may hold."""
    try:
        os.write(2, b"fleetbox: the shutdown hung past its bound; exiting now\n")
    except OSError:
        pass
    finally:
        os._exit(1 if box.failure else 0)


async def _serve(settings: Settings, tui: bool = False, *, watchdog: bool = False) -> int:
    """Run a box until SIGTERM, SIGINT, the `drain` verb or the TUI's quit; its exit status. `watchdog`: see `_stop`."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        return await _run_box(settings, tui, stop, watchdog)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _run_box(settings: Settings, tui: bool, stop: asyncio.Event, watchdog: bool) -> int:
    from appliance.app import Box
    from appliance.errors import FleetboxError
    from appliance.natsd import EmbeddedNatsRefused

    box = Box(settings)
    starting = asyncio.create_task(box.start())
    signalled = asyncio.create_task(stop.wait())
    await asyncio.wait([starting, signalled], return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    if not starting.done():  # a signal while the box still starts (it may wait for NATS for ever): stop now
        await cancel_and_wait([starting])
        await _stop(box, settings, watchdog=watchdog)
        return 0
    try:
        starting.result()
    except EmbeddedNatsRefused as exc:  # its port taken since the check before the start, its store unusable
        typer.echo(f"fleetbox: {exc.strerror}", err=True)
        await _stop(box, settings, watchdog=watchdog)
        return 1
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE or f"{settings.port}" not in str(exc):
            log.error("box failed to start", extra={"error": repr(exc)})
        else:  # taken since the check before the start
            typer.echo(f"fleetbox: port {settings.port} on {settings.host} is in use", err=True)
        await _stop(box, settings, watchdog=watchdog)
        return 1
    except Exception as exc:
        from nats.js.errors import APIError as JetStreamAPIError

        from appliance.connect import NatsInTheClear

        log.error("box failed to start", extra={"error": repr(exc)})
        if isinstance(exc, FleetboxError):  # its own words, as every other refusal at start says them (h51)
            typer.echo(f"fleetbox: {exc.message}", err=True)
        elif isinstance(exc, NatsInTheClear):
            typer.echo(f"fleetbox: {exc}", err=True)
        elif isinstance(exc, JetStreamAPIError):  # its repr is `ServerError()`: the server's words are its description
            typer.echo(f"fleetbox: JetStream refused the box's streams or buckets: {exc.description}", err=True)
        await _stop(box, settings, watchdog=watchdog)
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
    await _stop(box, settings, watchdog=watchdog)
    return 1 if box.failure else 0  # a box that stopped itself (its NATS gone) exits for its supervisor to restart


# The fleet commands (appliance/fleet_cli.py): `tui` beside `serve`, then `models ...` and `box ...`.
app.command("tui")(fleet_cli.tui_command)
app.add_typer(fleet_cli.models_app, name="models")
app.add_typer(fleet_cli.box_app, name="box")


@app.command()
def version() -> None:
    """Print the fleetbox version, and the commit it was built from when that is known."""
    typer.echo(_version())


def _finite(value: float | None) -> float | None:
    """click's ranges let nan through (no comparison with it is true) and inf means no bound at all."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def _above_0(value: float | None) -> float | None:
    """An SLO of 0 or below (`--slo-p99-ms -5`) no candidate can meet: a tune against it measured for nothing."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"{value} is not a number of milliseconds above 0")
    return value


@app.command()
def tune(
    model: Annotated[str, typer.Argument(help="a model name or alias the box knows, or a model folder")],
    budget_minutes: Annotated[
        float,
        typer.Option(
            min=0.01, callback=_finite, help="how long the whole tune may take (the baseline runs whatever it is)"
        ),
    ] = 10.0,
    slo_p99_ms: Annotated[
        float | None, typer.Option(callback=_above_0, help="only settings whose p99 stays within this qualify")
    ] = None,
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
        float | None, typer.Option(min=0.01, callback=_finite, help="seconds per measured window [1 CPU, 0.5 GPU]")
    ] = None,
    quick: Annotated[bool, typer.Option(help="a smaller space (fewer batching values)")] = False,
    name: Annotated[str | None, typer.Option(help="the name the model is served under, for a folder")] = None,
    note: Annotated[str | None, typer.Option(help="a line for the report, e.g. how busy the machine was")] = None,
    config: Annotated[Path | None, typer.Option(help="TOML config file [FBX_CONFIG]")] = None,
    inputs: Annotated[
        Path | None,
        typer.Option(help="requests of your own traffic, one a line (a request body, or a line of text)"),
    ] = None,
    force: Annotated[
        bool, typer.Option(help="write over a profile of this hardware that records a higher speedup")
    ] = False,
) -> None:
    """Find the fastest settings of MODEL on this machine that keep its answers; write its profile (docs/tuning.md)."""
    from appliance.tune_cli import run_tune

    try:
        settings = load_settings(config, device=device)
    except Exception as exc:  # pydantic's ValidationError or a missing file: a usage error, not a crash
        _refuse_settings(settings_problems(exc))
        raise typer.Exit(2) from None
    _refuse_settings([_device_problem(settings.device)])
    for warning in unknown_variables(os.environ):
        typer.echo(f"fleetbox: {warning}", err=True)
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
        force=force,
    )
    raise typer.Exit(code)


def main() -> None:
    app(prog_name="fleetbox")


if __name__ == "__main__":
    sys.exit(main())
