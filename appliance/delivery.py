"""What a worker owes each request it takes: its answer delivered until the gateway confirms it, the
request kept in progress while it is worked on, and the cancels of requests whose clients went away.

A reply is acked only once delivered: a worker that acks first and whose reply is lost loses the
request, so delivery is a NATS request its gateway answers, sent again while no gateway listens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Coroutine
from datetime import datetime
from enum import IntEnum
from typing import Any, Literal

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from appliance.envelope import MSG_ID, ReplyMeta, RequestMeta

log = logging.getLogger(__name__)

_CANCEL_MEMORY_S = 600.0  # how long a cancelled id is remembered (beyond any request deadline)
_CONFIRM_TIMEOUT_S = 5.0  # how long a gateway may take to confirm it has a reply
_RESEND_S = 0.25  # pause before sending a reply again that no gateway took
LET_GO_WAIT_S = 1.0  # a copy that came while the first is let go comes back after this (`Cancellations.letting_go`)
_COPY_TRIES = 3  # publishes of a request's copy that time out before it is naked after all (`HandBack`)

LocalReply = Callable[[str, ReplyMeta, bytes], bool]
"""Hands a reply to this box's own gateway in-process when the reply subject is its: True if it did."""


class GatewayState(IntEnum):
    """What a box knows of the gateway awaiting a request (`Fleet.gateway_gone`): falsy while it may await it."""

    AWAITS = 0
    GONE = 1  # its box unheard for twice the TTL; one only frozen or cut off comes back, and publishes copies
    OVER = 2  # its run is over (its box restarted under its id): nothing of that run comes back


GatewayGone = Callable[[RequestMeta], GatewayState]
"""Whether the gateway awaiting a request's answer is known to be gone (`Fleet.gateway_gone`), and for good."""


def never_gone(meta: RequestMeta) -> GatewayState:
    """A `GatewayGone` for a box that knows no fleet: every gateway may still be awaiting its answers."""
    return GatewayState.AWAITS


class Forsaken:
    """Which requests held here are let go as their gateway's box is gone (`GatewayGone`). A copy its gateway
    published again (`RequestMeta.copy`) only once that gateway has stayed gone for `grace_s` while it was held: it
    was published as the gateway's heartbeat came back, and this box may not have heard that yet; never let go, the
    copies of a gateway that lapsed, came back and then died for good were computed in full (review h202)."""

    def __init__(self, gateway_gone: GatewayGone, grace_s: float) -> None:
        self._gateway_gone = gateway_gone
        self._grace_s = grace_s
        self._copies_gone_at: dict[str, float] = {}  # a held copy's id -> monotonic, first judged with its gateway gone

    def __call__(self, held: Msg | RequestMeta) -> bool:
        try:
            meta = held if isinstance(held, RequestMeta) else RequestMeta.from_headers(held.headers)
        except ValueError:
            return False
        gone = self._gateway_gone(meta)
        if not gone:
            self._copies_gone_at.pop(meta.id, None)
            return False
        if not meta.copy or gone is GatewayState.OVER:  # an ended run's copies: no heartbeat of it is to come
            return True
        now = time.monotonic()
        return now - self._copies_gone_at.setdefault(meta.id, now) > self._grace_s

    def held_now(self, request_ids: Collection[str]) -> None:
        """Forget the copies no longer held (answered, let go, handed back): the ids of those that are."""
        if self._copies_gone_at:
            self._copies_gone_at = {i: at for i, at in self._copies_gone_at.items() if i in request_ids}


def gone_at_intake(meta: RequestMeta, msg: Msg, gateway_gone: GatewayGone) -> bool:
    """Whether a request taken in is dropped as its gateway is gone (`GatewayGone`): not a copy on its first delivery
    (published as its gateway's heartbeat came back: `RequestMeta.copy`) unless its gateway's run is over; a copy
    given again is judged as any."""
    gone = gateway_gone(meta)
    if meta.copy and (msg.metadata.num_delivered or 1) <= 1:
        return gone is GatewayState.OVER
    return bool(gone)


