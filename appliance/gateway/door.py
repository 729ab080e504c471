"""The box's HTTP listener: the aiohttp application on the box's host and port.

It opens last as a box starts (the API answers only once the queue, catalog and models are there)
and closes late as it stops: a draining box keeps answering its probes (`/readyz` says why) while
every other request is refused and each connection closes after its answer.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from appliance.gateway.app import build_app
from appliance.gateway.context import GatewayContext

# As it closes, the listener stops taking connections, then lets the kept-alive ones carry the request a client
# may be sending on them (its 503 closes the connection) until none has closed for _QUIET_S, _LINGER_S at most.
_QUIET_S = 0.25
_LINGER_S = 1.5
_POLL_S = 0.02


# An idle kept-alive connection is closed after this long (nginx's default): aiohttp's own 3,630 s let idle
# connections pile up to the box's open-files limit (tester h84: still open after 400 s, 19,990 of them at the limit).
KEEPALIVE_S = 75.0


class HttpDoor:
    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self._runner: web.AppRunner | None = None
        self.port: int | None = None  # the port it listens on: the one asked for, or the free one 0 got

    async def open(self, context: GatewayContext) -> None:
        # handler_cancellation: a client that disconnects cancels its handler, which cancels its request.
        self._runner = web.AppRunner(
            build_app(context),
            access_log=None,
            shutdown_timeout=3.0,
            handle_signals=False,
            handler_cancellation=True,
            keepalive_timeout=KEEPALIVE_S,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
        await site.start()
        server = site._server
        if server is not None and server.sockets:  # port 0 means "any free port"
            self.port = int(server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening, let kept-alive connections settle, then close after the handlers (3 s at most).

        Closing a kept-alive connection the moment a client sends on it loses that request with no answer (the
        client sees a dropped connection, not a 503 it could retry), so the connections in use are left to close
        by themselves after their next answer; only those quiet for a while are closed.
        """
        if self._runner is None:
            return
        for site in list(self._runner.sites):
            await site.stop()  # a new connection is refused: a client can retry that anywhere
        await self._settle()
        await self._runner.cleanup()

    async def _settle(self) -> None:
        """Wait until no connection is open, or none has closed for `_QUIET_S` (`_LINGER_S` at most)."""
        server = self._runner.server if self._runner is not None else None
        if server is None:
            return
        loop = asyncio.get_running_loop()
        give_up = loop.time() + _LINGER_S
        open_now = set(server.connections)
        changed = loop.time()
        while open_now and loop.time() < give_up and loop.time() - changed < _QUIET_S:
            await asyncio.sleep(_POLL_S)
            still_open = set(server.connections)
            if still_open != open_now:
                open_now, changed = still_open, loop.time()
