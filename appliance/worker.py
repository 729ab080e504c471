"""The worker side of a box: pulls requests for the models it holds and hands them, prepared, to the batcher.

The pull rule: a box asks the shared durable consumer for exactly as many messages as it has room
for, with at most one pull request outstanding per model. Room is measured in time: the rows this
box could still answer within `hold_ms` at its measured batch cost (at least one batch once its
device is nearly free, at most `worker_capacity` requests). A fast box asks for more, a slow or stalled one for less,
and no router ever guesses its state. How an answer then leaves the box (the reply its gateway confirms first, then
the ack) is `worker_replies.py`; how a request is taken in (judged as delivered, then prepared for the batcher) is
`worker_intake.py`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from appliance import bus
from appliance.adapters import AdapterHold
from appliance.batcher import Batcher
from appliance.blobs import Blobs
from appliance.catalog import Batching, Catalog, ModelSpec
from appliance.deadletter import DeadLetters
from appliance.delivery import (
    Cancellations,
    CancelWhy,
    Forsaken,
    GatewayGone,
    HandBack,
    LocalReply,
    QueueEpoch,
    keep_alive,
    keeps_held,
    never_gone,
)
from appliance.errors import UnloadedWhileStarting
from appliance.metrics import Metrics
from appliance.puller import BULK_IDLE_S, Puller, bulk_puller, stop_pullers
from appliance.recent_answers import RecentAnswers
from appliance.residency import Residency
from appliance.settings import Settings
from appliance.tasks import Background, cancel_and_wait
from appliance.work import Job
from appliance.worker_intake import WorkerIntake
from appliance.worker_replies import WorkerReplies
from runtimes import Runtime

log = logging.getLogger(__name__)


class ModelWorker:
    """Serves one model on this box: its puller, its batcher, and the answers."""

    def __init__(
        self,
        box_id: str,
        nc: NATS,
        spec: ModelSpec,
        runtime: Runtime,
        settings: Settings,
        metrics: Metrics,
        device_executor: Executor,
        cpu_executor: Executor,
        residency: Residency,
        catalog: Catalog,
        blobs: Blobs,
        dead_letters: DeadLetters,
        cancelled: Cancellations,
        local_reply: LocalReply | None = None,
        queue_epoch: QueueEpoch | None = None,
        gateway_gone: GatewayGone = never_gone,
    ) -> None:
        self.box_id = box_id
        self.spec = spec
        self._cancelled = cancelled
        self._forsaken = Forsaken(gateway_gone, grace_s=2 * settings.heartbeat_ttl_s)
        self.runtime = runtime
        self._settings = settings
        self._metrics = metrics
        self._blobs = blobs
        self._hand_back = HandBack(nc, settings.max_deliver, queue_epoch, ack_wait_s=settings.ack_wait_s)
        self._answered = RecentAnswers()
        self._held: dict[str, Job | Msg] = {}  # request id -> its job (or message, while preparing)
        self._holds: dict[str, AdapterHold] = {}  # request id -> the adapter kept loaded for it
        self._tasks = Background(f"worker:{spec.slug}")
        self.batcher = Batcher(
            spec.name,
            runtime,
            spec.batching,
            device_executor,
            metrics,
            self._on_done,
            on_oom=lambda: residency.evict_for_oom(keep=spec.name),
        )
        hold_s = settings.hold_ms / 1000
        self.puller = Puller(
            nc,
            spec.slug,
            bus.pull_inbox(box_id, spec.slug),
            self._room,
            self._on_message,
            room_opens_in=lambda: self.batcher.room_opens_in(hold_s),
            room_lasts=lambda: self.batcher.room_lasts_s(hold_s),
            keeps=self._keeps_late,
            hand_back=self._hand_back,
        )
        self.bulk_puller = bulk_puller(
            nc, box_id, spec.slug, self._bulk_room, self._on_message, self._keeps_late, hand_back=self._hand_back
        )
        self._replies = WorkerReplies(
            box_id,
            nc,
            spec.name,
            runtime,
            blobs,
            residency,
            self._answered,
            dead_letters,
            local_reply=local_reply,
            hand_back=self._hand_back,
            stopping=lambda: self._draining,
            current=self._current,
            let_go=self._let_go,
            poke=self.puller.poke,
            spawn=self._spawn,
            gateway_gone=gateway_gone,
        )
        self._intake = WorkerIntake(
            spec,
            runtime,
            settings,
            metrics,
            cpu_executor,
            catalog,
            residency,
            blobs,
            cancelled,
            self.batcher,
            self._replies,
            self._held,
            self._holds,
            current=self._current,
            let_go=self._let_go,
            spawn=self._spawn,
            gateway_gone=gateway_gone,
        )
        self._ticker: asyncio.Task[None] | None = None
        self._draining = False
        self.pulling = asyncio.Event()  # set once warmed up and pulling: ready for this model (`/readyz`, `serve`)
        self.pulling_since: float | None = None  # monotonic time its pullers started (`Box._in_use`)
        self._starting: asyncio.Future[None] | None = None  # the start, warm-up to pulling (`drain` waits)

    async def start(self) -> None:
        """Warm up, then pull. A drain meanwhile waits for it (`_starting`): one that came while the pullers
        subscribed stopped them before they started, and the start then left them pulling on a runtime the
        eviction closed, failing every request of the model until the box restarted (tester h95)."""
        self._starting = asyncio.ensure_future(self._start())
        await self._starting

    async def _start(self) -> None:
        await self.batcher.warm_up()
        if self._draining:  # unloaded while it warmed up (an eviction, a delete): it must not start pulling
            raise UnloadedWhileStarting(f"model {self.spec.name} was unloaded while it warmed up")
        self.batcher.start()
        await self.puller.start()
        await self.bulk_puller.start()
        if self._draining:  # while its pullers subscribed: the drain stops them once this start ends
            raise UnloadedWhileStarting(f"model {self.spec.name} was unloaded while it started")
        self._ticker = asyncio.create_task(self._keep_alive(), name=f"in-progress:{self.spec.slug}")
        self.pulling.set()
        self.pulling_since = time.monotonic()
        log.info("worker pulling", extra={"model": self.spec.name, "box": self.box_id})

    def retune(self, batching: Batching) -> None:
        """The model's batching knobs changed in the catalog: its batcher (and the bulk pull) use them from now."""
        self.batcher.retune(batching)
        self.spec = replace(self.spec, batching=self.batcher.batching)
        self.puller.poke()  # its room may have changed

    async def drain(self) -> None:
        """Stop pulling, finish the batches in flight, hand unstarted requests back for redelivery.

        The requests held are kept in progress to the end: a batch in flight can outlast `ack_wait` (the device
        thread is shared with other models), and one redelivered meanwhile would be computed twice.
        """
        self._draining = True
        if self._starting is not None:  # its made-up batches end before the runtime may be closed (review r51)
            await asyncio.gather(self._starting, return_exceptions=True)
        try:
            await stop_pullers([self.puller, self.bulk_puller])
            await self._tasks.wait()
            for job in await self.batcher.drain():
                self._let_go(job.meta.id)
                await self._hand_back(job.handle)
            await self._tasks.wait()
        finally:
            await cancel_and_wait([self._ticker])

    @property
    def held(self) -> int:
        return len(self._held)

    def stats(self, window_s: float = 10.0) -> dict[str, float]:
        """Requests/s and end-to-end p50/p99 (ms) over the last `window_s`, for the heartbeat."""
        batching = self.batcher.batching  # as this box runs it: its profile's, or a retune's
        # What a gateway's burst bound reads: a round of this box's batches, and the pace it works at.
        line = self.batcher.pace_line()
        now = None if line is None else line.at(line.row_tokens)  # at the rows it ran lately
        pace = {
            "round_tokens": batching.max_batch_tokens * batching.concurrent_batches,
            "round_rows": batching.max_batch_size * batching.concurrent_batches,
            "tokens_per_s": None if now is None else round(now[0], 1),
            "rows_per_s": None if now is None else round(now[1], 1),
            "batch_cost": None if line is None else line.to_json(),  # the pace at any row length (`PaceLine`)
        }
        held = {"held": len(self._held), "unacked": len(self._held)}  # each one it holds is kept in progress
        return {**self._answered.summary(window_s), **held, **pace}

    def _room(self, *, for_bulk: bool = False) -> int:
        # Rows this box could still answer within `hold_ms` at its measured batch cost; a request still
        # being prepared is already spoken for.
        rows = self.batcher.room(self._settings.hold_ms / 1000, for_bulk=for_bulk)
        per_request = max(1.0, self._intake.rows_per_request)
        rows -= per_request * sum(1 for held in self._held.values() if not isinstance(held, Job))
        requests = math.ceil(rows / per_request) if rows > 0 else 0
        return max(0, min(self._settings.worker_capacity - len(self._held), requests))

    def _bulk_room(self) -> int:
        """Batch-priority work is pulled only while no interactive work waits, a batch at a time."""
        quiet = self.puller.quiet_for(BULK_IDLE_S)
        if not quiet or self.batcher.pending_interactive > 0:
            return 0
        return min(self._room(for_bulk=True), self.spec.batching.max_batch_size)

    def cancel(self, request_id: str, *, settle: bool = True, why: CancelWhy = "gone") -> None:
        """Its client went away (or its gateway gave up on it: `why`): drop it if this box holds it; the device thread
        skips it unless already running. Without `settle` its message is left for JetStream to give again (see
        `GenerateWorker.cancel`)."""
        held = self._held.get(request_id)
        if isinstance(held, Job) and not held.done:
            held.done = True  # the batcher, and the device thread's last look, skip done jobs
            self._let_go(request_id)
            if settle:
                if not held.started_ms:  # counted as dropped before compute: one on the device is computed all the same
                    self._metrics.dropped(self.spec.name, why)
                self._spawn(self._blobs.ack(held.handle, held.meta.blob))
            self.puller.poke()

    def _keeps_late(self, msg: Msg) -> bool:
        return keeps_held(msg, self._held.__contains__, self._on_message)

    def take(self, msg: Msg) -> bool:
        """A request of this model another puller of the box was given (a refusal's, as the model loaded here):
        taken in as if this worker's own pullers had been. False, not taken, while this worker drains: its batcher
        may have stopped, and the request would wait out `ack_wait` unanswered (review h141)."""
        if self._draining:
            return False
        self._on_message(msg)
        return True

    def _on_message(self, msg: Msg) -> None:
        self._intake.on_message(msg)

    def _current(self, request_id: str, msg: Msg) -> Msg:
        """The message this box holds for a request now: `msg`, or a copy its intake (`on_message`) took instead."""
        held = self._held.get(request_id)
        if isinstance(held, Job):
            return held.handle
        return held if held is not None else msg

    def _on_done(self, job: Job, error: Exception | None) -> None:
        self._spawn(self._replies.answer(job, error))

    async def _keep_alive(self) -> None:
        await keep_alive(
            lambda: [held.handle if isinstance(held, Job) else held for held in self._held.values()],
            self._settings.ack_wait_s,
            self._let_go_forsaken,
        )

    def _let_go_forsaken(self) -> None:
        """Cancel the requests held here whose gateway's box is gone from the fleet (`GatewayGone`), as a cancel of
        their clients' would: one not computed yet is dropped and acked (one being prepared, once it is:
        `WorkerIntake._submit`); a batch on the device finishes, and its reply is given up (`deliver_reply`)."""
        self._forsaken.held_now(self._held)
        for request_id, held in list(self._held.items()):
            if isinstance(held, Job):
                gone = not held.done and self._forsaken(held.meta)
            else:
                gone = self._forsaken(held)
            if gone:
                self._cancelled.add(request_id, why="gateway_gone")
                self.cancel(request_id, why="gateway_gone")

    def _let_go(self, request_id: str) -> None:
        """The request is no longer this box's: forget it, and let its adapter be unloaded again."""
        self._held.pop(request_id, None)
        hold = self._holds.pop(request_id, None)
        if hold is not None:
            hold.release()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._tasks.spawn(coro)
