"""The `fleetbox` command: `serve` runs a box (uvloop), `tune` profiles a model, `version`; the fleet
commands (`tui`, `models ...`, `box ...`) are appliance/fleet_cli.py. What `serve` checks before the start is
appliance/serve_checks.py; the running box and its bounded stop, appliance/serving.py.

`serve`'s flags override `FBX_*` environment variables, which override the `--config` TOML file;
every setting is checked before anything starts (one line per bad setting, exit 2).
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from appliance import __version__, fleet_cli, fleet_options, serve_checks, serving
from appliance.build import build_id
from appliance.logs import configure_logging
from appliance.settings_load import load_settings, settings_problems, unknown_variables

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
        str | None,
        typer.Option("--nats", help="NATS URL(s), comma-separated [FBX_NATS]; none starts an embedded server"),
    ] = None,
    nats_port: Annotated[int | None, typer.Option(help="embedded NATS port [FBX_NATS_PORT, default 4222]")] = None,
    # Paths as text: click turned "" into Path("."), the working directory, which the settings refuse when empty.
    state_dir: Annotated[
        str | None, typer.Option(metavar="PATH", help="state directory [FBX_STATE_DIR, default .fleetbox]")
    ] = None,
    config: Annotated[Path | None, typer.Option(help="TOML config file [FBX_CONFIG]")] = None,
    model_root: Annotated[
        list[str] | None,
        typer.Option(metavar="PATH", help="a folder registered models may live in; repeatable [FBX_MODEL_ROOTS]"),
    ] = None,
    role: Annotated[str | None, typer.Option(help="all | gateway | worker [FBX_ROLE]")] = None,
    box_id: Annotated[str | None, typer.Option(help="this box's id [FBX_BOX_ID, default host-random]")] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda | cuda:N [FBX_DEVICE]")] = None,
    log_level: Annotated[str | None, typer.Option(help="DEBUG | INFO | WARNING | ERROR [FBX_LOG_LEVEL]")] = None,
    creds: Annotated[str | None, typer.Option(metavar="PATH", help="NATS credentials file [FBX_CREDS]")] = None,
    tls_ca: Annotated[str | None, typer.Option(metavar="PATH", help="CA bundle for NATS TLS [FBX_TLS_CA]")] = None,
    tls_cert: Annotated[
        str | None, typer.Option(metavar="PATH", help="client certificate for NATS TLS [FBX_TLS_CERT]")
    ] = None,
    tls_key: Annotated[str | None, typer.Option(metavar="PATH", help="client key for NATS TLS [FBX_TLS_KEY]")] = None,
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
    with serving.stop_signals_end_the_start():  # until the box's event loop takes them over
        stream = fleet_cli.not_a_terminal() if tui else None
        if stream is not None:
            typer.echo(f"fleetbox: --tui needs a terminal: its {stream} is not one", err=True)
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
                serve_checks.host_problem("host", settings.host),
                *(
                    []
                    if settings.nats_urls
                    else [
                        serve_checks.host_problem("nats_host", settings.nats_host),
                        serve_checks.replicas_problem(settings),
                        serve_checks.ports_problem(settings),
                    ]
                ),
                *([serve_checks.device_problem(settings.device)] if settings.runs_models else []),
                *([fleet_options.creds_problem(settings.creds)] if settings.creds else []),
                fleet_options.tls_problem(settings.tls_ca, settings.tls_cert, settings.tls_key),
            ]
        )
        ports = (serve_checks.port_problem(settings.host, settings.port), serve_checks.nats_port_problem(settings))
        in_use = [problem for problem in ports if problem]
        for problem in in_use:
            typer.echo(f"fleetbox: {problem}", err=True)
        if in_use:
            raise typer.Exit(1)
        configure_logging(settings.log_level, runs_models=settings.runs_models)
        for warning in [*unknown_variables(os.environ), *serve_checks.open_routes_warnings(settings)]:
            log.warning(warning)
        import uvloop

        code = uvloop.run(serving.serve_box(settings, tui=tui, watchdog=True))
        serving.exit_now(code)


def _refuse_settings(problems: list[str | None]) -> None:
    """Exit 2 with one `fleetbox: bad settings: …` line per problem, if there is any."""
    problems_given = [problem for problem in problems if problem]
    for problem in problems_given:
        typer.echo(f"fleetbox: bad settings: {problem}", err=True)
    if problems_given:
        raise typer.Exit(2)


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
    _refuse_settings([serve_checks.device_problem(settings.device)])
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
    problem = fleet_options.repeated_option(typer.main.get_command(app), sys.argv[1:])
    if problem:
        typer.echo(f"fleetbox: {problem}", err=True)
        sys.exit(2)
    app(prog_name="fleetbox")


if __name__ == "__main__":
    sys.exit(main())
