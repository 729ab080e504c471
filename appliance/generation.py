"""The worker of one generative model: requests join one decode batch, tokens stream back as made.

The rule: one stepping task per model drives `runtime.step()` on the device thread while any
request is active (`generation_decode.py`); a request pulled from the queue is judged, admitted (its
body, its adapter, its prompt: `generation_intake.py`) and joins at the next step boundary, and each
step's text goes to the request's gateway at once as a numbered chunk (`generation_replies.py`: the
last chunk is confirmed before the ack; a request the model fails on, its prefill or a decode step
that failed for the whole batch, is retried or ends with an error chunk). Requests past their
deadline, or cancelled by their gateway, are dropped at the next boundary. A model deleted from the
catalog has nobody to hand its requests back to: they are answered 404 at once. What the worker
holds, and in which state: `generation_held.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from concurrent.futures import Executor
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from appliance import bus, delivery
from appliance.adapter_hold import adapter_deleted
from appliance.blobs import Blobs
from appliance.catalog import Catalog, ModelSpec
from appliance.deadletter import DeadLetters
from appliance.delivery import Cancellations, CancelWhy, HandBack, LocalReply, QueueEpoch, keep_alive
from appliance.errors import ServiceUnavailable
from appliance.generation_decode import DecodeLoop
from appliance.generation_held import HeldGenerations
from appliance.generation_intake import GenerationIntake, model_deleted
from appliance.generation_replies import GenerationReplies
from appliance.metrics import Metrics
from appliance.puller import BULK_IDLE_S, Puller, bulk_puller, stop_pullers
from appliance.recent_answers import RecentAnswers
from appliance.residency import Residency
from appliance.settings import Settings
from appliance.tasks import Background, cancel_and_wait
from runtimes.generate import GenerateRuntime

log = logging.getLogger(__name__)

_SETTLE_S = 2.0  # past the grace, at most this long for final answers to be confirmed and acked (the box allows 3)


class GenerateWorker:
    def __init__(
        self,
        box_id: str,
        nc: NATS,
        spec: ModelSpec,
        runtime: GenerateRuntime,
        settings: Settings,
        metrics: Metrics,
        device_executor: Executor,
        residency: Residency,
        catalog: Catalog,
        blobs: Blobs,
        dead_letters: DeadLetters,
        cancelled: Cancellations,
        local_reply: LocalReply | None = None,
        queue_epoch: QueueEpoch | None = None,
        gateway_gone: delivery.GatewayGone = delivery.never_gone,
    ) -> None:
        self.box_id = box_id
        self._cancelled = cancelled
        self._gateway_gone = gateway_gone  # its requests are cancelled: nobody awaits their answers (tester h190)
        self._forsaken = delivery.Forsaken(gateway_gone, grace_s=2 * settings.heartbeat_ttl_s)
        self._queue_epoch = queue_epoch or QueueEpoch()
        self._hand_back = HandBack(nc, settings.max_deliver, self._queue_epoch, ack_wait_s=settings.ack_wait_s)
        self._stopping = False  # draining: a reply no gateway takes is handed back instead of retried
        self.spec = spec
        self.runtime = runtime
        self._settings = settings
        self._metrics = metrics
        self._device = device_executor
        self._catalog = catalog
        self._blobs = blobs
        self._held = HeldGenerations()
        self._answered = RecentAnswers()
        self.pulling = asyncio.Event()  # as a ModelWorker's: set as it starts
        self.pulling_since: float | None = None  # monotonic time its pullers started (`Box._in_use`)
        self._tasks = Background(f"generate:{spec.slug}")
        self._stepper: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        # Room for the decode batch and as many again waiting to join it; the rest stays in the queue for other boxes.
        self._capacity = 2 * runtime.decode_batch
        # Read at each scrape: which box generates what (no metric said: tester h85).
        metrics.generations.labels(spec.name, "running").set_function(self._held.running)
        metrics.generations.labels(spec.name, "waiting").set_function(lambda: self.held - self._held.running())
        self.puller = Puller(
            nc,
            spec.slug,
            bus.pull_inbox(box_id, spec.slug),
            self._room,
            self._on_message,
            keeps=self._keeps_late,
            hand_back=self._hand_back,
        )
        self.bulk_puller = bulk_puller(
            nc, box_id, spec.slug, self._bulk_room, self._on_message, self._keeps_late, hand_back=self._hand_back
        )
        self._replies = GenerationReplies(
            box_id,
            nc,
            blobs,
            dead_letters,
            self._held,
            local_reply=local_reply,
            hand_back=self._hand_back,
            stopping=lambda: self._stopping,
            spawn=self._spawn,
            poke=self.puller.poke,
            gateway_gone=gateway_gone,
        )
        self._decoding = DecodeLoop(
            spec.name,
            runtime,
            device_executor,
            residency,
            metrics,
            self._held,
            self._replies,
            self._answered,
            take=self._on_message,
            spawn=self._spawn,
        )
        self._intake = GenerationIntake(
            spec,
            runtime,
            settings,
            metrics,
            catalog,
            residency,
            blobs,
            cancelled,
            self._held,
            self._replies,
            self._decoding,
            cancel=self.cancel,
            spawn=self._spawn,
            gateway_gone=gateway_gone,
        )

    async def start(self) -> None:
        self.pulling.set()  # before its pullers: nothing to warm up, and a caller of `serve` may wait on it
        self._stepper = asyncio.create_task(self._decoding.run(), name=f"generate:{self.spec.slug}")
        self._stepper.add_done_callback(self._stepper_ended)
        in_progress = keep_alive(self._held.messages, self._settings.ack_wait_s, self._let_go_forsaken)
        self._ticker = asyncio.create_task(in_progress, name=f"in-progress:{self.spec.slug}")
        await self.puller.start()
        await self.bulk_puller.start()
        self.pulling_since = time.monotonic()

    def _stepper_ended(self, task: asyncio.Task[None]) -> None:
        """The stepping task died (a bug): stop keeping its requests and stop pulling, so JetStream
        hands what this box holds to another box after `ack_wait`, instead of it being held for ever."""
        if task.cancelled() or task.exception() is None:
            return
        log.error(
            "generation stopped stepping; its requests go back to the queue",
            extra={"model": self.spec.name},
            exc_info=task.exception(),
        )
        if self._ticker is not None:
            self._ticker.cancel()
        self.puller.halt()  # at once: a spawned stop starts later
        self.bulk_puller.halt()
        self._spawn(stop_pullers([self.puller, self.bulk_puller]))

    @property
    def held(self) -> int:
        return self._held.count

    def stats(self, window_s: float = 10.0) -> dict[str, float]:
        """As a ModelWorker's, for the heartbeat: answers/s and whole-generation p50/p99 (ms) over `window_s`
        (they were left out: `fleetbox models list` showed a busy generator idle, h62), and the decode batch."""
        # `unacked`: every request it keeps in progress, its last chunks settling and its retries too (placement counts
        # the rest of a draining box's unacked as waiting; by `held`, those read as handed back: review h229).
        held = {"held": self.held, "unacked": len(self._held.messages())}
        return {**self._answered.summary(window_s), **held, "active": self.runtime.active}

    def _room(self) -> int:
        return max(0, min(self._capacity, self._settings.worker_capacity) - self.held)

    def _bulk_room(self) -> int:
        """Batch-priority generations join only while no interactive request has arrived lately."""
        quiet = self.puller.quiet_for(BULK_IDLE_S)
        return self._room() if quiet else 0

    def cancel(self, request_id: str, *, settle: bool = True, why: CancelWhy = "gone") -> bool:
        """The gateway's client went away (or the gateway gave up on it: `why`, counted so): stop spending tokens on
        it, and settle its message. Without `settle`,
        only stop: another box answers it now (a cancel naming this box), and the message, if it is the live copy,
        must come back to be answered if that box fails; acked, JetStream removed it while the other box held it,
        and remembered, this box dropped its next delivery (review r43)."""
        if request_id not in self._held.streams:
            return False
        self._decoding.let_go(request_id)
        stream = self._held.forget(request_id)
        assert stream is not None
        if settle:
            self._metrics.dropped(self.spec.name, why)
            self._spawn(self._blobs.ack(stream.msg, stream.meta.blob))
        self.puller.poke()
        return True

    def _let_go_forsaken(self) -> None:
        """Cancel the generations held here whose gateway's box is gone from the fleet (`GatewayGone`), as a cancel of
        their clients' would: stopped at the next decode step and acked, or, being admitted, once they are
        (`GenerationIntake`). A last chunk no gateway takes is given up (`deliver_reply`). Box A generated two answers
        for a gateway SIGKILLed, then the two it had held, redelivered, in full, and sent each last chunk again every
        0.25 s, unacked in the backlog, until the deadline, 300 s (tester h190)."""
        self._forsaken.held_now(self._held.streams.keys() | self._held.preparing.keys())
        for request_id, stream in list(self._held.streams.items()):
            if self._forsaken(stream.meta):
                self._cancelled.add(request_id, why="gateway_gone")
                self.cancel(request_id, why="gateway_gone")
        for request_id, msg in list(self._held.preparing.items()):
            if self._forsaken(msg):
                self._cancelled.add(request_id, why="gateway_gone")

    def adapters_retired(self) -> None:
        """An adapter left the catalog, or was registered again on another folder: a request for it that has made no
        token yet (waiting for a decode slot) is answered 404 now, as the deletion promises (it was generated by the
        deleted adapter once a slot freed, h62), or handed back (it ran the old weights, review r60), where the box that
        takes it judges it against the registration it holds (`hold_adapter`: one its gateway resolved before is
        answered 404). One already generating finishes: its adapter stays loaded until then."""
        for request_id, stream in list(self._held.streams.items()):
            if stream.tokens:
                continue
            if self._intake.adapter_gone(stream.meta):
                self._decoding.let_go(request_id)
                self._held.forget(request_id)
                self._spawn(self._replies.fail(stream.meta, stream.msg, adapter_deleted(str(stream.meta.adapter))))
            elif stream.adapter is not None and stream.adapter.retired:
                self.hand_back(request_id)
        self.puller.poke()

    def hand_back(self, request_id: str) -> bool:
        """Its gateway lost a chunk of the answer in transit (a NATS failover): stop, and hand the request back (a
        nak) to be generated again from the start by any box, the gateway replaying what its client has. False when
        this box does not generate it (it finished, and acked it)."""
        stream = self._held.streams.get(request_id)
        if stream is None:
            return False
        if self.from_lost_queue(request_id):  # no nak brings it back: its gateway publishes it again (`Workers`)
            self.cancel(request_id, settle=False)
            return True
        if (stream.msg.metadata.num_delivered or 1) >= self._settings.max_deliver:
            # Its last delivery: handed back, it would be dead-lettered (a 422 that blames the request) where the
            # client should hear the chunk was lost (a 503 it may retry). Review r50.
            return False
        self.cancel(request_id, settle=False)
        self._spawn(stream.msg.nak())  # redelivered here before the runtime's next step, it waits for it (`parks`)
        return True

    def from_lost_queue(self, request_id: str) -> bool:
        """Whether this box generates `request_id` from a request stream made anew since (a restart of a nats-server
        without --durable): its message went with the old stream."""
        stream = self._held.streams.get(request_id)
        return stream is not None and self._queue_epoch.lost(stream.msg)

    def queue_lost(self) -> None:
        """The request stream was made anew (a nats-server restart without --durable): a generation held from the
        old one that has sent nothing yet is let go, without settling (its message is gone): its gateway publishes
        it again, and one copy is generated, not two whose later first chunk takes the answer over (review r43)."""
        for request_id, stream in list(self._held.streams.items()):
            if stream.seq == 0 and self._queue_epoch.lost(stream.msg):
                self.cancel(request_id, settle=False)

    # -- intake (`generation_intake.py`) -------------------------------------------------------------

    def _keeps_late(self, msg: Msg) -> bool:
        return self._intake.keeps_late(msg)

    def take(self, msg: Msg) -> bool:
        """A request of this model another puller of the box was given (a refusal's, as the model loaded here):
        taken in as if this worker's own pullers had been. False, not taken, while this worker drains."""
        if self._stopping:
            return False
        self._on_message(msg)
        return True

    def _on_message(self, msg: Msg) -> None:
        self._intake.on_message(msg)

    # -- stop ------------------------------------------------------------------------------------

    async def drain(self) -> None:
        """Stop pulling; let active requests finish within the grace, hand the rest back.

        Bounded by the grace and `_SETTLE_S` after it, inside the box's own bound for a worker's drain;
        whatever is cut short, what is still held (generating, or still being admitted) is handed back (nak)
        and the keep-alive stopped.
        A model the catalog no longer holds is not drained but retired (`_retire`).
        """
        if self._deleted():
            await self._retire()
            return
        grace_s = self._settings.shutdown_grace_s
        self._stopping = True
        loop = asyncio.get_running_loop()
        until = loop.time() + grace_s
        try:
            await stop_pullers([self.puller, self.bulk_puller])
            # Requests being admitted join the decode batch (and are answered here) rather than handed back.
            await self._tasks.wait(grace_s)
            try:
                async with asyncio.timeout(max(0.0, until - loop.time())):
                    await self._held.idle.wait()
            except TimeoutError:
                log.warning("generation still active at drain; handing it back", extra={"model": self.spec.name})
            await cancel_and_wait([self._stepper])
            # Last chunks being confirmed then acked: let them end, not cut them off (a cut-off final
            # answer is never acked, and another box would generate it all over again).
            await self._tasks.wait(max(0.0, until + _SETTLE_S - loop.time()))
        finally:
            await cancel_and_wait([self._stepper])
            # Admissions still running are cut off too (an adapter load that outlasted the grace): taken before
            # their cancel forgets them, and handed back with the rest so another box takes them at once. So are
            # final chunks still awaiting their gateway's confirmation (`settling`): cut off, they were neither
            # acked nor handed back, and came back after the ack wait, dead-lettered on a last delivery (review h132).
            preparing = [*self._held.preparing.values(), *self._held.settling.values()]
            await self._tasks.cancel()
            try:
                if self._held.streams:
                    await loop.run_in_executor(self._device, self.runtime.clear)
                held = [(stream.meta, stream.msg, stream.seq) for stream in self._held.streams.values()]
                held += [(None, msg, 0) for msg in [*preparing, *self._decoding.clear()]]
                self._held.streams.clear()
                for meta, msg, sent in held:
                    if msg.is_acked:  # an admission answered (an error) just before its cancel
                        continue
                    if not self._queue_epoch.lost(msg):
                        await self._hand_back(msg)
                    elif meta is not None and sent:
                        # Its stream was lost in a NATS restart: nothing would give it to another box, and the
                        # client has part of its answer (a nak hung it to its deadline: regression tester h44).
                        await self._replies.fail(meta, msg, _orphaned(self.box_id), seq=sent)
                    # Lost with nothing of it sent: its gateway published it again in the new stream.
            finally:
                await cancel_and_wait([self._ticker])

    def _deleted(self) -> bool:
        """The catalog no longer holds this model: deleted, or its name registered again on another folder."""
        current = self._catalog.get(self.spec.name)
        return current is None or not current.same_source(self.spec)

    async def _retire(self) -> None:
        """The model was deleted: answer every request held here 404 at once (the deletion drops what is left
        of them in the stream: connect.delete_model).

        Handed back, a request would wait with no consumer until its deadline, or be answered by
        whatever model is registered under the name next, which is not the model the client asked for.
        """
        self._stopping = self._intake.retired = True
        try:
            await stop_pullers([self.puller, self.bulk_puller])
            await cancel_and_wait([self._stepper])
            await asyncio.get_running_loop().run_in_executor(self._device, self.runtime.clear)
            for request_id in list(self._held.streams):
                stream = self._held.forget(request_id)
                assert stream is not None
                deleted = model_deleted(self.spec.name, "generating" if stream.tokens else "queued")
                self._spawn(self._replies.fail(stream.meta, stream.msg, deleted, seq=stream.seq))
            # Requests being admitted see `retired` and are answered the same way.
            await self._tasks.wait(self._settings.shutdown_grace_s + _SETTLE_S)
        finally:
            await self._tasks.cancel()
            await cancel_and_wait([self._ticker])

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._tasks.spawn(coro)


def _orphaned(box_id: str) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"box {box_id} stopped while generating this answer, and the request queue it came from was lost in a NATS "
        "restart, so no other box can take it over; send the request again",
        retry_after_s=1,
    )
