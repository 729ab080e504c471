"""The embedded nats-server: refused on a port another process holds, and never outlives its box."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.natsd import EmbeddedNats, free_port

ROOT = Path(__file__).resolve().parent.parent

# A box in miniature: start an embedded server, say its pid, wait to be killed.
_BOX = """
import asyncio, sys
from pathlib import Path
from appliance.natsd import EmbeddedNats

async def main():
    server = EmbeddedNats(store_dir=Path(sys.argv[1]), port=int(sys.argv[2]))
    await server.start()
    print(server.process.pid, flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


async def test_a_port_another_server_holds_is_refused_before_starting(tmp_path: Path) -> None:
    port = free_port()
    first = EmbeddedNats(store_dir=tmp_path / "first", port=port)
    await first.start()
    try:
        second = EmbeddedNats(store_dir=tmp_path / "second", port=port)
        with pytest.raises(OSError, match="another process already does"):
            await second.start()
        assert second.process is None  # refused before anything was started
    finally:
        await first.stop()


async def test_port_0_is_refused_at_once_not_waited_for(tmp_path: Path) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "nats", port=0)
    with pytest.raises(ValueError, match="port from 1 to 65535, not 0"):
        await asyncio.wait_for(server.start(timeout_s=30), 5)
    assert server.process is None  # refused before anything was started


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_the_server_dies_with_its_box_even_on_sigkill(tmp_path: Path) -> None:
    box = subprocess.Popen(
        [sys.executable, "-c", _BOX, str(tmp_path / "nats"), str(free_port())],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert box.stdout is not None
        server_pid = int(box.stdout.readline())
        os.kill(box.pid, signal.SIGKILL)
        box.wait(10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _alive(server_pid):
            time.sleep(0.1)
        assert not _alive(server_pid), "the embedded nats-server outlived its SIGKILLed box"
    finally:
        if box.poll() is None:
            box.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
