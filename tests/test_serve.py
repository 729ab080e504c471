"""`fleetbox serve` as users run it: a subprocess with the embedded nats-server, then SIGTERM."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import nats as nats_client
import pytest

from appliance.control import call_box
from appliance.natsd import free_port
from tests.conftest import freeze, wait_for


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def until_ready(
    http: aiohttp.ClientSession, port: int, process: subprocess.Popen, log: Callable[[], str]
) -> None:
    """Wait for `fleetbox serve` to say it is ready; a process that died on the way fails with the end of `log`."""

    async def ready() -> bool:
        try:
            async with http.get(f"http://127.0.0.1:{port}/readyz") as response:
                return response.status == 200
        except aiohttp.ClientError:
            assert process.poll() is None, log()[-3000:]
            return False

    await wait_for(ready, timeout_s=120, what="fleetbox serve to be ready")


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
            await until_ready(http, http_port, process, lambda: process.stderr.read().decode())
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


@pytest.mark.parametrize("streams", [False, True], ids=["gateway-404s", "streamed-generations"])
async def test_a_stopping_serve_answers_every_request_its_kept_alive_connections_carry(
    tmp_path, generator_dir, streams: bool
) -> None:
    """Clients that keep their connections alive and send without pause: as the box stopped, the listener closed
    connections a request was arriving on, and 8-13 requests a run got no answer at all (the black-box tester's
    runs); after a streamed answer, the connection was closed under the client's next request (6-8 a run). Now
    each gets an answer (one during the stop is a 503 that closes its connection) or, once the listener is
    closed, a refused connection: both a client can retry on another box. A new connection still in the
    listener's accept queue as it closes is reset by the kernel (the client sees a reset, or its write fail on
    the closed connection); that request never reached the box, like a refused one. The box's own log says so:
    every request it answered reached its client."""
    http_port, nats_port = free_port(), free_port()
    log = tmp_path / "box.log"
    config = tmp_path / "box.toml"
    config.write_text('default_model = false\nlog_level = "DEBUG"\n')  # DEBUG: a line for every answer
    if streams:
        config.write_text(
            f'default_model = false\nlog_level = "DEBUG"\n[[models]]\nname = "gen"\npath = "{generator_dir}"\n'
            "pinned = true\n"
        )
    route, answered = ("/v1/chat/completions", 200) if streams else ("/v1/embeddings", 404)
    body = {"model": "gen", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    if not streams:
        body = {"model": "no-such-model", "input": "x"}  # answered at the gateway: 404, the fastest a box goes
    process = subprocess.Popen(
        [sys.executable, "-m", "appliance.cli", "serve", "--port", str(http_port), "--nats-port", str(nats_port),
         "--state-dir", str(tmp_path / "state"), "--config", str(config)],
        env={**os.environ, "FBX_DEVICE": "cpu"},
        stderr=log.open("wb"),  # a line for every 404: a pipe nobody reads would fill and stall the box
    )  # fmt: skip
    outcomes: collections.Counter[object] = collections.Counter()
    stopped = asyncio.Event()

    async def connection_made(session, trace, params) -> None:
        if trace.trace_request_ctx is not None:  # one of the clients' requests
            trace.trace_request_ctx["new connection"] = True

    tracing = aiohttp.TraceConfig()
    tracing.on_connection_create_end.append(connection_made)

    async def client(session: aiohttp.ClientSession) -> None:
        while not stopped.is_set():
            request: dict[str, bool] = {}
            try:
                async with session.post(
                    f"http://127.0.0.1:{http_port}{route}", json=body, trace_request_ctx=request
                ) as response:
                    await response.read()
                    outcomes[response.status] += 1
            except aiohttp.ClientConnectorError:
                outcomes["refused"] += 1  # the listener is closed: nothing was sent
                await asyncio.sleep(0.005)
            except (aiohttp.ClientError, TimeoutError) as exc:
                # A new connection reset in the listener's accept queue: the reset comes back on the client's
                # write (its request body cannot be written) or on its read.
                reset = getattr(exc, "errno", None) == errno.ECONNRESET or "Can not write request body" in str(exc)
                outcomes["reset" if reset and request.get("new connection") else f"dropped: {exc!r}"] += 1

    try:
        no_hang = aiohttp.ClientTimeout(total=10)
        connector = aiohttp.TCPConnector(limit=16)
        async with aiohttp.ClientSession(connector=connector, timeout=no_hang, trace_configs=[tracing]) as session:
            await until_ready(session, http_port, process, log.read_text)
            clients = [asyncio.create_task(client(session)) for _ in range(16)]
            await wait_for(lambda: outcomes[answered] >= (100 if streams else 500), what="the clients to be going")
            process.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(process.wait, 20) == 0
            await asyncio.sleep(0.2)  # the clients see the box gone
            stopped.set()
            await asyncio.gather(*clients)
        assert set(outcomes) <= {answered, 503, "refused", "reset"}, outcomes
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        box_answered = collections.Counter(
            line["status"] for line in lines if line["event"] == "request" and line["route"] == route
        )
        assert box_answered == {status: outcomes[status] for status in (answered, 503) if outcomes[status]}, outcomes
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


async def test_serve_warns_at_start_when_api_keys_alone_also_open_the_admin_routes(tmp_path) -> None:
    """`fleetbox serve` as run, not `open_routes_warnings` called alone: with FBX_API_KEYS and no FBX_ADMIN_KEYS its
    log says, before the box is ready, that every API key may also change the catalog; then SIGTERM stops it."""
    http_port, nats_port = free_port(), free_port()
    config = tmp_path / "box.toml"
    config.write_text('default_model = false\n[[models]]\nname = "noop"\nruntime = "noop"\npinned = true\n')
    log = tmp_path / "box.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FBX_")} | {"FBX_API_KEYS": "user-key"}
    process = subprocess.Popen(
        [sys.executable, "-m", "appliance.cli", "serve", "--port", str(http_port), "--nats-port", str(nats_port),
         "--state-dir", str(tmp_path / "state"), "--config", str(config), "--device", "cpu"],
        env=env,
        stderr=log.open("wb"),
    )  # fmt: skip
    with killed_if_left(process):
        async with aiohttp.ClientSession() as http:
            await until_ready(http, http_port, process, log.read_text)
        warnings = [
            record for line in log.read_text().splitlines()
            if line.startswith("{") and (record := json.loads(line))["level"] == "warning"
        ]  # fmt: skip
        assert [r["event"] for r in warnings if "FBX_ADMIN_KEYS" in r["event"]] == [
            "FBX_API_KEYS is set and FBX_ADMIN_KEYS is not: every API key may also register, change, delete, pin, "
            "load and evict models; set FBX_ADMIN_KEYS to keep those to operators"
        ], log.read_text()[-3000:]
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 20) == 0


@contextlib.contextmanager
def killed_if_left(process: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """A `fleetbox serve` a failed test left running is killed, not left holding its ports."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def serve_a_minute_of_work(tmp_path, nats: list[str], box_id: str) -> tuple[subprocess.Popen, int, Path]:
    """`fleetbox serve` of one pinned noop model, `slow`, whose batch takes a minute, with 1 s of shutdown grace:
    the process, its HTTP port and its log."""
    http_port = free_port()
    config = tmp_path / "box.toml"
    config.write_text(
        'default_model = false\nshutdown_grace_s = 1\n[[models]]\nname = "slow"\nruntime = "noop"\npinned = true\n'
        "options = { cost_ms = 60000 }\n"
    )
    log = tmp_path / "box.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "appliance.cli", "serve", "--port", str(http_port), *nats,
         "--state-dir", str(tmp_path / "state"), "--config", str(config), "--box-id", box_id],
        env={**os.environ, "FBX_DEVICE": "cpu"},
        stderr=log.open("wb"),
    )  # fmt: skip
    return process, http_port, log


