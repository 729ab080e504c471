"""The HTTP details every route shares: reading a JSON body within limits, deadlines, responses.

The body is the client's bytes, so everything about it is checked here before anything parses it:
the media type and its charset, the content encoding (decompressed here, within the size limit, not
by aiohttp, so a bad or unsupported encoding is a 4xx in the error shape), and the JSON itself. While
it arrives it is held in memory, so it must arrive within `body_timeout_s`, and the box receives at
most `max_receiving_bytes` of bodies at once (`Receiving`).
"""

from __future__ import annotations

import asyncio
import math
import re
import zlib
from typing import Any, TypeVar

import msgspec
import orjson
from aiohttp import hdrs, web

from appliance.envelope import INTERACTIVE, PRIORITIES
from appliance.errors import (
    BadRequest,
    PayloadTooLarge,
    RequestTimeout,
    TooManyRequests,
    Unprocessable,
    UnsupportedMediaType,
)
from appliance.schemas import MIN_TIMEOUT_S
from appliance.settings import MODEL_NAME_RULE, Settings

T = TypeVar("T")

TIMEOUT_HEADER = "Timeout"
PRIORITY_HEADER = "Fbx-Priority"

_UTF8 = frozenset({"utf-8", "utf8"})
_BOM = b"\xef\xbb\xbf"
# zlib window bits: a gzip header, a zlib header, or raw deflate (some clients send `deflate` without a header).
_GZIP, _ZLIB, _RAW_DEFLATE = 16 + zlib.MAX_WBITS, zlib.MAX_WBITS, -zlib.MAX_WBITS
_ENCODINGS = {"gzip": _GZIP, "x-gzip": _GZIP, "deflate": _ZLIB}
_GZIP_MAGIC = b"\x1f\x8b"  # how a gzip member starts (RFC 1952)
# A plain decimal number of seconds: ASCII digits, an optional fraction and exponent; no sign, `_`, nan or inf.
_SECONDS = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
_NAME_FIELD = re.compile(r"at `(\$\.(?:name|aliases\[\d+\]))`$")  # where a registration's names fail their pattern


