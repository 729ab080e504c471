"""The batching rule, checked on the real batcher with the no-op runtime (the policy is under test)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

import appliance.batcher as batcher_module
from appliance.batcher import Batcher
from appliance.catalog import Batching
from appliance.envelope import BATCH, RequestMeta
from appliance.metrics import Metrics
from appliance.packing import next_batch
from appliance.work import Job, WorkItem
from runtimes import ModelSource, Task, Tokenized
from runtimes.noop import NoopRuntime


class RecordingRuntime(NoopRuntime):
    """The no-op runtime, remembering each batch's row lengths."""

    def __init__(self) -> None:
        super().__init__(ModelSource(path=".", task=Task.EMBED))  # type: ignore[arg-type]
        self.batches: list[list[int]] = []
        self.adapters: list[str | None] = []

    def run(self, batch, adapter=None):
        self.batches.append([row.length for row in batch])
        self.adapters.append(adapter)
        return super().run(batch)


_ids = itertools.count()


def job(lengths: list[int], timeout_s: float = 30.0, adapter: str | None = None) -> Job:
    now = int(time.time() * 1000)
    deadline = now + int(timeout_s * 1000)
    meta = RequestMeta(id=f"job-{next(_ids)}", task="embed", model="m", reply="r", deadline_ms=deadline, sent_ms=now,
                       adapter=adapter)  # fmt: skip
    return Job(meta=meta, rows=[Tokenized(ids=np.ones(n, dtype=np.int64)) for n in lengths])


async def run_batcher(jobs: list[Job], batching: Batching) -> tuple[RecordingRuntime, list[tuple[Job, object]]]:
    runtime = RecordingRuntime()
    done: list[tuple[Job, object]] = []
    finished = asyncio.Event()

    def on_done(j: Job, error: object) -> None:
        done.append((j, error))
        if len(done) == len(jobs):
            finished.set()

    with ThreadPoolExecutor(1) as executor:
        batcher = Batcher("m", runtime, batching, executor, Metrics(), on_done)
        for j in jobs:
            batcher.submit(j)
        batcher.start()
        await asyncio.wait_for(finished.wait(), 10)
        await batcher.drain()
    return runtime, done


async def test_batches_respect_the_token_budget_with_padding_counted() -> None:
    lengths = [5, 50, 7, 48, 6, 52, 8, 49, 9, 51]
    runtime, done = await run_batcher([job(lengths)], Batching(max_batch_tokens=160, max_batch_size=64, max_wait_ms=1))
    assert sorted(n for batch in runtime.batches for n in batch) == sorted(lengths)
    for batch in runtime.batches:
        assert len(batch) * max(batch) <= 160
    assert done[0][1] is None and all(r is not None for r in done[0][0].results)


async def test_similar_lengths_are_batched_together() -> None:
    lengths = [5, 50, 7, 48, 6, 52, 8, 49]
    runtime, _ = await run_batcher([job(lengths)], Batching(max_batch_tokens=208, max_batch_size=4, max_wait_ms=1))
    assert sorted(sorted(b) for b in runtime.batches) == [[5, 6, 7, 8], [48, 49, 50, 52]]


async def test_batch_size_is_capped() -> None:
    runtime, _ = await run_batcher([job([3] * 10)], Batching(max_batch_tokens=10_000, max_batch_size=4, max_wait_ms=1))
    assert max(len(b) for b in runtime.batches) == 4
    assert sum(len(b) for b in runtime.batches) == 10


async def test_results_come_back_in_input_order() -> None:
    lengths = [30, 3, 20, 10]
    the_job = job(lengths)
    runtime, _ = await run_batcher([the_job], Batching(max_batch_tokens=10_000, max_batch_size=64, max_wait_ms=1))
    assert len(runtime.batches) == 1 and runtime.batches[0] == sorted(lengths)  # sorted for the device...
    assert all(result is not None for result in the_job.results)  # ...scattered back per input


async def test_expired_job_is_answered_with_504_and_never_computed() -> None:
    alive, dead = job([4, 4]), job([4], timeout_s=-1)
    runtime, done = await run_batcher([alive, dead], Batching(max_batch_tokens=1000, max_batch_size=8, max_wait_ms=1))
    errors = {j.meta.id: error for j, error in done}
    assert errors[alive.meta.id] is None
    assert getattr(errors[dead.meta.id], "status", None) == 504
    assert sum(len(b) for b in runtime.batches) == 2


async def test_a_lone_row_never_waits_for_company_past_its_deadline() -> None:
    """A long max_wait_ms must not outlive a request: the batch starts at the row's deadline at the latest."""
    started = time.monotonic()
    _, done = await run_batcher([job([5], timeout_s=0.3)], Batching(16384, 64, max_wait_ms=10_000))
    waited = time.monotonic() - started
    assert len(done) == 1
    assert waited < 5.0, waited  # waiting out max_wait_ms would take 10 s


