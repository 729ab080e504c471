"""The gateway's wait estimate (Little's law over one model's queue, weighed by cost), without a box.

The admission tests drive `Admission` with a clock of their own against a fake model (`drive`): what is
under test is the policy, and a simulated second takes no time, so nothing here depends on the machine.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections import deque
from dataclasses import dataclass
from fractions import Fraction

import aiohttp
import pytest

from appliance.batch_cost import BatchCost, PaceLine
from appliance.catalog import Batching
from appliance.errors import TooManyRequests
from appliance.gateway.admission import GENERATION_ROUND_TOKENS, Admission, paced_round, unmeasured_budget
from appliance.gateway.decode_admission import DecodeQueue, Decoder
from appliance.gateway.encoders import estimate_tokens
from appliance.gateway.model_queue import ModelQueue
from appliance.metrics import Metrics

DEFAULT_BUDGET = unmeasured_budget(Batching(16_384, 256, 0.0, 1))  # the default settings'
BURST = 4 * DEFAULT_BUDGET  # what a burst on an idle model may fill before its rate is measured
HEAVY = 1760  # the gateway's estimate for 32 inputs of about 45 words
HEAVY_PER_S = HEAVY / 0.85  # the default model on a 2-core CPU: 0.85 s for one such request


@dataclass(slots=True)
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True)
class Outcome:
    sent: float
    status: int = 0  # 0 while awaited
    wait_s: float = 0.0  # until its model started on it
    retry_after: int | None = None


def drive(
    admission: Admission,
    clock: Clock,
    sends: list[float],
    *,
    weight: int,
    per_s: float,
    budget: int = DEFAULT_BUDGET,
    batch: int = 1,
    clients: int = 0,
    total: int = 0,
    timeout_s: float = 30.0,
    priority: str = "interactive",
) -> list[Outcome]:
    """Requests of `weight` sent at `sends` (or by `clients` that each send the next once answered, `total` in
    all), through `admission`, to a fake model that starts up to `batch` of them at a time in order, at `per_s`
    weight a second. A request not answered by its deadline is a 504, and the model never starts it late."""
    arrivals, pending = deque(sorted(sends)), deque[tuple[str, float, int]]()
    running: tuple[float, list[tuple[str, float, int]]] | None = None
    outcomes: list[Outcome] = []
    queues: dict[str, ModelQueue] = {}

    def settle(i: int, request_id: str, status: int) -> None:
        queues.pop(request_id).remove(request_id, clock.now, answered=status == 200)
        outcomes[i].status = status
        if clients:
            arrivals.append(clock.now)

    while True:
        ends = running[0] if running else math.inf
        expires = min((deadline for _, deadline, _ in pending), default=math.inf)
        now = min(arrivals[0] if arrivals else math.inf, ends, expires)
        if now == math.inf:
            return outcomes
        clock.now = now
        if clock.now == ends:
            assert running is not None
            for request_id, _, i in running[1]:
                if not outcomes[i].status:
                    settle(i, request_id, 200)
            running = None
        elif clock.now == expires:
            request_id, _, i = next(entry for entry in pending if entry[1] == expires)
            pending.remove((request_id, expires, i))
            settle(i, request_id, 504)
        else:
            arrivals.popleft()
            if clients and len(outcomes) >= total:
                continue
            request_id = f"r{len(outcomes)}"
            outcomes.append(Outcome(clock.now))
            try:
                queue = admission.admit("m", priority, timeout_s, len(queues), weight=weight, budget=budget)
            except TooManyRequests as refused:
                outcomes[-1].status, outcomes[-1].retry_after = 429, int(refused.headers["Retry-After"])
                if clients:
                    arrivals.append(clock.now + 0.01)
                continue
            queue.add(request_id, clock.now, weight, deadline=clock.now + timeout_s)
            queues[request_id] = queue
            pending.append((request_id, clock.now + timeout_s, len(outcomes) - 1))
        if running is None and pending:
            started = [pending.popleft() for _ in range(min(batch, len(pending)))]
            for _, _, i in started:
                outcomes[i].wait_s = clock.now - outcomes[i].sent
            running = (clock.now + len(started) * weight / per_s, started)
        arrivals = deque(sorted(arrivals))


def admission(clock: Clock, max_queue_s: float = 10.0) -> Admission:
    return Admission(Metrics(), max_waiting=8192, max_queue_s=max_queue_s, clock=clock)


def busy(q: ModelQueue, start: float, seconds: float, per_s: int, weight: int = 1) -> float:
    """Keep `q` busy from `start` for `seconds`, answering `per_s` requests of `weight` a second; returns the end.

    A request of no weight, "head", waits throughout (and after, until the caller removes it).
    """
    step = 1 / per_s
    q.add("head", start, 0)
    for i in range(round(seconds * per_s)):
        q.add(f"{start}:{i}", start + i * step, weight)
        q.remove(f"{start}:{i}", start + (i + 1) * step, answered=True)
    return start + seconds


def test_wait_is_the_work_awaited_over_the_rate_it_is_answered() -> None:
    q = ModelQueue()
    now = busy(q, 10.0, 2.0, per_s=100, weight=10)  # 1,000 tokens a second
    for i in range(30):
        q.add(f"r{i}", now, 100)
    assert q.wait_s(now) == pytest.approx(3000 / 1000)  # "head" has waited since 10.0: the estimate is trusted


def test_a_large_request_weighs_its_tokens_not_one() -> None:
    q = ModelQueue()
    now = busy(q, 10.0, 2.0, per_s=100, weight=10)
    q.add("bulk", now, 250 * 128)  # 250 inputs of 128 tokens
    q.add("word", now, 3)
    assert q.wait_s(now + 0.5) > 30  # counted by requests it would be 2 / 100 per second: 0.02 s


def test_idle_time_does_not_dilute_the_rate() -> None:
    q = ModelQueue()
    end = busy(q, 10.0, 1.0, per_s=100)
    q.remove("head", end, answered=False)
    now = end + 1.2  # idle for 1.2 s: the window still holds the last busy spans
    q.add("r", now, 50)
    assert q.rate(now) == 100


def test_answers_seconds_apart_still_give_a_rate() -> None:
    """A big request answered every 5 s: no fixed 2 s window of answers would hold one."""
    q = ModelQueue()
    for i in range(5):
        q.add(f"big{i}", 0.0, 1000)
    for i in range(2):
        q.remove(f"big{i}", 5.0 * (i + 1), answered=True)
    assert q.wait_s(11.0) == 3000 / (1000 / 6.0)  # the last span (5 s), and the one open since (1 s)
    assert q.wait_s(10.0) == 3000 / 200


def test_a_stall_dilutes_the_rate_until_answers_come_again() -> None:
    q = ModelQueue()
    now = busy(q, 0.0, 1.0, per_s=100)
    q.add("stuck", now - 0.5, 10)
    early, late = q.wait_s(now + 1.0), q.wait_s(now + 9.0)
    assert early is not None and late is not None and late > early


def test_no_estimate_before_the_oldest_request_waited_or_anything_was_answered() -> None:
    q = ModelQueue()
    now = busy(q, 0.0, 1.0, per_s=100)
    q.remove("head", now, answered=False)
    q.add("fresh", now, 10)
    assert q.wait_s(now + 0.3) is None  # a fresh burst: nothing to refuse yet
    cold = ModelQueue()
    cold.add("first", 0.0, 10)
    assert cold.wait_s(5.0) is None  # nothing ever answered (a cold load): deadlines bound it
    q.remove("fresh", now + 0.4, answered=False)
    assert q.wait_s(now + 1.0) is None  # nothing waiting


def test_short_busy_spells_are_not_taken_for_the_models_rate() -> None:
    """One request answered alone in 5 ms says how fast one request goes, not how fast a full queue drains."""
    q = ModelQueue()
    for i in range(20):
        q.add(f"r{i}", i * 0.1, 10)
        q.remove(f"r{i}", i * 0.1 + 0.005, answered=True)
    assert not q.spans
    q.add("next", 2.0, 10)
    assert q.wait_s(3.0) is None


def test_a_model_busy_again_after_an_idle_gap_is_not_judged_by_its_old_pace_nor_its_reload() -> None:
    """Idle for an hour, then reloading for 20 s (evicted, or its box gone): the old spans are forgotten,
    so the reload is not read as a stall and nothing is refused; once answers flow again, the rate is
    timed from the first of them, not from the start of the reload."""
    q = ModelQueue()
    end = busy(q, 0.0, 2.0, per_s=100, weight=50)
    q.remove("head", end, answered=False)
    start = end + 3600.0
    for i in range(200):  # 10 requests a second arrive while the model reloads
        q.add(f"r{i}", start + i * 0.1, 50)
    assert q.wait_s(start + 19.9) is None  # nothing answered yet in this spell: deadlines bound it
    for i in range(100):  # then the model answers 100 a second
        q.remove(f"r{i}", start + 20.0 + i * 0.01, answered=True)
    assert q.wait_s(start + 21.0) == pytest.approx(100 * 50 / 5000, rel=0.05)


def test_one_batch_answered_at_once_is_not_a_rate() -> None:
    """Nine requests answered together 8 s in: the clock starts with them, so they say nothing of the pace
    (counted, they made it look nine requests in a few milliseconds, and a flood was let in)."""
    q = ModelQueue()
    for i in range(20):
        q.add(f"r{i}", i * 0.025, HEAVY)
    for i in range(9):
        q.remove(f"r{i}", 8.0 + i * 0.001, answered=True)
    assert q.rate(8.2) is None and q.wait_s(8.2) is None
    for i in range(9, 18):  # the next batch, 8 s on: now there is a rate, of that batch alone
        q.remove(f"r{i}", 16.0 + (i - 9) * 0.001, answered=True)
    assert q.rate(16.01) == pytest.approx(9 * HEAVY / (16.01 - 8.008))  # timed from the last of the first batch


def test_a_heavy_burst_on_an_idle_model_is_refused_at_once_and_what_is_admitted_starts_in_time() -> None:
    """40 requests a second of 0.85 s each, for 20 s, on a model nothing was sent to before (black-box
    finding: 59 to 142 were admitted in the 2-4 s before a rate was measured, and most then got a 504)."""
    clock = Clock()
    sends = [100.0 + i / 40 for i in range(800)]
    outcomes = drive(admission(clock), clock, sends, weight=HEAVY, per_s=HEAVY_PER_S)
    statuses = {status: sum(o.status == status for o in outcomes) for status in (200, 429, 504)}
    assert statuses[504] == 0 and statuses[200] + statuses[429] == 800, statuses
    assert min(o.sent for o in outcomes if o.status == 429) < 100.5  # refused within half a second
    assert max(o.wait_s for o in outcomes if o.status == 200) <= 10.0 + 0.85  # the bound, and one request
    assert all(1 <= (o.retry_after or 0) <= 20 for o in outcomes if o.status == 429)


def test_a_light_burst_a_fast_model_clears_at_once_is_not_refused() -> None:
    """2,000 one-sentence requests at concurrency 64 (benchmarks/e2e_embed.py case b), to a model that
    answers 300 of them a second in batches of 32, from its first request."""
    clock = Clock()
    outcomes = drive(admission(clock), clock, [100.0] * 64, weight=14, per_s=14 * 300, batch=32, clients=64, total=2000)
    assert len(outcomes) == 2000 and {o.status for o in outcomes} == {200}


def test_what_a_model_has_shown_outlasts_an_idle_gap() -> None:
    """The budget is a floor, not a cap. A model that cleared its last burst fast takes a bigger one at
    once, up to twice what it cleared (held to its rounds of batches, it got that much a second, one per
    retry, for ever); a slow model is held to what it starts within the bound at its last pace (here more
    than its budget). A round is one request for the fast model (a burst fills four), two for the slow one."""
    clock = Clock()
    fast = admission(clock)
    admitted = []
    for _ in range(4):  # 20 arrive at once, an hour apart: a slow start, each spell at most doubling
        burst = drive(fast, clock, [clock.now] * 20, weight=HEAVY, per_s=HEAVY * 200, batch=32, budget=HEAVY)
        admitted.append(sum(o.status == 200 for o in burst))
        clock.now += 3600.0
    assert admitted == [4, 8, 16, 20]
    clock = Clock()
    slow = admission(clock)
    spell = drive(slow, clock, [100.0 + i * 0.6 for i in range(10)], weight=HEAVY, per_s=HEAVY_PER_S, budget=2 * HEAVY)
    assert {o.status for o in spell} == {200}  # one busy spell of 10 requests, in 8.5 s
    clock.now += 3600.0
    burst = drive(slow, clock, [clock.now] * 40, weight=HEAVY, per_s=HEAVY_PER_S, budget=2 * HEAVY)
    assert 10 <= sum(o.status == 200 for o in burst) <= 12  # about 10 s at its last pace, not the 8 of its budget
    assert max(o.wait_s for o in burst if o.status == 200) <= 10.0


def test_a_request_sent_while_a_large_one_runs_is_let_in_on_what_the_model_took_in_lately() -> None:
    """Tester h70: on an idle fleet, a request of one input sent 0.15 s after one of 100 was refused 429 (1 in 90 of
    the small requests of a light soak): the last busy spell, one small request, was all the model had shown, and a
    round of its 8-row batches is 96 tokens. The most a spell answered in the last minute (the 100 inputs) counts."""
    clock = Clock()
    gate = admission(clock)
    round_of_rows, large, small = 96, 1200, 12

    def spell(weight: int, seconds: float) -> None:
        queue = gate.admit("m", "interactive", 30.0, 0, weight=weight, budget=round_of_rows)
        queue.add(f"r{clock.now}", clock.now, weight)
        clock.now += seconds
        queue.remove(f"r{clock.now - seconds}", clock.now, answered=True)

    spell(large, 0.3)
    clock.now += 3.0
    spell(small, 0.02)
    clock.now += 3.0
    queue = gate.admit("m", "interactive", 30.0, 0, weight=large, budget=round_of_rows)  # alone: it goes
    queue.add("large", clock.now, large)
    clock.now += 0.15
    gate.admit("m", "interactive", 30.0, 1, weight=small, budget=round_of_rows)  # was a 429
    clock.now += 60.0
    queue.remove("large", clock.now, answered=True)
    clock.now += 3.0
    spell(small, 0.02)
    clock.now += 61.0  # a minute on: only the last spell is remembered, and the gate is as strict as before
    queue.add("large", clock.now, large)
    clock.now += 0.15
    with pytest.raises(TooManyRequests) as refused:
        gate.admit("m", "interactive", 30.0, 1, weight=small, budget=round_of_rows)
    assert "this gateway already awaits 1 request for it, as much as" in refused.value.message  # not "1 requests"


def test_a_flood_on_a_model_its_holders_have_timed_is_held_to_their_pace_in_rows_and_tokens() -> None:
    """Tester h70 again: on an idle box of the 2-core profile (8-row batches), one input sent 0.15 s after 100 long
    ones was refused 429 in 4 of 4 rounds. Held to one round as a flood, and that round reckoned in rows of the
    short input alone (7 tokens a row), the long request already filled it. The rows are those of the work
    awaited, and what the holders compute in half the bound is let in for a flood as for a burst; a flood of
    short inputs is still held to the rows they go at."""
    clock = Clock()
    gate = admission(clock)
    catalog, pace, rows_pace = Batching(16_384, 256, 2.0, 1), 6_000.0, 70.0  # the profile's: 8 rows, 1,024 tokens

    def admit(request_id: str, weight: int, inputs: int) -> None:
        per_input = gate.per_input("m", "interactive", weight, inputs)
        paced = paced_round(pace, rows_pace, per_input)
        budget = unmeasured_budget(catalog, box_round=1024, box_rows=8, per_input=per_input)
        queue = gate.admit("m", "interactive", 30.0, 0, weight=weight, budget=budget, paced=paced)
        queue.add(request_id, clock.now, weight, rows=inputs)

    admit("large", 8_700, 100)  # alone: it goes
    clock.now += 0.15
    assert gate.per_input("m", "interactive", 7, 1) == pytest.approx(8_707 / 101)
    admit("small", 7, 1)  # was a 429: 1.4 s of the holders' work awaited, against a bound of 10 s
    clock.now += 3.0
    gate.forget("m")
    admit("short0", 7, 1)
    clock.now += 0.15
    with pytest.raises(TooManyRequests):  # 420 rows at 70 a second: 6 s of work, more than half the bound
        for i in range(1, 420):
            admit(f"short{i}", 7, 1)
            clock.now += 0.001
    assert 100 < i < 400, i


def test_a_lone_short_request_answered_fast_does_not_open_the_gate_to_heavy_work() -> None:
    """14 tokens answered in 2 ms is a pace of 7,000 tokens a second; the same model takes 0.85 s for 1,760."""
    clock = Clock()
    gate = admission(clock)
    drive(gate, clock, [100.0], weight=14, per_s=7000)
    clock.now += 1.0
    flood = drive(gate, clock, [clock.now + i / 40 for i in range(40)], weight=HEAVY, per_s=HEAVY_PER_S)
    assert sum(o.status == 200 for o in flood) == DEFAULT_BUDGET // HEAVY + 1  # a round, and one answered


def test_work_that_will_expire_unstarted_still_counts_toward_the_wait() -> None:
    """142 requests of 0.85 s admitted in 3.5 s, each with a 30 s deadline: most of that work will expire
    unstarted, and so would a request sent now, so it is overload (reckoned only to the latest deadline,
    28.5 s away, a request sent with a deadline of 30 s or less was always let in: 504s, never a 429)."""
    q = ModelQueue()
    for i in range(142):
        q.add(f"r{i}", i * 0.025, HEAVY, deadline=i * 0.025 + 30.0)
    for i in range(3):
        q.remove(f"r{i}", 0.85 * (i + 1), answered=True)
    assert q.wait_s(5.0) == pytest.approx(139 * HEAVY / (q.rate(5.0) or 0)) and (q.wait_s(5.0) or 0) > 100
    assert q.latest_deadline() == pytest.approx(141 * 0.025 + 30.0)
    q.remove("r141", 5.0, answered=False)  # the latest deadline goes with its request
    assert q.latest_deadline() == pytest.approx(140 * 0.025 + 30.0)


@pytest.mark.parametrize(("priority", "timeout_s"), [("interactive", 5.0), ("interactive", 10.0), ("batch", 30.0)])
def test_a_heavy_flood_is_refused_whatever_the_requests_deadline(priority: str, timeout_s: float) -> None:
    """The heavy flood with deadlines no longer than the limit (a `Timeout` of at most `max_queue_s`, or any
    batch-priority request, whose limit is its deadline): a wait reckoned only to the latest deadline never
    passed the limit, and 712 (at 5 s) or 683 (batch) of the 800 got a 504 and none a 429."""
    clock = Clock()
    sends = [100.0 + i / 40 for i in range(800)]
    outcomes = drive(
        admission(clock), clock, sends, weight=HEAVY, per_s=HEAVY_PER_S, timeout_s=timeout_s, priority=priority
    )
    statuses = {status: sum(o.status == status for o in outcomes) for status in (200, 429, 504)}
    assert statuses[429] > 700 and statuses[504] <= 5, statuses
    assert min(o.sent for o in outcomes if o.status == 429) < 101.0


def test_retry_after_is_when_the_queue_has_run_or_expired_not_when_all_of_it_would_run() -> None:
    """Black-box finding: every 429 said Retry-After 60 ("would wait about 655s") while the box was free
    again about 10 s after the load stopped. The wait it says is the one its Retry-After reckons (tester h214): by
    then what is awaited has started or expired."""
    clock = Clock(0.0)
    gate = admission(clock)
    queue = gate.admit("m", "interactive", 30.0, 0, weight=HEAVY, budget=DEFAULT_BUDGET)
    for i in range(142):
        queue.add(f"r{i}", i * 0.025, HEAVY, deadline=i * 0.025 + 30.0)
    for i in range(3):
        queue.remove(f"r{i}", 0.85 * (i + 1), answered=True)
    clock.now = 5.0
    with pytest.raises(TooManyRequests) as refused:
        gate.admit("m", "interactive", 30.0, 139, weight=HEAVY, budget=DEFAULT_BUDGET)
    assert refused.value.headers["Retry-After"] == str(math.ceil(141 * 0.025 + 30.0 - 5.0 - 10.0))  # 19
    assert "would take about 29s to start, over 10s" in refused.value.message  # not 459 s: 139 requests at 3 in 2.55 s


def test_a_gateway_is_not_refused_for_the_lumps_its_share_of_a_shared_queue_comes_in() -> None:
    """Two gateways, 40 clients on each sending their next request once answered, one model that starts the
    oldest 4 requests every 0.3 s. In one queue the order settles: each gateway's requests come in a run, so
    each gateway sees 3 s of answers, then 3 s of none while the other's run (operator tester: 429 "about 69s
    to start, retry in 50s" from a gateway whose requests took at most 3 s). A window of answers shorter than
    a request waits read that gap as the model stalling. A request here waits 6 s: nothing is refused."""
    clock = Clock(0.0)
    gates = {"a": admission(clock), "b": admission(clock)}
    order: deque[tuple[str, str, ModelQueue]] = deque()  # (request id, gateway, its queue): oldest first
    sent: dict[str, float] = {}
    waits: list[float] = []
    refused: list[str] = []

    def send(gateway: str, client: int) -> None:
        request_id = f"{gateway}{client}@{clock.now:.1f}"
        try:
            queue = gates[gateway].admit("m", "interactive", 30.0, 0, weight=10, budget=DEFAULT_BUDGET)
        except TooManyRequests as refusal:
            refused.append(f"{request_id}: {refusal.message}")
            return
        queue.add(request_id, clock.now, 10, deadline=clock.now + 30.0)
        order.append((request_id, gateway, queue))
        sent[request_id] = clock.now

    for gateway in gates:
        for client in range(40):
            send(gateway, client)
    running: list[tuple[str, str, ModelQueue]] = []
    for tick in range(1, 120):  # 36 s
        clock.now = tick * 0.3
        for request_id, gateway, queue in running:
            queue.remove(request_id, clock.now, answered=True)
            waits.append(clock.now - 0.3 - sent[request_id])
            send(gateway, int(request_id[1:].split("@")[0]))
        running = [order.popleft() for _ in range(min(4, len(order)))]
    assert not refused, refused[:3]
    assert len(waits) == 119 * 4 - 4 and max(waits) <= 6.3


@pytest.mark.parametrize("backlog_s", [1.0, 3.0, 5.0])
def test_a_stall_is_seen_within_two_seconds_whatever_the_backlog(backlog_s: float) -> None:
    """A request every 0.1 s, each answered `backlog_s` after it was sent, then none (the model hangs): the estimate
    passes the 10 s bound within 2 s. Review finding: a window reaching back to the oldest request awaited grew with
    the stall itself (2.1-2.7 s); the window is as long as the last request answered waited, frozen in a stall."""
    q = ModelQueue()
    sent: deque[tuple[str, float]] = deque()
    for tick in range(500):  # 50 s; the model stops answering at 30 s
        now = tick / 10
        q.add(f"r{tick}", now, 10)
        sent.append((f"r{tick}", now))
        while now < 30 and sent and sent[0][1] <= now - backlog_s + 1e-9:
            q.remove(sent.popleft()[0], now, answered=True)
        wait = q.wait_s(now)
        if now >= 30 and wait is not None and wait > 10.0:
            assert now - 30 <= 2.0, now - 30
            return
    raise AssertionError("the stall was never seen")


def test_a_fast_stretch_is_not_taken_for_the_pace() -> None:
    """A request a second for 8 s, then four in the next second (on shared cores a box's pace swings like
    this): the last 2 s alone say 2.5 a second, and let in ten seconds of work that then took 25."""
    q = ModelQueue()
    for i in range(30):
        q.add(f"r{i}", i * 0.1, HEAVY)
    answers = [1.0 + i for i in range(8)] + [8.25, 8.5, 8.75, 9.0]
    for i, at in enumerate(answers):
        q.remove(f"r{i}", at, answered=True)
    assert q.rate(9.0) == pytest.approx(11 * HEAVY / 8.0)  # since the clock started at 1.0


@pytest.mark.parametrize("clients", [12, 16, 32])
def test_a_burst_of_large_requests_a_fast_model_clears_at_once_is_not_refused(clients: int) -> None:
    """Clients sending 32 inputs of about 45 words each, to an idle model that answers 200 such requests a
    second in batches of 32 (a GPU): held to one round of batches (9 of them) until a rate was measured,
    16 clients got 7 of their first 16 requests refused, and 378 of 2,000."""
    clock = Clock()
    outcomes = drive(
        admission(clock),
        clock,
        [100.0] * clients,
        weight=HEAVY,
        per_s=HEAVY * 200,
        batch=32,
        clients=clients,
        total=2000,
    )
    assert len(outcomes) == 2000 and {o.status for o in outcomes} == {200}


def test_long_inputs_weigh_what_the_model_takes_of_them() -> None:
    """Two requests of 8 inputs of 4,000 characters each, sent together to an idle model: weighed at 1,002
    tokens an input, where the model takes at most 512 of each, they were more than a round and one was 429."""
    texts = [f"{i} " + "lorem ipsum dolor sit amet " * 150 for i in range(8)]
    assert estimate_tokens(texts) == 8 * 512
    assert estimate_tokens(["a few words here"]) == len("a few words here") // 4 + 2
    clock = Clock()
    outcomes = drive(admission(clock), clock, [100.0] * 2, weight=estimate_tokens(texts), per_s=2000.0)
    assert [o.status for o in outcomes] == [200, 200]


def test_a_batch_priority_job_on_an_idle_model_is_bounded_by_its_deadline_only() -> None:
    """20 batch-priority requests of 32 inputs with a 600 s deadline, at once on an idle model: 11 were 429,
    held to the round of batches an interactive burst gets."""
    clock = Clock()
    gate = admission(clock)
    for i in range(20):
        queue = gate.admit("m", "batch", 600.0, i, weight=HEAVY, budget=DEFAULT_BUDGET)
        queue.add(f"r{i}", clock.now, HEAVY, deadline=clock.now + 600.0)
    assert len(queue.waiting) == 20


def decode(
    admission: Admission,
    clock: Clock,
    sends: list[float],
    *,
    max_tokens: int,
    slots: int,
    tokens_per_s: float,
    made_tokens: int | None = None,
    timeout_s: float = 30.0,
    pull_s: float = 0.05,
    retry: bool = False,
    priority: str = "interactive",
    shared: bool = False,
) -> list[Outcome]:
    """Generations of `max_tokens` sent at `sends` through `admission` to a fake generator of `slots` decode slots,
    each making `tokens_per_s` tokens a second: a generation starts (its first chunk) as a slot frees, in order,
    no sooner than `pull_s` after it was sent, and holds the slot until its answer of `made_tokens` (else
    `max_tokens`) is made; with `shared`, slots share the generator's time as on a CPU (an answer started with
    three others running takes four times as long). One not started by its deadline is a 504. With `retry`, a
    refused client sends again after its Retry-After (a new outcome). Every generation started lets go of its
    slot in the queue's count."""
    budget = unmeasured_budget(Batching(16_384, 256, 0.0, 1), slots)
    queue: ModelQueue | None = None
    arrivals, pending = deque(sorted(sends)), deque[tuple[str, float, int]]()  # (id, deadline, outcome index)
    running: dict[str, float] = {}  # id -> when its answer is made
    outcomes: list[Outcome] = []
    answer_s = (made_tokens or max_tokens) / tokens_per_s

    def ready() -> float:
        """When the next generation waiting can start on a free slot."""
        if not pending or len(running) >= slots:
            return math.inf
        return max(clock.now, outcomes[pending[0][2]].sent + pull_s)

    while arrivals or pending or running:
        expires = min((deadline for _, deadline, _ in pending), default=math.inf)
        made = min(running.values(), default=math.inf)
        arrives = arrivals[0] if arrivals else math.inf
        clock.now = min(arrives, made, expires, ready())
        if clock.now == made:
            request_id = next(request_id for request_id, at in running.items() if at == made)
            del running[request_id]
            assert queue is not None
            queue.finish(request_id, clock.now, whole=True, tokens=made_tokens or max_tokens)
        elif clock.now == expires:
            request_id, _, i = next(entry for entry in pending if entry[1] == expires)
            pending.remove((request_id, expires, i))
            assert queue is not None
            queue.remove(request_id, clock.now, answered=False)
            outcomes[i].status = 504
        elif clock.now == arrives:
            arrivals.popleft()
            outcomes.append(Outcome(clock.now))
            try:
                queue = admission.admit(
                    "m", priority, timeout_s, len(pending), weight=max_tokens, budget=budget, decode_batch=slots
                )
            except TooManyRequests as refused:
                outcomes[-1].status, outcomes[-1].retry_after = 429, int(refused.headers["Retry-After"])
                if retry:
                    arrivals.append(clock.now + outcomes[-1].retry_after)
                    arrivals = deque(sorted(arrivals))
                continue
            request_id = f"{priority}{len(outcomes)}"
            queue.add(request_id, clock.now, max_tokens, deadline=clock.now + timeout_s)
            pending.append((request_id, clock.now + timeout_s, len(outcomes) - 1))
        while ready() <= clock.now:
            request_id, _, i = pending.popleft()
            assert queue is not None
            queue.remove(request_id, clock.now, answered=True)
            outcomes[i].status, outcomes[i].wait_s = 200, clock.now - outcomes[i].sent
            running[request_id] = clock.now + answer_s * (len(running) + 1 if shared else 1)
    assert not isinstance(queue, DecodeQueue) or not queue.decoder.running
    return outcomes


