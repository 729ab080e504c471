"""The HTTP details every route shares: reading a JSON body within limits, deadlines, responses."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import orjson
from aiohttp import web

from appliance.envelope import INTERACTIVE, PRIORITIES
from appliance.errors import BadRequest, PayloadTooLarge, Unprocessable, UnsupportedMediaType
from appliance.settings import Settings

T = TypeVar("T")

TIMEOUT_HEADER = "Timeout"
PRIORITY_HEADER = "Fbx-Priority"


async def read_body(request: web.Request, settings: Settings) -> bytes:
    """The raw JSON body, after the content-type and size checks."""
    if request.content_type != "application/json":
        raise UnsupportedMediaType(f"expected Content-Type: application/json, got {request.content_type or 'none'}")
    if request.content_length is not None and request.content_length > settings.max_body_bytes:
        raise _too_large(settings)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(settings) from None


def _too_large(settings: Settings) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body is larger than the limit of {settings.max_body_bytes} bytes")


def decode(body: bytes, decoder: msgspec.json.Decoder[T]) -> T:
    """Validate a body against its schema: malformed JSON is 400, a wrong shape or value 422."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise Unprocessable(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"malformed JSON: {exc}", code="invalid_json") from None


def request_timeout(request: web.Request, field: float | None, settings: Settings) -> float:
    """The request's deadline in seconds: the `timeout` field, else the `Timeout` header, else the default."""
    value: float | None = field
    if value is None and TIMEOUT_HEADER in request.headers:
        try:
            value = float(request.headers[TIMEOUT_HEADER])
        except ValueError:
            raise BadRequest(f"the {TIMEOUT_HEADER} header must be a number of seconds") from None
        if not value > 0:
            raise BadRequest(f"the {TIMEOUT_HEADER} header must be positive")
    if value is None:
        return settings.default_timeout_s
    return min(value, settings.max_timeout_s)


def json_response(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY),
        status=status,
        content_type="application/json",
        headers=headers,
    )


def request_priority(request: web.Request) -> str:
    """`interactive` (the default) or `batch`: bulk work that waits while interactive work is queued."""
    priority = request.headers.get(PRIORITY_HEADER, INTERACTIVE).strip().lower()
    if priority not in PRIORITIES:
        raise Unprocessable(
            f"the {PRIORITY_HEADER} header must be one of {', '.join(PRIORITIES)}, not {priority!r}",
            code="invalid_priority",
        )
    return priority