async def test_a_batch_holds_one_adapter() -> None:
    jobs = [job([4, 4], adapter="a"), job([4], adapter=None), job([4, 4], adapter="b"), job([4], adapter="a")]
    runtime, done = await run_batcher(jobs, Batching(max_batch_tokens=1000, max_batch_size=64, max_wait_ms=1))
    assert all(error is None for _, error in done)
    assert sorted(map(str, runtime.adapters)) == ["None", "a", "b"]
    sizes = dict(zip(map(str, runtime.adapters), map(len, runtime.batches), strict=True))
    assert sizes == {"a": 3, "None": 1, "b": 2}


def taught(fixed_s: float, per_token_s: float) -> Batcher:
    """A batcher whose cost model has seen batches that cost `fixed_s + per_token_s × padded tokens`."""
    batcher = Batcher("m", RecordingRuntime(), Batching(max_batch_tokens=10_000, max_batch_size=8, max_wait_ms=0),
                      ThreadPoolExecutor(1), Metrics(), lambda job, error: None)  # fmt: skip
    for tokens in (64, 128, 256, 512, 64, 128, 256, 512):
        batcher.cost.observe(tokens, 8, fixed_s + per_token_s * tokens)
    return batcher


async def test_batch_stops_growing_where_padding_costs_more_than_a_batch_saves() -> None:
    """Four short rows and four long ones: where padded tokens are what costs, they run apart."""
    rows = [5, 5, 5, 5, 60, 60, 60, 60]
    padding_bound = taught(fixed_s=0.0005, per_token_s=0.0001)
    padding_bound.submit(job(rows))
    assert sorted(item.length for item in padding_bound._take_batch()) == [5, 5, 5, 5]
    launch_bound = taught(fixed_s=0.05, per_token_s=0.000001)  # a GPU-like fixed cost: one batch is best
    launch_bound.submit(job(rows))
    assert sorted(item.length for item in launch_bound._take_batch()) == rows


def waiting(*jobs: Job) -> list[WorkItem]:
    """The rows of `jobs` as a batcher holds them, in arrival order."""
    return [WorkItem(j, i, row, float(n)) for n, j in enumerate(jobs) for i, row in enumerate(j.rows)]


def test_the_next_batch_is_anchored_on_the_oldest_interactive_row_and_holds_its_adapter_only() -> None:
    bulk = job([4, 4])
    bulk.meta = replace(bulk.meta, priority=BATCH)
    interactive, other_adapter = job([4, 5], adapter="a"), job([4], adapter="b")
    batch = next_batch(waiting(bulk, interactive, other_adapter), Batching(1000, 64, 0.0), None)
    assert [item.job for item in batch] == [interactive, interactive]


def test_the_next_batch_grows_toward_the_least_padding_within_the_token_budget() -> None:
    pending = waiting(job([6, 50, 5, 7, 30]))
    batch = next_batch(pending, Batching(max_batch_tokens=40, max_batch_size=64, max_wait_ms=0.0), None)
    assert [item.length for item in batch] == [5, 6, 7]  # 4 rows of 30 would pass the 40-token budget
    assert next_batch([], Batching(40, 64, 0.0), None) == []


class BarrierRuntime(NoopRuntime):
    """The no-op runtime whose batches each wait until `parties` batches are on the device together."""

    def __init__(self, parties: int) -> None:
        super().__init__(ModelSource(path=".", task=Task.EMBED))  # type: ignore[arg-type]
        self.barrier = threading.Barrier(parties, timeout=5)

    def run(self, batch, adapter=None):
        self.barrier.wait()  # BrokenBarrierError (a failed job) unless the other batch runs meanwhile
        return super().run(batch)


async def test_concurrent_batches_run_together_on_their_own_threads() -> None:
    runtime = BarrierRuntime(2)
    done: list[tuple[Job, object]] = []
    finished = asyncio.Event()
    jobs = [job([5]), job([5])]

    def on_done(j: Job, error: object) -> None:
        done.append((j, error))
        if len(done) == len(jobs):
            finished.set()

    with ThreadPoolExecutor(1) as shared:  # the box's one device thread: two batches could not meet there
        batcher = Batcher("m", runtime, Batching(1024, 1, 0.0, concurrent_batches=2), shared, Metrics(), on_done)
        for j in jobs:
            batcher.submit(j)
        batcher.start()
        await asyncio.wait_for(finished.wait(), 10)
        await batcher.drain()
    assert [error for _, error in done] == [None, None]


def test_room_counts_every_slot() -> None:
    def learnt(concurrent: int) -> Batcher:
        batching = Batching(16_384, 8, 0.0, concurrent_batches=concurrent)
        batcher = Batcher("m", NoopRuntime(ModelSource(path=".", task=Task.EMBED)), batching, None, Metrics(), print)  # type: ignore[arg-type]
        for rows in (2, 4, 8, 8, 8, 8):  # 10 ms a batch plus 1 ms a padded token: 90 ms for 8 rows of 10
            batcher.cost.observe(rows * 10, rows, 0.010 + 0.001 * rows * 10)
        return batcher

    one, two = learnt(1), learnt(2)
    assert one.room(0.2) == 2 * 8  # two 90 ms batches fit in 200 ms
    assert two.room(0.2) == 2 * 2 * 8  # and as many again on the second slot
    assert one.room(0.05) == two.room(0.05) == 8  # no batch fits: an idle device still takes one