def statuses(outcomes: list[Outcome]) -> dict[int, int]:
    return {status: sum(o.status == status for o in outcomes) for status in (200, 429, 504)}


def test_a_burst_of_long_generations_on_an_idle_generator_is_refused_at_once_not_left_to_time_out() -> None:
    """40 generations of up to 200 tokens at once, to a generator decoding 4 at a time at 30 tokens a second
    (6.7 s an answer) that nothing was sent to before (black-box finding: weighed as one request each, against
    a budget of 256, all were let in and the last 16 waited out their deadline: a 504 at 30 s, not a 429).
    Clients that retry after their Retry-After are all answered, none waiting past the bound."""
    clock = Clock()
    first = decode(admission(clock), clock, [100.0] * 40, max_tokens=200, slots=4, tokens_per_s=30.0)
    assert [o.status for o in first] == [200] * 5 + [429] * 35  # the free slots' 4, and one round behind them
    assert {o.retry_after for o in first if o.status == 429} == {1}
    clock = Clock()
    retried = decode(admission(clock), clock, [100.0] * 40, max_tokens=200, slots=4, tokens_per_s=30.0, retry=True)
    assert statuses(retried)[200] == 40 and statuses(retried)[504] == 0
    assert max(o.wait_s for o in retried if o.status == 200) <= 10.0


