"""CORS: browser apps on the origins a box allows (`cors_allow_origins`) may call its API directly.

A preflight (`OPTIONS` with `Access-Control-Request-Method`) is answered here, before any route or key check
(a browser sends it without credentials) and even while the box drains (a browser reads a refused preflight as
a CORS failure, never as the 503 it could retry); every other answer to an allowed origin gets its CORS headers as it is
sent, streams included, whose headers go out before the handler returns. No origin allowed: no headers at all.
"""

from __future__ import annotations

from aiohttp import web

from appliance.gateway.auth import Handler
from appliance.gateway.context import GatewayContext

_METHODS = "GET, POST, PATCH, DELETE, OPTIONS"
# What a browser app may read of an answer besides the basic headers: the request id, timing, the retry hint.
_EXPOSED = "Fbx-Request-Id, X-Request-Id, Fbx-Box, Fbx-Queue-Ms, Fbx-Compute-Ms, Retry-After"
_PREFLIGHT_CACHE_S = "600"


def _allowed(request: web.Request, origins: list[str]) -> str | None:
    """The `Access-Control-Allow-Origin` for this request, or None when its origin is not allowed (or it has none)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return None
    if "*" in origins:
        return "*"
    return origin if origin.lower() in origins else None


@web.middleware
async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
        return await handler(request)
    ctx = GatewayContext.of(request)
    if _allowed(request, ctx.settings.cors_origin_list) is None:
        return await handler(request)  # not an origin this box serves: the route's own 405
    response = web.Response(status=204)
    # Every answer has its request id, as api.md says: the preflight's was missing (tester h99).
    response.headers["Fbx-Request-Id"] = response.headers["X-Request-Id"] = ctx.new_request_id()
    response.headers["Access-Control-Allow-Methods"] = _METHODS
    requested = request.headers.get("Access-Control-Request-Headers")
    if requested:  # Authorization (the API key), Content-Type, Timeout, Fbx-Priority, ...
        response.headers["Access-Control-Allow-Headers"] = requested
    response.headers["Access-Control-Max-Age"] = _PREFLIGHT_CACHE_S
    return response


async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare`: the CORS headers of an answer to an allowed origin."""
    origins = GatewayContext.of(request).settings.cors_origin_list
    if "*" not in origins:
        response.headers.add("Vary", "Origin")  # the answer depends on the origin: a cache must not mix them
    allowed = _allowed(request, origins)
    if allowed is not None:
        response.headers["Access-Control-Allow-Origin"] = allowed
        response.headers["Access-Control-Expose-Headers"] = _EXPOSED