class QueueEpoch:
    """When the request stream this box works from was made: a message stored before it is of a stream that is gone
    (a nats-server restart without --durable), and handing it back (a nak) would reach nobody."""

    def __init__(self) -> None:
        self.made: datetime | None = None

    def lost(self, msg: Msg) -> bool:
        return self.made is not None and msg.metadata.timestamp < self.made


def another_copy(held: Msg, msg: Msg) -> bool:
    """Whether `msg` is a second message of a request whose `held` one this box works on, not a redelivery of it: a
    gateway publishes a request again when the stream it was in was made anew (a nats-server restart without
    `--durable`), and a box may hold the old copy still."""
    # Not the stream sequence alone: a stream made anew numbers its messages from 1 again.
    return (held.metadata.sequence.stream, held.metadata.timestamp) != (
        msg.metadata.sequence.stream,
        msg.metadata.timestamp,
    )


def request_meta(msg: Msg, spawn: Callable[[Coroutine[Any, Any, Any]], None]) -> RequestMeta | None:
    """A delivered request's headers, or None when they cannot be read: such a message is terminated (logged), as no
    delivery of it will read better."""
    try:
        return RequestMeta.from_headers(msg.headers)
    except ValueError as exc:
        log.warning("malformed request message dropped", extra={"error": str(exc)})
        spawn(msg.term())
        return None


def keeps_held(msg: Msg, holds: Callable[[str], bool], take: Callable[[Msg], None]) -> bool:
    """A worker's `Puller` `keeps`: a message its pullers were sent after they stopped stays with the box when it is a
    copy of a request the box `holds`, taken in by `take` (the worker's intake) as any copy is (handed back, another
    box computed it again: review); the rest is handed back."""
    try:
        held = holds(RequestMeta.from_headers(msg.headers).id)
    except ValueError:
        return False
    if held:
        take(msg)
    return held


class HandBack:
    """How a worker gives a request back to the queue for another delivery, maybe to another box: a nak, but not on
    its last delivery (`max_deliver`, its consumer's), where a nak has it dead-lettered and its client told 422
    `dead_lettered`, blaming the request for a box that drained or stopped (review h122: with `max_deliver` 1, every
    request a drain handed back). There a copy of it is queued afresh, under a `Nats-Msg-Id` of its own (the
    stream's duplicate window knows the request's), and the message acked, its stored body left to the copy.

    The copy goes to the back of the queue, where a nak is delivered again first. A publish that timed out is sent
    again under the same id (it may have been stored: the duplicate window keeps one); one the stream refuses (full,
    `discard new`) leaves the nak, as before. The original is marked in progress before each try, and a try waits a
    third of `ack_wait_s` at most: three tries of JetStream's 5 s outlasted the 10 s ack wait, and the original's
    max-deliveries advisory had it dead-lettered, its client told 422 and its blob deleted, while its copy was
    served (review h132). Shielded: a stop that cancels its caller does not cut it between the copy and the ack. A
    message of a request stream made anew since (`queue_epoch`) is not copied: its gateway publishes the request
    again itself."""

    def __init__(
        self, nc: NATS, max_deliver: int, queue_epoch: QueueEpoch | None = None, *, ack_wait_s: float = 10.0
    ) -> None:
        self._nc = nc
        self._max_deliver = max_deliver
        self._queue_epoch = queue_epoch
        self._try_s = max(0.1, ack_wait_s / 3)

    async def __call__(self, msg: Msg) -> None:
        last = (msg.metadata.num_delivered or 1) >= self._max_deliver
        if not last or (self._queue_epoch is not None and self._queue_epoch.lost(msg)):
            await msg.nak()
            return
        await asyncio.shield(self._copy(msg))

    async def _copy(self, msg: Msg) -> None:
        try:
            await self._copy_or_nak(msg)
        except NatsError as exc:  # cut off meanwhile (shielded, nobody awaits it): JetStream gives it out again
            log.warning("request not handed back", extra={"error": repr(exc)})

    async def _copy_or_nak(self, msg: Msg) -> None:
        headers = dict(msg.headers or {})
        headers[MSG_ID] = f"{headers.get(MSG_ID, '')}.again.{msg.metadata.sequence.stream}"
        for _ in range(_COPY_TRIES):
            await msg.in_progress()
            try:
                await self._nc.jetstream().publish(msg.subject, msg.data, timeout=self._try_s, headers=headers)
            except NatsTimeout:
                continue
            except NatsError:  # refused (the stream full, say) or no stream: as before, the nak
                break
            await msg.ack()
            return
        await msg.nak()