@pytest.mark.parametrize("made_tokens", [200, 60])
def test_a_flood_of_generations_waits_about_the_bound_and_no_more(made_tokens: int) -> None:
    """Three generations a second for a minute to the same generator, which starts 0.6 (answers of 200 tokens)
    or 2 (of 60) a second: refused from the first seconds, what is let in starts within the bound (and a slot's
    free), and nothing times out. Its rate taken from starts, clumped as slots free together, let in requests
    that waited 29 s; taken from `max_tokens` it would count answers of 60 as 200."""
    clock = Clock()
    sends = [100.0 + i / 3 for i in range(180)]
    outcomes = decode(
        admission(clock), clock, sends, max_tokens=200, made_tokens=made_tokens, slots=4, tokens_per_s=30.0
    )
    capacity = 4 / (made_tokens / 30.0)  # generations a second
    assert statuses(outcomes)[504] == 0 and min(o.sent for o in outcomes if o.status == 429) < 103.0
    assert 55 * capacity <= statuses(outcomes)[200] <= 70 * capacity + 4  # the generator kept busy, no more
    assert max(o.wait_s for o in outcomes if o.status == 200) <= 10.0 + made_tokens / 30.0 / 4


def test_a_chat_clients_large_max_tokens_is_not_taken_for_the_answers_length() -> None:
    """A client that asks for up to 8,192 tokens and gets answers of 200: once a generation is made, waits are
    reckoned from how long answers held their slot, so a flood is let in as for answers of 200."""
    clock = Clock()
    gate = admission(clock)
    decode(gate, clock, [100.0], max_tokens=8192, made_tokens=200, slots=4, tokens_per_s=30.0)
    sends = [clock.now + i / 3 for i in range(90)]
    flood = decode(gate, clock, sends, max_tokens=8192, made_tokens=200, slots=4, tokens_per_s=30.0)
    assert statuses(flood)[504] == 0 and 18 <= statuses(flood)[200] <= 30  # 0.6 a second for 30 s, and a bound
    assert max(o.wait_s for o in flood if o.status == 200) <= 10.0 + 200 / 30.0 / 4