class Receiving:
    """The bytes of request bodies a box is receiving at once, against `max_receiving_bytes`: a body is held in
    memory until all of it has come, and a client that stopped sending halfway held its share as long as it liked
    (100 stalled 8 MiB uploads took 1.6 GB: black-box finding). Counted as they arrive: counted at a body's
    `Content-Length`, 32 connections that sent headers alone shut every upload out (review r50)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, nbytes: int) -> None:
        if self.held + nbytes > self.limit:
            raise TooManyRequests(
                f"the box is receiving {self.held} bytes of request bodies at once, its limit "
                f"(max_receiving_bytes) is {self.limit}; retry in a second",
                retry_after_s=1,
            )
        self.held += nbytes

    def give(self, nbytes: int) -> None:
        self.held -= nbytes


RECEIVING = web.AppKey("receiving", Receiving)


async def read_body(request: web.Request, settings: Settings) -> bytes:
    """The raw JSON body (decompressed, without a BOM), after the media type, encoding and size checks."""
    _check_media_type(request)
    encoding = _content_coding(request)
    if encoding != "identity" and encoding not in _ENCODINGS:
        raise UnsupportedMediaType(
            f"Content-Encoding {encoding!r} is not supported; send the body as gzip, deflate or uncompressed",
            code="unsupported_encoding",
        )
    if request.content_length is not None and request.content_length > settings.max_body_bytes:
        raise _too_large(settings)
    body = await _receive(request, settings)
    if encoding != "identity":
        body = await asyncio.get_running_loop().run_in_executor(
            None, _decompress, body, encoding, settings.max_body_bytes
        )
    return body.removeprefix(_BOM)


async def _receive(request: web.Request, settings: Settings) -> bytes:
    """The body's bytes, within `max_body_bytes`, `body_timeout_s` and the box's `Receiving` budget."""
    receiving = request.app.get(RECEIVING) or Receiving(settings.max_receiving_bytes)
    if request.content.is_eof():
        # All of it came with the headers (a small body, the usual case): nothing to wait for. The timed read below
        # cost 4% of a no-op request's CPU (py-spy, e2e_embed (d)).
        body = request.content.read_nowait()
        if len(body) > settings.max_body_bytes:
            raise _too_large(settings)
        receiving.take(len(body))  # judged against the bodies still arriving, as if its bytes came now
        receiving.give(len(body))
        return body
    parts: list[bytes] = []
    received = 0
    try:
        async with asyncio.timeout(settings.body_timeout_s):
            async for chunk in request.content.iter_any():
                if received + len(chunk) > settings.max_body_bytes:
                    raise _too_large(settings)
                receiving.take(len(chunk))
                received += len(chunk)
                parts.append(chunk)
    except TimeoutError:
        raise RequestTimeout(
            f"the request body did not arrive within {settings.body_timeout_s:g}s (body_timeout_s)"
        ) from None
    finally:
        receiving.give(received)
    return b"".join(parts)


def _content_coding(request: web.Request) -> str:
    """The body's one content coding: `identity` for none. Several (in one header or in several, which a proxy may
    read otherwise than this box: one header was read, the other ignored) are refused unless all but one are
    `identity`."""
    codings = [
        coding.strip().lower()
        for header in request.headers.getall(hdrs.CONTENT_ENCODING, [])
        for coding in header.split(",")
        if coding.strip()
    ]
    codings = [coding for coding in codings if coding != "identity"]
    if len(codings) > 1:
        raise UnsupportedMediaType(
            f"Content-Encoding {', '.join(codings)}: send the body in one coding (gzip, deflate) or uncompressed",
            code="unsupported_encoding",
        )
    return codings[0] if codings else "identity"


def _check_media_type(request: web.Request) -> None:
    if hdrs.CONTENT_TYPE not in request.headers:
        raise UnsupportedMediaType("the request has no Content-Type; send Content-Type: application/json")
    if request.content_type != "application/json":
        # The header as sent: one aiohttp cannot parse reads as application/octet-stream, a type no client sent (h84).
        sent = request.headers[hdrs.CONTENT_TYPE].strip()[:100] or "none"
        raise UnsupportedMediaType(f"expected Content-Type: application/json, got {sent}")
    charset = request.charset
    if charset is not None and charset.lower() not in _UTF8:
        raise UnsupportedMediaType(f"the body must be UTF-8 JSON; charset={charset} is not accepted")


# Clients send one; each member after the first copies the rest of the body (zlib's `unused_data`): 8 MiB of
# 400,000 empty members took 40 s of a core, and four such bodies held the threads that tokenise prompts (h84).
_MAX_GZIP_MEMBERS = 64


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """The decoded body, refused as too large past `limit` bytes without inflating the rest (a zip bomb)."""
    wbits = _ENCODINGS[encoding]
    if wbits == _ZLIB and body[:1] and body[0] & 0x0F != 8:  # not a zlib header: raw deflate
        wbits = _RAW_DEFLATE
    parts: list[bytes] = []  # joined once: appending member by member copied the whole so far each time
    size = 0
    while True:  # gzip: one member after another, as `gzip -d` reads them (RFC 1952); the rest: one stream
        if len(parts) == _MAX_GZIP_MEMBERS:
            raise BadRequest(f"the gzip body has more than {_MAX_GZIP_MEMBERS} members; send it as one")
        inflater = zlib.decompressobj(wbits)
        try:
            part = inflater.decompress(body, limit + 1 - size)
            if size + len(part) > limit:
                raise PayloadTooLarge(f"the decompressed request body is larger than the limit of {limit} bytes")
            part += inflater.flush()
        except zlib.error as exc:
            raise BadRequest(f"the body is not valid {encoding} data, as its Content-Encoding says ({exc})") from None
        if not inflater.eof:
            raise BadRequest(f"the body is not valid {encoding} data, as its Content-Encoding says (it is cut short)")
        parts.append(part)
        size += len(part)
        body = inflater.unused_data
        if not body:
            return b"".join(parts)
        if wbits != _GZIP or not body.startswith(_GZIP_MAGIC):  # bytes after the data, not another gzip member
            raise BadRequest(f"the body has {len(body)} bytes after its {encoding} data")


def _too_large(settings: Settings) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body is larger than the limit of {settings.max_body_bytes} bytes")


def decode(body: bytes, decoder: msgspec.json.Decoder[T]) -> T:
    """Validate a body against its schema: malformed JSON is 400, a wrong shape or value 422."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if "matching regex" in message and (name := _NAME_FIELD.search(message)) is not None:
            # msgspec quotes the pattern (292 characters of it); say what it means (regression tester h53).
            message = f"{MODEL_NAME_RULE} - at `{name.group(1)}`"
        raise Unprocessable(f"invalid request: {message}") from None
    except msgspec.DecodeError as exc:
        if not body.strip():  # msgspec calls it truncated, as if the upload were cut off
            raise BadRequest("the request body is empty; send a JSON object", code="invalid_json") from None
        raise BadRequest(f"malformed JSON: {_decode_error(body, exc)}", code="invalid_json") from None
    except RecursionError:  # deep nesting, even in a field the schema ignores
        raise BadRequest("malformed JSON: nested too deeply", code="invalid_json") from None


def _decode_error(body: bytes, exc: msgspec.DecodeError) -> str:
    """What is wrong with the JSON, without msgspec's own "JSON is malformed: " (the message says it already)."""
    # A `\ud800` escape near the end makes the decoder look past the end of the body for its pair and
    # call the body truncated; a body padded with whitespace (still the same JSON) names the real fault.
    if str(exc) == "Input data was truncated":
        try:
            msgspec.json.decode(body + b" " * 12)
        except msgspec.DecodeError as padded:
            if "surrogate" in str(padded):
                exc = padded
        except (msgspec.ValidationError, RecursionError):
            pass
    return str(exc).removeprefix("JSON is malformed: ")


def request_timeout(
    request: web.Request, field: float | None, settings: Settings, *, generation: bool = False
) -> float:
    """The request's deadline in seconds: the `timeout` field, else the `Timeout` header, else the default (a
    generation's own: its deadline covers the whole answer), at most `max_timeout_s`."""
    value: float | None = field
    if value is None and TIMEOUT_HEADER in request.headers:
        value = _header_seconds(request.headers[TIMEOUT_HEADER])
    if value is None:
        value = settings.generation_timeout_s if generation else settings.default_timeout_s
    return min(value, settings.max_timeout_s)


def _header_seconds(text: str) -> float:
    if not _SECONDS.fullmatch(text.strip()):
        raise BadRequest(
            f"the {TIMEOUT_HEADER} header must be a positive number of seconds, such as 30 or 2.5; got {text!r}"
        )
    value = float(text)
    if not math.isfinite(value):
        raise BadRequest(f"the {TIMEOUT_HEADER} header is too large: {text!r}")
    if not value >= MIN_TIMEOUT_S:
        raise BadRequest(f"the {TIMEOUT_HEADER} header must be at least {MIN_TIMEOUT_S} seconds, not {text!r}")
    return value


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
