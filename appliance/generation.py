"""The worker of one generative model: requests join one decode batch, tokens stream back as made.

The rule: one stepping task per model drives `runtime.step()` on the device thread while any
request is active; a request pulled from the queue joins at the next step boundary, and each step's
text goes to the request's gateway at once as a numbered chunk (`generation_replies.py`: the last
chunk is confirmed before the ack; a request the model fails on, its prefill or a decode step that
failed for the whole batch, is retried or ends with an error chunk). Requests past their deadline,
or cancelled by their gateway, are dropped at the next boundary. A model deleted from the catalog
has nobody to hand its requests back to: they are answered 404 at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from concurrent.futures import Executor
from contextlib import suppress
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from appliance import bus
from appliance.adapter_hold import (
    NOT_HEARD_DELAY_S,
    RegistrationNotHeard,
    adapter_deleted,
    hold_adapter,
    judge_registration,
)
from appliance.adapters import AdapterHold
from appliance.blobs import Blobs
from appliance.catalog import Catalog, ModelSpec
from appliance.deadletter import DeadLetters
from appliance.delivery import (
    Cancellations,
    HandBack,
    LocalReply,
    QueueEpoch,
    another_copy,
    keep_alive,
    keeps_held,
)
from appliance.envelope import RequestMeta
from appliance.errors import (
    FleetboxError,
    GatewayTimeout,
    NotFound,
    ServiceUnavailable,
    Unprocessable,
    deadline_passed,
)
from appliance.generation_replies import GenerationReplies, Stream
from appliance.generation_request import decode_generation, prompt_ids, sampling_params
from appliance.metrics import Metrics
from appliance.puller import BULK_IDLE_S, Puller, bulk_puller, stop_pullers
from appliance.residency import Residency
from appliance.settings import Settings
from appliance.tasks import Background, cancel_and_wait
from appliance.worker import RecentAnswers
from runtimes import UnknownAdapter
from runtimes.generate import GenerateRuntime, StepOutput

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
        js: JetStreamContext,
        cancelled: Cancellations,
        local_reply: LocalReply | None = None,
        queue_epoch: QueueEpoch | None = None,
    ) -> None:
        self.box_id = box_id
        self._queue_epoch = queue_epoch or QueueEpoch()
        self._hand_back = HandBack(nc, settings.max_deliver, self._queue_epoch, ack_wait_s=settings.ack_wait_s)
        self._cancelled = cancelled  # the box's: ids whose clients went away, heard before their request came
        self._stopping = False  # draining: a reply no gateway takes is handed back instead of retried
        self._retired = False  # the model was deleted: whatever still arrives is answered 404
        self.spec = spec
        self.runtime = runtime
        self._nc = nc
        self._settings = settings
        self._metrics = metrics
        self._device = device_executor
        self._residency = residency
        self._catalog = catalog
        self._blobs = blobs
        self._streams: dict[str, Stream] = {}
        self._answered = RecentAnswers()
        self._idle = asyncio.Event()  # set whenever no stream is active, for drain
        self._idle.set()
        self._started = time.time()  # a request sent before it waited for this model's load (cold start)
        self._preparing: dict[str, Msg] = {}  # request id -> its message, while admitted (blob, adapter, prompt)
        # Ids let go (`cancel`, `hand_back`) that the runtime holds until its next step, and copies of them delivered
        # meanwhile, taken in after it: admitted at once, the runtime refused such a copy ("already generating"), a
        # 422 to a generation its gateway published again after a NATS restart (tester h85).
        self._letting_go: set[str] = set()
        self._parked: list[Msg] = []
        self.pulling = asyncio.Event()  # as a ModelWorker's: set as it starts
        self.pulling_since: float | None = None  # monotonic time its pullers started (`Box._in_use`)
        self._wake = asyncio.Event()
        self._tasks = Background(f"generate:{spec.slug}")
        self._stepper: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        # Room for the decode batch and as many again waiting to join it; the rest stays in the queue for other boxes.
        self._capacity = 2 * runtime.decode_batch
        # Read at each scrape: which box generates what (no metric said: tester h85).
        metrics.generations.labels(spec.name, "running").set_function(self._running)
        metrics.generations.labels(spec.name, "waiting").set_function(lambda: self.held - self._running())
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
        dead_lettered = metrics.dead_lettered.labels(spec.name)
        dead_letters = DeadLetters(
            box_id, nc, js, blobs, settings.max_deliver, dead_lettered, stopping=lambda: self._stopping
        )
        self._replies = GenerationReplies(
            box_id,
            nc,
            blobs,
            dead_letters,
            local_reply=local_reply,
            hand_back=self._hand_back,
            stopping=lambda: self._stopping,
            spawn=self._spawn,
            poke=self.puller.poke,
        )

    async def start(self) -> None:
        self.pulling.set()  # before its pullers: nothing to warm up, and a caller of `serve` may wait on it
        self._stepper = asyncio.create_task(self._step_forever(), name=f"generate:{self.spec.slug}")
        self._stepper.add_done_callback(self._stepper_ended)
        in_progress = keep_alive(self._held_messages, self._settings.ack_wait_s)
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
        return len(self._streams) + len(self._preparing)

    def _held_messages(self) -> list[Msg]:
        """Every request this worker holds, kept in progress: those generating, those being admitted, whose adapter
        load (one at a time per base) or prompt rendering can outlast `ack_wait` too, those whose last chunk waits
        for its gateway, and those being given another try or dead-lettered."""
        streams, replies = [stream.msg for stream in self._streams.values()], self._replies
        return [*streams, *self._preparing.values(), *replies.settling.values(), *replies.retrying.values()]

    def stats(self, window_s: float = 10.0) -> dict[str, float]:
        """As a ModelWorker's, for the heartbeat: answers/s and whole-generation p50/p99 (ms) over `window_s`
        (they were left out: `fleetbox models list` showed a busy generator idle, h62), and the decode batch."""
        return {**self._answered.summary(window_s), "held": self.held, "active": self.runtime.active}

    def _room(self) -> int:
        return max(0, min(self._capacity, self._settings.worker_capacity) - self.held)

    def _bulk_room(self) -> int:
        """Batch-priority generations join only while no interactive request has arrived lately."""
        quiet = self.puller.quiet_for(BULK_IDLE_S)
        return self._room() if quiet else 0

    def cancel(self, request_id: str, *, settle: bool = True) -> bool:
        """The gateway's client went away: stop spending tokens on it, and settle its message. Without `settle`,
        only stop: another box answers it now (a cancel naming this box), and the message, if it is the live copy,
        must come back to be answered if that box fails; acked, JetStream removed it while the other box held it,
        and remembered, this box dropped its next delivery (review r43)."""
        if request_id not in self._streams:
            return False
        self._stop_in_runtime(request_id)
        stream = self._forget(request_id)
        assert stream is not None
        if settle:
            self._metrics.cancelled.labels(self.spec.name).inc()
            self._spawn(self._blobs.ack(stream.msg, stream.meta.blob))
        self.puller.poke()
        return True

    def adapters_retired(self) -> None:
        """An adapter left the catalog, or was registered again on another folder: a request for it that has made no
        token yet (waiting for a decode slot) is answered 404 now, as the deletion promises (it was generated by the
        deleted adapter once a slot freed, h62), or handed back (it ran the old weights, review r60), where the box that
        takes it judges it against the registration it holds (`hold_adapter`: one its gateway resolved before is
        answered 404). One already generating finishes: its adapter stays loaded until then."""
        for request_id, stream in list(self._streams.items()):
            if stream.tokens:
                continue
            if self._adapter_gone(stream.meta):
                self._stop_in_runtime(request_id)
                self._forget(request_id)
                self._spawn(self._replies.fail(stream.meta, stream.msg, adapter_deleted(str(stream.meta.adapter))))
            elif stream.adapter is not None and stream.adapter.retired:
                self.hand_back(request_id)
        self.puller.poke()

    def _stop_in_runtime(self, request_id: str) -> None:
        """Have the runtime drop it at its next step; a copy delivered before then waits for it (`_stepped`)."""
        self.runtime.cancel(request_id)
        self._letting_go.add(request_id)

    def _adapter_gone(self, meta: RequestMeta) -> bool:
        adapter = self._catalog.get(meta.adapter) if meta.adapter is not None else None
        return meta.adapter is not None and (adapter is None or adapter.adapter_of != self.spec.name)

    def hand_back(self, request_id: str) -> bool:
        """Its gateway lost a chunk of the answer in transit (a NATS failover): stop, and hand the request back (a
        nak) to be generated again from the start by any box, the gateway replaying what its client has. False when
        this box does not generate it (it finished, and acked it)."""
        stream = self._streams.get(request_id)
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
        self._spawn(stream.msg.nak())  # redelivered here before the runtime's next step, it waits for it (`_parked`)
        return True

    def from_lost_queue(self, request_id: str) -> bool:
        """Whether this box generates `request_id` from a request stream made anew since (a restart of a nats-server
        without --durable): its message went with the old stream."""
        stream = self._streams.get(request_id)
        return stream is not None and self._queue_epoch.lost(stream.msg)

    def _stepped(self, let_go: set[str]) -> None:
        """A step has run, or the runtime holds nothing: the ids in `let_go` (as they were before it) are out of it,
        and copies of them delivered meanwhile are taken in."""
        self._letting_go -= let_go
        parked, self._parked = self._parked, []
        for msg in parked:
            self._on_message(msg)

    def queue_lost(self) -> None:
        """The request stream was made anew (a nats-server restart without --durable): a generation held from the
        old one that has sent nothing yet is let go, without settling (its message is gone): its gateway publishes
        it again, and one copy is generated, not two whose later first chunk takes the answer over (review r43)."""
        for request_id, stream in list(self._streams.items()):
            if stream.seq == 0 and self._queue_epoch.lost(stream.msg):
                self.cancel(request_id, settle=False)

    # -- intake ----------------------------------------------------------------------------------

    def _keeps_late(self, msg: Msg) -> bool:
        def held(request_id: str) -> bool:
            return self._held_copy(request_id) is not None

        return keeps_held(msg, held, self._on_message)

    def _held_copy(self, request_id: str) -> Msg | None:
        """The message of a request this worker holds (generating, being admitted, or its last chunk settling)."""
        if request_id in self._streams:
            return self._streams[request_id].msg
        if request_id in self._preparing:
            return self._preparing[request_id]
        return self._replies.settling.get(request_id)

    def take(self, msg: Msg) -> None:
        """A request of this model another puller of the box was given (a refusal's, as the model loaded here):
        taken in as if this worker's own pullers had been."""
        self._on_message(msg)

    def _on_message(self, msg: Msg) -> None:
        try:
            meta = RequestMeta.from_headers(msg.headers)
        except ValueError as exc:
            log.warning("malformed request message dropped", extra={"error": str(exc)})
            self._spawn(msg.term())
            return
        held = self._held_copy(meta.id)
        if held is not None:  # a redelivery of what this box generates: its keep-alive holds it
            if another_copy(held, msg):  # published again after the queue was lost: see ModelWorker._on_message
                if meta.id in self._streams:
                    self._streams[meta.id].msg = msg
                elif meta.id in self._preparing:
                    self._preparing[meta.id] = msg
                else:
                    self._replies.settling[meta.id] = msg
            return
        if meta.id in self._letting_go:  # the runtime drops its old copy at its next step: this one comes in after
            self._parked.append(msg)
            self._wake.set()
            return
        if self._cancelled.contains(meta.id):  # its client went away while it waited in the queue
            self._metrics.cancelled.labels(self.spec.name).inc()
            self._spawn(self._blobs.ack(msg, meta.blob))
            return
        if self._retired:
            self._spawn(self._replies.fail(meta, msg, self._deleted_error("queued")))
            return
        try:
            judge_registration(self._catalog, self.spec, meta, msg.metadata.num_delivered, self._settings.max_deliver)
        except RegistrationNotHeard:
            self._spawn(msg.nak(delay=NOT_HEARD_DELAY_S))
            return
        except FleetboxError as exc:
            self._spawn(self._replies.fail(meta, msg, exc))
            return
        if msg.metadata.num_delivered > 1:
            self._metrics.redelivered.labels(self.spec.name).inc()
        if meta.expired:
            self._metrics.expired.labels(self.spec.name).inc()
            self._spawn(self._replies.fail(meta, msg, deadline_passed(meta.id)))
            return
        if meta.sent_ms and meta.sent_ms < self._started * 1000:
            self._metrics.cold_start_ms.labels(self.spec.name).observe(self._started * 1000 - meta.sent_ms)
        self._preparing[meta.id] = msg
        self._spawn(self._admit(meta, msg))

    async def _admit(self, meta: RequestMeta, msg: Msg) -> None:
        loaded = None  # the adapter's load it runs with
        try:
            request = decode_generation(await self._blobs.get(meta.blob) if meta.blob else msg.data)
            # Held until the runtime has the request: from then on it keeps the adapter loaded itself.
            hold = None
            if meta.adapter is not None:
                hold = await self._hold_adapter(meta, msg)
                loaded = hold.loaded
            try:
                prompt = await asyncio.get_running_loop().run_in_executor(None, prompt_ids, self.runtime, request)
                if self._retired:
                    raise self._deleted_error("queued")
                if self._adapter_gone(meta):  # deleted while the prompt was rendered: `adapters_retired` missed it
                    raise adapter_deleted(str(meta.adapter))
                while hold is not None and hold.loaded.retired:  # registered again meanwhile: the new one it is
                    hold.release()
                    hold = await self._hold_adapter(meta, msg)
                    loaded = hold.loaded
                adapter = hold.key if hold is not None else None
                self.runtime.add(meta.id, prompt, sampling_params(self.runtime, request), adapter=adapter)
            finally:
                if hold is not None:
                    hold.release()
        except FleetboxError as exc:
            await self._replies.fail(meta, self._preparing.get(meta.id, msg), exc)
            return
        except (ValueError, UnknownAdapter) as exc:
            await self._replies.fail(meta, self._preparing.get(meta.id, msg), Unprocessable(str(exc)))
            return
        except RegistrationNotHeard:  # asked again shortly, maybe on another box (see `hold_adapter`)
            with suppress(NatsError):
                await self._preparing.get(meta.id, msg).nak(delay=NOT_HEARD_DELAY_S)
            return
        except Exception as exc:
            # Not the client's doing (its body's blob not read, a NATS hiccup): tried again, maybe elsewhere,
            # and past max_deliver dead-lettered with why, instead of waiting out ack_wait.
            log.error(
                "generation not admitted", extra={"model": self.spec.name, "request_id": meta.id, "error": repr(exc)}
            )
            await self._replies.retry_or_dead_letter(meta, self._preparing.get(meta.id, msg), exc)
            return
        finally:
            msg = self._preparing.pop(meta.id, msg)  # the copy it holds now (`_on_message` may have taken another)
        self._streams[meta.id] = Stream(meta, msg, adapter=loaded)
        self._idle.clear()
        self._wake.set()
        if self._cancelled.contains(meta.id):  # cancelled while it was being prepared
            self.cancel(meta.id)

    async def _hold_adapter(self, meta: RequestMeta, msg: Msg) -> AdapterHold:
        """The request's adapter, judged and held on this model (`hold_adapter`), at this delivery of its message."""
        return await hold_adapter(
            self._catalog, self._residency, self.spec, meta, msg.metadata.num_delivered, self._settings.max_deliver
        )

    # -- decoding --------------------------------------------------------------------------------

    async def _step_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            let_go = set(self._letting_go)  # before this step: out of the runtime once it has run
            if not self.runtime.has_work:
                self._stepped(let_go)  # the runtime holds none of them
                self._wake.clear()
                await self._wake.wait()
                continue
            self._drop_expired()
            self._residency.touch(self.spec.name)  # generating is using: not the model evicted for an idle one
            started = time.perf_counter()
            try:
                outputs = await loop.run_in_executor(self._device, self.runtime.step)
            except Exception as exc:
                log.error("decode step failed", extra={"model": self.spec.name, "error": repr(exc)})
                # The requests that ran in it (decoding, or joining) are dropped, each owed a retry or an
                # error; those waiting to join never ran: they join at the next step, no delivery spent.
                for request_id in await loop.run_in_executor(self._device, self.runtime.drop_decoding):
                    stream = self._forget(request_id)
                    if stream is not None:
                        self._replies.failed(stream, exc)
                self._stepped(let_go)  # this step dropped them from the runtime
                continue
            self._stepped(let_go)  # dropped by this step
            elapsed_ms = (time.perf_counter() - started) * 1000
            self._metrics.compute_ms.labels(self.spec.name).observe(elapsed_ms)
            self._metrics.batch_size.labels(self.spec.name).observe(len(outputs))
            self._metrics.rows_computed.labels(self.spec.name).inc(len(outputs))
            for output in outputs:
                try:
                    await self._send(output, elapsed_ms)
                except Exception as exc:  # a chunk not sent (the outbound buffer full in a reconnect, say)
                    self._not_sent(output.request_id, exc)

    def _not_sent(self, request_id: str, error: Exception) -> None:
        """A chunk that could not be sent fails its request alone; the stepping goes on for the others."""
        log.warning("chunk not sent", extra={"model": self.spec.name, "request_id": request_id, "error": repr(error)})
        self.runtime.cancel(request_id)
        stream = self._forget(request_id)
        if stream is not None:
            self._replies.failed(stream, error)

    def _drop_expired(self) -> None:
        now_ms = time.time() * 1000
        for request_id, stream in list(self._streams.items()):
            if now_ms >= stream.meta.deadline_ms:
                self.runtime.cancel(request_id)
                self._forget(request_id)
                self._metrics.expired.labels(self.spec.name).inc()
                error = deadline_passed(request_id)
                if stream.tokens:
                    error = GatewayTimeout(
                        f"request {request_id} reached its deadline after {stream.tokens} generated tokens; "
                        "raise its `timeout`, or ask for fewer tokens"
                    )
                self._spawn(self._replies.fail(stream.meta, stream.msg, error, seq=stream.seq))

    async def _send(self, output: StepOutput, step_ms: float) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return  # cancelled or expired meanwhile
        if output.error is not None:
            log.error(
                "prefill failed",
                extra={"model": self.spec.name, "request_id": output.request_id, "error": repr(output.error)},
            )
            self._forget(output.request_id)
            self._replies.failed(stream, output.error)
            return
        stream.tokens += 1
        if stream.tokens == 1 and stream.meta.sent_ms:  # its first step: queued until that step started
            started_ms = time.time() * 1000 - step_ms
            self._metrics.queue_ms.labels(self.spec.name).observe(max(0.0, started_ms - stream.meta.sent_ms))
        if not output.text_delta and not output.finished:
            return  # nothing stable to show yet (a half-made character, a possible stop string)
        if output.finished:
            self._forget(output.request_id)
        await self._replies.send(stream, output, step_ms)
        if output.finished:
            self._answered.add(stream.meta)
            self._residency.touch(self.spec.name, answered=1)  # its demand: eviction takes the least asked for

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
                    await self._idle.wait()
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
            preparing = [*self._preparing.values(), *self._replies.settling.values()]
            await self._tasks.cancel()
            try:
                if self._streams:
                    await loop.run_in_executor(self._device, self.runtime.clear)
                held = [(stream.meta, stream.msg, stream.seq) for stream in self._streams.values()]
                held += [(None, msg, 0) for msg in [*preparing, *self._parked]]
                self._streams.clear()
                self._parked.clear()
                self._letting_go.clear()
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

    def _running(self) -> int:
        return sum(1 for stream in self._streams.values() if stream.tokens)

    def _deleted(self) -> bool:
        """The catalog no longer holds this model: deleted, or its name registered again on another folder."""
        current = self._catalog.get(self.spec.name)
        return current is None or not current.same_source(self.spec)

    def _deleted_error(self, doing: str) -> NotFound:
        return NotFound(f"model {self.spec.name!r} was deleted while this request was {doing}", code="model_not_found")

    async def _retire(self) -> None:
        """The model was deleted: answer every request held here 404 at once (the deletion drops what is left
        of them in the stream: connect.delete_model).

        Handed back, a request would wait with no consumer until its deadline, or be answered by
        whatever model is registered under the name next, which is not the model the client asked for.
        """
        self._stopping = self._retired = True
        try:
            await stop_pullers([self.puller, self.bulk_puller])
            await cancel_and_wait([self._stepper])
            await asyncio.get_running_loop().run_in_executor(self._device, self.runtime.clear)
            for request_id in list(self._streams):
                stream = self._forget(request_id)
                assert stream is not None
                deleted = self._deleted_error("generating" if stream.tokens else "queued")
                self._spawn(self._replies.fail(stream.meta, stream.msg, deleted, seq=stream.seq))
            # Requests being admitted see `_retired` and are answered the same way.
            await self._tasks.wait(self._settings.shutdown_grace_s + _SETTLE_S)
        finally:
            await self._tasks.cancel()
            await cancel_and_wait([self._ticker])

    def _forget(self, request_id: str) -> Stream | None:
        stream = self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()
        return stream

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._tasks.spawn(coro)


def _orphaned(box_id: str) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"box {box_id} stopped while generating this answer, and the request queue it came from was lost in a NATS "
        "restart, so no other box can take it over; send the request again",
        retry_after_s=1,
    )
