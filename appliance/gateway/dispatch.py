"""Sending a gateway's requests and waiting for their answers (`publish.py` puts them on the queue).

One `Dispatcher` per gateway takes a request from its handler to its answer: admitted, given its envelope,
published, awaited within its deadline, its answer's body read back where it went to the object store. The table
of reply waiters it awaits on is its `Waiters` (`waiters.py`): the first reply carrying a request's id answers it.

Before a request is published, the gateway's admission control (`Admission`, in `admission.py`)
says whether it may wait at all: a 429 at once, rather than a 504 after its deadline, when it would
wait too long to start, reckoned with the boxes that hold its model (`Holders`, in `holders.py`).
It is told of every request awaited and every answer. What a lost queue took is published again by
the `Resender` (`resend.py`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from fractions import Fraction

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.nuid import NUID

from appliance import bus
from appliance.blobs import READ_TIMEOUT_S, Blobs
from appliance.catalog import ModelSpec
from appliance.envelope import ReplyMeta, RequestMeta
from appliance.errors import FleetboxError, GatewayTimeout, ServiceUnavailable
from appliance.gateway.admission import Admission
from appliance.gateway.holders import Holders
from appliance.gateway.model_queue import ModelQueue
from appliance.gateway.publish import Publisher
from appliance.gateway.replies import Reply, StreamWaiter
from appliance.gateway.resend import Resender
from appliance.gateway.waiters import Waiters
from appliance.metrics import Metrics

log = logging.getLogger(__name__)
_REPLY_READ_LEAST_S = 1.0  # an answer's body read from the object store may take this long past its deadline


def _deadline(timeout_s: float, max_timeout_s: float, *, nats_connected: bool = True) -> GatewayTimeout:
    if not nats_connected:  # the queue is out of reach: a longer deadline is not the cure (tester h146)
        advice = (
            "this gateway is not connected to NATS now (the request queue is out of reach; see /readyz): "
            "retry once it is back"
        )
    elif timeout_s >= max_timeout_s:  # raising it cannot help: the box's cap set it (auditor h61)
        advice = "that is this box's longest (its `max_timeout_s`); retry later, or send less work per request"
    else:
        advice = "raise it with the `timeout` field or header, or retry later"
    return GatewayTimeout(f"no answer within the request's deadline of {timeout_s:g}s; {advice}")


class Dispatcher:
    def __init__(
        self,
        box_id: str,
        run: str,
        nc: NATS,
        js: JetStreamContext,
        metrics: Metrics,
        blobs: Blobs,
        *,
        max_waiting: int,
        max_queue_s: float,
        max_timeout_s: float = math.inf,
        silence_s: float = 10.0,  # a begun generation silent this long after its queue was lost is published again
        holders_per_gateway: Callable[[str], Fraction] | None = None,
        box_round: Callable[[str], int | None] | None = None,
        box_round_rows: Callable[[str], int | None] | None = None,
        pace: Callable[[str, float], tuple[float, float] | None] | None = None,
        holders: Callable[[str], list[str]] | None = None,
        hears_fleet: Callable[[], bool] | None = None,
        can_load: Callable[[str], bool] | None = None,
    ) -> None:
        self.box_id = box_id
        self._max_timeout_s = max_timeout_s  # every request's deadline is at most this
        self._nc = nc
        self._metrics = metrics
        self._blobs = blobs
        self._closed: FleetboxError | None = None  # set by `abandon`: what a request arriving after it is told
        self._admission = Admission(metrics, max_waiting=max_waiting, max_queue_s=max_queue_s)
        self._holders = Holders(
            self._admission,
            max_queue_s,
            holders_per_gateway=holders_per_gateway,
            box_round=box_round,
            box_round_rows=box_round_rows,
            pace=pace,
            holders=holders,
            hears_fleet=hears_fleet,
            can_load=can_load,
        )
        self._publisher = Publisher(nc, js, blobs, lambda why: self._admission.overloaded(why, self.waiting))
        self._waiters = Waiters(
            box_id,
            metrics,
            blobs,
            self._admission,
            self._publisher,
            # The resender is made next, told by the waiters which requests are awaited.
            republish=lambda request_id: self._resender.again(request_id),
            forget=lambda request_id: self._resender.forget(request_id),
        )
        self._resender = Resender(
            self._publisher,
            awaited=self._waiters.awaits,
            unstarted=self._waiters.unstarted,
            fail=self._waiters.fail,
            heard_at=self._waiters.heard_at,
            silence_s=silence_s,
        )
        self._nuid = NUID()
        self._reply_subject = bus.reply_subject(box_id)
        self._run = run

    async def start(self) -> None:
        await self._nc.subscribe(self._reply_subject, cb=self._on_reply)

    @property
    def backlog(self) -> int:
        """Messages in the request stream, for the Retry-After estimate (kept fresh by the box's stream monitor)."""
        return self._admission.backlog

    @backlog.setter
    def backlog(self, messages: int) -> None:
        self._admission.backlog = messages

    def queue_unanswered(self) -> bool:
        """Whether the request stream does not answer this gateway's publishes now (`Publisher.unanswered`)."""
        return self._publisher.unanswered(time.monotonic())

    def stream_answered(self, looked_at: float) -> None:
        """The box's look at the request stream, begun at `looked_at`, was answered (`Publisher.stream_answered`)."""
        self._publisher.stream_answered(looked_at)

    @property
    def waiting(self) -> int:
        return self._waiters.waiting

    def waiting_for(self, model: str) -> int:
        """The requests for `model` (an adapter's count on its base) this gateway awaits: the model list's stats."""
        return self._admission.waiting_for(model)

    async def wait_answered(self, timeout_s: float) -> None:
        """Until every request this gateway awaits is answered, or `timeout_s` (a stopping box's grace).

        Its own worker hands unstarted requests back to the queue as the box stops; other boxes
        compute them and reply here, to clients still connected to this box's HTTP port.
        """
        await self._waiters.wait_answered(timeout_s)

    async def abandon(self, error: FleetboxError) -> None:
        """Answer every request still awaited with `error` and cancel it fleet-wide: the box is stopping.

        A client then gets a clear error it can retry elsewhere instead of a dropped connection, and no
        box computes an answer nobody can be given.
        """
        self._closed = error  # a handler that reaches the queue from now on is answered at once, not left hanging
        await self._resender.close()
        await self._waiters.abandon(error)

    def abandon_model(self, model: str, error: FleetboxError) -> None:
        """A model was just deleted from the catalog: what this gateway awaits for it is answered `error` after a
        grace (`Waiters.abandon_model`)."""
        self._waiters.abandon_model(model, error)

    async def call(
        self,
        *,
        spec: ModelSpec,
        task: str,
        body: bytes,
        timeout_s: float,
        tokens: int,
        inputs: int = 1,
        adapter: ModelSpec | None = None,
        priority: str = "interactive",
        request_id: str | None = None,
    ) -> Reply:
        weight = max(1, tokens)
        queue, meta = self._accept(
            spec, task, timeout_s, tokens, adapter, priority, request_id, weight=weight, inputs=inputs
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        future: asyncio.Future[Reply] = loop.create_future()
        with self._waiters.awaiting(meta.id, (future, queue), queue, weight, timeout_s, inputs):
            try:
                await self._resender.publish(spec, body, meta)
                try:
                    reply = await asyncio.wait_for(future, max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise self._past_deadline(timeout_s) from None
            except asyncio.CancelledError:
                # The client went away (maybe while the publish waited for its ack, as in a failover): a box
                # that has not started it drops it, and so does any box later.
                await asyncio.shield(self._publisher.cancel(meta.id))
                raise
            if reply.meta.blob:
                # Within the request's deadline (review h147: 30 s past a 2 s one), but a second at least: an answer
                # that came in time is read, however little of its deadline was left.
                left_s = max(deadline - loop.time(), _REPLY_READ_LEAST_S)
                return await self._reply_body(meta.id, reply, left_s, timeout_s)
            return reply

    async def _reply_body(self, request_id: str, reply: Reply, within_s: float, timeout_s: float) -> Reply:
        """The answer whose body went to the object store, read within `within_s`. The answer was made: a body not
        read is a 503 telling the client to send it again (it was a 500), or the deadline's 504 where that ran out."""
        assert reply.meta.blob is not None
        try:
            return Reply(reply.meta, await self._blobs.take(reply.meta.blob, within_s))
        except TimeoutError:  # NATS's too
            log.warning("reply body not read in time", extra={"request_id": request_id, "within_s": within_s})
            if within_s < READ_TIMEOUT_S:
                raise self._past_deadline(timeout_s) from None
            why = f"within {READ_TIMEOUT_S:g}s"
        except NatsError as exc:
            log.warning("reply body not read", extra={"request_id": request_id, "error": repr(exc)})
            why = f"({exc!r})"
        raise ServiceUnavailable(
            f"the answer's body could not be read from the object store {bus.BLOBS_BUCKET} {why}; send the request "
            "again",
            retry_after_s=1,
        )

    def _past_deadline(self, timeout_s: float) -> GatewayTimeout:
        return _deadline(timeout_s, self._max_timeout_s, nats_connected=self._nc.is_connected)

    def _accept(
        self,
        spec: ModelSpec,
        task: str,
        timeout_s: float,
        tokens: int,
        adapter: ModelSpec | None,
        priority: str,
        request_id: str | None,
        *,
        weight: int,
        inputs: int = 1,
    ) -> tuple[ModelQueue, RequestMeta]:
        """Admit a request (or raise the 429) and give it its model's queue and its envelope.

        `weight` is what the request costs its model: its tokens, or a generation's `max_tokens` (see `ModelQueue`);
        `inputs` the rows it takes in a batch (an encoder's).
        """
        if self._closed is not None:
            raise self._closed
        # Before admission: cut off from NATS, the work it awaits goes unanswered, and that read as overload (a 429
        # with a Retry-After growing by the second, where a 503 says what is wrong).
        self._publisher.check_connected()
        queue = self._holders.admit(spec, priority, timeout_s, self.waiting, weight=weight, inputs=inputs)
        request_id = request_id or self._nuid.next().decode()
        now_ms = int(time.time() * 1000)
        meta = RequestMeta(
            id=request_id,
            task=task,
            model=spec.name,
            reply=self._reply_subject,
            run=self._run,
            deadline_ms=now_ms + int(timeout_s * 1000),
            sent_ms=now_ms,
            tokens=tokens,
            adapter=adapter.name if adapter is not None else None,
            priority=priority,
            # The registration it resolved: a box holding another never answers it with that one's weights.
            adapter_registered_ms=adapter.registered_ms if adapter is not None else 0,
            registered_ms=spec.registered_ms,  # as the adapter's: no box answers it with another registration's model
        )
        return queue, meta

    async def stream(
        self,
        *,
        spec: ModelSpec,
        task: str,
        body: bytes,
        timeout_s: float,
        tokens: int,
        new_tokens: int,
        adapter: ModelSpec | None = None,
        priority: str = "interactive",
        request_id: str | None = None,
        asked_timeout_s: float | None = None,
    ) -> AsyncIterator[Reply]:
        """Publish a generation request and yield its chunks in order, until the final one.

        Chunks are taken from one box at a time. If another box starts the answer over (the first
        died mid-answer and the request was redelivered), its chunks are taken from then on, the
        first marked `restarted`, and any late chunk of the first box is dropped. A caller that
        stops early (its client went away) cancels the generation.

        Admission is reckoned as for `call`, with a generation counted as started at its first chunk:
        what a client waits for before tokens flow is the wait to start, however long the answer. It
        weighs `new_tokens`, the most it may make: how long it may hold a decode slot. `timeout_s` is what is left of
        the deadline; `asked_timeout_s` the client's whole timeout, which a 504 names (default: `timeout_s`).
        """
        queue, meta = self._accept(spec, task, timeout_s, tokens, adapter, priority, request_id, weight=new_tokens)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        waiter = StreamWaiter(spec.name)
        finished = whole = restarted = expired = refused = False
        tokens = 0  # made, as the final chunk says
        arrived = time.monotonic()
        try:
            with self._waiters.awaiting(meta.id, waiter, queue, new_tokens, timeout_s):
                try:
                    await self._resender.publish(spec, body, meta)
                except FleetboxError:  # the queue's refusal: the publisher sent what cancel it needed, if any
                    refused = True
                    raise
                while not finished:
                    try:
                        chunk = await asyncio.wait_for(waiter.queue.get(), max(0.0, deadline - loop.time()))
                    except TimeoutError:
                        expired = True
                        raise self._past_deadline(asked_timeout_s or timeout_s) from None
                    started = waiter.first_at or time.monotonic()  # when its first chunk came
                    if meta.id in queue.waiting and chunk.meta.status == 200:  # a box's error answer is no token
                        self._metrics.first_token_ms.labels(spec.name).observe((started - arrived) * 1000)
                    queue.remove(meta.id, started, answered=True)
                    finished, restarted = chunk.meta.final, restarted or chunk.restarted
                    whole = finished and not restarted and chunk.meta.status == 200  # on one box in one go
                    tokens = chunk.meta.usage_tokens
                    if whole and tokens > 1 and waiter.final_at is not None:
                        per_token_s = (waiter.final_at - started) / (tokens - 1)
                        self._metrics.token_ms.labels(spec.name).observe(per_token_s * 1000)
                    yield chunk
        finally:
            queue.finish(meta.id, waiter.final_at or time.monotonic(), whole=whole, tokens=tokens)
            if not finished and not refused:
                await self._publisher.cancel(meta.id, why="expired" if expired else "gone")

    def nats_interrupted(self) -> None:
        """Cut off from NATS, or back on it: what was not answered meanwhile says nothing of any model's pace."""
        self._admission.restart_rates()
        self._resender.interrupted()

    def held_again(self, models: list[str]) -> None:
        """Models resident on a live box again after none held them (their only worker restarted, or their box
        evicted them for budget): the seconds nobody held them answered nothing, and say nothing of their pace; the
        pace timed while they were served stands (`ModelQueue.away`), unless other boxes hold them now (`Holders`,
        measured afresh at their next admission). Counted, 429s after a lone worker's
        restart said "about 211s to start", `Retry-After: 35`, for a backlog cleared in 7 s (tester h208)."""
        self._admission.restart_rates(models)

    def queue_lost(self) -> None:
        """The request stream was made anew: what this gateway published before its last cut from NATS is published
        again (`Resender.queue_lost`)."""
        self._resender.queue_lost()

    def heartbeat_lapsed(self, lapsed_s: float, settle_s: float) -> None:
        """This box wrote no heartbeat for `lapsed_s`, over a TTL: what it awaits and the workers let go meanwhile is
        published again, once they have heard its heartbeat again (`settle_s`: `Resender.lapsed`). Nothing answered
        meanwhile says nothing of any model's pace: counted, a 6 s freeze had 429s say a backlog cleared in 5 s
        would take 101 s (tester h205)."""
        self._admission.restart_rates()
        self._resender.lapsed(lapsed_s, settle_s)

    def retry_after_s(self) -> int:
        """Seconds until the backlog would drain at the rate answers have been arriving lately."""
        return self._admission.retry_after_s(self.waiting)

    @property
    def reply_subject(self) -> str:
        return self._reply_subject

    async def _on_reply(self, msg: Msg) -> None:
        if msg.reply:  # the worker acks the request only once a gateway confirms it has the reply
            await msg.respond(b"")
        try:
            meta = ReplyMeta.from_headers(msg.headers)
        except ValueError as exc:
            log.warning("malformed reply dropped", extra={"error": str(exc)})
            return
        self.take(meta, msg.data)

    def take(self, meta: ReplyMeta, body: bytes) -> None:
        """A reply for this gateway: from NATS, or handed over in-process by a worker of the same box
        (`Waiters.take`)."""
        self._waiters.take(meta, body)
