"""A NATS that wants mutual TLS with a private CA: a box joins it, and so do the TUI and the CLI.

Real TLS throughout: `openssl` makes a throwaway CA, a server certificate for 127.0.0.1 and a
client certificate; nats-server verifies the client's; `fleetbox` runs as a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from typer.testing import CliRunner

from appliance import cli
from appliance.app import Box
from appliance.connect import NatsAuth, NatsInTheClear, client_tls
from appliance.natsd import EmbeddedNats, free_port, nats_server_binary
from tests.conftest import box_settings, noop_model, wait_for
from tui import commands
from tui.source import NatsSource

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")

FLEETBOX = str(Path(sys.executable).with_name("fleetbox"))


@dataclass(slots=True, frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_key: Path  # a key that belongs to no certificate here

    def options(self) -> list[str]:
        return ["--tls-ca", str(self.ca), "--tls-cert", str(self.client_cert), "--tls-key", str(self.client_key)]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def _key(path: Path) -> Path:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-out", str(path))
    return path


def _signed(folder: Path, name: str, ca: Path, ca_key: Path, extension: str) -> tuple[Path, Path]:
    key, request, cert, ext = (folder / f"{name}{suffix}" for suffix in (".key", ".csr", ".pem", ".ext"))
    _key(key)
    _openssl("req", "-new", "-key", str(key), "-out", str(request), "-subj", f"/CN={name}")
    ext.write_text(extension + "\n")
    _openssl("x509", "-req", "-in", str(request), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
             "-out", str(cert), "-days", "1", "-extfile", str(ext))  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca, ca_key = folder / "ca.pem", _key(folder / "ca.key")
    _openssl("req", "-x509", "-new", "-key", str(ca_key), "-out", str(ca), "-days", "1", "-subj", "/CN=test CA")
    server_cert, server_key = _signed(folder, "server", ca, ca_key, "subjectAltName=IP:127.0.0.1,DNS:localhost")
    client_cert, client_key = _signed(folder, "client", ca, ca_key, "extendedKeyUsage=clientAuth")
    return Pki(ca, server_cert, server_key, client_cert, client_key, _key(folder / "stranger.key"))


@pytest.fixture
async def tls_nats(pki: Pki, tmp_path: Path) -> AsyncIterator[str]:
    """A nats-server that speaks TLS only and verifies client certificates; yields its tls:// URL."""
    server = EmbeddedNats(
        store_dir=tmp_path / "nats",
        port=free_port(),
        extra_args=("--tlsverify", "--tlscert", str(pki.server_cert), "--tlskey", str(pki.server_key),
                    "--tlscacert", str(pki.ca)),
    )  # fmt: skip
    await server.start()
    yield f"tls://127.0.0.1:{server.port}"
    await server.stop()


async def fleetbox(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        FLEETBOX,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "120", **(env or {})},
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode or 0, out.decode(), err.decode()


async def test_models_list_reaches_a_mutual_tls_fleet_with_the_tls_options(pki, tls_nats) -> None:
    tls = {"tls_ca": pki.ca, "tls_cert": pki.client_cert, "tls_key": pki.client_key}
    box = Box(box_settings(tls_nats, default_model=False, models=[noop_model("alpha")], box_id="tls-box", **tls))
    await box.start()
    try:

        async def listed(*args: str, env: dict[str, str] | None = None) -> bool:
            code, out, err = await fleetbox("models", "list", "--json", "--nats", tls_nats, *args, env=env)
            assert code == 0, err
            assert err == "", err  # nothing but the listing: no warnings from the TLS transport either
            listing = [(m["name"], m["state"], m["boxes"]) for m in json.loads(out)]
            return listing == [("alpha", "resident", ["tls-box"])]

        await wait_for(lambda: listed(*pki.options()), 20.0, "models list showing the box's model")
        from_env = {"FBX_TLS_CA": str(pki.ca), "FBX_TLS_CERT": str(pki.client_cert), "FBX_TLS_KEY": str(pki.client_key)}
        assert await listed(env=from_env)
    finally:
        await box.stop()


async def test_the_tui_dials_a_mutual_tls_nats_and_says_why_it_cannot_without_its_ca(pki, tls_nats) -> None:
    untrusting = NatsSource.dialing(tls_nats, period_s=0.2)
    source = NatsSource.dialing(tls_nats, NatsAuth(tls=client_tls(pki.ca, pki.client_cert, pki.client_key)))
    await untrusting.start()
    await source.start()
    try:
        await wait_for(lambda: source.view().connected, 10.0, "the TUI's source connected over TLS")
        await wait_for(
            lambda: "TLS: the server's certificate is not trusted" in (untrusting.view().problem or ""),
            10.0,
            "the TLS refusal named on the status line",
        )
        assert not untrusting.view().connected
    finally:
        await source.stop()
        await untrusting.stop()