class GateRuntime(NoopRuntime):
    """The no-op runtime whose batches wait for `gate`, counting those that started."""

    def __init__(self) -> None:
        super().__init__(ModelSource(path=".", task=Task.EMBED))  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.started = 0

    def run(self, batch, adapter=None):
        self.started += 1
        self.gate.wait(5)
        return super().run(batch)


async def test_a_batch_formed_ahead_waits_for_a_free_thread_and_counts_as_waiting() -> None:
    runtime = GateRuntime()
    done: list[Job] = []
    batching = Batching(1024, 1, 0.0, concurrent_batches=2)
    batcher = Batcher("m", runtime, batching, None, Metrics(), lambda j, e: done.append(j))  # type: ignore[arg-type]
    for _ in range(4):
        batcher.submit(job([5]))
    batcher.start()
    for _ in range(200):
        if runtime.started == 2 and batcher.pending_interactive == 1:
            break
        await asyncio.sleep(0.01)
    # Two batches on the device threads, a third formed ahead of them, the fourth row still pending:
    # the room (one row per batch, two slots, before any batch is timed) counts both waiting rows.
    assert (runtime.started, batcher.pending_interactive) == (2, 1)
    assert batcher.room(1.0) == 0
    runtime.gate.set()
    for _ in range(200):
        if len(done) == 4:
            break
        await asyncio.sleep(0.01)
    await batcher.drain()
    assert len(done) == 4 and runtime.started == 4


async def test_room_waits_for_the_soonest_slot_when_every_slot_is_busy() -> None:
    runtime = GateRuntime()
    batching = Batching(16_384, 8, 0.0, concurrent_batches=2)
    batcher = Batcher("m", runtime, batching, None, Metrics(), lambda j, e: None)  # type: ignore[arg-type]
    for rows in (2, 4, 8, 8, 8, 8):  # 100 ms a batch plus 10 ms a padded token: 900 ms for 8 rows of 10
        batcher.cost.observe(rows * 10, rows, 0.100 + 0.010 * rows * 10)
    batcher.submit(job([10] * 8))
    batcher.submit(job([10] * 8))
    batcher.start()
    for _ in range(200):
        if runtime.started == 2:
            break
        await asyncio.sleep(0.01)
    assert runtime.started == 2  # both slots hold a batch predicted to take 900 ms (held at the gate)
    # Within 3 s each slot finishes its batch and runs two more: four batches of 8 rows; within 2 s,
    # one more each. (Robust to this test running up to 300 ms late.)
    assert batcher.room(3.0) == 4 * 8
    assert batcher.room(2.0) == 2 * 8
    # Within 1.5 s none: a row would wait out a slot's batch (up to 900 ms) and then run in its own.
    # Room opens once the sooner slot has 600 ms left, and a request sent then lasts until that slot
    # frees, plus the nearly-free margin (150 ms of 1.5 s).
    assert batcher.room(1.5) == 0
    opens = batcher.room_opens_in(1.5)
    assert opens is not None and 0 < opens <= 0.3
    lasts = batcher.room_lasts_s(1.5)
    assert lasts is not None and 0.15 < lasts <= 0.9 + 0.15
    runtime.gate.set()
    await batcher.drain()


async def test_a_fault_in_forming_a_batch_fails_the_waiting_requests_and_the_batcher_goes_on(monkeypatch) -> None:
    faults = iter([RuntimeError("packing bug")])

    def next_batch_failing_once(pending, batching, fit):
        for fault in faults:
            raise fault
        return next_batch(pending, batching, fit)

    monkeypatch.setattr(batcher_module, "next_batch", next_batch_failing_once)
    runtime = RecordingRuntime()
    done: list[tuple[Job, object]] = []
    answered = asyncio.Event()

    def on_done(j: Job, error: object) -> None:
        done.append((j, error))
        answered.set()

    with ThreadPoolExecutor(1) as executor:
        batcher = Batcher(
            "m", runtime, Batching(max_batch_tokens=256, max_batch_size=8, max_wait_ms=0), executor, Metrics(), on_done
        )
        batcher.start()
        first = job([5, 6])
        batcher.submit(first)
        await asyncio.wait_for(answered.wait(), 10)
        answered.clear()
        second = job([7])
        batcher.submit(second)
        await asyncio.wait_for(answered.wait(), 10)
        await batcher.drain()
    (first_job, first_error), (second_job, second_error) = done
    assert first_job is first and isinstance(first_error, RuntimeError) and "packing bug" in str(first_error)
    assert second_job is second and second_error is None and second.results[0] is not None
    assert runtime.batches == [[7]]