def retry_delay_s(msg: Msg) -> float:
    """How long a request that could not be handled waits before its next delivery: 0.1 s, doubling, at most 2 s."""
    deliveries = msg.metadata.num_delivered or 1
    return min(2.0, 0.1 * 2 ** (deliveries - 1))


async def deliver_reply(
    nc: NATS,
    meta: RequestMeta,
    body: bytes,
    headers: dict[str, str],
    give_up: Callable[[], bool],
    untaken: Callable[[], Awaitable[None]] | None = None,
    gateway_gone: GatewayGone = never_gone,
) -> bool:
    """Send a reply until its gateway confirms it; False if `give_up()` says stop first.

    No responders means no gateway listens on the reply subject right now (it is reconnecting):
    a plain publish would vanish, and the ack after it would lose the request. Once the request's
    deadline has passed nobody waits for the answer, so it counts as delivered: sent once, and where the reply
    left something behind (its body's blob), `untaken()` is called if no gateway confirmed it. A gateway drops a
    late reply and deletes its blob; with its gateway gone, the blob was left to the bucket's TTL (tester h131).
    So does a reply whose gateway is known gone (`gateway_gone`): its box died, and sending it again every 0.25 s
    kept the request unacked, in the backlog, until its deadline (300 s for a generation: tester h190).
    """
    attempts = 0
    while True:
        if meta.expired:
            if attempts:  # said once, as its first try was: a reply tried to its deadline went silent (tester h190)
                log.info("reply not taken by a gateway by the request's deadline", extra={"request_id": meta.id})
            if untaken is None:
                await nc.publish(meta.reply, body, headers=headers)  # a late answer: best effort is enough
                return True
            try:
                await nc.request(meta.reply, body, timeout=_CONFIRM_TIMEOUT_S, headers=headers)
            except (NoRespondersError, NatsTimeout):
                await untaken()
            return True
        try:
            await nc.request(meta.reply, body, timeout=_CONFIRM_TIMEOUT_S, headers=headers)
            if attempts:
                log.info("reply taken by its gateway", extra={"request_id": meta.id, "attempts": attempts + 1})
            return True
        except (NoRespondersError, NatsTimeout):
            if give_up():
                return False
            if gateway_gone(meta):
                log.info(
                    "reply not taken: its gateway's box is gone from the fleet; given up",
                    extra={"request_id": meta.id, "reply": meta.reply, "attempts": attempts + 1},
                )
                if untaken is not None:
                    await untaken()
                return True
            # Said once per reply, then at debug: a gateway gone for good is tried every 0.25 s until the
            # request's deadline (89 lines for one reply, 2,261 for 29 when a box died: fleet tester h40).
            level = logging.INFO if attempts == 0 else logging.DEBUG
            log.log(level, "reply not taken by a gateway; sending it again", extra={"request_id": meta.id})
            attempts += 1
            await asyncio.sleep(_RESEND_S)


async def keep_alive(
    held: Callable[[], list[Msg]], ack_wait_s: float, let_go_forsaken: Callable[[], None] | None = None
) -> None:
    """Tell JetStream that held requests are still being worked on, so slow work is not redelivered; first, each
    time, `let_go_forsaken()` drops those whose gateway is gone (the worker's `_let_go_forsaken`)."""
    period = max(0.5, ack_wait_s / 3)
    while True:
        await asyncio.sleep(period)
        if let_go_forsaken is not None:
            let_go_forsaken()
        for msg in held():
            if msg.is_acked:  # nak'd (or acked) since it was listed: an in-progress would hold back its redelivery
                continue
            try:
                await msg.in_progress()
            except Exception as exc:
                log.debug("in-progress ack failed", extra={"error": repr(exc)})


