"""Requests that failed on every delivery: kept in stream FBX_DLQ with the reason, answered with an error.

Two roads lead here. A worker whose model raises on a request naks it for another try, and on
the last allowed delivery dead-letters it itself (`DeadLetters`, for the encoder and the generation
workers alike). A request that kills the box holding it (so no worker lives to decide) makes
JetStream publish a max-deliveries advisory; one box of the fleet (a queue group) takes the
advisory, moves the message to FBX_DLQ, answers the client and removes it from the queue, so the
other requests flow on and the client is not left waiting. Either way the request leaves the queue only
once its gateway confirms the error reply (`deliver_reply`, as every answer): one sent while the gateway
reconnects is sent again, not lost with the request acked and its client left to wait for a 504.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import BadObjectMetaError, DigestMismatchError, NotFoundError
from prometheus_client import Counter

from appliance import bus
from appliance.blobs import Blobs
from appliance.delivery import GatewayGone, deliver_reply, never_gone, retry_delay_s
from appliance.envelope import BLOB, ReplyMeta, RequestMeta
from appliance.errors import Unprocessable
from appliance.tasks import Background

log = logging.getLogger(__name__)

REASON = "Fbx-Dead-Reason"
DELIVERIES = "Fbx-Deliveries"
_QUEUE_GROUP = "fbx-dead-letters"
_STOP_S = 1.0  # how long a stopping box lets the dead letters it is answering finish
_SETTLE_TRIES = 5  # an advisory's settling tried again after a NATS error, 0.25 s apart and doubling
# A blob read that says the body is gone (deleted, its TTL past) or unreadable, not that the store failed just now.
_BODY_GONE = (NotFoundError, DigestMismatchError, BadObjectMetaError)


def dead_letter_error(meta: RequestMeta, deliveries: int, reason: str) -> Unprocessable:
    return Unprocessable(
        f"request {meta.id} failed on every one of its {deliveries} deliveries ({reason}); "
        f"it is kept in stream {bus.DEAD_LETTER_STREAM} for an operator to inspect",
        code="dead_lettered",
    )


async def keep_dead_letter(
    js: JetStreamContext, meta: RequestMeta, headers: dict[str, str], body: bytes, *, deliveries: int, reason: str
) -> bool:
    """Keep the request in FBX_DLQ with why: once, whichever box keeps it (a worker that stopped before its client
    was told hands it back, and JetStream's max-deliveries advisory has a box keep it again: FBX_DLQ's duplicate
    window drops that one). False: a dead letter of it was kept before, maybe without `body`."""
    slug = bus.model_slug(meta.model)
    kept = {**headers, REASON: reason[:1000], DELIVERIES: str(deliveries)}
    kept["Nats-Msg-Id"] = f"dead:{meta.id}"  # not the request's own id, which FBX_REQ's window knows
    ack = await js.publish(bus.dead_letter_subject(slug), body, headers=kept)
    if ack.duplicate:
        return False
    log.warning("request dead-lettered", extra={"request_id": meta.id, "model": meta.model, "reason": reason})
    return True


async def _body_to_keep(
    blobs: Blobs, meta: RequestMeta, headers: dict[str, str], data: bytes, reason: str, *, tried_again: bool = False
) -> tuple[bytes, str, str | None]:
    """The body a dead letter keeps, its reason, and the blob to delete once it is kept (None: none, or one left to
    the bucket's TTL). A large body's message carries only its blob's key: the dead letter keeps the body itself
    where a message can carry it, so an operator can inspect it after the blob's TTL, and then names no blob in
    `headers` (the dead letter's, changed here). A read the store fails just now (a timeout, a 503 while a server fails
    over, no responders) is raised where the caller will be `tried_again` (the advisory's settling): elsewhere the
    dead letter keeps the envelope and says the body stays in the store. Only a body gone or unreadable is kept as
    gone (review h141: a 503 taken for gone kept the envelope, and the blob was then deleted)."""
    blob = meta.blob
    if not blob:
        return data, reason, None
    try:
        body = await blobs.get(blob)
    except _BODY_GONE as exc:  # maybe why it failed: keep the envelope and why
        return data, f"{reason}; its body (blob {blob}) could not be read: {exc!r}", None
    except (NatsError, TimeoutError) as exc:  # a store failing just now, not a body gone
        if tried_again:
            raise
        return data, f"{reason}; its body stays in the object store {bus.BLOBS_BUCKET} as {blob} ({exc!r})", None
    except Exception as exc:
        return data, f"{reason}; its body (blob {blob}) could not be read: {exc!r}", None
    if len(body) > blobs.message_room:  # more than a message carries: the dead letter names the blob
        return b"", f"{reason}; its body stays in the object store {bus.BLOBS_BUCKET} as {blob} until it expires", None
    headers.pop(BLOB, None)
    return body, reason, blob


async def tell_dead_lettered(
    nc: NATS,
    meta: RequestMeta,
    *,
    deliveries: int,
    reason: str,
    box_id: str,
    give_up: Callable[[], bool],
    gateway_gone: GatewayGone = never_gone,
) -> bool:
    """Tell a dead-lettered request's client until its gateway confirms it, or is known gone (`GatewayGone`: nobody
    to tell; told again every 0.25 s to its deadline, review h202): False if `give_up()` said stop first (the box is
    stopping), when the request must not be settled as if its client knew."""
    error = dead_letter_error(meta, deliveries, reason)
    reply = ReplyMeta.for_error(meta.id, error, box_id)
    return await deliver_reply(nc, meta, error.to_json(), reply.headers(), give_up, gateway_gone=gateway_gone)


class DeadLetters:
    """What a worker does with a request its model raised on: another try, or FBX_DLQ after `max_deliver`. One per
    worker, of either kind, made with it by the box's table of workers (`Workers`)."""

    def __init__(
        self,
        box_id: str,
        nc: NATS,
        js: JetStreamContext,
        blobs: Blobs,
        max_deliver: int,
        dead_lettered: Counter,
        *,
        gateway_gone: GatewayGone = never_gone,
    ) -> None:
        self._tell = partial(tell_dead_lettered, nc, box_id=box_id, gateway_gone=gateway_gone)
        self._js = js
        self._blobs = blobs
        self._max_deliver = max_deliver
        self._dead_lettered = dead_lettered  # the worker's model's count of them

    async def retry_or_dead_letter(
        self, meta: RequestMeta, msg: Msg, error: Exception, *, stopping: Callable[[], bool]
    ) -> bool:
        """Nak it for another try after a back-off (maybe on another box), or on its `max_deliver`-th
        delivery keep it in FBX_DLQ with why, answer its client and ack it. Either way it is settled.
        True where it was dead-lettered, its client told and the message acked: no copy of it is to be tried again.
        The worker drains (`stopping`): an error reply no gateway takes is handed back, not retried."""
        deliveries = msg.metadata.num_delivered or 1
        if deliveries < self._max_deliver:
            await msg.nak(delay=retry_delay_s(msg))
            return False
        headers = dict(msg.headers or {})
        body, reason, blob = await _body_to_keep(self._blobs, meta, headers, msg.data, repr(error))
        kept = await keep_dead_letter(self._js, meta, headers, body, deliveries=deliveries, reason=reason)
        if not kept:
            blob = None  # the dead letter kept before may not carry the body: its blob is left to the bucket's TTL
        told = await self._tell(meta, deliveries=deliveries, reason=reason, give_up=stopping)
        if not told:
            # The box is stopping with its client not told: past its last delivery, JetStream's max-deliveries
            # advisory has a box of the fleet (`DeadLetterWatch`) dead-letter it and answer it, and count it:
            # counted here as well, and kept twice, it was counted by two boxes (review r41).
            await msg.nak()
            return False
        if kept:  # one kept before was counted by whoever kept it (review h147: a copy's second dead letter)
            self._dead_lettered.inc()
        try:
            await self._blobs.ack(msg, blob)  # its body is kept in the dead letter, or left to the bucket's TTL
        except NatsError as exc:  # cut off: delivered again, it is dead-lettered again (a duplicate, not counted)
            log.warning("dead letter not acked", extra={"request_id": meta.id, "error": repr(exc)})
        return True  # in FBX_DLQ, its client told, whether or not the ack went (review h148)


class DeadLetterWatch:
    """Takes JetStream's max-deliveries advisories for FBX_REQ (one box per advisory).

    Each advisory is settled by a task of its own: nats-py runs one callback at a time per subscription, and
    a reply waiting for its gateway's confirmation would hold up every other advisory.
    """

    def __init__(
        self,
        box_id: str,
        nc: NATS,
        js: JetStreamContext,
        blobs: Blobs,
        dead_lettered: Counter,
        gateway_gone: GatewayGone = never_gone,
    ) -> None:
        self._tell = partial(
            tell_dead_lettered, nc, box_id=box_id, give_up=lambda: self._stopping, gateway_gone=gateway_gone
        )
        self._nc = nc
        self._js = js
        self._blobs = blobs
        self._dead_lettered = dead_lettered  # the box's count of them, by model
        self._sub: Subscription | None = None
        self._settling = Background("dead letters")
        self._stopping = False

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(bus.max_deliveries_advisories(), queue=_QUEUE_GROUP, cb=self._on_advisory)

    async def stop_taking(self) -> None:
        """Take no more advisories: a stopping box's workers hand their requests back, and one past its last
        delivery is the fleet's to settle, not this box's, which would give up on telling its client (review r41's
        test: the advisory of a request its own worker handed back reached it half the time)."""
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()

    async def stop(self) -> None:
        self._stopping = True  # a reply no gateway takes is given up on at its next try
        await self.stop_taking()
        await self._settling.wait(_STOP_S)
        await self._settling.cancel()

    async def _on_advisory(self, msg: Msg) -> None:
        self._settling.spawn(self._settle_for_sure(msg))

    async def _settle_for_sure(self, msg: Msg) -> None:
        """The advisory is the last word on its request: no delivery of it is left, so a settling that a NATS error
        (a timeout while the server is busy or fails over) cut short is tried again, or the request would stay in
        FBX_REQ for good and its client wait out its deadline. Each step may be taken twice: FBX_DLQ's duplicate
        window drops a second copy and the gateway a second reply."""
        removed = _Removal()
        for attempt in range(_SETTLE_TRIES):
            try:
                await self._settle(msg, removed, last_try=attempt == _SETTLE_TRIES - 1)
                return
            except (NatsError, TimeoutError) as exc:
                if self._stopping or attempt == _SETTLE_TRIES - 1:
                    raise
                log.info("dead letter not settled; trying again", extra={"error": f"{exc!r}: {exc}"})
                await asyncio.sleep(0.25 * 2**attempt)

    async def _settle(self, msg: Msg, removed: _Removal, *, last_try: bool = False) -> None:
        try:
            advisory = orjson.loads(msg.data)
            seq, deliveries = int(advisory["stream_seq"]), int(advisory.get("deliveries", 0))
            stored = await self._js.get_msg(bus.REQUEST_STREAM, seq)
        except NotFoundError:
            if removed.model is not None:  # an earlier try's delete reached the server, its answer lost: finish it
                await self._removed(removed)
            return
        except (orjson.JSONDecodeError, KeyError, ValueError) as exc:
            log.debug("max-deliveries advisory not actionable", extra={"error": repr(exc)})
            return
        headers = dict(stored.headers or {})
        try:
            meta = RequestMeta.from_headers(headers)
        except ValueError:
            await self._js.delete_msg(bus.REQUEST_STREAM, seq)
            return
        reason = "no box finished it: each box holding it stopped answering (crashed or was killed)"
        body, reason, blob = await _body_to_keep(
            self._blobs, meta, headers, stored.data or b"", reason, tried_again=not last_try
        )
        if await keep_dead_letter(self._js, meta, headers, body, deliveries=deliveries, reason=reason):
            removed.kept_blob = blob
        told = await self._tell(meta, deliveries=deliveries, reason=reason)
        if not told:
            # Its deliveries are used up and this advisory was the last word on it: nobody else will answer it.
            log.warning("dead-lettered request's client not told: the box is stopping", extra={"request_id": meta.id})
        removed.model = meta.model
        try:
            await self._js.delete_msg(bus.REQUEST_STREAM, seq)
        except NotFoundError:
            pass
        await self._removed(removed)

    async def _removed(self, removed: _Removal) -> None:
        """The request is out of FBX_REQ: its blob (kept in the dead letter) deleted, and the dead letter counted."""
        if removed.kept_blob:
            await self._blobs.delete(removed.kept_blob)  # left, it would hold nats-server's memory until its TTL
        self._dead_lettered.labels(removed.model).inc()  # once settled: a settling tried again counts it once


@dataclass
class _Removal:
    """What a settling tried to remove from FBX_REQ, kept across its tries: a delete whose answer was lost may have
    removed the request, and a later try, finding it gone, still deletes its blob and counts it (review h132)."""

    model: str | None = None  # set as its delete is sent
    # The blob whose body the dead letter this settling kept carries: deleted once the request is out. None where the
    # dead letter carries none, or was kept before (by a worker, or a try whose answer was lost), maybe without it.
    kept_blob: str | None = None
