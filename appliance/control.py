"""Control of one box over NATS: `fbx.ctl.<box>.<verb>` with a JSON body, answered with JSON.

Verbs: `load`, `evict`, `pin`, `unpin` (body `{"model": name}`; `evict`'s may add `"where": "every holder"`,
which a box that runs no models answers `evicted: false` rather than refuse), `fits` (whether this box could hold
a model pinned: `pin_fits.py`), `update` and `delete` (as `PATCH` and `DELETE /v1/models/{name}`), `register` (the
body of `POST /v1/models`), `drain` and `status`. The
admin HTTP routes, the `fleetbox` CLI and the TUI all go through `call_box`, so every way of
steering a box runs the same code and gets the same errors.

Each request is answered by a task of its own: nats-py runs one callback at a time per
subscription, so a handler awaited in the callback would make a minutes-long `load` hold up a
`drain` or a `status` sent to the same box.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import KeyNotFoundError

from appliance import bus
from appliance.envelope import RETRY_AFTER, STATUS, retry_after_in
from appliance.errors import (
    BadRequest,
    FleetboxError,
    InternalError,
    NotFound,
    ServiceUnavailable,
    error_from_reply,
    retry_after_of,
)
from appliance.settings import BOX_ID_PATTERN
from appliance.tasks import Background, cancel_and_wait

log = logging.getLogger(__name__)

_BOX_ID = re.compile(BOX_ID_PATTERN)  # what a box may be named: one NATS subject token

VERBS = ("load", "evict", "pin", "fits", "unpin", "update", "register", "delete", "drain", "status")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlServer:
    """Answers this box's control subjects with the handlers the box gives it."""

    def __init__(self, nc: NATS, box_id: str, handlers: dict[str, Handler]) -> None:
        self._nc = nc
        self._box_id = box_id
        self._handlers = handlers
        self._sub: Subscription | None = None
        self._answering = Background("control")  # one task per request being answered

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(bus.control_subject(self._box_id, "*"), cb=self._on_request)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
        await self._answering.cancel()

    async def _on_request(self, msg: Msg) -> None:
        self._answering.spawn(self._answer(msg))

    async def _answer(self, msg: Msg) -> None:
        verb = msg.subject.rsplit(".", 1)[-1]
        try:
            handler = self._handlers.get(verb)
            if handler is None:
                raise NotFound(f"unknown control verb {verb!r}; verbs: {', '.join(self._handlers)}")
            try:
                payload = orjson.loads(msg.data) if msg.data else {}
            except orjson.JSONDecodeError:
                raise BadRequest("control body is not JSON") from None
            if not isinstance(payload, dict):
                raise BadRequest("control body must be a JSON object")
            result = {"ok": True, "box": self._box_id, **(await handler(payload))}
            headers = {STATUS: "200"}
        except FleetboxError as exc:
            result, headers = exc.body(), _error_headers(exc)
        except asyncio.CancelledError:  # the box is stopping: say so, rather than let the caller wait out its 120 s
            if msg.reply:
                stopping = ServiceUnavailable(
                    f"box {self._box_id} stopped before it finished {verb}; send it again", retry_after_s=1
                )
                with suppress(Exception):
                    await self._nc.publish(msg.reply, stopping.to_json(), headers=_error_headers(stopping))
            raise
        except Exception as exc:
            log.exception("control verb failed", extra={"verb": verb})
            error = InternalError(f"{verb} failed: {exc!r}")
            result, headers = error.body(), _error_headers(error)
        if msg.reply:
            await self._nc.publish(msg.reply, orjson.dumps(result), headers=headers)


async def _until_it_stops_beating(nc: NATS, box_id: str, every_s: float = 1.0) -> None:
    """Return once the heartbeat record of `box_id`, seen while its verb runs, is gone (a record lives a TTL past
    the last beat): a box frozen (SIGSTOP, a paused VM) or cut off keeps its control subscription on the server,
    and the caller waited out the whole 120 s of a verb (tester h82). Never returns while no record was seen (a box
    that has not beaten yet), nor when the bucket cannot be read: the verb's own timeout stands then."""
    seen = False
    while True:
        try:
            kv = await nc.jetstream().key_value(bus.BOXES_BUCKET)
            break
        except Exception:  # no bucket yet, or NATS slow to say: asked again
            await asyncio.sleep(every_s)
    while True:
        try:
            await kv.get(box_id)
            seen = True
        except KeyNotFoundError:
            if seen:
                return
        except Exception:  # the bucket unreadable a moment (a failover): no judgement from it
            pass
        await asyncio.sleep(every_s)


def _error_headers(error: FleetboxError) -> dict[str, str]:
    """A refused verb's status, and its Retry-After for the HTTP route that passes the error on."""
    retry = retry_after_of(error)
    return {STATUS: str(error.status), RETRY_AFTER: str(retry)} if retry else {STATUS: str(error.status)}


async def call_box(
    nc: NATS, box_id: str, verb: str, payload: dict[str, Any] | None = None, timeout_s: float = 120.0
) -> dict:
    """Ask one box to do `verb`; raises the box's own typed error when it refuses."""
    not_found = NotFound(f"box {box_id!r} is not connected to the fleet", code="box_not_found")
    if not _BOX_ID.fullmatch(box_id):
        raise not_found  # no box can have that id (a space, a dot, a wildcard would also break the subject)
    asking = asyncio.ensure_future(
        nc.request(bus.control_subject(box_id, verb), orjson.dumps(payload or {}), timeout=timeout_s)
    )
    beats = asyncio.ensure_future(_until_it_stops_beating(nc, box_id))
    try:
        await asyncio.wait((asking, beats), return_when=asyncio.FIRST_COMPLETED)
    finally:
        left = asking if not asking.done() else None
        await cancel_and_wait((beats, left))
    if left is not None:
        raise ServiceUnavailable(
            f"box {box_id!r} left the fleet before it answered {verb} (its heartbeat record is gone: it stopped or "
            "died, or is frozen or cut off); it may have done it or not"
        )
    try:
        reply = asking.result()
    except NoRespondersError:
        raise not_found from None
    except NatsTimeout:
        raise ServiceUnavailable(f"box {box_id!r} did not answer {verb} within {timeout_s:g}s") from None
    status = int((reply.headers or {}).get(STATUS, "200"))
    if status != 200:
        raise error_from_reply(status, reply.data, retry_after_in(reply.headers))
    return orjson.loads(reply.data)
