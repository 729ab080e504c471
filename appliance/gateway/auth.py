"""API keys (bearer) for inference routes and admin keys for admin routes, compared in constant time.

A route is open when no key of its kind is configured; the admin routes take the API keys when only those are
set (tester h191: with API keys alone, anyone without a key could register and delete models). Keys are never
logged. A missing key, or one that is no key of the box's, is 401 (as OpenAI, vLLM and TEI answer it: the openai
SDK raises `AuthenticationError`); an API key on an admin route is 403: known, but not allowed there.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Sequence
from functools import wraps

from aiohttp import web

from appliance.errors import Forbidden, TooManyRequests, Unauthorized
from appliance.gateway.context import GatewayContext

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _matches(presented: bytes, keys: Sequence[str]) -> bool:
    matched = False
    for key in keys:  # every key is compared, so timing does not tell which one nearly matched
        matched |= hmac.compare_digest(presented, key.encode())
    return matched


def _check(request: web.Request, keys: Sequence[str], kind: str, others: Sequence[str] = ()) -> str | None:
    """The key the request presented, once it is known to be valid; None when the route is open. `others`: keys
    the box knows that are not valid here (API keys on an admin route), 403 rather than 401."""
    if not keys:
        return None
    headers = request.headers.getall("Authorization", [])
    if len(headers) > 1:  # which one counts would depend on who reads them (a proxy may add one)
        raise Unauthorized("send one Authorization header, not several")
    scheme, _, token = (headers[0] if headers else "").partition(" ")
    token = token.lstrip(" ")  # one or more spaces after the scheme (RFC 9110)
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized(f"this route needs an {kind} key: send `Authorization: Bearer <key>`")
    # Header bytes that are not UTF-8 arrive as surrogate escapes: compared as the bytes they were.
    presented = token.encode("utf-8", "surrogateescape")
    if _matches(presented, keys):
        return token
    if _matches(presented, others):
        raise Forbidden(f"this route needs an {kind} key, and the key sent is not one")
    raise Unauthorized(f"the key sent is not valid: this route needs an {kind} key")


def may_send_body(request: web.Request) -> bool:
    """Whether the request presents a key some route of the box takes (or the box takes none): a client asking
    `Expect: 100-continue` is told to send its body only then, not invited to upload megabytes before its 401."""
    settings = GatewayContext.of(request).settings
    if not settings.api_key_list:  # the inference routes are open (an admin body is small: its 401 comes after it)
        return True
    keys = settings.api_key_list + settings.admin_key_list
    try:
        _check(request, keys, "API")
    except (Unauthorized, Forbidden):
        return False
    return True


def inference(handler: Handler) -> Handler:
    @wraps(handler)
    async def guarded(request: web.Request) -> web.StreamResponse:
        ctx = GatewayContext.of(request)
        settings = ctx.settings
        # An admin key may also call the inference routes.
        key = _check(request, settings.api_key_list + settings.admin_key_list if settings.api_key_list else [], "API")
        limit = settings.max_concurrent_per_key
        if key is None or limit <= 0:
            return await handler(request)
        in_flight = request.app[IN_FLIGHT]
        if in_flight.get(key, 0) >= limit:
            raise TooManyRequests(
                f"this API key already has {limit} request{'s' if limit != 1 else ''} in flight", retry_after_s=1
            )
        in_flight[key] = in_flight.get(key, 0) + 1
        try:
            return await handler(request)
        finally:
            in_flight[key] -= 1
            if not in_flight[key]:
                del in_flight[key]

    return guarded


def metrics_guard(handler: Handler) -> Handler:
    """`/metrics` is open unless `metrics_require_key`; then any API or admin key opens it."""

    @wraps(handler)
    async def guarded(request: web.Request) -> web.StreamResponse:
        settings = GatewayContext.of(request).settings
        if settings.metrics_require_key:
            _check(request, settings.api_key_list + settings.admin_key_list, "API or admin")
        return await handler(request)

    return guarded


# Requests in flight per API key; owned by the application (one per gateway), touched only here.
IN_FLIGHT: web.AppKey[dict[str, int]] = web.AppKey("fbx_in_flight", dict)


def admin(handler: Handler) -> Handler:
    @wraps(handler)
    async def guarded(request: web.Request) -> web.StreamResponse:
        settings = GatewayContext.of(request).settings
        if settings.admin_key_list:
            _check(request, settings.admin_key_list, "admin", others=settings.api_key_list)
        else:  # no admin keys: whoever holds an API key administers (`serve` warns at start), never anyone else
            _check(request, settings.api_key_list, "API")
        return await handler(request)

    return guarded
