"""The `fleetbox` command: `serve` runs a box (uvloop), more verbs join as they land.

Flags override `FBX_*` environment variables, which override the `--config` TOML file.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from appliance import __version__
from appliance.logs import configure_logging
from appliance.settings import Settings, load_settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="fleetbox: serve a fleet of small models.")
log = logging.getLogger("appliance.cli")


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
    log_level: Annotated[str | None, typer.Option(help="DEBUG | INFO | WARNING [FBX_LOG_LEVEL]")] = None,
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
) -> None:
    """Run a box: gateway, worker and (without --nats) an embedded nats-server."""
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
    except Exception as exc:  # pydantic's ValidationError or a missing file: a usage error, not a crash
        typer.echo(f"fleetbox: bad settings: {exc}", err=True)
        raise typer.Exit(2) from None
    configure_logging(settings.log_level)
    import uvloop

    code = uvloop.run(_serve(settings))
    raise typer.Exit(code)


async def _serve(settings: Settings) -> int:
    from appliance.app import Box

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    box = Box(settings)
    try:
        await box.start()
    except Exception as exc:
        log.error("box failed to start", extra={"error": repr(exc)})
        await box.stop()
        return 1
    # A signal, or the `drain` control verb, ends the box the same way.
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(box.stop_requested.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    try:
        await asyncio.wait_for(box.stop(), settings.shutdown_grace_s + 4.0)
    except TimeoutError:
        log.error("shutdown took too long; exiting anyway")
    return 0


@app.command()
def version() -> None:
    """Print the fleetbox version."""
    typer.echo(__version__)


def main() -> None:
    app(prog_name="fleetbox")


if __name__ == "__main__":
    sys.exit(main())
