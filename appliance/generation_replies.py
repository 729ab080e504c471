"""How a generation's answer leaves the box: chunk by chunk, the last one confirmed before the ack.

The one rule: a request is acked only once its last chunk (or its error) is confirmed by its gateway,
so a box that dies mid-answer leaves it for redelivery. A request the model failed on is tried again
(maybe elsewhere) and, past `max_deliver`, dead-lettered, while none of its answer has left the box;
once chunks have been sent, it ends with an error chunk numbered after them instead.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from contextlib import suppress
from typing import Any

import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from appliance.blobs import Blobs
from appliance.deadletter import DeadLetters
from appliance.delivery import GatewayGone, HandBack, LocalReply, deliver_reply, never_gone
from appliance.envelope import ReplyMeta, RequestMeta
from appliance.errors import FleetboxError, InternalError
from appliance.generation_held import HeldGenerations, Stream
from runtimes.generate import StepOutput


class GenerationReplies:
    """The replies of one generative model's worker on this box."""

    def __init__(
        self,
        box_id: str,
        nc: NATS,
        blobs: Blobs,
        dead_letters: DeadLetters,
        held: HeldGenerations,
        *,
        local_reply: LocalReply | None,
        hand_back: HandBack,
        stopping: Callable[[], bool],
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
        poke: Callable[[], None],
        gateway_gone: GatewayGone = never_gone,
    ) -> None:
        self._box_id = box_id
        self._nc = nc
        self._blobs = blobs
        self._dead_letters = dead_letters
        self._held = held  # its `settling` and `retrying` are this object's to fill
        self._local_reply = local_reply
        self._hand_back = hand_back
        self._stopping = stopping  # draining: a reply no gateway takes is handed back instead of retried
        self._spawn = spawn  # the worker's background tasks, waited for at its drain
        self._poke = poke  # a request answered or handed back: the worker has room again
        self._gateway_gone = gateway_gone  # a last chunk whose gateway is gone is not sent again

    async def send(self, stream: Stream, output: StepOutput, step_ms: float) -> None:
        """One chunk of text; the last one (with the usage) is confirmed then acked off the caller's path."""
        body: dict[str, Any] = {"text": output.text_delta}
        if output.finished:
            body["finish_reason"] = output.finish_reason
            if output.usage is not None:
                body["usage"] = {
                    "prompt_tokens": output.usage.prompt_tokens,
                    "completion_tokens": output.usage.completion_tokens,
                }
        reply = ReplyMeta(
            id=output.request_id,
            status=200,
            box=self._box_id,
            compute_ms=step_ms,
            seq=stream.seq,
            final=output.finished,
            # The tokens made, for the gateway's admission: how long an answer holds its decode slot.
            usage_tokens=output.usage.completion_tokens if output.finished and output.usage is not None else 0,
        )
        if not output.finished:
            await self.reply(stream.meta, reply, orjson.dumps(body))
            stream.seq += 1  # counted once sent: a chunk whose send raised never left the box
            return
        stream.seq += 1
        # The last chunk is confirmed before the ack (off the stepper: all generations step together).
        self._spawn(self.settle(stream.meta, stream.msg, reply, orjson.dumps(body)))

    def failed(self, stream: Stream, error: Exception) -> None:
        """The model failed on a request its worker has let go of (it is no longer in the decode batch).

        Nothing of its answer has left the box yet: it is tried again (maybe elsewhere) or dead-lettered,
        as the encoder worker does. Once chunks have been sent it is not: its client already has part of
        the answer, and a start over generates it again from the first token. The gateway can stitch
        that onto what was sent only when it comes out the same (greedy or seeded); a sampled answer
        would be text from two generations, mixed. So it ends with a 500 error chunk, numbered after
        those sent.
        """
        if stream.seq == 0:
            self._spawn(self.retry_or_dead_letter(stream.meta, stream.msg, error))
            return
        failed = InternalError(f"generation failed: {error!r}")
        self._spawn(self.fail(stream.meta, stream.msg, failed, seq=stream.seq))

    async def retry_or_dead_letter(self, meta: RequestMeta, msg: Msg, error: Exception) -> None:
        """Another try, or FBX_DLQ (`DeadLetters`). Meanwhile the request is `retrying`, kept in progress: a dead letter
        whose client is told while its gateway reconnects outlasted the ack wait, and JetStream's max-deliveries
        advisory had another box keep, tell and count it again (review h132)."""
        self._held.retrying[meta.id] = msg
        dead_lettered = False
        try:
            dead_lettered = await self._dead_letters.retry_or_dead_letter(meta, msg, error, stopping=self._stopping)
        finally:
            copy = self._held.retrying.pop(meta.id, None)
            if copy is not None and copy is not msg:
                # Published again after the queue was lost, it came meanwhile: the live copy. Settled with the
                # original where that was dead-lettered (in FBX_DLQ, its client told: review h147), else given
                # the other try the original's nak, sent to the lost stream, could not give.
                self._spawn(_settle_copy(copy, dead_lettered))
            self._poke()

    async def fail(self, meta: RequestMeta, msg: Msg, error: FleetboxError, seq: int = 0) -> None:
        """An error as the request's last chunk, numbered `seq` (after the chunks already sent)."""
        await self.settle(meta, msg, ReplyMeta.for_error(meta.id, error, self._box_id, seq=seq), error.to_json())

    async def settle(self, meta: RequestMeta, msg: Msg, reply: ReplyMeta, body: bytes) -> None:
        """The last chunk or an error: confirmed by its gateway, then the request acked and its blob deleted.

        Meanwhile the request is `settling`; the copy acked is the one held then (published again after the queue
        was lost, a copy may have taken the old one's place)."""
        self._held.settling[meta.id] = msg
        try:
            if not await self.reply(meta, reply, body, confirmed=True):
                # This box is stopping with the answer undelivered: another box answers it.
                await self._hand_back(self._held.settling.get(meta.id, msg))
                return
            await self._blobs.ack(self._held.settling.get(meta.id, msg), meta.blob)
        finally:
            self._held.settling.pop(meta.id, None)
            self._poke()

    async def reply(self, meta: RequestMeta, reply: ReplyMeta, body: bytes, *, confirmed: bool = False) -> bool:
        """Send one chunk; a confirmed one is sent until its gateway has it (False: this box is stopping first)."""
        if self._local_reply is not None and self._local_reply(meta.reply, reply, body):
            return True
        if confirmed:
            return await deliver_reply(
                self._nc, meta, body, reply.headers(), self._stopping, gateway_gone=self._gateway_gone
            )
        await self._nc.publish(meta.reply, body, headers=reply.headers())
        return True


async def _settle_copy(msg: Msg, dead_lettered: bool) -> None:
    with suppress(NatsError):  # cut off: JetStream gives it out again after its ack wait all the same
        await (msg.ack() if dead_lettered else msg.nak())
