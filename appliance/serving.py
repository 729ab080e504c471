"""A box run in the event loop until it is told to stop (SIGTERM, SIGINT, the `drain` verb, the TUI's quit), and
stopped within a bound: a watchdog thread exits the process whatever still runs past it.

Before the loop runs, while `serve` checks its settings and imports its runtimes, a stop signal ends the process
at once: nothing has started to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, NoReturn

import typer

from appliance.settings import Settings
from appliance.tasks import cancel_and_wait

if TYPE_CHECKING:
    from appliance.app import Box

log = logging.getLogger("appliance.serving")


@contextlib.contextmanager
def stop_signals_end_the_start() -> Iterator[None]:
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


def exit_now(code: int) -> NoReturn:
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


async def serve_box(settings: Settings, tui: bool = False, *, watchdog: bool = False) -> int:
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
        elif isinstance(exc, JetStreamAPIError) and exc.description is None:  # no responders: no JetStream there
            # It printed ": None" after a minute of retries (tester h199); the TUI's words for the same server.
            typer.echo(
                f"fleetbox: JetStream does not answer at {settings.nats or 'the embedded server'} (a nats-server "
                "without -js?): the box needs JetStream for its queue and buckets",
                err=True,
            )
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
