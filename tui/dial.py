"""Dialling NATS for the operator's tools (the TUI and the fleet CLI): a first connect that gives up
or retries as the caller says, and names why it failed in words an operator acts on.

nats-py on its own retries a first connect for ever in silence and prints its errors itself; here
the first connect is bounded (the CLI's one-shot verbs) or endless with every reason reported (the
TUI, which draws at once and says what it is waiting for), and once connected the client
reconnects for ever.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import socket
import ssl
from collections.abc import Callable, Coroutine
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from appliance.connect import (
    NO_AUTH,
    NatsAuth,
    NatsInTheClear,
    asks_for_tls,
    in_the_clear,
    refuse_plain_servers,
    shown_url,
)

log = logging.getLogger(__name__)

_REFUSALS_PER_SERVER = 2  # refusals in a row from each server after which a bounded first connect gives up


class NatsUnreachable(ConnectionError):
    """The first connection to NATS did not come about; the message says where and why."""

    def __init__(self, servers: str, reason: str) -> None:
        super().__init__(f"cannot reach NATS at {shown_url(servers)}: {reason}")
        self.reason = reason


def refused(exc: BaseException) -> bool:
    """Whether nothing listens where the connection went: at each of a host's addresses, when it has several (asyncio
    then raises `OSError("Multiple exceptions: [Errno 111] ..., [Errno 111] ...")`, `localhost` on many systems)."""
    if isinstance(exc, ConnectionRefusedError):
        return True
    numbers = re.findall(r"\[Errno (\d+)\]", str(exc)) if str(exc).startswith("Multiple exceptions: ") else []
    return bool(numbers) and all(int(number) == errno.ECONNREFUSED for number in numbers)


def connect_problem(exc: BaseException) -> str:
    """Why a connection attempt failed, in words an operator acts on."""
    if refused(exc):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return f"host not found ({exc.strerror})"
    if isinstance(exc, TimeoutError):
        return "no answer"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS: the server's certificate is not trusted ({exc.verify_message}); give its CA with --tls-ca"
    if isinstance(exc, ssl.SSLError) and exc.reason == "TLSV13_ALERT_CERTIFICATE_REQUIRED":
        return "TLS: the server asks for a client certificate; give one with --tls-cert and --tls-key"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {(exc.reason or str(exc)).replace('_', ' ').lower()}"  # "TLS: certificate unknown"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[0].lower() + exc.strerror[1:]
    return str(exc) or type(exc).__name__


async def dial(
    nc: NATS,
    servers: str,
    auth: NatsAuth = NO_AUTH,
    *,
    give_up_after_s: float | None = 10.0,
    on_problem: Callable[[str], None] | None = None,
) -> None:
    """Connect `nc` for the TUI and the CLI; once connected it reconnects for ever.

    The first connect tries for `give_up_after_s`, then raises `NatsUnreachable` naming the last
    reason (the CLI's one-shot verbs); with None it tries for ever (the TUI), telling `on_problem`
    each reason so that the screen can show it. nats-py itself would retry a first connect for
    ever in silence. A bounded connect gives up at once when every server has refused twice in a
    row (nothing listens there: waiting out the bound only delays the one line that says so).
    """
    urls = [url.strip() for url in servers.split(",") if url.strip()]
    if not urls:  # nats-py would loop for ever over an empty server list
        raise NatsUnreachable(servers, "no NATS URL given")
    problems: list[str] = []  # the last one only
    refusals = 0  # in a row
    all_refused = asyncio.Event()

    async def failed(exc: Exception) -> None:  # nats-py prints errors itself otherwise
        nonlocal refusals
        problems[:] = [connect_problem(exc)]
        refusals = refusals + 1 if refused(exc) else 0
        if refusals >= _REFUSALS_PER_SERVER * len(urls):
            all_refused.set()
        if on_problem is not None:
            on_problem(problems[0])

    async def quiet(*_: Any) -> None:
        return None

    try:
        await refuse_plain_servers(urls, auth.tls)
    except NatsInTheClear:
        raise NatsUnreachable(servers, NatsInTheClear.reason) from None
    connecting = nc.connect(
        servers=urls,
        user_credentials=str(auth.creds) if auth.creds else None,
        tls=auth.tls,
        name="fleetbox-tui",
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        error_cb=failed,
        disconnected_cb=quiet,
        reconnected_cb=quiet,
    )
    try:  # not wait_for: on Python 3.11 it can swallow a cancel (the TUI quitting while it dials)
        async with asyncio.timeout(give_up_after_s):
            if give_up_after_s is None:
                await connecting
            else:
                await _first_of(connecting, all_refused.wait())
    except asyncio.CancelledError:
        await _close_quietly(nc)
        raise
    except TimeoutError:
        await _close_quietly(nc)
        why = problems[0] if problems else f"no answer within {give_up_after_s:g} s"
        raise NatsUnreachable(servers, why) from None
    except Exception as exc:  # a URL nats-py cannot parse, a credentials file it cannot use
        await _close_quietly(nc)
        raise NatsUnreachable(servers, connect_problem(exc)) from None
    if asks_for_tls(urls, auth.tls) and in_the_clear(nc):
        await _close_quietly(nc)
        raise NatsUnreachable(servers, NatsInTheClear.reason)


async def _first_of(connecting: Coroutine[Any, Any, None], refused: Coroutine[Any, Any, bool]) -> None:
    """Await the connect, or raise TimeoutError as the bound would once every server refused."""
    connect_task = asyncio.ensure_future(connecting)
    refused_task = asyncio.ensure_future(refused)
    try:
        done, _ = await asyncio.wait((connect_task, refused_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        refused_task.cancel()
        if not connect_task.done():
            connect_task.cancel()
            await asyncio.gather(connect_task, return_exceptions=True)
    if connect_task not in done:
        raise TimeoutError
    connect_task.result()


async def connect(servers: str, auth: NatsAuth = NO_AUTH, *, give_up_after_s: float | None = 10.0) -> NATS:
    """A connected client (see `dial`); raises `NatsUnreachable` after `give_up_after_s`."""
    nc = NATS()
    await dial(nc, servers, auth, give_up_after_s=give_up_after_s)
    return nc


async def _close_quietly(nc: NATS) -> None:
    try:
        async with asyncio.timeout(3.0):
            await nc.close()
    except (NatsError, OSError, TimeoutError) as exc:
        log.debug("closing a NATS connection that never came up failed", extra={"error": repr(exc)})
