"""Publishing a gateway's requests again when the queue they went to is lost (`Resender`).

A request stream made anew (a nats-server that kept it in memory restarted: the default fleet without `--durable`)
lost what was queued in the old one. The one idea: every request is kept, as published, while its client awaits it,
with the count of this gateway's cuts from NATS at its publish (its epoch); a request published before the last cut
may have gone with the old stream, and is published again under its id. A box that had pulled the old copy may
answer it too: the gateway takes the first answer (`waiters.py`). A generation already begun is its box's to
finish, from the copy in hand, unless that box died with the queue: then its answer falls silent, and it is
published again once silent for `silence_s`, as JetStream would have redelivered it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from appliance.catalog import ModelSpec
from appliance.envelope import RequestMeta
from appliance.errors import FleetboxError, ServiceUnavailable
from appliance.gateway.publish import FAILOVER_RETRY_S, Publisher
from appliance.tasks import Background

log = logging.getLogger(__name__)

_CONCURRENT_LOOKS = 32  # looks at the request stream at once after a lapse: thousands awaited need not wait in turn
_LOOK_AGAIN_S = 1.0  # a look the stream did not answer is made again after this


@dataclass(slots=True, frozen=True)
class _Sent:
    """A request this gateway published and still awaits: what it needs to publish it again."""

    spec: ModelSpec
    body: bytes
    meta: RequestMeta
    epoch: int  # the gateway's count of cuts from NATS when it was published
    at: float  # monotonic, when it was published
    again: bool  # a copy published again (`RequestMeta.copy`)
    seq: int  # its message's sequence in the request stream


class Resender:
    """One gateway's requests as published, while awaited. The gateway's `Waiters` (waiters.py) say which are
    `awaited`, which are `unstarted` (a call not answered, a generation before its first chunk), when a begun
    generation's answer last came in (`heard_at`, monotonic; None once it is whole), and how a client whose request
    could not be queued again is answered (`fail`)."""

    def __init__(
        self,
        publisher: Publisher,
        *,
        awaited: Callable[[str], bool],
        unstarted: Callable[[str], bool],
        fail: Callable[[str, FleetboxError], None],
        heard_at: Callable[[str], float | None],
        silence_s: float,
    ) -> None:
        self._publisher = publisher
        self._awaited = awaited
        self._unstarted = unstarted
        self._fail = fail
        self._heard_at = heard_at
        self._silence_s = silence_s
        self._sent: dict[str, _Sent] = {}  # what is awaited, as published (`queue_lost` publishes it again)
        self._epoch = 0  # cuts from NATS, and returns: a publish before the last one may be in a lost stream
        self._republishes = Background("requests published again")
        self._republishing: set[str] = set()  # ids being published again now: one copy at a time (review h204)
        self._looking: set[str] = set()  # ids whose message is being looked at after a lapse: one look loop each
        self._looks = asyncio.Semaphore(_CONCURRENT_LOOKS)

    def interrupted(self) -> None:
        """Cut off from NATS, or back on it: what was published until now may be in a stream that is lost."""
        self._epoch += 1

    async def publish(self, spec: ModelSpec, body: bytes, meta: RequestMeta, *, again: bool = False) -> None:
        """Queue a request, and keep what `queue_lost` needs to publish it again while it is awaited."""
        epoch, at = self._epoch, time.monotonic()
        seq = await self._publisher.publish(spec.slug, body, meta, again=again)
        if self._awaited(meta.id):  # still awaited: its client has not gone
            self._sent[meta.id] = _Sent(spec, body, meta, epoch, at, again, seq)

    def forget(self, request_id: str) -> None:
        """Its client has its answer, or went away."""
        self._sent.pop(request_id, None)

    async def close(self) -> None:
        """Stop publishing again: the box is stopping and answers every request it awaits (`Dispatcher.abandon`).
        A lapse's looks at the stream, a generation's wait for silence, or a copy's publish went on to their ends,
        each for as long as its request stayed awaited (review h204 L4); a copy published then was queued for
        nobody."""
        await self._republishes.cancel()

    def again(self, request_id: str) -> None:
        """Publish one request again now (a generation handed back whose message went with a lost queue)."""
        if (sent := self._sent.get(request_id)) is not None:
            self._republishes.spawn(self._publish_again(sent))

    def queue_lost(self) -> None:
        """The request stream was made anew: what this gateway published before its last cut from NATS is gone with
        the old one. Each such request still unstarted is published again under its id, where it waited its whole
        deadline for a 504 (146 of 200 in the fleet tester's run, with the boxes back within a second)."""
        lost = [sent for sent in self._sent.values() if sent.epoch < self._epoch]
        self._publish_all_again(lost, "request queue made anew; publishing again what it lost")

    def lapsed(self, lapsed_s: float, settle_s: float) -> None:
        """This gateway's heartbeat lapsed for `lapsed_s`, over a TTL (its box frozen, stalled, behind a half-open
        link, cut off from NATS): the workers may have taken it for gone and let go what it published
        (`Fleet.gateway_gone`), and its clients waited to their deadline for nothing (review h195). Once every box
        has heard its heartbeat again (`settle_s`), each request it awaits that no box answered and whose message is
        gone from the queue (acked: let go) is published again, as a copy no worker lets go (`RequestMeta.copy`); one
        still queued or held is left be, so a lapse no worker took for gone (a NATS restart with `--durable`) doubles
        nothing. A generation begun is published again once its answer is silent for `silence_s` (its box let it go),
        else it is its box's to finish. A copy published since the lapse began (after a reconnect) is not looked at."""
        began = time.monotonic() - lapsed_s
        self._republishes.spawn(self._publish_again_if_let_go(began, lapsed_s, settle_s))

    async def _publish_again_if_let_go(self, began: float, lapsed_s: float, settle_s: float) -> None:
        await asyncio.sleep(settle_s)
        # What it awaits now, not at the lapse's end: a request published as its heartbeat came back, before the
        # boxes heard it, was let go too (4 of 4 runs with a 6 s freeze lost some: tester h205).
        lapsed = [sent for sent in self._sent.values() if not (sent.again and sent.at >= began)]
        lost_at = time.monotonic()
        unstarted: list[_Sent] = []
        for sent in lapsed:
            if not self._first_awaited(sent):  # answered, or published again
                continue
            if sent.meta.id in self._looking:  # an earlier lapse's look at it goes on
                continue
            if self._unstarted(sent.meta.id):
                unstarted.append(sent)
            else:
                self._republishes.spawn(self._publish_again_if_silent(sent, lost_at))
        let_go = sum(await asyncio.gather(*(self._publish_again_once_let_go(sent) for sent in unstarted)))
        level = logging.WARNING if let_go else logging.INFO
        log.log(level, f"heartbeat lapsed for {lapsed_s:.1f} s; published again what was let go meanwhile",
                extra={"requests": let_go, "awaited": len(lapsed)})  # fmt: skip

    async def _publish_again_once_let_go(self, sent: _Sent) -> bool:
        """Publish `sent` again if its message is gone from the queue (acked: let go), looking until the stream says
        so or its client has its answer: a look the stream does not answer tells nothing (review h202). Whether it
        was published again."""
        request_id = sent.meta.id
        self._looking.add(request_id)
        try:
            while self._first_awaited(sent) and self._unstarted(request_id):
                async with self._looks:
                    queued = await self._publisher.queued(sent.seq, request_id)
                if queued is False:
                    return await self._publish_again(sent)
                if queued:
                    return False
                await asyncio.sleep(_LOOK_AGAIN_S)
            return False
        finally:
            self._looking.discard(request_id)

    def _first_awaited(self, sent: _Sent) -> bool:
        """Whether `sent` is still awaited, as it was published (not since published again)."""
        return self._awaited(sent.meta.id) and self._sent.get(sent.meta.id) is sent

    def _publish_all_again(self, lost: list[_Sent], why: str) -> None:
        """Publish `lost` again: one unstarted at once, a begun generation once silent (`_publish_again_if_silent`)."""
        unstarted: list[_Sent] = []
        begun: list[_Sent] = []  # its box's to finish, unless it died with the queue (or let it go)
        for sent in lost:
            (unstarted if self._unstarted(sent.meta.id) else begun).append(sent)
        if unstarted:
            log.warning(why, extra={"requests": len(unstarted)})
        for sent in unstarted:
            self._republishes.spawn(self._publish_again(sent))
        lost_at = time.monotonic()
        for sent in begun:
            self._republishes.spawn(self._publish_again_if_silent(sent, lost_at))

    async def _publish_again_if_silent(self, sent: _Sent, lost_at: float) -> None:
        """A generation begun before the queue was lost, published again once its answer is silent for `silence_s`
        from then: its box died with the queue (the box of the embedded nats-server, killed: its generations for
        another box's clients waited their whole deadline, 3 of 3, tester h190)."""
        request_id = sent.meta.id
        while self._awaited(request_id) and (heard_at := self._heard_at(request_id)) is not None:
            silent_s = time.monotonic() - max(heard_at, lost_at)
            if silent_s >= self._silence_s:
                log.warning("generation silent since the queue was lost; publishing it again", extra={
                    "request_id": request_id, "silent_s": round(silent_s, 1)})  # fmt: skip
                await self._publish_again(sent)
                return
            await asyncio.sleep(self._silence_s - silent_s)

    async def _publish_again(self, sent: _Sent) -> bool:
        """Publish `sent` again, unless it was since (its copy is what is awaited now) or is being so: a lost queue
        and a lapse, or two lapses, each published a copy of one request (review h204). Whether it was."""
        request_id = sent.meta.id
        if request_id in self._republishing or self._sent.get(request_id) is not sent:
            return False
        self._republishing.add(request_id)
        try:
            await self.publish(sent.spec, sent.body, sent.meta, again=True)
            return True
        except Exception as exc:  # the new queue refused it (full, not answering, NATS gone again): its client is told
            error = (
                exc
                if isinstance(exc, FleetboxError)
                else ServiceUnavailable(
                    "the request queue was lost and the request could not be queued again; retry shortly",
                    retry_after_s=FAILOVER_RETRY_S,
                )
            )
            if not isinstance(exc, FleetboxError):
                log.warning("request not published again", extra={"request_id": request_id, "error": repr(exc)})
            self._fail(request_id, error)
            return False
        finally:
            self._republishing.discard(request_id)
