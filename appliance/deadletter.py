"""Requests that failed on every delivery: kept in stream FBX_DLQ with the reason, answered with an error.

Two roads lead here. A worker whose model raises on a request naks it for another try, and on
the last allowed delivery dead-letters it itself (`DeadLetters`, for the encoder and the generation
workers alike). A request that kills the box holding it (so no worker lives to decide) makes
JetStream publish a max-deliveries advisory; one box of the fleet (a queue group) takes the
advisory, moves the message to FBX_DLQ, answers the client and removes it from the queue, so the
other requests flow on and the client is not left waiting.
"""

from __future__ import annotations

import logging

import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from prometheus_client import Counter

from appliance import bus
from appliance.blobs import Blobs
from appliance.delivery import retry_delay_s
from appliance.envelope import ReplyMeta, RequestMeta
from appliance.errors import Unprocessable

log = logging.getLogger(__name__)

REASON = "Fbx-Dead-Reason"
DELIVERIES = "Fbx-Deliveries"
_QUEUE_GROUP = "fbx-dead-letters"


def dead_letter_error(meta: RequestMeta, deliveries: int, reason: str) -> Unprocessable:
    return Unprocessable(
        f"request {meta.id} failed on every one of its {deliveries} deliveries ({reason}); "
        f"it is kept in stream {bus.DEAD_LETTER_STREAM} for an operator to inspect",
        code="dead_lettered",
    )


async def dead_letter(
    box_id: str,
    nc: NATS,
    js: JetStreamContext,
    meta: RequestMeta,
    headers: dict[str, str],
    body: bytes,
    deliveries: int,
    reason: str,
) -> None:
    """Keep the request in FBX_DLQ with why, then tell its client."""
    slug = bus.model_slug(meta.model)
    kept = {**headers, REASON: reason[:1000], DELIVERIES: str(deliveries)}
    kept.pop("Nats-Msg-Id", None)  # the DLQ has its own duplicate window; do not collide with it
    await js.publish(bus.dead_letter_subject(slug), body, headers=kept)
    error = dead_letter_error(meta, deliveries, reason)
    reply = ReplyMeta.for_error(meta.id, error, box_id)
    await nc.publish(meta.reply, error.to_json(), headers=reply.headers())
    log.warning("request dead-lettered", extra={"request_id": meta.id, "model": meta.model, "reason": reason})


class DeadLetters:
    """What a worker does with a request its model raised on: another try, or FBX_DLQ after `max_deliver`."""

    def __init__(
        self, box_id: str, nc: NATS, js: JetStreamContext, blobs: Blobs, max_deliver: int, dead_lettered: Counter
    ) -> None:
        self._box_id = box_id
        self._nc = nc
        self._js = js
        self._blobs = blobs
        self._max_deliver = max_deliver
        self._dead_lettered = dead_lettered  # the worker's model's count of them

    async def retry_or_dead_letter(self, meta: RequestMeta, msg: Msg, error: Exception) -> None:
        """Nak it for another try after a back-off (maybe on another box), or on its `max_deliver`-th
        delivery keep it in FBX_DLQ with why, answer its client and ack it. Either way it is settled."""
        deliveries = msg.metadata.num_delivered or 1
        if deliveries < self._max_deliver:
            await msg.nak(delay=retry_delay_s(msg))
            return
        reason, body, blob = repr(error), msg.data, meta.blob
        if blob:
            try:
                body = await self._blobs.get(blob)
            except Exception as exc:  # the body is gone (maybe why it failed): keep the envelope and why
                reason += f"; its body (blob {blob}) could not be read: {exc!r}"
            else:
                if len(body) > self._blobs.message_room:  # more than a message carries: the dead letter names the blob
                    reason += f"; its body stays in the object store {bus.BLOBS_BUCKET} as {blob} until it expires"
                    body, blob = b"", None
        await dead_letter(self._box_id, self._nc, self._js, meta, dict(msg.headers or {}), body, deliveries, reason)
        self._dead_lettered.inc()
        await self._blobs.ack(msg, blob)  # its body is kept in the dead letter, or left to the bucket's TTL


class DeadLetterWatch:
    """Takes JetStream's max-deliveries advisories for FBX_REQ (one box per advisory)."""

    def __init__(self, box_id: str, nc: NATS, js: JetStreamContext) -> None:
        self._box_id = box_id
        self._nc = nc
        self._js = js
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(bus.max_deliveries_advisories(), queue=_QUEUE_GROUP, cb=self._on_advisory)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()

    async def _on_advisory(self, msg: Msg) -> None:
        try:
            advisory = orjson.loads(msg.data)
            seq, deliveries = int(advisory["stream_seq"]), int(advisory.get("deliveries", 0))
            stored = await self._js.get_msg(bus.REQUEST_STREAM, seq)
        except (orjson.JSONDecodeError, KeyError, ValueError, NotFoundError) as exc:
            log.debug("max-deliveries advisory not actionable", extra={"error": repr(exc)})
            return
        headers = dict(stored.headers or {})
        try:
            meta = RequestMeta.from_headers(headers)
        except ValueError:
            await self._js.delete_msg(bus.REQUEST_STREAM, seq)
            return
        reason = "no box finished it: each box holding it stopped answering (crashed or was killed)"
        await dead_letter(self._box_id, self._nc, self._js, meta, headers, stored.data or b"", deliveries, reason)
        try:
            await self._js.delete_msg(bus.REQUEST_STREAM, seq)
        except NotFoundError:
            pass
