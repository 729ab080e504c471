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

from appliance.natsd import EmbeddedNats, NatsStoreUnusable, free_port
from tests.conftest import box_settings

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


async def test_a_box_whose_embedded_server_is_killed_starts_it_again_and_serves(tmp_path: Path, http) -> None:
    """An OOM-killed embedded nats-server was never started again: the box answered 503 "retry shortly" for ever
    while /healthz said ok. Found by the black-box tester."""
    from appliance.app import Box
    from tests.conftest import noop_model, url, wait_for

    settings = box_settings(
        "", state_dir=tmp_path / "state", nats_port=free_port(), default_model=False, models=[noop_model()]
    )
    box = Box(settings)
    await box.start()
    try:
        assert box.natsd is not None and box.natsd.process is not None
        killed = box.natsd.process
        killed.kill()
        await killed.wait()
        await wait_for(lambda: box.natsd.process is not killed, what="the server to be started again")

        async def answered() -> bool:
            async with http.post(url(box, "/v1/embeddings"), json={"model": "noop", "input": "x"}) as response:
                return response.status == 200

        await wait_for(answered, timeout_s=30, what="a request to be answered again")
        assert box.failure is None
    finally:
        await box.stop()


async def test_a_server_that_will_not_start_again_makes_its_box_give_up(tmp_path: Path) -> None:
    """Its port taken meanwhile, say: the box is told why, to stop with an error exit for its supervisor."""
    import socket

    server = EmbeddedNats(store_dir=tmp_path / "nats", port=free_port())
    await server.start()
    reasons: list[str] = []
    watch = asyncio.create_task(server.supervise(reasons.append, pauses_s=(0.5, 0.5)))
    squatter = socket.socket()
    try:
        assert server.process is not None
        server.process.kill()
        await server.process.wait()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", server.port))  # before the first try, half a second away
        squatter.listen()
        await asyncio.wait_for(watch, 30)
        assert len(reasons) == 1 and "did not start again" in reasons[0], reasons
    finally:
        squatter.close()
        watch.cancel()
        await server.stop()


async def test_one_store_is_one_servers_and_a_state_dir_that_cannot_hold_it_is_said(tmp_path: Path) -> None:
    """Tester h73: two boxes given one --state-dir ran two nats-servers on one JetStream store, which corrupted it
    (each lost a registration it had answered 201); a state dir that was a file failed as a bare NotADirectoryError."""
    store = tmp_path / "state" / "nats"
    first = EmbeddedNats(store_dir=store, port=free_port())
    second = EmbeddedNats(store_dir=store, port=free_port())
    await first.start()
    try:
        with pytest.raises(NatsStoreUnusable, match=f"store {store} is in use by another box; give each box its own"):
            await second.start()
        assert second.process is None  # no server started on the store
    finally:
        await first.stop()
    await second.start()  # let go of with its server
    await second.stop()
    (tmp_path / "file").write_text("")
    on_a_file = EmbeddedNats(store_dir=tmp_path / "file" / "nats", port=free_port())
    with pytest.raises(NatsStoreUnusable, match=r"cannot keep its store in .*: Not a directory; give a writable"):
        await on_a_file.start()
