"""Putting a gateway's requests, and its cancels, on the queue (`Publisher`).

The one idea: a publish never leaves its client waiting on a queue that cannot take it. Cut off from NATS it is
refused before it is tried; a stream that refuses it (full) or does not acknowledge it (no leader, a failover) is
the client's answer now, a 429 or a 503 with a Retry-After, with the request's stored body deleted or a cancel sent
after it, so no box computes what was already answered. Once a publish went unanswered, one publish at a time tries
the stream again (a half-open breaker) and the rest are refused at once: each waited out the 5 s of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import replace

import orjson
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError

from appliance import bus
from appliance.blobs import Blobs
from appliance.delivery import CancelWhy
from appliance.envelope import ID, RequestMeta
from appliance.errors import FleetboxError, GatewayTimeout, ServiceUnavailable

log = logging.getLogger(__name__)

_PUBLISH_TIMEOUT_S = 5.0
_SLOW_PUBLISH_S = 2.0  # a publish unanswered this long: the stream is not answering (for `/readyz`)
_QUIET_S = 2 * _PUBLISH_TIMEOUT_S  # after a publish failed, a look at the stream says it answers only this long after
_HAND_BACK_TIMEOUT_S = 2.0  # a box that holds the generation answers at once; no answer: it is gone
_SHORT_DEADLINE_S = 0.1  # a publish past a deadline shorter than this: the deadline, not the queue, is advised on
FAILOVER_RETRY_S = 2  # Retry-After while the stream has no leader: a NATS election takes about that long
_STREAM_FULL_CODES = {10077, 10078, 10027}  # max messages, max bytes, (per-subject) limits
_STREAM_NOT_FOUND = 10059  # JetStream's err_code for a stream that does not exist (a message not found: 10037)
_NOT_ANSWERING = "the request queue (NATS JetStream) is not answering; retry shortly"
_BODY_NOT_STORED = (
    "the request body could not be stored beside the queue (NATS object store is not answering); retry shortly"
)


def _publish_timeout_s(meta: RequestMeta) -> float:
    """No longer than the request's deadline: with JetStream stalled, a request of `timeout` 0.5 was answered 503
    after the 5 s of a publish, ten times past it (review h122)."""
    return min(_PUBLISH_TIMEOUT_S, max(0.001, meta.deadline_ms / 1000 - time.time()))


class Publisher:
    """One gateway's publishes to the request stream and cancel subject. `overloaded` makes the 429 for a full
    stream (`Admission.overloaded`, with the gateway's count of requests awaited)."""

    def __init__(
        self, nc: NATS, js: JetStreamContext, blobs: Blobs, overloaded: Callable[[str], FleetboxError]
    ) -> None:
        self._nc = nc
        self._js = js
        self._blobs = blobs
        self._overloaded = overloaded
        # For `/readyz`: the publishes under way (request id -> monotonic start), and when the last one the stream did
        # not answer (no leader) ended, None once one is answered.
        self._publishing: dict[str, float] = {}
        self._unanswered_at: float | None = None
        self._copies = itertools.count(1)  # numbers each copy published `again` (`RequestMeta.copy`)
        # The breaker: open from a publish the stream did not answer until one it answers (not a look at the stream:
        # it answers looks without a quorum, publishes not); while open, one request's publish at a time tries the
        # stream (`_probe`), the others are refused at once.
        self._breaker_open = False
        self._probe: str | None = None

    async def cancel(self, request_id: str, box: str | None = None, *, why: CancelWhy = "gone") -> None:
        """Every box drops the request (`why`: its client went away, its deadline passed, or this gateway answered it
        without the queue), or only `box` (a second copy it holds)."""
        try:
            cancel: dict[str, object] = {"id": request_id} if box is None else {"id": request_id, "box": box}
            if why != "gone":  # counted as such, not as a client gone (testers h142, h146)
                cancel["why"] = why
            await self._nc.publish(bus.cancel_subject(), orjson.dumps(cancel))
        except Exception as exc:
            log.debug("cancel not sent", extra={"request_id": request_id, "error": repr(exc)})

    async def hand_back(self, request_id: str, box: str) -> tuple[bool, bool]:
        """Ask `box` to stop generating `request_id` and hand it back to the queue, to be generated again from the
        start by any box: whether it says it did (not: it finished it, or did not answer in time), and whether the
        request must be published again (its message went with a request stream lost since)."""
        payload = orjson.dumps({"id": request_id, "box": box, "again": True})
        try:
            reply = await self._nc.request(bus.cancel_subject(), payload, timeout=_HAND_BACK_TIMEOUT_S)
            answer = orjson.loads(reply.data)
            return answer.get("handed_back") is True, answer.get("publish_again") is True
        except Exception as exc:  # no box answered (it died, or NATS is away again): the caller says what was lost
            log.debug("generation not handed back", extra={"request_id": request_id, "error": repr(exc)})
            return False, False

    def unanswered(self, now: float) -> bool:
        """Whether the request stream does not answer this gateway's publishes now: the last one failed for want of
        an answer, or one has waited over `_SLOW_PUBLISH_S` (a publish waits out 5 s before it fails: `/readyz` said
        ready for them, tester h92)."""
        oldest = min(self._publishing.values(), default=now)
        return self._unanswered_at is not None or now - oldest > _SLOW_PUBLISH_S

    def stream_answered(self, looked_at: float) -> None:
        """The stream answered a look begun at `looked_at` (monotonic). It answers looks without a quorum when its
        leader lives, and publishes not (`/readyz` said ready for half of such an outage, tester h92): the look
        counts only after `_QUIET_S` with no publish failing; a publish answered counts at once."""
        if self._unanswered_at is not None and looked_at - self._unanswered_at >= _QUIET_S:
            self._unanswered_at = None

    def check_connected(self) -> None:
        if not self._nc.is_connected:
            # Refused at once: a publish now would wait in the client's buffer, be answered 503 after the
            # publish timeout, and still be queued (and computed) once NATS is back, beside the client's retry.
            raise ServiceUnavailable(
                "not connected to the request queue (NATS); retry shortly", retry_after_s=FAILOVER_RETRY_S
            )

    async def publish(self, slug: str, body: bytes, meta: RequestMeta, *, again: bool = False) -> int:
        """Queue a request for model `slug` (the caller checked the connection, with no wait since). `again`: one
        queued before, whose queue was lost since: it tries the stream whatever the breaker says (all of a lost
        queue's are published again at once, and all but one were refused), as a copy (`RequestMeta.copy`). Says
        its sequence in the request stream."""
        if again:
            meta = replace(meta, copy=next(self._copies))
        if self._breaker_open and not again:
            if self._probe is not None:  # another publish is trying the stream: this one would wait as it does
                raise ServiceUnavailable(_NOT_ANSWERING, retry_after_s=FAILOVER_RETRY_S)
            self._probe = meta.id
        try:
            if self._blobs.needed(body):
                # Too large to ride the queue: the message carries the object-store key instead.
                meta, body = replace(meta, blob=await self._store_body(meta, body)), b""
            self._publishing[meta.id] = time.monotonic()
            return await self._send(slug, body, meta)
        finally:
            self._publishing.pop(meta.id, None)
            if self._probe == meta.id:
                self._probe = None

    async def _store_body(self, meta: RequestMeta, body: bytes) -> str:
        """Put a large body in the object store, within the publish's bound: unbounded, a stalled server held it
        10 s (two puts of 5 s) past a 3 s deadline (review h178). The store is a stream of its own: its stall
        opens no breaker of the request stream, which may take every other request (review h179)."""
        timeout_s = _publish_timeout_s(meta)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._blobs.put(bus.request_blob_key(meta.id, meta.copy), body)
        except TimeoutError:  # NATS's too; nothing was published, so nothing to cancel (a part stored: the TTL's)
            if timeout_s < _PUBLISH_TIMEOUT_S:
                raise self._past_deadline(meta) from None
            raise ServiceUnavailable(_BODY_NOT_STORED, retry_after_s=FAILOVER_RETRY_S) from None
        except NatsError as exc:  # a failover, say: as a refused publish, not a 500 (review r40)
            log.warning("request body not stored", extra={"request_id": meta.id, "error": repr(exc)})
            raise ServiceUnavailable(
                "the request body could not be stored beside the queue (NATS object store); retry shortly",
                retry_after_s=FAILOVER_RETRY_S,
            ) from None

    async def _send(self, slug: str, body: bytes, meta: RequestMeta) -> int:
        timeout_s = _publish_timeout_s(meta)
        try:
            ack = await self._js.publish(
                bus.request_subject(slug, meta.priority), body, timeout=timeout_s, headers=meta.headers()
            )
            self._answered()
            return int(ack.seq)
        except APIError as exc:
            if meta.blob:  # not queued: no box will read or delete its body
                await self._blobs.delete(meta.blob)
            if exc.err_code in _STREAM_FULL_CODES or (exc.code == 503 and "maximum" in (exc.description or "")):
                self._answered()  # refused, but answered: a full stream is not a stalled one
                raise self._overloaded("the request queue is full") from None
            log.error("publish refused", extra={"request_id": meta.id, "error": repr(exc)})
            raise ServiceUnavailable(
                f"the request queue refused the request: {exc.description}", retry_after_s=FAILOVER_RETRY_S
            ) from None
        except (NatsTimeout, NoRespondersError, NoStreamResponseError) as exc:  # no stream leader now (a failover)
            # The request may be queued all the same (its acknowledgement lost, or the publish sent late on a
            # reconnect): the cancel follows it on the same connection, so no box computes what was answered.
            error = self._unanswered(meta, timeout_s if isinstance(exc, NatsTimeout) else _PUBLISH_TIMEOUT_S)
            await self.cancel(meta.id, why="expired" if isinstance(error, GatewayTimeout) else "abandoned")
            raise error from None

    async def queued(self, seq: int, request_id: str) -> bool | None:
        """Whether message `seq` of the request stream is still `request_id`'s: not acked yet (waiting, or held by a
        box). None where it cannot tell (the stream not answering, a failover, missing while it is made anew): taken for
        gone, each request still queued would be published twice, and its client failed where that copy was not taken
        (review h202)."""
        try:
            msg = await self._js.get_msg(bus.REQUEST_STREAM, seq)
        except NotFoundError as exc:  # acked (or a stream made anew since), unless the stream itself is missing
            return None if exc.err_code == _STREAM_NOT_FOUND else False
        except NatsError:
            return None
        return bool(msg.headers) and msg.headers.get(ID) == request_id

    def _answered(self) -> None:
        """The stream answered a publish: it is not stalled, and the breaker closes."""
        self._unanswered_at = None
        self._breaker_open = False

    def _unanswered(self, meta: RequestMeta, waited_s: float) -> FleetboxError:
        """The error for a request the queue did not take within `waited_s`: the deadline's 504 where that was its
        bound (the queue may be fine), else the 503 of a queue not answering, which opens the breaker."""
        if waited_s < _PUBLISH_TIMEOUT_S:
            return self._past_deadline(meta)
        self._unanswered_at = time.monotonic()
        self._breaker_open = True
        return ServiceUnavailable(_NOT_ANSWERING, retry_after_s=FAILOVER_RETRY_S)

    @staticmethod
    def _past_deadline(meta: RequestMeta) -> GatewayTimeout:
        timeout = (meta.deadline_ms - meta.sent_ms) / 1000
        # A deadline this short is the likelier cause than a stalled queue (tester h181: 0.001 s told of NATS).
        advice = "raise it with the `timeout` field or header" if timeout < _SHORT_DEADLINE_S else "retry shortly"
        return GatewayTimeout(
            f"no answer within the request's deadline of {timeout:g}s: the request queue (NATS JetStream) did not "
            f"take it in that time; {advice}"
        )
