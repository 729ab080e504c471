"""The box's HTTP listener: the aiohttp application on the box's host and port.

It opens last as a box starts (the API answers only once the queue, catalog and models are there)
and closes late as it stops: a draining box keeps answering its probes (`/readyz` says why) while
every other request is refused and each connection closes after its answer.
"""

from __future__ import annotations

from aiohttp import web

from appliance.gateway.app import build_app
from appliance.gateway.context import GatewayContext


class HttpDoor:
    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port
        self._runner: web.AppRunner | None = None
        self.port: int | None = None  # the port it listens on: the one asked for, or the free one 0 got

    async def open(self, context: GatewayContext) -> None:
        # handler_cancellation: a client that disconnects cancels its handler, which cancels its request.
        self._runner = web.AppRunner(
            build_app(context), access_log=None, shutdown_timeout=3.0, handle_signals=False, handler_cancellation=True
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
        await site.start()
        server = site._server
        if server is not None and server.sockets:  # port 0 means "any free port"
            self.port = int(server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening, after the handlers still answering (3 s at most)."""
        if self._runner is not None:
            await self._runner.cleanup()
