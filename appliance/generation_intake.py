"""How a generation worker takes a request in: judged as it is delivered, then admitted to the decode batch.

The rule: a delivery is judged at once, on the event loop (a copy of a request held, one whose client went away,
one past its deadline or for a registration this model does not serve is settled without a slot); the rest is
held in `preparing` while it is admitted off it (its body's blob read, its adapter held on the model, its prompt
rendered), then joins the decode batch at the next step. An admission that fails for the client's doing is
answered; any other is tried again, maybe elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from contextlib import suppress
from typing import Any, Protocol

from nats.aio.msg import Msg
from nats.errors import Error as NatsError

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
from appliance.delivery import (
    LET_GO_WAIT_S,
    Cancellations,
    CancelWhy,
    GatewayGone,
    another_copy,
    gone_at_intake,
    keeps_held,
    never_gone,
    request_meta,
)
from appliance.envelope import RequestMeta
from appliance.errors import FleetboxError, NotFound, Unprocessable, deadline_passed
from appliance.generation_decode import DecodeLoop
from appliance.generation_held import HeldGenerations, Stream
from appliance.generation_replies import GenerationReplies
from appliance.generation_request import decode_generation, prompt_ids, sampling_params
from appliance.metrics import Metrics
from appliance.residency import Residency
from appliance.settings import Settings
from runtimes import UnknownAdapter
from runtimes.generate import GenerateRuntime

log = logging.getLogger(__name__)


class CancelGeneration(Protocol):
    """The worker's cancel (`GenerateWorker.cancel`): stop a generation and settle its message."""

    def __call__(self, request_id: str, *, why: CancelWhy = "gone") -> bool: ...