async def test_without_the_right_tls_options_the_cli_says_why_and_exits_1(pki, tls_nats, monkeypatch) -> None:
    """The CLI runs its own event loop, so CliRunner runs in a thread here."""
    monkeypatch.setattr(commands, "ATTACH_TIMEOUT_S", 2.0)

    def models_list(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(cli.app, ["models", "list", "--nats", tls_nats, *args])
        return result.exit_code, result.output

    code, output = await asyncio.to_thread(models_list)
    assert code == 1
    assert output == (
        f"fleetbox: cannot reach NATS at {tls_nats}: TLS: the server's certificate is not trusted"
        " (unable to get local issuer certificate); give its CA with --tls-ca\n"
    )
    code, output = await asyncio.to_thread(models_list, "--tls-ca", str(pki.ca))  # no client certificate
    assert code == 1 and output.startswith(f"fleetbox: cannot reach NATS at {tls_nats}: ")
    assert len(output.splitlines()) == 1, output


def test_bad_tls_files_are_a_one_line_usage_error(pki, tmp_path) -> None:
    absent = tmp_path / "absent.pem"
    cases = [
        (["--tls-ca", str(absent)], f"tls-ca: {absent} does not exist"),
        (["--tls-ca", str(pki.client_key)], f"tls-ca: {pki.client_key} holds no PEM certificate"),
        (["--tls-cert", str(pki.client_key)], f"tls-cert: {pki.client_key} holds no PEM certificate"),
        (["--tls-cert", str(pki.client_cert)], f"tls-key: {pki.client_cert} holds no PEM private key"),
        (["--tls-key", str(pki.client_key)], f"tls-key: {pki.client_key} is given without its certificate"),
        (
            ["--tls-cert", str(pki.client_cert), "--tls-key", str(pki.stranger_key)],
            f"tls-key: {pki.stranger_key} is not the key of the certificate {pki.client_cert}",
        ),
    ]
    for command in (["models", "list"], ["tui"], ["models", "pin", "alpha"], ["box", "drain", "some-box"]):
        for options, why in cases:
            result = CliRunner().invoke(cli.app, [*command, "--nats", "tls://127.0.0.1:1", *options])
            assert result.exit_code == 2, (command, options, result.output)
            assert result.output.startswith(f"fleetbox: {why}") and len(result.output.splitlines()) == 1, result.output

    result = CliRunner().invoke(cli.app, ["serve", "--nats", "tls://127.0.0.1:1", "--tls-ca", str(absent)])
    assert result.exit_code == 2
    assert result.output == f"fleetbox: bad settings: tls-ca: {absent} does not exist\n"


async def test_tls_asked_for_is_never_dropped_for_a_server_in_the_clear(pki, nats_server, monkeypatch) -> None:
    """nats-py starts TLS only when the server asks for it: with a CA given, or a tls:// URL, it talked to a server
    without TLS in the clear, and the box and the CLI said nothing (tester h63). Without TLS asked for, the CLI
    says at once that no box ever started there (it waited out its whole attach timeout)."""
    monkeypatch.setattr(commands, "ATTACH_TIMEOUT_S", 300.0)
    plain = f"nats://127.0.0.1:{nats_server.port}"
    box = Box(box_settings(plain, default_model=False, models=[noop_model("alpha")], tls_ca=pki.ca))
    with pytest.raises(NatsInTheClear, match="does not speak TLS, though TLS is asked for"):
        await box.start()
    await box.stop()

    def models_list(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(cli.app, ["models", "list", *args])
        return result.exit_code, result.output

    reason = f"{NatsInTheClear.reason}\n"
    for args in (["--nats", plain, "--tls-ca", str(pki.ca)], ["--nats", f"tls://127.0.0.1:{nats_server.port}"]):
        code, output = await asyncio.to_thread(models_list, *args)
        assert (code, output) == (1, f"fleetbox: cannot reach NATS at {args[1]}: {reason}"), args
    no_tls = asyncio.to_thread(models_list, "--nats", plain)  # no TLS asked for: it reads the fleet
    code, output = await asyncio.wait_for(no_tls, 60)
    assert (code, output) == (1, f"fleetbox: no fleet at {plain} yet: no box has started there\n")


async def test_a_box_whose_nats_comes_back_without_tls_stops(pki, tmp_path) -> None:
    """The server it reconnects to (another of a cluster's, or one restarted without its tls block) is not talked
    to in the clear either: the box stops with the reason."""
    port = free_port()
    tls_args = ("--tls", "--tlscert", str(pki.server_cert), "--tlskey", str(pki.server_key))
    server = EmbeddedNats(store_dir=tmp_path / "nats", port=port, extra_args=tls_args)
    await server.start()
    box = Box(box_settings(f"tls://127.0.0.1:{port}", default_model=False, models=[], tls_ca=pki.ca))
    try:
        await box.start()
        await server.stop()
        server = EmbeddedNats(store_dir=tmp_path / "nats", port=port)
        await server.start()
        await asyncio.wait_for(box.stop_requested.wait(), 30)
        assert box.failure is not None and "does not speak TLS, though TLS is asked for" in box.failure
    finally:
        await box.stop()
        await server.stop()


async def test_a_plain_server_is_refused_before_anything_is_sent_to_it(pki, tmp_path) -> None:
    """Tester h74: the refusal came after nats-py had connected, so the server had the CONNECT, a password of the
    URL included, in the clear; and the refusal printed the password. A plain look-alike server records what it
    is sent: nothing."""
    received = bytearray()

    async def plain_nats(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'INFO {"server_id":"fake","version":"2.10.0","max_payload":1048576,"proto":1}\r\n')
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(4096):
                received.extend(chunk)
        writer.close()

    server = await asyncio.start_server(plain_nats, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    secret = f"nats://fleetuser:s3cret@127.0.0.1:{port}"
    try:
        box = Box(box_settings(secret, default_model=False, models=[], tls_ca=pki.ca))
        with pytest.raises(NatsInTheClear) as refused:
            await box.start()
        await box.stop()
        assert "s3cret" not in str(refused.value) and f"127.0.0.1:{port}" in str(refused.value)

        def models_list() -> tuple[int, str]:
            result = CliRunner().invoke(cli.app, ["models", "list", "--nats", secret.replace("nats:", "tls:")])
            return result.exit_code, result.output

        code, output = await asyncio.to_thread(models_list)
        assert code == 1 and "does not speak TLS" in output and "s3cret" not in output, output
        await asyncio.sleep(0.2)  # anything sent after the INFO has arrived by now
        assert b"s3cret" not in received and b"CONNECT" not in received, bytes(received)
    finally:
        server.close()
        await server.wait_closed()


async def test_a_nats_without_jetstream_is_said_to_have_no_fleet_at_once(tmp_path, monkeypatch) -> None:
    """Tester h74: `models list` against a nats-server without JetStream waited out its 10 s attach bound, then said
    `cannot read the fleet: ServiceUnavailableError()`."""
    monkeypatch.setattr(commands, "ATTACH_TIMEOUT_S", 300.0)
    port = free_port()
    server = await asyncio.create_subprocess_exec(nats_server_binary(), "-a", "127.0.0.1", "-p", str(port))
    try:
        nc = await wait_for_nats(f"nats://127.0.0.1:{port}")
        await nc.close()

        def models_list() -> tuple[int, str]:
            result = CliRunner().invoke(cli.app, ["models", "list", "--nats", f"nats://127.0.0.1:{port}"])
            return result.exit_code, result.output

        code, output = await asyncio.wait_for(asyncio.to_thread(models_list), 60)
        said = f"fleetbox: no fleet at nats://127.0.0.1:{port}: JetStream does not answer there (no -js?)\n"
        assert (code, output) == (1, said)
    finally:
        server.terminate()
        await server.wait()


async def test_serve_against_a_nats_without_jetstream_says_so(tmp_path, monkeypatch, capsys) -> None:
    """Tester h199: `fleetbox serve --nats` at a nats-server without JetStream retried a minute (as for a cluster
    electing its leaders), then said `JetStream refused the box's streams or buckets: None`."""
    from appliance import connect
    from appliance.serving import serve_box

    monkeypatch.setattr(connect, "_JETSTREAM_SETTLE_S", 1.0)
    port = free_port()
    server = await asyncio.create_subprocess_exec(nats_server_binary(), "-a", "127.0.0.1", "-p", str(port))
    try:
        address = f"nats://127.0.0.1:{port}"
        nc = await wait_for_nats(address)
        await nc.close()
        settings = box_settings(address, role="gateway", default_model=False, state_dir=tmp_path / "state")
        assert await asyncio.wait_for(serve_box(settings), 60) == 1
        said = capsys.readouterr().err
        assert f"fleetbox: JetStream does not answer at {address} (a nats-server without -js?)" in said, said
        assert "None" not in said
    finally:
        server.terminate()
        await server.wait()


async def wait_for_nats(url: str) -> nats.NATS:
    for _ in range(100):
        with contextlib.suppress(Exception):
            return await nats.connect(url, allow_reconnect=False, connect_timeout=1)
        await asyncio.sleep(0.1)
    raise AssertionError(f"no nats-server at {url}")
