"""How a model worker takes a request in: judged as it is delivered, then prepared for the batcher.

The rule: a delivery is judged at once, on the event loop (a copy of a request held takes its place; one whose client
went away, or whose gateway's box is gone, is dropped; one past its deadline, for a registration or a task this model
does not serve, or for a LoRA base's untrained head, is answered); the rest is held while it is prepared (its body's
blob read, its adapter held on the model, its body tokenised: on the loop up to 16 KiB, in a CPU thread above) and
submitted to the batcher as a `Job`. A preparation that fails for the client's doing is answered; any other is tried
again, maybe elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any

from nats.aio.msg import Msg

from appliance.adapter_hold import NOT_HEARD_DELAY_S, RegistrationNotHeard, hold_adapter, judge_registration
from appliance.adapters import AdapterHold
from appliance.batcher import Batcher
from appliance.blobs import Blobs
from appliance.catalog import Catalog, ModelSpec
from appliance.delivery import (
    LET_GO_WAIT_S,
    Cancellations,
    GatewayGone,
    another_copy,
    gone_at_intake,
    never_gone,
    request_meta,
)
from appliance.envelope import RequestMeta
from appliance.errors import FleetboxError, Unprocessable, deadline_passed
from appliance.jobs import TaskJobs, jobs_for
from appliance.metrics import Metrics
from appliance.residency import Residency
from appliance.settings import Settings
from appliance.work import Job
from appliance.worker_replies import WorkerReplies
from runtimes import Runtime

log = logging.getLogger(__name__)

_BIG_BODY = 16 * 1024  # tokenise bodies above this off the event loop


class WorkerIntake:
    """Takes in the requests delivered to one model's worker on this box (`ModelWorker`), up to its batcher."""

    def __init__(
        self,
        spec: ModelSpec,
        runtime: Runtime,
        settings: Settings,
        metrics: Metrics,
        cpu_executor: Executor,
        catalog: Catalog,
        residency: Residency,
        blobs: Blobs,
        cancelled: Cancellations,
        batcher: Batcher,
        replies: WorkerReplies,
        held: dict[str, Job | Msg],
        holds: dict[str, AdapterHold],
        *,
        current: Callable[[str, Msg], Msg],
        let_go: Callable[[str], None],
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
        gateway_gone: GatewayGone = never_gone,
    ) -> None:
        self._spec = spec  # its name, task and registration (a retune changes only its batching: not read here)
        self._runtime = runtime
        self._settings = settings
        self._metrics = metrics
        self._cpu_executor = cpu_executor
        self._catalog = catalog
        self._residency = residency
        self._blobs = blobs
        self._cancelled = cancelled  # the box's: ids whose clients went away, heard before their request came
        self._batcher = batcher
        self._replies = replies
        self._held = held  # the worker's: request id -> its job (or message, while preparing)
        self._holds = holds  # the worker's: request id -> the adapter kept loaded for it
        self._current = current  # the message the worker holds for a request now (a copy may have taken its place)
        self._let_go = let_go  # the request is no longer the worker's
        self._spawn = spawn  # the worker's background tasks, waited for at its drain
        self._gateway_gone = gateway_gone  # its requests are cancelled: nobody awaits their answers (tester h190)
        self._started = time.time()  # a request sent before it waited for this model's load (cold start)
        self.rows_per_request = 1.0  # EWMA of inputs per request, to turn rows of room into requests

    def on_message(self, msg: Msg) -> None:
        """A request delivered to the worker: a copy of one it holds kept, any other judged then prepared."""
        meta = request_meta(msg, self._spawn)
        if meta is None:
            return
        held = self._held.get(meta.id)
        if held is not None:  # a redelivery of something this box is already working on: its keep-alive holds it
            if self._cancelled.letting_go(meta):
                self._spawn(msg.nak(delay=LET_GO_WAIT_S))
            elif another_copy(held.handle if isinstance(held, Job) else held, msg):
                # The copy its gateway published again when the queue was lost (made anew): the one in hand is in a
                # stream that is gone, so this box holds the new one instead, keeps it alive and acks it when it
                # answers. Ignored, it came back after each ack_wait_s and was dead-lettered while its answer was
                # made (review r41); acked at once, a nak or a crash of this box had nothing left to redeliver (r42).
                if isinstance(held, Job):
                    held.handle = msg
                else:
                    self._held[meta.id] = msg
            return
        # Its gateway's box is gone: dropped as a cancel of its client's would be (a copy of a gateway back: taken).
        self._cancelled.judge_gateway(meta.id, gone_at_intake(meta, msg, self._gateway_gone))
        if self._cancelled.contains(meta.id):
            self._metrics.dropped(self._spec.name, self._cancelled.why(meta.id))
            self._spawn(self._blobs.ack(msg, meta.blob))
            return
        if msg.metadata.num_delivered > 1:
            self._metrics.redelivered.labels(self._spec.name).inc()
        self._held[meta.id] = msg
        if meta.expired:
            self._metrics.expired.labels(self._spec.name).inc()
            self._spawn(self._replies.fail(meta, msg, deadline_passed(meta.id)))
            return
        try:
            judge_registration(self._catalog, self._spec, meta, msg.metadata.num_delivered, self._settings.max_deliver)
        except RegistrationNotHeard:
            self._spawn(self._replies.ask_again(meta, msg, NOT_HEARD_DELAY_S))
            return
        except FleetboxError as exc:
            self._spawn(self._replies.fail(meta, msg, exc))
            return
        jobs = jobs_for(meta.task)
        if jobs is None or meta.task != self._spec.task.value:
            error = Unprocessable(
                f"model {self._spec.name} serves {self._spec.task}, not {meta.task}", code="wrong_task"
            )
            self._spawn(self._replies.fail(meta, msg, error))
            return
        untrained = self._runtime.info.untrained_head
        if meta.adapter is None and untrained:  # a LoRA base: its own head is random
            self._spawn(self._replies.fail(meta, msg, _untrained_head(self._spec.name, untrained)))
            return
        if meta.sent_ms and meta.sent_ms < self._started * 1000:
            self._metrics.cold_start_ms.labels(self._spec.name).observe(self._started * 1000 - meta.sent_ms)
        if meta.adapter is not None or meta.blob is not None:
            self._spawn(self._prepare_async(meta, msg, jobs))
        elif len(msg.data) > _BIG_BODY:
            self._spawn(self._prepare_off_loop(meta, msg, jobs, msg.data))
        else:
            self._prepare(meta, msg, jobs)

    async def _prepare_async(self, meta: RequestMeta, msg: Msg, jobs: TaskJobs) -> None:
        """Fetch an offloaded body and load the request's LoRA adapter (once), then prepare as usual."""
        try:
            body = await self._blobs.get(meta.blob) if meta.blob else msg.data
            if meta.adapter is not None:
                hold = await hold_adapter(
                    self._catalog,
                    self._residency,
                    self._spec,
                    meta,
                    msg.metadata.num_delivered,
                    self._settings.max_deliver,
                )
                self._holds[meta.id] = hold
                meta = replace(meta, adapter=hold.key)  # the batch runs it under its name in the runtime
        except Exception as exc:
            await self._not_prepared(meta, msg, exc)
            return
        await self._prepare_off_loop(meta, msg, jobs, body)

    def _prepare(self, meta: RequestMeta, msg: Msg, jobs: TaskJobs) -> None:
        try:
            rows, params = jobs.prepare(msg.data, self._runtime)
        except Exception as exc:
            self._spawn(self._not_prepared(meta, msg, exc))
            return
        self._submit(meta, msg, rows, params)

    async def _prepare_off_loop(self, meta: RequestMeta, msg: Msg, jobs: TaskJobs, body: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            rows, params = await loop.run_in_executor(self._cpu_executor, jobs.prepare, body, self._runtime)
        except Exception as exc:
            await self._not_prepared(meta, msg, exc)
            return
        self._submit(meta, msg, rows, params)

    async def _not_prepared(self, meta: RequestMeta, msg: Msg, error: Exception) -> None:
        """A request that could not be made ready: the client's error is answered; any other is retried.

        Anything else (its body's blob not fetched, a NATS hiccup, a bug) must not leave the request
        held: a held request is kept in progress, so JetStream would never hand it to anyone again.
        """
        if isinstance(error, FleetboxError):
            await self._replies.fail(meta, msg, error)
            return
        if isinstance(error, RegistrationNotHeard):
            await self._replies.ask_again(meta, msg, NOT_HEARD_DELAY_S)
            return
        log.error("request not prepared", extra={"model": self._spec.name, "request_id": meta.id, "error": repr(error)})
        await self._replies.retry_or_dead_letter(meta, msg, error)

    def _submit(self, meta: RequestMeta, msg: Msg, rows: list, params: object) -> None:
        msg = self._current(meta.id, msg)
        self.rows_per_request = 0.9 * self.rows_per_request + 0.1 * len(rows)
        if self._cancelled.still_cancelled(meta, self._gateway_gone):  # cancelled while its body was being prepared
            self._let_go(meta.id)
            self._metrics.dropped(self._spec.name, self._cancelled.why(meta.id))  # as a cancel of one held or queued is
            self._spawn(self._blobs.ack(msg, meta.blob))
            return
        job = Job(meta=meta, rows=rows, params=params, handle=msg)
        self._held[meta.id] = job
        self._batcher.submit(job)


def _untrained_head(model: str, weights: tuple[str, ...]) -> Unprocessable:
    """The answer for a LoRA base called without an adapter: its folder holds no trained head (random logits)."""
    return Unprocessable(
        f"model {model} has no trained head (its folder lacks {', '.join(weights)}): call it through one of its LoRA "
        "adapters, which bring their own",
        code="untrained_head",
    )