@pytest.mark.parametrize(("max_tokens", "refused"), [(16, 0), (512, 7)])
def test_a_generation_weighs_the_tokens_it_may_make_until_one_is_made(max_tokens: int, refused: int) -> None:
    """Eight generations at once to an idle generator of one decode slot: short answers (16 tokens) all go,
    and of long ones (512) only the one its slot starts at once, until one is made. Counted as requests in
    rounds of the decode batch, a one-slot generator refused the fifth of eight short ones."""
    clock = Clock()
    gate = admission(clock)
    outcomes = decode(gate, clock, [100.0] * 8, max_tokens=max_tokens, slots=1, tokens_per_s=200.0)
    assert statuses(outcomes)[429] == refused and statuses(outcomes)[504] == 0
    clock.now += 1.0  # the same eight again, once an answer has been made: as many as start within the bound
    again = decode(gate, clock, [clock.now] * 8, max_tokens=max_tokens, slots=1, tokens_per_s=200.0)
    assert statuses(again)[200] == min(8, 1 + int(10.0 / (max_tokens / 200.0)))


@pytest.mark.parametrize("sent", [32, 40])
def test_what_an_idle_generators_free_slots_start_at_once_is_let_in_however_long_the_answers(sent: int) -> None:
    """Generations of up to 2,048 tokens sent at once to an idle generator of 32 decode slots: the first 32 start
    together, whatever their length; weighed against rounds of 50 tokens a slot alone, 28 of them were refused."""
    clock = Clock()
    outcomes = decode(admission(clock), clock, [100.0] * sent, max_tokens=2048, slots=32, tokens_per_s=100.0)
    assert [o.status for o in outcomes[:32]] == [200] * 32
    assert all(o.wait_s <= 0.05 for o in outcomes[:32])
    assert [o.status for o in outcomes[32:]] == [429] * (sent - 32)  # behind 32 answers of up to 2,048 tokens


def test_a_second_wave_behind_a_full_decode_batch_is_not_let_in_on_how_fast_the_first_started() -> None:
    """Review finding: 32 long generations started together read as a pace of thousands of tokens a second, and
    40 more sent 0.2 s later were let in behind them (33 then timed out)."""
    clock = Clock()
    gate = admission(clock)
    sends = [100.0] * 32 + [100.2] * 40
    outcomes = decode(gate, clock, sends, max_tokens=512, slots=32, tokens_per_s=30.0)
    assert statuses(outcomes) == {200: 32, 429: 40, 504: 0}


