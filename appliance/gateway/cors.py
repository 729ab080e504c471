"""CORS: browser apps on the origins a box allows (`cors_allow_origins`) may call its API directly.

A preflight (`OPTIONS` with `Access-Control-Request-Method`) for a route and method the box has is answered
here, before any key check (a browser sends it without credentials) and even while the box drains (a browser
reads a refused preflight as a CORS failure, never as the 503 it could retry), allowing that route's methods.
A preflight for a path or method the box does not have gets the answer it would without CORS (404, 405),
allowing nothing. Every other answer to an allowed origin gets its CORS headers as it is sent, streams
included, whose headers go out before the handler returns. No origin allowed: no headers at all.
"""

from __future__ import annotations

from aiohttp import web

from appliance.gateway.auth import Handler
from appliance.gateway.context import GatewayContext

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


def _methods_of(request: web.Request) -> frozenset[str]:
    """The methods the preflight's path takes, as the router found them for its OPTIONS (none: no such path).

    No route takes OPTIONS itself, so the router's answer to it is a 405 naming the path's methods, or a 404; nor
    is OPTIONS allowed, then: a plain OPTIONS is that 405 (review h201).
    """
    refused = request.match_info.http_exception
    if isinstance(refused, web.HTTPMethodNotAllowed):
        return frozenset(refused.allowed_methods)
    return frozenset()


def _is_preflight(request: web.Request) -> bool:
    return request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers


@web.middleware
async def preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
    if not _is_preflight(request):
        return await handler(request)
    ctx = GatewayContext.of(request)
    if _allowed(request, ctx.settings.cors_origin_list) is None:
        return await handler(request)  # not an origin this box serves: the route's own 405
    methods = _methods_of(request)
    if request.headers["Access-Control-Request-Method"].strip() not in methods:
        return await handler(request)  # no such route, or not that method: its 404 or 405, allowing nothing
    response = web.Response(status=204)
    # Every answer has its request id, as api.md says: the preflight's was missing (tester h99).
    response.headers["Fbx-Request-Id"] = response.headers["X-Request-Id"] = ctx.new_request_id()
    response.headers["Access-Control-Allow-Methods"] = ", ".join(sorted(methods))
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
    # A preflight refused (no such route or method) allows nothing: it is the answer a request without CORS gets.
    refused_preflight = _is_preflight(request) and "Access-Control-Allow-Methods" not in response.headers
    if allowed is not None and not refused_preflight:
        response.headers["Access-Control-Allow-Origin"] = allowed
        response.headers["Access-Control-Expose-Headers"] = _EXPOSED