class GenerationIntake:
    """Takes in the requests delivered to one generative model's worker on this box."""

    def __init__(
        self,
        spec: ModelSpec,
        runtime: GenerateRuntime,
        settings: Settings,
        metrics: Metrics,
        catalog: Catalog,
        residency: Residency,
        blobs: Blobs,
        cancelled: Cancellations,
        held: HeldGenerations,
        replies: GenerationReplies,
        decoding: DecodeLoop,
        *,
        cancel: CancelGeneration,
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
        gateway_gone: GatewayGone = never_gone,
    ) -> None:
        self._spec = spec
        self._runtime = runtime
        self._settings = settings
        self._metrics = metrics
        self._catalog = catalog
        self._residency = residency
        self._blobs = blobs
        self._cancelled = cancelled  # the box's: ids whose clients went away, heard before their request came
        self._held = held
        self._replies = replies
        self._decoding = decoding
        self._cancel = cancel  # the worker's: a request cancelled while it was admitted
        self._spawn = spawn  # the worker's background tasks, waited for at its drain
        self._gateway_gone = gateway_gone  # its box died: nobody awaits the answer
        self.retired = False  # the model was deleted: whatever still arrives is answered 404
        self._started = time.time()  # a request sent before it waited for this model's load (cold start)

    def keeps_late(self, msg: Msg) -> bool:
        def held(request_id: str) -> bool:
            return self._held.copy_of(request_id) is not None

        return keeps_held(msg, held, self.on_message)

    def on_message(self, msg: Msg) -> None:
        """A request delivered to the worker: a copy of one it holds kept, any other judged then admitted."""
        meta = request_meta(msg, self._spawn)
        if meta is None:
            return
        held = self._held.copy_of(meta.id)
        if held is not None:  # a redelivery of what this box generates: its keep-alive holds it
            if self._cancelled.letting_go(meta):
                self._spawn(msg.nak(delay=LET_GO_WAIT_S))
            elif another_copy(held, msg):  # published again after the queue was lost: see WorkerIntake.on_message
                self._held.take_copy(meta.id, msg)
            return
        if self._decoding.parks(meta.id, msg):  # the runtime drops its old copy at its next step: this one comes after
            return
        # Its gateway's box is gone: dropped as a cancel of its client's would be (a copy of a gateway back: taken).
        self._cancelled.judge_gateway(meta.id, gone_at_intake(meta, msg, self._gateway_gone))
        if self._cancelled.contains(meta.id):  # its client went away (or its deadline passed) while it was queued
            self._metrics.dropped(self._spec.name, self._cancelled.why(meta.id))
            self._spawn(self._blobs.ack(msg, meta.blob))
            return
        if self.retired:
            self._spawn(self._replies.fail(meta, msg, model_deleted(self._spec.name, "queued")))
            return
        try:
            judge_registration(self._catalog, self._spec, meta, msg.metadata.num_delivered, self._settings.max_deliver)
        except RegistrationNotHeard:
            self._spawn(msg.nak(delay=NOT_HEARD_DELAY_S))
            return
        except FleetboxError as exc:
            self._spawn(self._replies.fail(meta, msg, exc))
            return
        if msg.metadata.num_delivered > 1:
            self._metrics.redelivered.labels(self._spec.name).inc()
        if meta.expired:
            self._metrics.expired.labels(self._spec.name).inc()
            self._spawn(self._replies.fail(meta, msg, deadline_passed(meta.id)))
            return
        if meta.sent_ms and meta.sent_ms < self._started * 1000:
            self._metrics.cold_start_ms.labels(self._spec.name).observe(self._started * 1000 - meta.sent_ms)
        self._held.preparing[meta.id] = msg
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
                prompt = await asyncio.get_running_loop().run_in_executor(None, prompt_ids, self._runtime, request)
                if self.retired:
                    raise model_deleted(self._spec.name, "queued")
                if self.adapter_gone(meta):  # deleted while the prompt was rendered: `adapters_retired` missed it
                    raise adapter_deleted(str(meta.adapter))
                while hold is not None and hold.loaded.retired:  # registered again meanwhile: the new one it is
                    hold.release()
                    hold = await self._hold_adapter(meta, msg)
                    loaded = hold.loaded
                adapter = hold.key if hold is not None else None
                self._runtime.add(meta.id, prompt, sampling_params(self._runtime, request), adapter=adapter)
            finally:
                if hold is not None:
                    hold.release()
        # A request not admitted leaves `preparing` before it is answered, tried again or dead-lettered: one still
        # there is handed back by a drain, which on its last delivery queued afresh a request already in FBX_DLQ
        # (review h141). Those tables (`settling`, `retrying`) keep it in progress meanwhile.
        except FleetboxError as exc:
            await self._replies.fail(meta, self._held.preparing.pop(meta.id, msg), exc)
            return
        except (ValueError, UnknownAdapter) as exc:
            await self._replies.fail(meta, self._held.preparing.pop(meta.id, msg), Unprocessable(str(exc)))
            return
        except RegistrationNotHeard:  # asked again shortly, maybe on another box (see `hold_adapter`)
            with suppress(NatsError):
                await self._held.preparing.pop(meta.id, msg).nak(delay=NOT_HEARD_DELAY_S)
            return
        except Exception as exc:
            # Not the client's doing (its body's blob not read, a NATS hiccup): tried again, maybe elsewhere,
            # and past max_deliver dead-lettered with why, instead of waiting out ack_wait.
            log.error(
                "generation not admitted", extra={"model": self._spec.name, "request_id": meta.id, "error": repr(exc)}
            )
            await self._replies.retry_or_dead_letter(meta, self._held.preparing.pop(meta.id, msg), exc)
            return
        finally:
            msg = self._held.preparing.pop(meta.id, msg)  # the copy it holds now (`on_message` may have taken another)
        self._held.generating(Stream(meta, msg, adapter=loaded))
        self._decoding.wake()
        if self._cancelled.still_cancelled(meta, self._gateway_gone):  # cancelled while it was being prepared
            self._cancel(meta.id, why=self._cancelled.why(meta.id))

    async def _hold_adapter(self, meta: RequestMeta, msg: Msg) -> AdapterHold:
        """The request's adapter, judged and held on this model (`hold_adapter`), at this delivery of its message."""
        return await hold_adapter(
            self._catalog, self._residency, self._spec, meta, msg.metadata.num_delivered, self._settings.max_deliver
        )

    def adapter_gone(self, meta: RequestMeta) -> bool:
        adapter = self._catalog.get(meta.adapter) if meta.adapter is not None else None
        return meta.adapter is not None and (adapter is None or adapter.adapter_of != self._spec.name)


def model_deleted(model: str, doing: str) -> NotFound:
    return NotFound(f"model {model!r} was deleted while this request was {doing}", code="model_not_found")