def test_generations_holding_every_slot_at_batch_priority_leave_none_free_for_interactive_ones() -> None:
    """A batch job's 32 generations hold the 32 slots: interactive generations sent then wait for them too, and are
    not let in as if a free slot started each (review finding: 20 of 20 were, and all timed out)."""
    clock = Clock()
    gate = admission(clock)
    budget = unmeasured_budget(Batching(16_384, 256, 0.0, 1), 32)
    bulk = None
    for i in range(32):
        bulk = gate.admit("m", "batch", 600.0, i, weight=2048, budget=budget, decode_batch=32)
        bulk.add(f"b{i}", clock.now, 2048, deadline=clock.now + 600.0)
        bulk.remove(f"b{i}", clock.now, answered=True)
    clock.now += 1.0
    outcomes = decode(gate, clock, [clock.now] * 20, max_tokens=256, slots=32, tokens_per_s=30.0, timeout_s=5.0)
    assert statuses(outcomes)[200] <= 1 and statuses(outcomes)[504] <= 1  # the one that waits alone: see below
    assert bulk is not None and len(bulk.decoder.running) == 32


def test_a_generators_pace_is_forgotten_after_it_was_idle_a_while() -> None:
    """The model may be elsewhere now, on a slower box: what it showed before an idle gap of over 10 s is not
    its pace (review finding: moved to a box ten times slower, a flood then got 30 504s)."""
    clock = Clock()
    gate = admission(clock)
    decode(gate, clock, [100.0] * 4, max_tokens=200, slots=4, tokens_per_s=300.0)
    queue = gate.admit("m", "interactive", 30.0, 0, weight=200, budget=200, decode_batch=4)
    assert isinstance(queue, DecodeQueue) and queue.decoder.token_s() is not None
    clock.now += 11.0
    queue.add("later", clock.now, 200)
    assert queue.decoder.token_s() is None


def test_a_pace_shown_by_one_users_answers_is_not_taken_for_a_full_decode_batchs_on_a_cpu() -> None:
    """One user's answers, made alone, take a quarter of the time four take at once on a CPU: a flood right after
    is reckoned at the rate slots freed (one every 3.3 s), not at each slot's pace alone (four every 3.3 s)."""
    clock = Clock()
    gate = admission(clock)
    for _ in range(3):
        decode(gate, clock, [clock.now + 1.0], max_tokens=100, slots=4, tokens_per_s=30.0, shared=True)
    sends = [clock.now + 1.0 + i / 3 for i in range(90)]
    flood = decode(gate, clock, sends, max_tokens=100, slots=4, tokens_per_s=30.0, shared=True)
    assert statuses(flood)[504] == 0 and statuses(flood)[429] > 0
    assert max(o.wait_s for o in flood if o.status == 200) <= 10.0 + 4 * 100 / 30.0  # and an answer of a full batch


def test_a_generation_that_would_wait_on_busy_slots_alone_is_refused_with_a_retry_after() -> None:
    """Nothing awaited, the one slot held by an answer of about 60 s: the wait is the slot's, and the Retry-After
    when it is back under the bound (reckoned to the latest deadline of the work awaited, of which there is none,
    it was infinite: a 500 for `math.ceil`)."""
    clock = Clock()
    gate = admission(clock)
    decode(gate, clock, [100.0], max_tokens=480, slots=1, tokens_per_s=8.0)  # a 60 s answer made: the pace
    queue = gate.admit("m", "interactive", 120.0, 0, weight=480, budget=50, decode_batch=1)
    queue.add("long", clock.now, 480, deadline=clock.now + 120.0)
    queue.remove("long", clock.now, answered=True)
    clock.now += 5.0
    with pytest.raises(TooManyRequests) as refused:
        gate.admit("m", "interactive", 30.0, 1, weight=16, budget=50, decode_batch=1)
    assert int(refused.value.headers["Retry-After"]) in (45, 46)  # 55 s to the slot's free, less the bound


def test_answers_made_together_are_timed_at_the_slots_they_held_not_those_left_when_each_ended() -> None:
    """Four answers of 6.7 s started and made together held four slots throughout; counted at the slots held when
    each ended (4, 3, 2, 1: the last ones made), a slot looked to take 10.7 s and the next burst got only the
    free slots' four (black-box run: 4 of 40 per gateway, the rest refused, with slots freeing within 7 s)."""
    clock = Clock()
    gate = admission(clock)
    decode(gate, clock, [100.0] * 4, max_tokens=200, slots=4, tokens_per_s=30.0)
    burst = decode(gate, clock, [clock.now + 1.0] * 12, max_tokens=200, slots=4, tokens_per_s=30.0)
    assert [o.status for o in burst] == [200] * 8 + [429] * 4  # four at once, four as the first four are made


def test_answers_running_past_the_typical_length_are_expected_to_run_to_their_max_tokens() -> None:
    """Black-box finding: answers of 16 tokens timed first, then four of up to 1,000 held the four slots; reckoned
    at the 0.6 s a slot had taken, they were overdue, every short request sent then was let in at once, and each
    ended 504 at 30 s without a token (the slots freed at 47 s)."""
    clock = Clock()
    gate = admission(clock)
    decode(gate, clock, [100.0] * 4, max_tokens=16, slots=4, tokens_per_s=25.0)
    budget = unmeasured_budget(Batching(16_384, 256, 0.0, 1), 4)
    for i in range(4):
        queue = gate.admit("m", "interactive", 300.0, i, weight=1000, budget=budget, decode_batch=4)
        queue.add(f"long{i}", clock.now, 1000, deadline=clock.now + 300.0)
        queue.remove(f"long{i}", clock.now, answered=True)
    clock.now += 1.0  # 25 tokens made each at the pace the short answers showed: past their 16
    for i in range(4):
        with pytest.raises(TooManyRequests) as refused:
            gate.admit("m", "interactive", 30.0, 4 + i, weight=16, budget=budget, decode_batch=4)
        assert "about 42s to start" in refused.value.message  # 977 tokens to go, at 0.6 s for the 15 after the first


def test_a_running_answer_just_past_the_mean_length_is_expected_at_the_longer_answers_length() -> None:
    """Review finding: answers of 190 to 210 tokens, asked with `max_tokens` 4,096; one at 205 tokens was taken to
    run to 4,096 (about half of answers pass the mean), and a second user was refused "about 130s" with 0.17 s to
    go. It is expected at the mean length of the answers longer than what it has made."""
    clock = Clock()
    gate = admission(clock)
    for made in (190, 200, 210):
        decode(gate, clock, [clock.now + 0.5], max_tokens=4096, made_tokens=made, slots=1, tokens_per_s=30.0)
    queue = gate.admit("m", "interactive", 300.0, 0, weight=4096, budget=50, decode_batch=1)
    queue.add("running", clock.now, 4096, deadline=clock.now + 300.0)
    queue.remove("running", clock.now, answered=True)
    clock.now += 205 / 30.0
    second = gate.admit("m", "interactive", 300.0, 1, weight=4096, budget=50, decode_batch=1)
    assert isinstance(second, DecodeQueue) and (second.wait_s(clock.now) or 0) < 1.0


def test_batch_generations_must_start_in_time_to_be_made_within_their_deadline() -> None:
    """Review finding: with a 300 s deadline, batch-priority generations were let in to start as late as 290 s
    (their rounds scaled by the deadline, their wait bounded by it alone), and were cut mid-answer."""
    clock = Clock()
    outcomes = decode(
        admission(clock), clock, [100.0] * 200, max_tokens=200, slots=4, tokens_per_s=20.0, timeout_s=300.0,
        priority="batch", shared=True,
    )  # fmt: skip
    assert statuses(outcomes)[504] == 0 and statuses(outcomes)[429] > 0
    assert max(o.wait_s for o in outcomes if o.status == 200) <= 300.0 - 200 / 20.0 * 4  # and an answer made


def test_a_name_registered_again_as_another_kind_of_model_gets_that_kind_of_queue() -> None:
    """Review finding: a generator deleted and registered again as an encoder, the delete missed, kept its decode
    queue, which counted every answer as a generation that never ended, until all were refused."""
    clock = Clock()
    gate = admission(clock)
    assert isinstance(gate.admit("m", "interactive", 30.0, 0, weight=1, budget=1, decode_batch=4), DecodeQueue)
    queue = gate.admit("m", "interactive", 30.0, 0, weight=1, budget=1)
    assert type(queue) is ModelQueue
    assert gate.admit("m", "batch", 30.0, 0, weight=1, budget=1, decode_batch=8).decoder.slots == 8  # as now set


def test_a_generators_timing_takes_stamps_out_of_order_and_answers_of_one_token_in_its_stride() -> None:
    """Stamps come as chunks reached the gateway, applied as their consumers run: an answer whose stamps both came
    before the last one applied held no slot-time, and as the only sample it divided by zero (review finding). An
    answer of one token has no time after its first."""
    decoder = Decoder(slots=2)
    decoder.start("late", 10.0, 16)
    decoder.start("early", 9.0, 16)
    decoder.end("early", 9.5, whole=True, tokens=8)
    decoder.end("late", 10.0, whole=True, tokens=1)
    assert not decoder.made and decoder.token_s() is None and not decoder.running
    decoder.start("a", 11.0, 16)
    decoder.end("a", 12.0, whole=True, tokens=11)
    assert decoder.token_s() == pytest.approx(2 * 1.0 / 10)  # two slots, one held for the 10 tokens after the first


