"""The requests a gateway awaits, and the replies that answer them (`Waiters`).

The one idea: a request's waiter is resolved by the first reply carrying its id; any later reply for the same id
(a redelivery computed twice) is counted and dropped, so the client gets exactly one answer. A streamed answer's
chunks are stitched into one by its `StreamWaiter` (`replies.py`); a chunk lost while its box still generates the
answer has that box asked to hand the request back, to start the answer over. What the box will not answer (it is
stopping, or the request's model was deleted) is answered here, and the boxes are told to stop computing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from appliance.blobs import Blobs
from appliance.delivery import CancelWhy
from appliance.envelope import ReplyMeta
from appliance.errors import FleetboxError
from appliance.gateway.admission import Admission
from appliance.gateway.model_queue import ModelQueue
from appliance.gateway.publish import Publisher
from appliance.gateway.replies import Reply, StreamWaiter
from appliance.metrics import Metrics
from appliance.tasks import Background

_DELETED_GRACE_S = 2.0  # after a model's deletion, what its boxes were computing then is answered within this
_RESTART_WAIT_S = 20.0  # for a generation handed back after a lost chunk to send its answer's first chunk again


class Waiters:
    """The one owner of a gateway's reply waiters: a call's future (with its model's queue), a generation's
    `StreamWaiter`. It tells `Admission` of every answer, and the `Resender` what it keeps to publish again: a
    handed-back generation whose message went with a lost queue is published again (`republish`, its `again`), a
    request no longer awaited is let go (`forget`)."""

    def __init__(
        self,
        box_id: str,
        metrics: Metrics,
        blobs: Blobs,
        admission: Admission,
        publisher: Publisher,
        *,
        republish: Callable[[str], None],
        forget: Callable[[str], None],
    ) -> None:
        self._box_id = box_id
        self._metrics = metrics
        self._blobs = blobs
        self._admission = admission
        self._publisher = publisher
        self._republish = republish
        self._forget = forget
        self._calls: dict[str, tuple[asyncio.Future[Reply], ModelQueue]] = {}
        self._streams: dict[str, StreamWaiter] = {}
        self._none_awaited = asyncio.Event()  # set whenever no request is awaited (a stopping box waits for it)
        self._none_awaited.set()
        # Cancels sent for requests answered without their box, and asks to hand a generation back (`_start_over`).
        self._cancels = Background("cancels sent")
        self._dropped_blobs = Background("dropped reply blobs")  # deletes of the bodies of replies dropped

    @property
    def waiting(self) -> int:
        return len(self._calls) + len(self._streams)

    async def wait_answered(self, timeout_s: float) -> None:
        """Until every request awaited is answered, or `timeout_s` (a stopping box's grace)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._none_awaited.wait()

    def _settle(self) -> None:
        if not self.waiting:
            self._none_awaited.set()

    async def abandon(self, error: FleetboxError) -> None:
        """Answer every request still awaited with `error` and cancel it fleet-wide (`Dispatcher.abandon`)."""
        # Every client is answered before any cancel is sent: a publish can wait on a NATS that hangs.
        awaited = [*self._calls, *self._streams]
        for future, _queue in self._calls.values():
            if not future.done():
                future.set_exception(error)
        for request_id, stream in self._streams.items():
            stream.queue.put_nowait(self._error_reply(request_id, error))
        for request_id in awaited:  # answered here, not gone: counted as neither a client gone nor expired (h148)
            await self._publisher.cancel(request_id, why="abandoned")

    def abandon_model(self, model: str, error: FleetboxError) -> None:
        """A model was just deleted from the catalog: what this gateway awaits for it and is not answered within
        `_DELETED_GRACE_S` (a batch running when it was deleted is) gets `error`, and its boxes a cancel. The
        deletion dropped its queue, so no box would answer the rest before their deadline."""
        calls = [request_id for queue in self._admission.forget(model) for request_id in queue.waiting]
        streams = {request_id: s.next_seq for request_id, s in self._streams.items() if s.model == model}
        if calls or streams:
            asyncio.get_running_loop().call_later(_DELETED_GRACE_S, self._answer_deleted, calls, streams, error)

    def _answer_deleted(self, calls: list[str], streams: dict[str, int], error: FleetboxError) -> None:
        """The end of `abandon_model`'s grace: calls still awaited, and streams no chunk reached since, answered."""
        for request_id in calls:
            waiter = self._calls.get(request_id)
            if waiter is not None and not waiter[0].done():
                waiter[0].set_exception(error)
                self._cancel_soon(request_id, why="abandoned")
        for request_id, next_seq in streams.items():
            stream = self._streams.get(request_id)
            if stream is not None and stream.next_seq == next_seq:
                stream.queue.put_nowait(self._error_reply(request_id, error))
                self._cancel_soon(request_id, why="abandoned")

    def _error_reply(self, request_id: str, error: FleetboxError) -> Reply:
        """A final reply this gateway makes up for a stream its box will not answer."""
        return Reply(ReplyMeta.for_error(request_id, error, self._box_id), error.to_json(), error=error)

    def _cancel_soon(self, request_id: str, box: str | None = None, *, why: CancelWhy = "gone") -> None:
        self._cancels.spawn(self._publisher.cancel(request_id, box, why=why))

    async def _start_over(self, request_id: str, box: str, lost: Reply) -> None:
        """A chunk of a streamed answer was lost in transit while `box` still generates it: the box is asked to hand
        the request back, and whichever box pulls it starts the answer over (`StreamWaiter.stitch`); where it cannot
        (it finished meanwhile, or is gone), the client is told the chunk was lost."""
        restarts = stream.restarts if (stream := self._streams.get(request_id)) is not None else 0
        handed_back, publish_again = await self._publisher.hand_back(request_id, box)
        if stream is None or self._streams.get(request_id) is not stream:
            return  # answered meanwhile
        if not handed_back:
            if stream.broken and stream.box == box:
                stream.queue.put_nowait(lost)
            return
        if publish_again:  # its message went with a lost queue
            self._republish(request_id)
        # The answer must now start over; if no chunk 0 comes (lost too, in the same failover), the client is told.
        loop = asyncio.get_running_loop()
        loop.call_later(_RESTART_WAIT_S, self._restart_overdue, request_id, stream, restarts, lost)

    def _restart_overdue(self, request_id: str, stream: StreamWaiter, restarts: int, lost: Reply) -> None:
        """A generation handed back after a lost chunk has not started over within `_RESTART_WAIT_S`: its new first
        chunk was lost as well, or no box could take it. Waiting on, its client had a 504 at its deadline while a box
        generated the answer for nobody (review r50): it gets the chunk's loss now, and the boxes a cancel."""
        if self._streams.get(request_id) is stream and stream.broken and stream.restarts == restarts:
            stream.queue.put_nowait(lost)
            self._cancel_soon(request_id, why="abandoned")

    @contextlib.contextmanager
    def awaiting(
        self,
        request_id: str,
        waiter: tuple[asyncio.Future[Reply], ModelQueue] | StreamWaiter,
        queue: ModelQueue,
        weight: int,
        timeout_s: float,
        rows: int = 1,
    ) -> Iterator[None]:
        """Count a request (of `rows` inputs) as awaited (by its model's queue, and by a stopping box) while the
        block runs: a call by its future, a generation by its `StreamWaiter`."""
        table: dict[str, Any] = self._streams if isinstance(waiter, StreamWaiter) else self._calls
        table[request_id] = waiter
        self._none_awaited.clear()
        now = time.monotonic()
        queue.add(request_id, now, weight, deadline=now + timeout_s, rows=rows)
        try:
            yield
        finally:
            table.pop(request_id, None)
            self._forget(request_id)
            queue.remove(request_id, time.monotonic(), answered=False)
            self._settle()

    def awaits(self, request_id: str) -> bool:
        return request_id in self._calls or request_id in self._streams

    def unstarted(self, request_id: str) -> bool:
        """Awaited and not begun: a call not answered, a generation before its first chunk."""
        waiter, stream = self._calls.get(request_id), self._streams.get(request_id)
        return not (waiter is not None and waiter[0].done()) and not (stream is not None and stream.box is not None)

    def heard_at(self, request_id: str) -> float | None:
        """When a begun generation's answer last came in; None for a call, or an answer whole or not begun."""
        stream = self._streams.get(request_id)
        return None if stream is None or stream.final_at is not None else stream.last_at

    def fail(self, request_id: str, error: FleetboxError) -> None:
        """A request that could not be queued again: its client is told, unless it has an answer or a chunk."""
        waiter, stream = self._calls.get(request_id), self._streams.get(request_id)
        if waiter is not None and not waiter[0].done():
            waiter[0].set_exception(error)
        elif stream is not None and stream.box is None:
            stream.queue.put_nowait(self._error_reply(request_id, error))

    def take(self, meta: ReplyMeta, body: bytes) -> None:
        """A reply for this gateway: from NATS, or handed over in-process by a worker of the same box."""
        stream = self._streams.get(meta.id)
        if stream is not None:
            stitched = stream.stitch(meta, body)
            if stitched.replaced is not None:
                self._cancel_soon(meta.id, stitched.replaced)
            if stitched.late:
                self._metrics.duplicate_replies.inc()
            if stitched.lost is not None:
                self._cancels.spawn(self._start_over(meta.id, meta.box, stitched.lost))
            if stitched.reply is not None:
                if stitched.reply.meta.final:
                    self._admission.answered(stream.final_at or time.monotonic())
                stream.queue.put_nowait(stitched.reply)
            return
        waiter = self._calls.get(meta.id)
        if waiter is None or waiter[0].done():
            self._metrics.duplicate_replies.inc()
            if meta.blob:  # the body of an answer nobody reads (each box puts its own): not left to the bucket's TTL
                self._dropped_blobs.spawn(self._blobs.delete(meta.blob))
            return
        future, queue = waiter
        now = time.monotonic()
        self._admission.answered(now)
        queue.remove(meta.id, now, answered=True)
        future.set_result(Reply(meta, body))
