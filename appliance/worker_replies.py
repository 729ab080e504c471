"""How a model worker's answer leaves the box: the reply confirmed by its gateway first, then the ack.

The one rule: a request is acked only once its gateway confirms the reply (or its error), so a box that dies in
between leaves it for JetStream to redeliver, and the gateway drops the second answer; a reply sent while its gateway
is reconnecting (a NATS server restarted or failed over) is sent again rather than acked and lost. A request the model
failed on is tried again (maybe elsewhere) and, past `max_deliver`, dead-lettered. However it is settled, the worker
then lets it go (`let_go`) and has room again (`poke`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from contextlib import suppress
from dataclasses import replace
from functools import partial
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from appliance import bus
from appliance.blobs import Blobs
from appliance.deadletter import DeadLetters
from appliance.delivery import GatewayGone, HandBack, LocalReply, deliver_reply, never_gone
from appliance.envelope import ReplyMeta, RequestMeta
from appliance.errors import FleetboxError
from appliance.jobs import jobs_for
from appliance.recent_answers import RecentAnswers
from appliance.residency import Residency
from appliance.work import Job
from runtimes import Runtime

log = logging.getLogger(__name__)


class WorkerReplies:
    """The replies of one model's worker on this box (`ModelWorker`), and the requests it settles without one."""

    def __init__(
        self,
        box_id: str,
        nc: NATS,
        model: str,
        runtime: Runtime,
        blobs: Blobs,
        residency: Residency,
        answered: RecentAnswers,
        dead_letters: DeadLetters,
        *,
        local_reply: LocalReply | None,
        hand_back: HandBack,
        stopping: Callable[[], bool],
        current: Callable[[str, Msg], Msg],
        let_go: Callable[[str], None],
        poke: Callable[[], None],
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
        gateway_gone: GatewayGone = never_gone,
    ) -> None:
        self._box_id = box_id
        self._nc = nc
        self._model = model
        self._runtime = runtime
        self._blobs = blobs
        self._residency = residency
        self._answered = answered
        self._dead_letters = dead_letters
        self._local_reply = local_reply
        self._hand_back = hand_back
        self._stopping = stopping  # draining: a reply no gateway takes is handed back instead of sent again
        self._current = current  # the message the worker holds for a request now (a copy may have taken its place)
        self._let_go = let_go  # the request is no longer the worker's
        self._poke = poke  # a request settled: the worker has room again
        self._spawn = spawn  # the worker's background tasks, waited for at its drain
        self._gateway_gone = gateway_gone  # a reply whose gateway is gone is not sent again

    async def answer(self, job: Job, error: Exception | None) -> None:
        """A job its batch finished (or failed on): its answer made and sent, or its error handled."""
        meta, msg = job.meta, job.handle
        if error is not None:
            if isinstance(error, FleetboxError):
                await self.fail(meta, msg, error)
            else:
                await self.retry_or_dead_letter(meta, msg, error)
            return
        queue_ms = max(0.0, job.started_ms - meta.sent_ms) if meta.sent_ms else 0.0
        draft = ReplyMeta(id=meta.id, status=200, box=self._box_id, queue_ms=queue_ms, compute_ms=job.compute_ms)
        jobs = jobs_for(meta.task)
        assert jobs is not None
        try:
            body, reply = jobs.finish(job, draft, self._runtime)
        except FleetboxError as exc:
            await self.fail(meta, msg, exc)
            return
        except Exception as exc:
            log.error("answer not made", extra={"model": self._model, "request_id": meta.id, "error": repr(exc)})
            await self.retry_or_dead_letter(meta, msg, exc)
            return
        await self._send(meta, msg, body, reply)

    async def ask_again(self, meta: RequestMeta, msg: Msg, delay_s: float) -> None:
        """Hand the request back to the queue, to be delivered again (maybe elsewhere) after `delay_s`."""
        try:
            with suppress(NatsError):  # cut off: JetStream gives it again after ack_wait_s
                await self._current(meta.id, msg).nak(delay=delay_s)
        finally:
            self._let_go(meta.id)
            self._poke()

    async def retry_or_dead_letter(self, meta: RequestMeta, msg: Msg, error: Exception) -> None:
        """The model raised on this request: try again (maybe elsewhere), or give up after max_deliver."""
        msg = self._current(meta.id, msg)
        try:
            await self._dead_letters.retry_or_dead_letter(meta, msg, error, stopping=self._stopping)
        finally:
            self._let_go(meta.id)
            self._poke()

    async def fail(self, meta: RequestMeta, msg: Msg, error: FleetboxError) -> None:
        """The request's answer is `error`."""
        await self._send(meta, msg, error.to_json(), ReplyMeta.for_error(meta.id, error, self._box_id))

    async def _send(self, meta: RequestMeta, msg: Msg, body: bytes, reply: ReplyMeta) -> None:
        try:
            # This box's own gateway awaiting it: handed over in-process, as sure as a confirmed reply.
            local = self._local_reply is not None and self._local_reply(meta.reply, reply, body)
            if not local:
                untaken = None
                if self._blobs.needed(body):
                    reply = replace(reply, blob=await self._blobs.put(bus.reply_blob_key(meta.id, self._box_id), body))
                    body, untaken = b"", partial(self._blobs.delete, reply.blob)
                if not await deliver_reply(
                    self._nc, meta, body, reply.headers(), self._stopping, untaken, self._gateway_gone
                ):
                    # This box is stopping with the answer undelivered: another box answers it (with a blob of its own).
                    await self._hand_back(self._current(meta.id, msg))
                    if untaken is not None:  # in the background: a redelivery meanwhile would find it still held
                        self._spawn(untaken())
                    return
            # The message held now: a copy published again may have been taken in its place while the reply waited
            # for its gateway (review r43).
            await self._blobs.ack(self._current(meta.id, msg), meta.blob)
            self._residency.touch(self._model, answered=1)  # its demand: eviction takes the least asked for
            self._answered.add(meta)
        finally:
            self._let_go(meta.id)
            self._poke()