def test_short_generations_awaited_are_expected_at_their_max_tokens_not_the_typical_length() -> None:
    """Answers of 1,000 tokens timed (10 s each on one slot): five generations awaited asking for at most 16 hold
    the slot 0.16 s each, so one more sent behind them starts within a second of the running answer's end."""
    clock = Clock()
    gate = admission(clock)
    decode(gate, clock, [100.0], max_tokens=1000, slots=1, tokens_per_s=100.0)
    queue = gate.admit("m", "interactive", 30.0, 0, weight=1000, budget=50, decode_batch=1)
    queue.add("running", clock.now, 1000, deadline=clock.now + 30.0)
    queue.remove("running", clock.now, answered=True)
    clock.now += 9.0  # a second of its answer to go
    for i in range(5):
        queue.add(f"short{i}", clock.now, 16, deadline=clock.now + 30.0)
    assert (queue.wait_s(clock.now) or 0) == pytest.approx(1.0 + 5 * 0.16, rel=0.01)  # not 1 + 5 × 10 s


def test_a_generation_is_let_in_only_with_an_answers_length_to_spare_before_its_deadline() -> None:
    """A black-box batch job: let in to start within its deadline less its answer, one started at 293 s against an
    estimate of 287 s and was cut at 300 s. An answer's length is kept in hand for the estimate."""
    clock = Clock()
    gate = admission(clock)
    decode(gate, clock, [100.0], max_tokens=100, slots=1, tokens_per_s=10.0)  # an answer of 10 s timed
    queue = gate.admit("m", "batch", 300.0, 0, weight=100, budget=50, decode_batch=1)
    queue.add("running", clock.now, 100, deadline=clock.now + 300.0)
    queue.remove("running", clock.now, answered=True)  # its slot frees in about 10 s
    gate.admit("m", "batch", 31.0, 1, weight=100, budget=50, decode_batch=1)  # 10 s to wait, 10 to answer, 10 spare
    with pytest.raises(TooManyRequests):
        gate.admit("m", "batch", 29.0, 1, weight=100, budget=50, decode_batch=1)
    with pytest.raises(TooManyRequests) as refused:  # tester h81: "about 10s to start, over 0s" read as no bound
        gate.admit("m", "interactive", 18.0, 1, weight=100, budget=50, decode_batch=1)
    assert "to start, over the 0s its 18s deadline leaves to start an answer of about 10s" in refused.value.message


@pytest.mark.parametrize(("max_tokens", "admitted"), [(16, True), (1000, False)])
def test_a_cap_unlike_the_last_answers_is_not_taken_for_their_length(max_tokens: int, admitted: bool) -> None:
    """Re-test finding: after answers of 16 tokens (each its whole cap), four generations of up to 1,000 holding the
    four slots were taken for answers of 16, and short requests let in behind them waited 52 s for a first token.
    Answers use a share of their cap: these used all of it, so one of up to 1,000 is expected to run to it."""
    clock = Clock()
    gate = admission(clock)
    decode(gate, clock, [100.0] * 4, max_tokens=16, slots=4, tokens_per_s=25.0)
    for i in range(4):
        queue = gate.admit("m", "interactive", 300.0, i, weight=max_tokens, budget=200, decode_batch=4)
        queue.add(f"running{i}", clock.now, max_tokens, deadline=clock.now + 300.0)
        queue.remove(f"running{i}", clock.now, answered=True)
    clock.now += 0.1
    if admitted:
        gate.admit("m", "interactive", 300.0, 4, weight=16, budget=200, decode_batch=4)
    else:
        with pytest.raises(TooManyRequests, match=r"about 4[0-9]s to start"):
            gate.admit("m", "interactive", 300.0, 4, weight=16, budget=200, decode_batch=4)


def test_a_chat_clients_large_cap_is_still_read_as_the_share_its_answers_use() -> None:
    """Answers of about 200 tokens under a cap of 8,192: a generation awaited with that cap is expected at about 200,
    and one with a cap of 1,000 at no less."""
    decoder = Decoder(slots=1)
    for i, tokens in enumerate((190, 200, 210)):
        decoder.start(f"r{i}", float(i * 10), 8192)
        decoder.end(f"r{i}", float(i * 10 + 7), whole=True, tokens=tokens)
    assert decoder.expected_tokens(8192) == pytest.approx(200)
    assert decoder.expected_tokens(1000) == pytest.approx(200)
    assert decoder.expected_tokens(16) == 16


def test_the_wait_a_429_says_is_one_its_retry_after_advises() -> None:
    """Tester h214: the Retry-After is capped at 60 s, and the message printed the raw estimate: "about 10081s to
    start, over 10s; retry in 60s". Seen failing so ("about 206s" here). It says the wait its Retry-After reckons."""
    clock = Clock()
    gate = admission(clock)
    queue = gate.admit("m", "interactive", 30.0, 0, weight=10, budget=DEFAULT_BUDGET)
    now = busy(queue, clock.now, 2.0, per_s=50, weight=10)
    for i in range(100):
        queue.add(f"held{i}", now, 10)
    clock.now = now + 100.0  # a stall: the estimate grows past what any Retry-After says
    with pytest.raises(TooManyRequests) as refused:
        gate.admit("m", "interactive", 30.0, 101, weight=10, budget=DEFAULT_BUDGET)
    said = re.search(r"about (\d+)s to start, over (\d+)s; retry in (\d+)s", str(refused.value))
    assert said is not None, refused.value
    wait_s, limit_s, retry_s = map(int, said.groups())
    assert retry_s == int(refused.value.headers["Retry-After"]) == 60
    assert wait_s == limit_s + retry_s


def test_after_a_nats_outage_the_rate_is_measured_afresh_not_read_from_the_silence() -> None:
    """Answers stop while a gateway is cut off from NATS; back on it, the open span diluted by the outage read as a
    model going ever slower: 429 "about 41s to start, retry in 31s" for a backlog the fleet cleared in 2 s
    (black-box finding). After `restart_rates` the rate is measured afresh and a burst's rounds hold meanwhile."""
    clock = Clock()
    gate = admission(clock)
    queue = gate.admit("m", "interactive", 30.0, 0, weight=10, budget=DEFAULT_BUDGET)
    now = busy(queue, clock.now, 2.0, per_s=50, weight=10)  # measured: 500 a second
    for i in range(100):
        queue.add(f"held{i}", now, 10)  # then NATS goes away with these awaited (2 s of work)
    clock.now = now + 8.0  # eight seconds of outage: nothing answered

    def refused() -> bool:
        try:
            gate.admit("m", "interactive", 30.0, 101, weight=10, budget=DEFAULT_BUDGET)
        except TooManyRequests:
            return True
        return False

    assert refused()  # the silence read as a slow model
    gate.restart_rates()
    assert queue.wait_s(clock.now) is None and not refused()


def test_a_model_held_again_after_none_held_it_has_its_rate_measured_afresh_and_only_its() -> None:
    """Tester h208: the only worker of a model restarted; its seconds away read as the model's pace, and 429s said
    "about 211s to start", `Retry-After: 35`, for a backlog cleared in 7 s. `restart_rates` of the models held again
    drops the seconds away, keeps the pace measured while it was served (measured afresh, a model evicted and loaded
    again all the time under churn was on an unmeasured model's rounds: tester h214), and leaves another model's
    rate as measured."""
    clock = Clock()
    gate = admission(clock)
    queue = gate.admit("m", "interactive", 30.0, 0, weight=10, budget=DEFAULT_BUDGET)
    other = gate.admit("n", "interactive", 30.0, 0, weight=10, budget=DEFAULT_BUDGET)
    now = busy(queue, clock.now, 2.0, per_s=50, weight=10)
    busy(other, clock.now, 2.0, per_s=50, weight=10)
    for i in range(100):
        queue.add(f"held{i}", now, 10)  # its worker restarts with these awaited
    clock.now = now + 8.0
    assert queue.wait_s(clock.now) is not None
    rate = other.rate(clock.now)
    gate.restart_rates(["m"])
    assert queue.wait_s(clock.now) == pytest.approx(1000 / 500)  # at its pace, not diluted by the 8 s away
    assert other.rate(clock.now) == rate  # n's stands


def test_the_retry_after_of_a_full_gateway_counts_no_answer_from_before_a_model_was_held_again() -> None:
    """Review h211: the answers of before a short outage (under the 10 s they are counted over) stayed in the
    gateway's Retry-After once its model was held again: a rate halved, Retry-After 37 s for a backlog cleared in 8 s.
    Seen failing so (17 s here)."""
    gate = admission(Clock())
    before = time.monotonic() - 8.0
    for i in range(50):
        gate.answered(before + i * 0.1)  # 50 answers in 5 s, then 3 s of outage
    assert gate.retry_after_s(100) > 1
    gate.restart_rates(["m"])
    assert gate.retry_after_s(100) == 1  # measured afresh as answers come