async def until_held(nats_url: str, box_id: str) -> None:
    """Until the box's worker holds a request for `slow`: with the device idle, its batch starts at once."""
    nc = await nats_client.connect(nats_url)

    async def held() -> bool:
        models = (await call_box(nc, box_id, "status"))["models"]
        return any(m["name"] == "slow" and m.get("held") for m in models)

    try:
        await wait_for(held, what="the worker to take the request")
    finally:
        await nc.close()


async def test_a_box_stopped_during_a_long_batch_exits_within_its_bound(tmp_path) -> None:
    """A batch (or a model load) on an executor thread cannot be interrupted, and the interpreter's exit joined
    those threads: SIGTERM during a 30 s batch exited after 28.5 s, long after the box had logged "box stopped"
    (the review of the stop path). Now the process exits once the stop is done or its bound has passed."""
    nats_port = free_port()
    process, http_port, log = serve_a_minute_of_work(tmp_path, ["--nats-port", str(nats_port)], "slowbox")
    try:
        async with aiohttp.ClientSession() as http:
            await until_ready(http, http_port, process, log.read_text)
            body = {"model": "slow", "input": "a minute of work"}
            answer = asyncio.create_task(http.post(f"http://127.0.0.1:{http_port}/v1/embeddings", json=body))
            await until_held(f"nats://127.0.0.1:{nats_port}", "slowbox")
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(process.wait, 30)
            took = time.monotonic() - started
            answer.cancel()
        assert code == 0, log.read_text()[-3000:]
        assert took < 15, f"exited {took:.1f} s after SIGTERM"  # 1 s of grace and the steps' bounds; not 60 s
        assert '"event":"box stopped"' in log.read_text()
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


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler of its own for `sig` (its `SigCgt` mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    raise AssertionError(f"no SigCgt line for process {pid}")


def test_a_stop_signal_while_serve_still_starts_exits_0_with_a_line(tmp_path) -> None:
    """The seconds before the event loop (the settings checked, torch imported) ended at SIGTERM with Python's
    default: exit 143 and no word. The config file here is a pipe that nobody writes, so `serve` waits in the
    settings' read for as long as the test needs, with the signal's handler set."""
    config = tmp_path / "box.toml"
    os.mkfifo(config)
    process = subprocess.Popen(
        [sys.executable, "-m", "appliance.cli", "serve", "--config", str(config), "--state-dir", str(tmp_path)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not catches(process.pid, signal.SIGTERM):
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "serve set no SIGTERM handler of its own while it started"
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
        assert process.stderr.read() == "fleetbox: stopped by SIGTERM before the box started\n"
        assert not (tmp_path / "nats").exists()  # nothing started
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def nats_port_refusal(port: int) -> str:
    return (
        f"fleetbox: the embedded nats-server cannot listen on 127.0.0.1:{port}: another process already does "
        "(another box's server?); give another --nats-port, or join that server with --nats"
    )


def test_serve_names_an_embedded_nats_port_in_use_in_one_line(tmp_path) -> None:
    """As a taken HTTP port is named: the refusal was a JSON log line carrying an `OSError(98, ...)` repr."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        nats_port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "appliance.cli", "serve", "--port", str(free_port()), "--nats-port",
             str(nats_port), "--state-dir", str(tmp_path / "state")],
            capture_output=True, text=True, timeout=120, env={**os.environ, "FBX_DEVICE": "cpu"},
        )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.splitlines() == [nats_port_refusal(nats_port)]


async def test_a_nats_port_taken_after_the_check_is_named_in_one_line_too(tmp_path, capsys) -> None:
    """Taken between the check in `serve` and the server's start: the box stops, exit 1, the same line."""
    from appliance.serving import serve_box
    from appliance.settings import Settings

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        nats_port = taken.getsockname()[1]
        settings = Settings(port=free_port(), nats_port=nats_port, state_dir=tmp_path, device="cpu")
        assert await serve_box(settings) == 1
    assert capsys.readouterr().err.splitlines() == [nats_port_refusal(nats_port)]


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


async def test_a_box_whose_nats_hangs_still_exits_within_its_bound_and_answers_its_client(nats_server, tmp_path):
    """A NATS server that stops answering (hung, SIGSTOP here) as the box stops: nats-py's drain and close wait on
    it, and on a hung server they would wait for ever. The stop answers the awaited client first (a 503), and the
    process exits within the stop's bound (grace + 4 s; here its workers' step is cut at it), the watchdog's
    2 s after it at the latest."""
    process, http_port, log = serve_a_minute_of_work(tmp_path, ["--nats", nats_server.url], "hungbox")
    assert nats_server.process is not None
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            await until_ready(http, http_port, process, log.read_text)
            body = {"model": "slow", "input": "a minute of work"}
            answer = asyncio.create_task(http.post(f"http://127.0.0.1:{http_port}/v1/embeddings", json=body))
            await until_held(nats_server.url, "hungbox")
            await freeze(nats_server)  # every thread stopped: hung, not merely signalled
            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            response = await asyncio.wait_for(answer, 15)
            assert response.status == 503, await response.text()
            code = await asyncio.to_thread(process.wait, 30)
            took = time.monotonic() - started
        assert took < 1 + 4 + 2 + 3, f"exited {took:.1f} s after SIGTERM"
        assert code in (0, 1), log.read_text()[-3000:]
    finally:
        os.kill(nats_server.process.pid, signal.SIGCONT)
        if process.poll() is None:
            process.kill()
            process.wait(10)


async def test_a_box_that_cannot_reach_its_nats_warns_once_a_minute_not_at_every_try(tmp_path, caplog) -> None:
    """Operator tester h187: a box whose NATS was gone logged the same "nats error" warning at every reconnect, every
    0.5 s: 2,092 lines in 16 minutes. The first is a warning, the tries after it DEBUG until a minute has passed."""
    import logging

    from appliance import app
    from appliance.settings import Settings

    caplog.set_level(logging.DEBUG, logger="appliance.app")
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    box = app.Box(Settings(port=free_port(), nats=url, state_dir=tmp_path, device="cpu", default_model=False))
    starting = asyncio.create_task(box.start())

    def said(level: int) -> int:
        return sum(r.getMessage() == "nats error" and r.levelno == level for r in caplog.records)

    try:
        await wait_for(lambda: said(logging.DEBUG) >= 2, what="three tries of NATS")
        assert said(logging.WARNING) == 1
        box._nats_errors._said_at -= app.NATS_ERROR_REMIND_S  # a minute on
        await wait_for(lambda: said(logging.WARNING) == 2, what="the reminder")
    finally:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)


async def test_a_box_that_cannot_reach_its_nats_says_which_it_tries(tmp_path, caplog) -> None:
    """Operator tester: `serve --nats` at a server that is not there kept trying, as documented, but its log lines
    said only "Connection refused", never the URL: with no HTTP port open yet, the log is all an operator sees."""
    from appliance.app import Box
    from appliance.settings import Settings

    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    box = Box(Settings(port=free_port(), nats=url, state_dir=tmp_path, device="cpu", default_model=False))
    starting = asyncio.create_task(box.start())
    try:
        await wait_for(
            lambda: any(getattr(r, "nats", None) == url for r in caplog.records if r.getMessage() == "nats error"),
            what="a log line naming the NATS it tries",
        )
    finally:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)


async def test_a_start_refused_for_its_memory_budget_says_why_in_one_line(tmp_path, capsys) -> None:
    """Operator tester: `--memory-budget 10MB` exited 1 with its reason in a JSON log line only, where every other
    refusal at start prints one `fleetbox: ...` line."""
    from appliance.serving import serve_box
    from appliance.settings import Settings

    settings = Settings(port=free_port(), nats_port=free_port(), state_dir=tmp_path, device="cpu", memory_budget="10MB")
    assert await serve_box(settings) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fleetbox: ")]
    assert "needs about" in line and "budget is" in line, line


async def test_streams_jetstream_refuses_are_named_with_its_reason_in_one_line(nats_server, tmp_path, capsys) -> None:
    """Three replicas on a single server: the box exited 1 with `"error":"ServerError()"` in its log, which named
    neither replicas nor a cluster (auditor h61); the server's own words now make a `fleetbox: ...` line."""
    from appliance.serving import serve_box
    from appliance.settings import Settings

    settings = Settings(nats=nats_server.url, port=free_port(), state_dir=tmp_path, device="cpu", replicas=3)
    assert await serve_box(settings) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fleetbox: ")]
    assert (
        line
        == "fleetbox: JetStream refused the box's streams or buckets: replicas > 1 not supported in non-clustered mode"
    )
