"""`fleetbox serve --tui`: the TUI inside the serving process, on the box's own event loop.

The app reads the fleet through the box's NATS connection exactly as `fleetbox tui` would from
afar (the box is one of the boxes it shows), so nothing here touches the box's objects. Two
things keep serving undisturbed: the app refreshes at most once per `refresh_s` and does no I/O
in its refresh; and log records stop going to the terminal the app draws on: while it runs,
they are queued to a thread that appends them to `<state_dir>/fleetbox.log`.
"""

from __future__ import annotations

import asyncio
import logging
import logging.handlers
import queue
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from nats.aio.client import Client as NATS

from appliance.logs import JsonLines
from tui.app import FleetboxApp
from tui.source import NatsSource

log = logging.getLogger(__name__)


@contextmanager
def logs_to_file(path: Path) -> Iterator[None]:
    """Send every log record to `path` (JSON lines) instead of the terminal, written off the loop."""
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    previous = root.handlers[:]
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    file_handler = logging.FileHandler(path, encoding="utf-8")
    file_handler.setFormatter(JsonLines())
    listener = logging.handlers.QueueListener(records, file_handler)
    listener.start()
    root.handlers[:] = [logging.handlers.QueueHandler(records)]
    try:
        yield
    finally:
        root.handlers[:] = previous
        listener.stop()
        file_handler.close()


class EmbeddedTui:
    def __init__(self, nc: NATS, box_id: str, nats_url: str, log_path: Path, refresh_s: float = 1.0) -> None:
        self._nc = nc
        self._address = f"box {box_id} · {nats_url}"
        self._log_path = log_path
        self._refresh_s = refresh_s
        self._app: FleetboxApp | None = None
        self._closed = asyncio.Event()  # set once the terminal is given back

    async def run(self) -> None:
        """Show the TUI until the operator quits (then return, so the box stops).

        If the app itself fails, serving goes on without it: the error is logged and this waits
        for the box's other reasons to stop (a signal, a drain).
        """
        source = NatsSource(self._nc, address=self._address, period_s=self._refresh_s)
        self._app = FleetboxApp(source, refresh_s=self._refresh_s, embedded=True)
        loop = asyncio.get_running_loop()
        # Textual may install an eager task factory (Python 3.12+); the box's tasks keep the loop's own.
        loop.call_soon(loop.set_task_factory, loop.get_task_factory())
        with logs_to_file(self._log_path):
            log.info("TUI started; logs go to this file until it closes", extra={"log": str(self._log_path)})
            await source.start()
            try:
                await self._app.run_async()
            finally:
                await source.stop()
                self._closed.set()
        if self._app.return_code:
            log.error("the TUI failed; the box keeps serving without it", extra={"code": self._app.return_code})
            await asyncio.Event().wait()  # never set: serving ends by signal or drain, as without --tui

    async def close(self, timeout_s: float = 5.0) -> None:
        """Close the app (the box is stopping for another reason) and wait until the terminal is back."""
        if self._app is None or self._closed.is_set():
            return
        self._app.exit()
        try:
            async with asyncio.timeout(timeout_s):  # not wait_for: on Python 3.11 it can swallow a cancel
                await self._closed.wait()
        except TimeoutError:
            log.warning("the TUI did not close in time")