def test_answers_made_together_on_one_of_two_boxes_are_timed_at_that_boxs_pace() -> None:
    """A gateway counting the decode slots of two boxes (2 each): two answers of 100 tokens made together in 1 s
    (on one box, which pulled both) were read as though the fleet's four slots shared one box's time: twice the
    time an answer takes (review finding). Each box's slots share its time, not the fleet's."""

    def two_answers_made_together(decoder: Decoder) -> Decoder:
        for request_id in ("a", "b"):
            decoder.start(request_id, 100.0, 200)
        for request_id in ("a", "b"):
            decoder.end(request_id, 101.0, whole=True, tokens=100)
        return decoder

    decoder = two_answers_made_together(Decoder(slots=4, box_slots=2))
    assert decoder.answer_s(100, decoder.token_s()) == pytest.approx(1.0, rel=0.02)
    # The same answers on a gateway that counts one box: the same pace.
    one_box = two_answers_made_together(Decoder(slots=2, box_slots=2))
    assert one_box.token_s() == pytest.approx(decoder.token_s())


def _admitted_of_a_burst(timeout_s: float, priority: str = "interactive", requests: int = 100) -> int:
    """How many of `requests` of 100 tokens sent together to an idle model with a 1,000-token round get in."""
    clock = Clock()
    gate = admission(clock)
    admitted = 0
    for i in range(requests):
        try:
            queue = gate.admit("m", priority, timeout_s, 0, weight=100, budget=1000)
        except TooManyRequests:
            continue
        queue.add(f"r{i}", clock.now, 100, deadline=clock.now + timeout_s)
        admitted += 1
    return admitted


def test_a_burst_with_deadlines_short_of_the_bound_is_held_to_the_rounds_that_fit_them() -> None:
    """Fleet tester: 200 requests with 5 s deadlines, sent together, were let in whole (four rounds, meant to start
    within `max_queue_s` of 10 s) and 197 ended 504 at 5 s, none 429. Interactive work gets the rounds its deadline
    fits; batch-priority work keeps its own rule (its rounds grow with a deadline past the bound)."""
    assert _admitted_of_a_burst(30.0) == 40  # four rounds of 1,000 tokens
    assert _admitted_of_a_burst(5.0) == 20  # two
    assert _admitted_of_a_burst(0.5) == 2  # a request alone always goes, and one more within a fifth of a round
    assert _admitted_of_a_burst(5.0, priority="batch") == 40


def test_the_unmeasured_budget_is_a_round_as_a_box_holding_the_model_runs_it() -> None:
    """Fleet tester: the catalog's 16,384-token batches made the burst bound four rounds of them, where the box's
    profile ran 1,024-token batches: 64 of its batches, and 184 of 200 requests waited over the 10 s bound."""
    catalog = Batching(16_384, 256, 2.0, 1)
    assert unmeasured_budget(catalog) == 16_384
    assert unmeasured_budget(catalog, box_round=1024) == 1024
    assert unmeasured_budget(catalog, box_round=1024, boxes=Fraction(3, 2)) == 1536  # 3 holders, 2 gateways
    assert unmeasured_budget(catalog, decode_batch=8) == 8 * GENERATION_ROUND_TOKENS
    # A round holds its rows, however short they are (black-box finding: 4-row batches, 600 requests let in).
    assert unmeasured_budget(catalog, per_input=3.0) == 256 * 3
    assert unmeasured_budget(Batching(16_384, 4, 2.0, 1), per_input=3.0) == 12
    assert unmeasured_budget(catalog, box_round=1024, box_rows=8, per_input=15.0) == 120
    assert unmeasured_budget(catalog, box_round=1024, box_rows=8, per_input=500.0) == 1024  # long inputs: tokens bind
    # A pace read off 40-token rows, for 3-token inputs: they go a row each (review r51: 616 of a burst let in).
    two_rows = Batching(16_384, 2, 2.0, 1)
    assert unmeasured_budget(two_rows, per_input=3.0) == 6
    assert paced_round(1232.6, None, 3.0, max_queue_s=2.0) == 308
    assert paced_round(1232.6, 40.0, 3.0, max_queue_s=2.0) == 30


async def test_a_gateway_bounds_a_burst_by_the_round_and_pace_the_boxes_holding_the_model_say(start_box, http) -> None:
    """The wiring of the rules above: a box's heartbeat says the round its worker runs (its profile's or a retune's
    batching: here a retune's 512 tokens, not the catalog's 16,384) and, once its batch cost is measured, the
    tokens a second it computes; the gateway's dispatcher reads both from the fleet's heartbeats."""
    from appliance.box_status import heartbeat
    from tests.conftest import noop_model, url, wait_for

    box = await start_box(default_model=False, models=[noop_model("small", cost_ms=5)], heartbeat_s=0.2)
    box.workers["small"].batcher.retune(Batching(512, 8, 0.0, 1))  # as a profile or a PATCH of the model would

    def entry() -> dict:
        (small,) = [entry for entry in heartbeat(box)["models"] if entry["name"] == "small"]
        return small

    assert entry()["round_tokens"] == 512 and entry()["tokens_per_s"] is not None  # from the warm-up's batches
    for i in range(8):
        async with http.post(url(box, "/v1/embeddings"), json={"model": "small", "input": f"text {i}"}) as response:
            assert response.status == 200
    pace = entry()["tokens_per_s"]
    assert pace is not None and pace > 0
    holders = box.dispatcher._holders
    await wait_for(lambda: holders._box_round("small") == 512, what="the heartbeat after the retune heard")
    row_tokens = entry()["batch_cost"]["row_tokens"]
    assert holders._pace("small", row_tokens) is not None
    assert holders._pace("small", row_tokens)[0] == pytest.approx(entry()["tokens_per_s"], rel=0.5)
    assert holders._box_round("unknown") is None and holders._pace("unknown", 10.0) is None


async def test_a_burst_on_a_model_its_rows_per_batch_slow_waits_no_longer_than_the_bound(start_box) -> None:
    """Black-box finding: a model of 2-row batches (the burst bound counted a round in tokens alone, 16,384 of them:
    thousands of short requests) let a burst of 600 in whole; they waited up to 30 s against a 10 s bound, and 11
    ended 504. A round holds its rows: the burst is refused past what starts within the bound, each time."""
    from appliance.settings import ModelEntry
    from tests.conftest import url

    slow = ModelEntry(name="rows", runtime="noop", pinned=True, max_batch_size=2, options={"cost_ms": 200})
    box = await start_box(default_model=False, models=[slow], max_queue_s=2.0)
    unlimited = aiohttp.TCPConnector(limit=0)  # all 300 at once, as a client with its own pool of connections
    async with aiohttp.ClientSession(connector=unlimited, timeout=aiohttp.ClientTimeout(total=60)) as http:

        async def one(i: int) -> tuple[int, float]:
            async with http.post(url(box, "/v1/embeddings"), json={"model": "rows", "input": f"t{i}"}) as response:
                return response.status, float(response.headers.get("Fbx-Queue-Ms", 0))

        for burst in range(2):  # an idle model, then again once it has answered some
            outcomes = await asyncio.gather(*(one(i) for i in range(300)))
            statuses = [status for status, _ in outcomes]
            assert set(statuses) <= {200, 429} and statuses.count(429) >= 100, (burst, statuses.count(200))
            # Let in whole, the last of the 300 would wait 150 batches of 0.2 s: 30 s. The margin over the 2 s bound
            # is for a loaded CI machine (4.06 s seen at twice the bound, 2.5 s on a quiet one).
            assert max(queued for status, queued in outcomes if status == 200) <= 3 * 2000, (burst, outcomes)


async def test_a_short_request_sent_while_a_long_one_runs_on_an_idle_box_is_answered(start_box, http) -> None:
    """Tester h70's repro through a box: each round one small request alone, a pause, 100 long inputs, and 0.15 s
    later one short input, on a model of 8-row batches. The short one was refused 429 in every round."""
    from appliance.settings import ModelEntry
    from tests.conftest import url

    rows = ModelEntry(
        name="rows", runtime="noop", pinned=True, max_batch_size=8, options={"cost_ms": 5, "cost_per_token_us": 100}
    )
    box = await start_box(default_model=False, models=[rows])
    long_inputs = [" ".join(f"word{i}x{j}" for j in range(60)) for i in range(100)]

    async def embed(text: str | list[str]) -> int:
        async with http.post(url(box, "/v1/embeddings"), json={"model": "rows", "input": text}) as response:
            return response.status

    for _ in range(2):
        assert await embed("warm") == 200
        await asyncio.sleep(1.0)
        large = asyncio.ensure_future(embed(long_inputs))
        await asyncio.sleep(0.15)
        assert await embed("The cat sat on the mat.") == 200
        assert await large == 200


