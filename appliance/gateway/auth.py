"""API keys (bearer) for inference routes and admin keys for admin routes, compared in constant time.

A route is open when no key of its kind is configured. Keys are never logged; a missing key is
401, a wrong one 403.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from functools import wraps

from aiohttp import web

from appliance.errors import Forbidden, Unauthorized
from appliance.gateway.context import GatewayContext

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _check(request: web.Request, keys: list[str], kind: str) -> None:
    if not keys:
        return
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized(f"this route needs an {kind} key: send `Authorization: Bearer <key>`")
    matched = False
    for key in keys:  # every key is compared, so timing does not tell which one nearly matched
        matched |= hmac.compare_digest(token.encode(), key.encode())
    if not matched:
        raise Forbidden(f"the {kind} key is not valid")


def inference(handler: Handler) -> Handler:
    @wraps(handler)
    async def guarded(request: web.Request) -> web.StreamResponse:
        settings = GatewayContext.of(request).settings
        # An admin key may also call the inference routes.
        _check(request, settings.api_key_list + settings.admin_key_list if settings.api_key_list else [], "API")
        return await handler(request)

    return guarded


def admin(handler: Handler) -> Handler:
    @wraps(handler)
    async def guarded(request: web.Request) -> web.StreamResponse:
        _check(request, GatewayContext.of(request).settings.admin_key_list, "admin")
        return await handler(request)

    return guarded
