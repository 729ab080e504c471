"""The local batcher of one model: packs tokenised rows from many requests into device batches.

Which rows form a batch is the batching rule (`packing.next_batch`): a batch is anchored on the
oldest waiting row (so no row starves), then grown one row at a time toward whichever neighbour in
length adds the least padding, while `rows × longest row` (padding counted) stays within
`max_batch_tokens` and the row count within `max_batch_size`. Once the cost of a batch here is
known (`BatchCost`), the batch is cut where rows per second peak along that growth: past some size,
the padding a longer row brings to every row costs more than a batch's fixed cost saves (on a CPU,
soon; on a GPU, rarely). When a batch forms is decided here: at most `concurrent_batches` batches
are on the device at a time (one by default), so rows arriving meanwhile gather for the next one;
when the device is idle, a partial batch waits at most `max_wait_ms` for company (0 by default: an
idle device starts at once). Rows whose request's deadline has passed are dropped before any
compute is spent on them, the last look taken on the device thread itself.

One task owns the pending list; others only call `submit`. Every batch run also teaches `BatchCost`
what a batch costs here, so the box can tell how much more work it could answer in a given time
(`room`, reckoned in `batch_room.py`): that is what it pulls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from appliance.batch_cost import BatchCost, PaceLine
from appliance.batch_room import BatchRoom
from appliance.catalog import Batching
from appliance.envelope import BATCH
from appliance.errors import InternalError, deadline_passed
from appliance.metrics import Metrics
from appliance.packing import next_batch
from appliance.tasks import cancel_and_wait
from appliance.work import Job, WorkItem
from runtimes import Runtime

log = logging.getLogger(__name__)

# Made-up rows timed before any request (`warm_up`): words a row, alternating so the fit sees two sizes, and the most
# time spent on them (a large model on a CPU stops early and measures its pace from its first requests instead).
_WARM_UP_WORDS = (12, 40)
_WARM_UP_ROWS = 16  # at most: enough for the fit, which the pace reads at full batches
_WARM_UP_S = 2.0


class Batcher:
    """Feeds one runtime; calls `on_done(job)` once per job, with results or an error set."""

    def __init__(
        self,
        model: str,
        runtime: Runtime,
        batching: Batching,
        executor: Executor,
        metrics: Metrics,
        on_done: Callable[[Job, Exception | None], None],
        on_oom: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.model = model
        self.runtime = runtime
        self.batching = batching
        # One batch at a time runs on the box's shared device thread: rows are tokenised on arrival,
        # so a batch queued behind another would overlap nothing and only split the waiting rows.
        # Concurrent batches get threads of their own, one each, and one batch formed ahead of them:
        # a thread that finishes starts it at once instead of waiting for a busy event loop to
        # form one (measured: 5-8% more throughput with two one-thread batches on 2 cores; none
        # with a single batch slot, so that keeps no batch ahead).
        self._slots_total = max(1, batching.concurrent_batches)
        self._ahead = 1 if self._slots_total > 1 else 0
        self._own_executor = (
            ThreadPoolExecutor(self._slots_total, thread_name_prefix=f"fbx-device-{model}")
            if self._slots_total > 1
            else None
        )
        self._executor = self._own_executor or executor
        self._metrics = metrics
        self._on_done = on_done
        self._on_oom = on_oom  # frees device memory (evicts another model); True when it did
        self._pending: list[WorkItem] = []  # arrival order
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(self._slots_total + self._ahead)
        self._in_flight: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.cost = BatchCost()
        self._room = BatchRoom(self._slots_total, self.cost, lambda: self.batching, self._rows_pending)

    def room(self, within_s: float, *, for_bulk: bool = False) -> int:
        """Rows this batcher could take now and still answer within `within_s` (`BatchRoom.room`)."""
        return self._room.room(within_s, for_bulk=for_bulk)

    def room_opens_in(self, within_s: float) -> float | None:
        """Seconds until `room(within_s)` may turn positive as batches on the device run; None: only an event can."""
        return self._room.opens_in(within_s)

    def room_lasts_s(self, within_s: float) -> float | None:
        """How long rows pulled now for the next batch still make it (`BatchRoom.lasts_s`). None: no sooner limit."""
        return self._room.lasts_s(within_s)

    def pace_line(self) -> PaceLine | None:
        """The measured cost as a box's heartbeat tells gateways, None until it is trusted (`BatchRoom.pace_line`)."""
        return self._room.pace_line()

    @property
    def pending_interactive(self) -> int:
        return sum(1 for item in self._pending if item.job.meta.priority != BATCH)

    def _rows_pending(self, for_bulk: bool) -> int:
        return len(self._pending) if for_bulk else self.pending_interactive

    def submit(self, job: Job) -> None:
        now = asyncio.get_running_loop().time()
        self._pending.extend(WorkItem(job, i, row, now) for i, row in enumerate(job.rows))
        self._wake.set()

    async def warm_up(self) -> None:
        """Time a few full batches of made-up rows before any request, so the box tells gateways its pace from its
        first heartbeat: until it was measured on requests, a gateway bounded a burst by rounds of the box's batches
        alone, and a fresh box let 32 of a burst of 200 short requests in (it answers them all in half a second).
        They shape no batch and no room: this box batches as an untimed one until requests have been timed.
        Bounded by `_WARM_UP_S`; a runtime that fails on them is left to its requests."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            for index in range(BatchCost.TRUST_AFTER + 1):  # the first untimed: a first call's one-off costs
                if loop.time() - started > _WARM_UP_S:
                    return
                words = _WARM_UP_WORDS[index % 2]
                await loop.run_in_executor(self._executor, self._time_made_up_batch, words, index > 0)
        except Exception as exc:
            log.info("warm-up batches not timed", extra={"model": self.model, "error": repr(exc)})

    def _time_made_up_batch(self, words: int, timed: bool) -> None:
        (row,) = self.runtime.tokenize([" ".join(["word"] * words)])
        rows = min(_WARM_UP_ROWS, self._room.full_rows(row.length))
        predicted = getattr(self.runtime, "predicted_s", None)  # the no-op runtime's: what its options say
        if predicted is not None:
            seconds = predicted(rows, row.length)
        else:
            t0 = time.perf_counter()
            self.runtime.run([row] * rows)
            seconds = time.perf_counter() - t0
        if timed and seconds > 0:
            self.cost.observe(rows * row.length, rows, seconds, made_up=True)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"batcher:{self.model}")

    def retune(self, batching: Batching) -> None:
        """New knobs from the next batch on (a PATCH of the model), without a reload: rows waiting are packed by
        them and a wait for company is measured by them. The batch slots stay: they are this batcher's threads."""
        self.batching = replace(batching, concurrent_batches=self.batching.concurrent_batches)
        self._wake.set()

    async def drain(self) -> list[Job]:
        """Stop forming batches, finish those in flight; return the jobs never started."""
        self._closing = True
        self._wake.set()
        await cancel_and_wait([self._task])
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)
        if self._own_executor is not None:
            self._own_executor.shutdown(wait=False)
        unstarted: dict[int, Job] = {}
        for item in self._pending:
            if not item.job.done:
                unstarted[id(item.job)] = item.job
        self._pending.clear()
        return list(unstarted.values())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._slots.acquire()
            try:
                await self._wait_for_company(loop)
                batch = self._take_batch()
            except Exception as exc:
                self._slots.release()
                self._fail_pending(exc)
                continue
            except BaseException:
                self._slots.release()
                raise
            if not batch:
                self._slots.release()
                continue
            task = asyncio.create_task(self._compute(batch))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _wait_for_company(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait up to max_wait_ms after the oldest row arrived, unless a full batch is already there.

        A batch formed ahead of busy device threads waits for a full batch or a free thread, however
        long: rows arriving meanwhile join it instead of the one after.
        """
        batching = self.batching
        limit = self._company_limit(loop)
        while not self._full() and (loop.time() < limit or self._room.threads_busy()):
            if self.batching is not batching:  # retuned meanwhile: a shorter wait ends sooner
                batching, limit = self.batching, self._company_limit(loop)
                continue
            self._wake.clear()
            if self._room.threads_busy():
                await self._wake.wait()  # a row arriving or a batch ending wakes it
                continue
            try:  # not wait_for: on Python 3.11 it can swallow a cancel that meets a wake (drain would hang)
                async with asyncio.timeout(limit - loop.time()):
                    await self._wake.wait()
            except TimeoutError:
                break

    def _company_limit(self, loop: asyncio.AbstractEventLoop) -> float:
        """When (loop time) a partial batch stops waiting for company."""
        limit = self._pending[0].arrived + self.batching.max_wait_ms / 1000
        if self.batching.max_wait_ms > 0:  # never wait for company so long that a waiting row misses its deadline
            soonest = min(self._pending, key=lambda item: item.job.meta.deadline_ms)
            compute_s = self.cost.seconds(soonest.length) or 0.0
            limit = min(limit, loop.time() + (soonest.job.meta.deadline_ms - time.time() * 1000) / 1000 - compute_s)
        return limit

    def _full(self) -> bool:
        if len(self._pending) >= self.batching.max_batch_size:
            return True
        return sum(item.length for item in self._pending) >= self.batching.max_batch_tokens

    def _take_batch(self) -> list[WorkItem]:
        self._drop_expired()
        fit = self.cost.fit() if self.cost.batches >= BatchCost.TRUST_AFTER else None
        batch = next_batch(self._pending, self.batching, fit)
        chosen = {id(item) for item in batch}
        self._pending = [item for item in self._pending if id(item) not in chosen]
        return batch

    def _fail_pending(self, exc: Exception) -> None:
        """A fault in forming a batch (a bug, not a request's doing): the requests waiting are given up as failed
        tries (their worker tries them again, maybe on another box, and dead-letters one that keeps failing) and this
        batcher goes on with the next ones. Left to end the batcher's task, the fault would keep every later request of
        its model in progress until its deadline, with nothing in the logs to say why."""
        log.exception("batch not formed", extra={"model": self.model, "error": repr(exc)})
        pending, self._pending = self._pending, []
        for item in pending:
            self._finish(item.job, RuntimeError(f"the batcher could not form a batch: {exc!r}"))

    def _drop_expired(self) -> None:
        kept: list[WorkItem] = []
        for item in self._pending:
            job = item.job
            if job.done:
                continue
            if job.expired:
                self._expire(job)
                continue
            kept.append(item)
        self._pending = kept

    async def _compute(self, batch: list[WorkItem]) -> None:
        try:
            await self._run_rows(batch)
        except Exception as exc:
            # A failure past the device call (a runtime that returned the wrong number of rows, say). Nobody reads
            # this task's error: unfinished, its requests would be kept in progress until their deadlines.
            log.exception("batch not finished", extra={"model": self.model, "error": repr(exc)})
            for item in batch:
                self._finish(item.job, InternalError(f"the batch this request ran in failed: {exc}"))
        finally:
            self._slots.release()
            self._wake.set()

    async def _run_rows(self, batch: list[WorkItem], after_oom: bool = False) -> None:
        """Run a batch; out of memory: evict another model and retry, then split; else fail one request."""
        try:
            live, outputs, elapsed_ms = await self._on_device(batch)
        except Exception as exc:  # a failing batch must not take its neighbours down
            if _out_of_memory(exc) and not after_oom and self._on_oom is not None and await self._on_oom():
                log.warning("out of memory; evicted a model, retrying", extra={"model": self.model})
                await self._run_rows(batch, after_oom=True)
                return
            if len(batch) > 1:
                log.warning("batch failed; splitting", extra={"model": self.model, "error": repr(exc)})
                half = len(batch) // 2
                # At most one eviction per batch formed: its halves must not each evict another model.
                await self._run_rows(batch[:half], after_oom=True)
                await self._run_rows(batch[half:], after_oom=True)
                return
            job = batch[0].job
            log.error("input failed", extra={"model": self.model, "request_id": job.meta.id, "error": repr(exc)})
            self._finish(job, exc)
            return
        for item in batch:
            if item.job.expired and not item.job.done:
                self._expire(item.job)
        if not live:
            return
        rows = len(live)
        tokens = rows * max(item.length for item in live)
        if elapsed_ms > 0:
            self.cost.observe(tokens, rows, elapsed_ms / 1000)
        for item in live:
            if item.job.started_ms and item.job.meta.sent_ms and item.index == 0:
                self._metrics.queue_ms.labels(self.model).observe(max(0.0, item.job.started_ms - item.job.meta.sent_ms))
        self._metrics.compute_ms.labels(self.model).observe(elapsed_ms)
        self._metrics.batch_size.labels(self.model).observe(rows)
        self._metrics.batch_tokens.labels(self.model).observe(tokens)
        self._metrics.rows_computed.labels(self.model).inc(rows)
        if outputs is None or len(outputs) != rows:
            raise RuntimeError(f"the runtime returned {0 if outputs is None else len(outputs)} rows for {rows} inputs")
        for item, output in zip(live, outputs, strict=True):
            job = item.job
            if job.done:
                continue
            job.results[item.index] = output
            job.compute_ms += elapsed_ms / rows
            job.remaining -= 1
            if job.remaining == 0:
                self._finish(job, None)

    async def _on_device(self, batch: list[WorkItem]) -> tuple[list[WorkItem], np.ndarray | None, float]:
        """Run a batch on a device thread, knowing meanwhile when it should end (for `room`)."""
        key = id(batch)
        self._room.formed(key, len(batch), len(batch) * max(item.length for item in batch))
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._run_live, batch, key)
        finally:
            self._room.ended(key)

    def _run_live(self, batch: list[WorkItem], key: int) -> tuple[list[WorkItem], np.ndarray | None, float]:
        """On the device thread: the last look at deadlines before compute is spent, then the forward pass.

        Start and compute times are taken here, where the batch really starts, not where it was queued.
        """
        self._room.start(key)
        live = [item for item in batch if not item.job.done and not item.job.expired]
        if not live:
            return live, None, 0.0
        started = time.time() * 1000
        for item in live:
            if item.job.started_ms == 0.0:
                item.job.started_ms = started
        t0 = time.perf_counter()
        outputs = self.runtime.run([item.row for item in live], adapter=live[0].job.meta.adapter)
        return live, outputs, (time.perf_counter() - t0) * 1000

    def _expire(self, job: Job) -> None:
        self._metrics.expired.labels(self.model).inc()
        self._finish(job, deadline_passed(job.meta.id))

    def _finish(self, job: Job, error: Exception | None) -> None:
        if job.done:
            return
        job.done = True
        self._on_done(job, error)


def _out_of_memory(exc: Exception) -> bool:
    """torch's (CUDA) OutOfMemoryError or ONNX Runtime's allocation failure, without importing either."""
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()