async def test_a_short_request_sent_after_a_flood_of_long_inputs_is_answered(start_box, http) -> None:
    """Tester h86: right after a flood of long inputs, h70's repro was refused 429 again (4 of 4 runs, for about half
    a minute): the holders' heartbeats said their pace at the rows they had run last, 256 tokens long, and the
    gateway held 100 medium inputs to the rows a second of those. A heartbeat says the box's batch cost, and the
    gateway reckons the pace at the rows it awaits (here 8 rows of 62 tokens in 15 ms; of 512, in 87 ms)."""
    from appliance.settings import ModelEntry
    from tests.conftest import url, wait_for

    costs = {"cost_ms": 5, "cost_per_token_us": 20}
    rows = ModelEntry(name="rows", runtime="noop", pinned=True, max_batch_size=8, options=costs)
    box = await start_box(default_model=False, models=[rows])

    async def embed(text: str | list[str]) -> int:
        async with http.post(url(box, "/v1/embeddings"), json={"model": "rows", "input": text}) as response:
            return response.status

    def beat() -> float:
        (record,) = [record for record in box.fleet.live_boxes() if record["box"] == box.box_id]
        return float(record["ts"])

    words = [" ".join(["wrd"] * count) for count in (600, 60)]  # a token a word, as the gateway reckons it too
    assert await embed([words[0]] * 160) == 200  # 20 batches of 512-token rows
    flooded = beat()
    await wait_for(lambda: beat() > flooded, what="a heartbeat after the flood")
    assert await embed("warm") == 200  # the last busy spell, a small one: it shows no pace worth going by
    await asyncio.sleep(0.3)
    medium = asyncio.ensure_future(embed([words[1]] * 700))
    await asyncio.sleep(0.12)  # not part of a burst with it
    assert await embed("The cat sat on the mat.") == 200  # 1.3 s of the box's work awaited: was a 429
    assert await medium == 200


def test_a_pace_line_reckons_shorter_rows_at_their_cost_and_longer_ones_at_the_rows_it_ran() -> None:
    """The line a heartbeat says (`PaceLine`): from batches of 512-token rows, rows of 62 tokens go at their own
    cost (not at 512-token rows' rows a second), rows longer than those run are not reckoned cheaper per token
    than they were (a fitted line says nothing past them), and a line from batches of one size assumes no
    shorter row costs less."""
    fixed, per_token = 0.005, 20e-6
    cost = BatchCost()
    for index in range(30):  # full batches of 8 rows of 512 tokens, a few partial ones
        rows = 8 if index % 3 else 5
        cost.observe(rows * 512, rows, fixed + per_token * rows * 512)
    line = PaceLine(*cost.fit(), 8, 16_384, 1, 512.0)
    tokens, rows_s = line.at(62.0)
    assert rows_s == pytest.approx(8 / (fixed + per_token * 8 * 62), rel=0.01)
    assert tokens == pytest.approx(rows_s * 62)
    assert line.at(2000.0) == line.at(512.0)
    flat = PaceLine(fixed + per_token * 8 * 512, 0.0, 8, 16_384, 1, 512.0)
    assert flat.at(62.0)[1] == pytest.approx(flat.at(512.0)[1])  # 8 rows a batch either way, no faster
    assert flat.at(1.0)[1] == flat.at(62.0)[1]
    assert PaceLine.from_json(line.to_json()) == line
    for bad in (None, [], {"fixed_s": 1}, {**line.to_json(), "rows": 0}, {**line.to_json(), "token_s": "x"}):
        assert PaceLine.from_json(bad) is None


def test_a_flood_of_like_batches_keeps_the_shape_of_the_cost_measured_before_it() -> None:
    """Tester h92: after a flood of like inputs every recent batch was full and of one size, the fit of fixed and
    per-token cost could not tell them apart, and the pace took each batch as all fixed cost: 8 short rows as slow as
    8 long ones, 9 of 10 short requests sent next refused 429 (1 run of 5). The last fit's shape is kept, scaled to
    what the flood's batches take."""
    fixed, per_token = 0.005, 20e-6
    cost = BatchCost()
    for index in range(10):  # the warm-up's: two sizes
        tokens = 16 * (40 if index % 2 else 12)
        cost.observe(tokens, 16, fixed + per_token * tokens, made_up=True)
    for _ in range(200):  # the flood's: all of 8 rows of 256 tokens, 10% slower than the warm-up said
        cost.observe(2048, 8, 1.1 * (fixed + per_token * 2048))
    assert cost.fit() is None
    kept_fixed, kept_per_token = cost.line()
    assert kept_fixed > 0 and kept_per_token > 0  # a shape, not all fixed cost
    assert kept_fixed + kept_per_token * 2048 == pytest.approx(1.1 * (fixed + per_token * 2048), rel=0.01)
    line = PaceLine(kept_fixed, kept_per_token, 8, 16_384, 1, 256.0)
    assert line.at(10.0)[1] > 5 * line.at(256.0)[1]  # short rows at their cost, not at the long rows' pace
    flat = PaceLine(cost.seconds(2048), 0.0, 8, 16_384, 1, 256.0)  # what the batcher reckoned without it
    assert flat.at(10.0)[1] == pytest.approx(flat.at(256.0)[1])


async def test_a_fresh_box_says_its_pace_before_any_request(start_box, encoder_dir) -> None:
    """Black-box finding: a box just started had timed no batch, so a gateway bounded a burst by rounds of its
    batches alone, rows counted (32 of 200 short requests let in; before rows were counted, 292 of 800). Its worker
    times a few batches of made-up rows first: its heartbeat says a pace from the start."""
    from appliance.box_status import heartbeat
    from appliance.settings import ModelEntry
    from tests.conftest import wait_for

    enc = ModelEntry(name="enc", path=encoder_dir, task="embed", pinned=True)
    box = await start_box(default_model=False, models=[enc])

    def pace() -> float | None:
        (entry,) = [entry for entry in heartbeat(box)["models"] if entry["name"] == "enc"]
        return entry["tokens_per_s"]

    await wait_for(lambda: pace() is not None, timeout_s=10.0, what="a pace with no request sent")
    cost = box.workers["enc"].batcher.cost
    assert pace() > 0 and (cost.samples, cost.batches) == (BatchCost.TRUST_AFTER, 0)  # made up: shape no batch
    assert box.metrics.registry.get_sample_value("fbx_batch_size_count", {"model": "enc"}) in (None, 0.0)


def test_a_burst_a_box_clears_within_the_bound_at_its_measured_pace_is_let_in() -> None:
    """Review r41: held to four of the 2-core profile's 1,024-token rounds, 8 requests of 32 inputs (864 tokens
    each by the gateway's estimate) sent together had 4 refused, though the box answers them in under a second.
    With the holders' measured pace (5,000 tokens a second) a round is a quarter of what they do in 5 s."""
    catalog = Batching(16_384, 256, 2.0, 1)
    budget, paced = unmeasured_budget(catalog, box_round=1024), paced_round(5000.0, None, None, max_queue_s=10.0)
    assert (budget, paced) == (1024, 6_250)
    clock = Clock()
    gate = admission(clock)
    for i in range(8):
        queue = gate.admit("m", "interactive", 30.0, 0, weight=864, budget=budget, paced=paced)
        queue.add(f"r{i}", clock.now, 864, deadline=clock.now + 30.0)
    with pytest.raises(TooManyRequests):  # a slow box: its rounds, at least, and no more
        gate.admit("m", "interactive", 30.0, 0, weight=864, budget=budget, paced=paced_round(100.0, None, None))


@pytest.mark.parametrize(
    ("then", "now", "kept"),
    [
        ({"a"}, {"a"}, True),
        ({"a"}, {"a", "b"}, True),  # a burst had a second box load it: the pace of the first still holds
        ({"a"}, {"b"}, False),
        ({"a", "b"}, {"a"}, False),
        (set(), set(), False),
    ],
)
def test_a_generators_pace_is_kept_over_a_pause_while_the_same_boxes_hold_it(then, now, kept) -> None:
    """Generation and regression testers: after any pause over 10 s a warm generator's next burst had a third
    refused (its pace forgotten: the model may be elsewhere now), though the same boxes held it and answered the
    burst in half a second. Forgotten only when the boxes holding it changed (or are not known)."""
    clock = Clock()
    gate = admission(clock)
    queue = gate.admit("m", "interactive", 30.0, 0, weight=200, budget=200, decode_batch=4, holders=frozenset(then))
    assert isinstance(queue, DecodeQueue)
    for i in range(4):  # four answers of 100 tokens, made at 100 tokens a second
        queue.add(f"r{i}", clock.now, 200)
        queue.remove(f"r{i}", clock.now, answered=True)
    clock.now += 1.0
    for i in range(4):
        queue.finish(f"r{i}", clock.now, whole=True, tokens=100)
    assert queue.decoder.token_s() is not None
    clock.now += 15.0  # a pause
    gate.admit("m", "interactive", 30.0, 0, weight=200, budget=200, decode_batch=4, holders=frozenset(now))
    queue.add("after", clock.now, 200)
    assert (queue.decoder.token_s() is not None) == kept
