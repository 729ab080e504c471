"""Typed errors that map to HTTP statuses and the `{"error": {"message", "type", "code"}}` shape.

Handlers and workers raise these; one gateway middleware turns them into responses, and a worker
sends them back as a reply with `Fbx-Status`, so a client sees the same error whichever box failed.
"""

from __future__ import annotations

from typing import Any

import orjson

from runtimes.base import UnsupportedModel


class FleetboxError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str = "internal_error"

    def __init__(self, message: str, *, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}

    def to_json(self) -> bytes:
        return orjson.dumps(self.body())


def shown(value: str, most: int = 200) -> str:
    """A client's string as an error message quotes it: its repr, cut at `most` characters (a 1 MB `model` came back
    whole in its 404: black-box finding)."""
    if len(value) <= most:
        return repr(value)
    return f"{value[:most]!r}... ({len(value)} characters)"


class BadRequest(FleetboxError):
    status, type, code = 400, "invalid_request_error", "bad_request"


class Unauthorized(FleetboxError):
    """A 401 says how to authenticate (`WWW-Authenticate`, which HTTP requires of it): a bearer key."""

    status, type, code = 401, "authentication_error", "unauthorized"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"WWW-Authenticate": 'Bearer realm="fleetbox"'})


class Forbidden(FleetboxError):
    status, type, code = 403, "permission_error", "forbidden"


class NotFound(FleetboxError):
    status, type, code = 404, "invalid_request_error", "not_found"


class MethodNotAllowed(FleetboxError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"

    @classmethod
    def allowing(cls, allowed: str) -> MethodNotAllowed:
        """The 405 names the route's methods in its message and, as RFC 9110 asks, in an `Allow` header."""
        return cls(f"method not allowed; allowed: {allowed}", headers={"Allow": allowed})


class RequestTimeout(FleetboxError):
    status, type, code = 408, "invalid_request_error", "body_timeout"


class Conflict(FleetboxError):
    status, type, code = 409, "invalid_request_error", "conflict"


class PayloadTooLarge(FleetboxError):
    status, type, code = 413, "invalid_request_error", "payload_too_large"


class UnsupportedMediaType(FleetboxError):
    status, type, code = 415, "invalid_request_error", "unsupported_media_type"


class ExpectationFailed(FleetboxError):
    status, type, code = 417, "invalid_request_error", "expectation_failed"


class Unprocessable(FleetboxError):
    status, type, code = 422, "invalid_request_error", "invalid_input"


class TooManyRequests(FleetboxError):
    status, type, code = 429, "rate_limit_error", "overloaded"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(max(1, retry_after_s))})


class InsufficientMemory(FleetboxError):
    status, type, code = 507, "server_error", "insufficient_memory"

    def __init__(self, message: str, *, code: str | None = None, need_bytes: int = 0) -> None:
        super().__init__(message, code=code)
        self.need_bytes = need_bytes  # what the model needs, when the box that refused it knows


class InternalError(FleetboxError):
    status, type, code = 500, "server_error", "internal_error"


class ServiceUnavailable(FleetboxError):
    status, type, code = 503, "server_error", "unavailable"

    def __init__(self, message: str, *, code: str | None = None, retry_after_s: int | None = None) -> None:
        headers = {"Retry-After": str(max(1, retry_after_s))} if retry_after_s is not None else None
        super().__init__(message, code=code, headers=headers)


class UnloadedWhileStarting(ServiceUnavailable):
    """A model evicted or deleted while its worker started (warmed up): no load failed, so no back-off."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after_s=1)


class GatewayTimeout(FleetboxError):
    status, type, code = 504, "timeout_error", "deadline_exceeded"


def reason_of(exc: BaseException) -> str:
    """What went wrong, for a client or an operator: a fleetbox error's own message, a runtime's of a model it cannot
    serve, or of a file it cannot read (whose message says it all: as a repr it read `FileNotFoundError('the model
    folder ...')`, tester h80), else the exception's repr."""
    if isinstance(exc, FleetboxError):
        return exc.message
    # A file the load could not read says so itself (transformers' "Error no file named model.safetensors found in
    # directory ...", an OSError: a repr around it, h86).
    return str(exc) if isinstance(exc, (UnsupportedModel, OSError)) else repr(exc)


def too_many_dimensions(dimensions: int, width: int) -> Unprocessable:
    """`dimensions` past the model's width: said by the worker, or by a gateway that knows the width from a holder's
    heartbeat before it admits the request (else a 429 told the client to retry what could never be answered)."""
    return Unprocessable(f"dimensions={dimensions} is more than this model's {width}", code="invalid_dimensions")


def not_resident(model: str, box: str) -> NotFound:
    """An evict from a named box that does not hold the model (the HTTP route and the CLI alike)."""
    return NotFound(f"model {model} is not resident on box {box}", code="model_not_resident")


def not_evicted(model: str, box: str, answer: dict[str, Any]) -> FleetboxError:
    """Why the `evict` verb on a box named evicted nothing: the model loads there (an eviction then did nothing, and
    said so as a 200), or it is not resident there. Evicting from every box skips both."""
    if answer.get("loading"):
        return Conflict(f"model {model} is loading on box {box}; evict it once it is loaded")
    return not_resident(model, box)


def model_deleted(name: str) -> NotFound:
    """The answer to a request whose model was deleted while it waited (its name perhaps registered again since)."""
    return NotFound(f"model {name!r} was deleted while this request waited for it", code="model_not_found")


def deadline_passed(request_id: str) -> GatewayTimeout:
    return GatewayTimeout(f"request {request_id} passed its deadline while queued; it was not computed")


_BY_STATUS: dict[int, type[FleetboxError]] = {
    cls.status: cls
    for cls in (
        BadRequest,
        Unauthorized,
        Forbidden,
        NotFound,
        MethodNotAllowed,
        Conflict,
        PayloadTooLarge,
        UnsupportedMediaType,
        Unprocessable,
        InternalError,
        InsufficientMemory,
        ServiceUnavailable,
        GatewayTimeout,
    )
}


def retry_after_of(error: FleetboxError) -> int:
    """An error's Retry-After in seconds, 0 when it has none: what a worker's reply carries for it."""
    try:
        return max(0, int(error.headers.get("Retry-After", 0)))
    except ValueError:
        return 0


def error_from_reply(status: int, body: bytes, retry_after_s: int = 0) -> FleetboxError:
    """Rebuild the error a worker sent, keeping its message, code and Retry-After."""
    try:
        fields = orjson.loads(body)["error"]
        message, code = str(fields["message"]), str(fields.get("code") or "")
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message, code = body.decode("utf-8", "replace") or f"worker answered {status}", ""
    cls = _BY_STATUS.get(status, InternalError)
    error = cls(message, code=code or None)
    if retry_after_s > 0:
        error.headers["Retry-After"] = str(retry_after_s)
    return error
