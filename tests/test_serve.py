"""`fleetbox serve` as users run it: a subprocess with the embedded nats-server, then SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp

from appliance.natsd import free_port
from tests.conftest import wait_for


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def test_serve_answers_then_exits_cleanly_on_sigterm(tmp_path) -> None:
    http_port, nats_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "appliance.cli", "serve", "--port", str(http_port), "--nats-port", str(nats_port),
         "--state-dir", str(tmp_path / "state")],
        env={**os.environ, "FBX_DEVICE": "cpu"},
        stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:

            async def ready() -> bool:
                try:
                    async with http.get(f"http://127.0.0.1:{http_port}/readyz") as response:
                        return response.status == 200
                except aiohttp.ClientError:
                    assert process.poll() is None, process.stderr.read().decode()[-3000:]
                    return False

            await wait_for(ready, timeout_s=120, what="fleetbox serve to be ready")
            assert (tmp_path / "state" / "nats").is_dir()  # JetStream stores under the state dir
            body = {"input": ["served by a real box"], "model": "all-minilm-l6-v2"}
            async with http.post(f"http://127.0.0.1:{http_port}/v1/embeddings", json=body) as response:
                assert response.status == 200
                assert len((await response.json())["data"][0]["embedding"]) == 384
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(process.wait, 20)
        assert code == 0
        assert time.monotonic() - started < 15
        assert not port_open(nats_port)  # the embedded server went with it
        log = process.stderr.read().decode()
        assert '"event":"box stopped"' in log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def test_serve_rejects_a_missing_config_file_with_a_usage_error(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "appliance.cli", "serve", "--config", str(tmp_path / "absent.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "absent.toml" in result.stderr


async def test_drain_verb_finishes_and_exits_the_box(nats_server, tmp_path) -> None:
    import nats as nats_client

    from appliance.control import call_box

    config = tmp_path / "box.toml"
    config.write_text('default_model = false\n[[models]]\nname = "noop"\nruntime = "noop"\npinned = true\n')
    process = subprocess.Popen(
        [sys.executable, "-m", "appliance.cli", "serve", "--nats", nats_server.url, "--port", str(free_port()),
         "--box-id", "drainee", "--config", str(config)],
        env={**os.environ, "FBX_LOG_LEVEL": "WARNING"},
    )  # fmt: skip
    nc = await nats_client.connect(nats_server.url)
    try:

        async def box_answers() -> bool:
            try:
                return (await call_box(nc, "drainee", "status", timeout_s=1.0))["box"] == "drainee"
            except Exception:
                assert process.poll() is None
                return False

        await wait_for(box_answers, timeout_s=60, what="the box to answer its control subject")
        assert (await call_box(nc, "drainee", "drain"))["draining"] is True
        assert await asyncio.to_thread(process.wait, 20) == 0
    finally:
        await nc.close()
        if process.poll() is None:
            process.kill()
            process.wait(10)
