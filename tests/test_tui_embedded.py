"""`fleetbox serve --tui` in a real terminal (a pty): the box serves while the TUI draws, its logs go
to a file instead of the screen, and quitting the TUI (after its confirmation) stops the box cleanly."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from appliance.natsd import free_port
from tests.conftest import wait_for

FLEETBOX = str(Path(sys.executable).with_name("fleetbox"))
ALTERNATE_SCREEN = "\x1b[?1049h"
CONFIG = """
default_model = false
[[models]]
name = "noop"
runtime = "noop"
pinned = true
"""


class Terminal:
    """A child process on an 80×24 pseudo-terminal, its output collected by a thread."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        self._master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        self.process = subprocess.Popen(
            args, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env={**os.environ, "TERM": "xterm-256color"}
        )
        os.close(slave)
        self._output = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self._master, 65536)
            except OSError:  # the child closed the terminal
                return
            if not data:
                return
            with self._lock:
                self._output.extend(data)

    @property
    def output(self) -> str:
        with self._lock:
            return self._output.decode(errors="replace")

    @property
    def drawn(self) -> str:
        """What was written after the app switched to the alternate screen (its own drawing)."""
        output = self.output
        start = output.find(ALTERNATE_SCREEN)
        return output[start:] if start >= 0 else ""

    def type(self, keys: str) -> None:
        os.write(self._master, keys.encode())

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        os.close(self._master)


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[tuple[Terminal, int, Path]]:
    (tmp_path / "noop.toml").write_text(CONFIG)
    port = free_port()
    args = [FLEETBOX, "serve", "--tui", "--config", "noop.toml", "--device", "cpu", "--box-id", "tui-embedded"]
    args += ["--port", str(port), "--nats-port", str(free_port()), "--state-dir", "state"]
    term = Terminal(args, tmp_path)
    yield term, port, tmp_path / "state" / "fleetbox.log"
    term.close()


async def test_serve_with_tui_serves_logs_to_a_file_and_quits_cleanly(terminal) -> None:
    term, port, log_file = terminal
    body = {"model": "noop", "input": ["a", "b"]}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:

        async def serving() -> bool:
            try:
                async with http.post(f"http://127.0.0.1:{port}/v1/embeddings", json=body) as response:
                    return response.status == 200
            except aiohttp.ClientError:
                return False

        await wait_for(serving, 60.0, "the box answering while the TUI runs")

        async def drawn() -> bool:
            return "tui-embedded" in term.drawn and "Drain" in term.drawn

        await wait_for(drawn, 20.0, "the Fleet screen listing the box")
        for _ in range(20):
            assert await serving()

    async def logged() -> bool:
        return log_file.is_file() and "TUI started" in log_file.read_text()

    await wait_for(logged, 10.0, "log records in the file")
    assert '"level"' not in term.drawn  # no log line scribbled over the screen

    term.type("q")

    async def asked() -> bool:
        return "Stop serving on this box" in term.drawn

    await wait_for(asked, 10.0, "the quit confirmation")
    term.type("y")

    async def exited() -> bool:
        return term.process.poll() is not None

    await wait_for(exited, 20.0, "the box to exit")
    assert term.process.returncode == 0
    assert '"box stopped"' in term.output.rsplit("\x1b[?1049l", 1)[-1]  # the terminal is back for the last logs