# Why a gateway cancelled a request (`fbx.cancel`'s `why`, "gone" when it says none): its client went away, its
# deadline passed, or the gateway answered it without the queue (a publish that went unconfirmed: a 503). Each is
# counted as such where a box drops it (`Metrics.dropped`): only "gone" is a client that went away (tester h146).
# A box cancels a request itself as "gateway_gone" when its gateway's box is gone from the fleet (`GatewayGone`): its
# clients went with it, and it is counted as theirs.
CancelWhy = Literal["gone", "expired", "abandoned", "gateway_gone"]
CANCEL_WHYS: tuple[CancelWhy, ...] = ("gone", "expired", "abandoned")  # those a gateway says on `fbx.cancel`


class Cancellations:
    """Request ids whose clients went away, or that their gateway gave up on (`CancelWhy`), remembered for a while,
    fed by `fbx.cancel`.

    Every box hears every cancel in the fleet: ids expire in the order they came, from the front of
    a queue, so a storm of cancels costs each one a constant amount of work. Why each was cancelled is kept with
    it: a box that pulls a request after its cancel counts it as the cancel said (review h145).
    """

    def __init__(self, memory_s: float = _CANCEL_MEMORY_S, most: int = 100_000) -> None:
        self._memory_s = memory_s
        self._most = most
        self._order: deque[tuple[float, str]] = deque()  # (expiry, id), oldest first
        self._ids: dict[str, CancelWhy] = {}

    def add(self, request_id: str, *, why: CancelWhy = "gone") -> None:
        now = time.monotonic()
        self._forget(now)
        if request_id in self._ids:
            if self._ids[request_id] == "gateway_gone":  # a gateway's own word outranks this box's guess (h204)
                self._ids[request_id] = why
            return
        if len(self._order) >= self._most:
            self._ids.pop(self._order.popleft()[1], None)
        self._order.append((now + self._memory_s, request_id))
        self._ids[request_id] = why

    def contains(self, request_id: str) -> bool:
        self._forget(time.monotonic())
        return request_id in self._ids

    def judge_gateway(self, request_id: str, gone: bool) -> None:
        """A request taken in: cancelled if its gateway is gone (`gone_at_intake`); no longer, if it was only for that
        and this is its gateway's copy, published again once its heartbeat came back (`Resender.lapsed`)."""
        if gone:
            self.add(request_id, why="gateway_gone")
        elif self._ids.get(request_id) == "gateway_gone":
            del self._ids[request_id]

    def still_cancelled(self, meta: RequestMeta, gateway_gone: GatewayGone) -> bool:
        """Whether a request cancelled while it was being prepared (its blob read, its adapter loaded) stays so once
        prepared: not one cancelled only as its gateway was gone, if that gateway is heard again. Back, it found the
        message still held here, published no copy, and awaits this answer: dropped, its client had a 504 at its
        deadline (review h202)."""
        if not gateway_gone(meta):
            self.judge_gateway(meta.id, gone=False)
        return self.contains(meta.id)

    def letting_go(self, meta: RequestMeta) -> bool:
        """Whether `meta` is a copy its gateway published again (`RequestMeta.copy`) of a request this box is letting
        go as its gateway's (`gateway_gone`): taken in the held one's place, the let-go would ack the copy. The
        worker naks it instead (`LET_GO_WAIT_S`), to come back once the first is let go."""
        return bool(meta.copy) and self._ids.get(meta.id) == "gateway_gone"

    def why(self, request_id: str) -> CancelWhy:
        """Why `request_id` was cancelled (asked of one it `contains`)."""
        return self._ids.get(request_id, "gone")

    def _forget(self, now: float) -> None:
        while self._order and self._order[0][0] <= now:
            self._ids.pop(self._order.popleft()[1], None)
